//! The MCP sessions of `stepgate mcp --listen`: which are open, who opened
//! each, when each was last used, and the step counter of each (calls without
//! a step in `_meta` are numbered by their session). One table, kept in step
//! with rmcp's own sessions by [`FrontSessionManager`]:
//!
//! - an entry is made when rmcp creates a session, and removed when rmcp
//!   closes it — a `DELETE` by the client, its worker ending (idle for
//!   `mcp.session_idle_timeout`, which is rmcp's keep-alive here), or the
//!   front closing it (below). A closed session's counter is gone with it, and
//!   a request naming it is refused (404 with [`UNKNOWN_SESSION`]);
//! - **a counter is never made anew for an id**: only rmcp's creation of a
//!   session makes one, and rmcp never creates an id twice nor restores one
//!   (no session store is configured). A session this process does not know
//!   (closed, evicted, or opened before a restart) is refused, never numbered
//!   from step 0 again — step 0 of its workflow may be answered already, and
//!   that answer would come back for a new call with nothing run;
//! - at most `mcp.max_sessions` are open. A new session beyond that closes
//!   the least recently used one if it has been idle for the idle bound;
//!   otherwise — every session used within it — the new one is refused (503
//!   with [`Reserve::Full`]'s wait), and no open session is touched.
//!
//! Why refuse rather than rebuild an unknown session's position from Kafka:
//! what a session's counter holds is not only how many steps it numbered but
//! which of them lost their answer (taken as retried by the session's next
//! call of the tool); none of that is durable. A rebuilt counter would number
//! a retry as a new step (the tool runs again) or a new call as an old step
//! (an old answer, nothing run). The client starts a new session instead, and
//! its calls there are new steps of a new workflow.

use super::SessionSteps;
use futures::Stream;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::session::{
    ServerSseMessage, SessionId, SessionManager,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a request naming a session this front does not know gets (HTTP 404,
/// as the MCP specification has it, so that a client starts a new session).
pub const UNKNOWN_SESSION: &str = "Not Found: this MCP session is not open on this server: it was \
closed, idle for longer than the server keeps an unused session, or opened before the server \
restarted. Nothing in this request was performed. Start a new MCP session (an `initialize` \
request without `Mcp-Session-Id`) and make the request there. A tool call without `_meta.\
workflow_id` and `_meta.step_index` is a new step in the new session: a call whose answer this \
session never received is not recognised as its retry.";

/// The open sessions (see the module's doc).
pub struct Sessions {
    table: Mutex<Table>,
    /// `mcp.max_sessions`.
    cap: usize,
    /// `mcp.session_idle_timeout`.
    idle: Duration,
    /// `mcp.max_sessions_per_principal`.
    per_principal: usize,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<String, Entry>,
    /// Session ids by last use, least recent first (the value of [`Entry::used`]).
    by_use: BTreeMap<u64, String>,
    /// Each principal's sessions.
    by_principal: HashMap<String, Vec<String>>,
    /// The last use given out ([`Entry::used`] grows with every use).
    uses: u64,
    /// New sessions admitted by [`Sessions::reserve`] and not yet created
    /// (counted against the cap until they are, or until their `initialize`
    /// is answered without one).
    reserved: usize,
    /// Sessions closed by the front because they were idle at the cap.
    evicted: u64,
}

struct Entry {
    /// The principal that opened it; `None` while its `initialize` is being
    /// answered (no request can name it yet).
    owner: Option<String>,
    steps: Arc<SessionSteps>,
    /// Its position in [`Table::by_use`].
    used: u64,
    last_used: Instant,
}

/// [`Sessions::reserve`]'s answer.
#[derive(Debug, PartialEq)]
pub enum Reserve {
    /// A new session may be opened; the reservation ends when it is dropped.
    Granted(Reservation),
    /// Close this session (idle at the cap) and ask again.
    Evict(String),
    /// Every session was used within the idle bound: the least recently used
    /// one will have been idle long enough after this wait.
    Full(Duration),
}

/// A new session's place under the cap while its `initialize` is answered:
/// the session's creation takes the place over ([`Sessions::created`]);
/// dropped without [`Reservation::opened`], the place is given back.
#[derive(Debug)]
pub struct Reservation {
    sessions: Arc<Sessions>,
    held: bool,
}

impl Reservation {
    /// The `initialize` opened a session: its entry holds the place now.
    pub fn opened(mut self) {
        self.held = false;
    }
}

impl PartialEq for Reservation {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.sessions, &other.sessions)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.held {
            let mut t = self.sessions.lock();
            t.reserved = t.reserved.saturating_sub(1);
        }
    }
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("cap", &self.cap)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    pub fn new(cap: usize, idle: Duration, per_principal: usize) -> Arc<Sessions> {
        Arc::new(Sessions {
            table: Mutex::new(Table::default()),
            cap: cap.max(1),
            idle,
            per_principal: per_principal.max(1),
        })
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    pub fn idle(&self) -> Duration {
        self.idle
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("MCP sessions lock")
    }

    /// Sessions open now.
    pub fn open(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Sessions closed by the front for being idle at the cap, so far.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    /// rmcp created session `id`.
    fn created(&self, id: &str) {
        let mut t = self.lock();
        // It takes over the place reserved for its `initialize`.
        t.reserved = t.reserved.saturating_sub(1);
        let used = t.next_use();
        t.by_use.insert(used, id.to_owned());
        t.by_id.insert(
            id.to_owned(),
            Entry {
                owner: None,
                steps: Arc::new(SessionSteps::default()),
                used,
                last_used: Instant::now(),
            },
        );
    }

    /// rmcp closed session `id` (or never had it).
    fn closed(&self, id: &str) {
        let mut t = self.lock();
        let Some(e) = t.by_id.remove(id) else { return };
        t.by_use.remove(&e.used);
        if let Some(owner) = e.owner
            && let Some(list) = t.by_principal.get_mut(&owner)
        {
            list.retain(|x| x != id);
            if list.is_empty() {
                t.by_principal.remove(&owner);
            }
        }
    }

    /// The response to an `initialize` of `owner` named session `id`: it is
    /// `owner`'s from now on. Returns the sessions of `owner` beyond its cap,
    /// least recently used first, for the caller to close.
    pub fn claim(&self, id: &str, owner: &str) -> Vec<String> {
        let mut t = self.lock();
        let Some(e) = t.by_id.get_mut(id) else {
            return Vec::new();
        };
        if e.owner.is_some() {
            return Vec::new();
        }
        e.owner = Some(owner.to_owned());
        let list = {
            let list = t.by_principal.entry(owner.to_owned()).or_default();
            list.push(id.to_owned());
            list.clone()
        };
        if list.len() <= self.per_principal {
            return Vec::new();
        }
        let mut mine: Vec<(u64, String)> = list
            .iter()
            .filter(|x| x.as_str() != id)
            .filter_map(|x| t.by_id.get(x).map(|e| (e.used, x.clone())))
            .collect();
        mine.sort();
        let excess = list.len() - self.per_principal;
        mine.into_iter().take(excess).map(|(_, x)| x).collect()
    }

    /// A request of `owner` names session `id`: whether it is open and
    /// `owner`'s (another's is answered as unknown); if so, it is used now.
    pub fn touch(&self, id: &str, owner: &str) -> bool {
        let mut t = self.lock();
        let used = t.next_use();
        let Some(e) = t.by_id.get_mut(id) else {
            return false;
        };
        if e.owner.as_deref() != Some(owner) {
            return false;
        }
        let before = std::mem::replace(&mut e.used, used);
        e.last_used = Instant::now();
        t.by_use.remove(&before);
        t.by_use.insert(used, id.to_owned());
        true
    }

    /// The step counter of open session `id`; `None` when it is not open.
    /// Never makes one: only rmcp's creation of a session does.
    pub fn steps(&self, id: &str) -> Option<Arc<SessionSteps>> {
        self.lock().by_id.get(id).map(|e| e.steps.clone())
    }

    /// May a new session be opened?
    pub fn reserve(self: &Arc<Self>) -> Reserve {
        self.reserve_at(Instant::now())
    }

    fn reserve_at(self: &Arc<Self>, now: Instant) -> Reserve {
        let mut t = self.lock();
        if t.by_id.len() + t.reserved < self.cap {
            t.reserved += 1;
            return Reserve::Granted(Reservation {
                sessions: self.clone(),
                held: true,
            });
        }
        let least = t
            .by_use
            .values()
            .next()
            .and_then(|id| Some((id.clone(), t.by_id.get(id)?.last_used)));
        match least {
            Some((id, last_used)) => {
                let idle_for = now.saturating_duration_since(last_used);
                if idle_for >= self.idle {
                    Reserve::Evict(id)
                } else {
                    Reserve::Full(self.idle - idle_for)
                }
            }
            // Every place is reserved by an `initialize` being answered.
            None => Reserve::Full(Duration::from_secs(1)),
        }
    }

    /// The front closed session `id` for being idle at the cap.
    pub fn count_eviction(&self) {
        self.lock().evicted += 1;
    }
}

impl Table {
    fn next_use(&mut self) -> u64 {
        self.uses += 1;
        self.uses
    }
}

/// rmcp's [`LocalSessionManager`], telling [`Sessions`] of every session it
/// creates and closes. It restores no session (the trait's default): a
/// session id it does not have is unknown.
pub struct FrontSessionManager {
    local: LocalSessionManager,
    sessions: Arc<Sessions>,
}

impl FrontSessionManager {
    /// Sessions idle for `sessions.idle()` are closed by rmcp's keep-alive.
    pub fn new(sessions: Arc<Sessions>) -> FrontSessionManager {
        let mut local = LocalSessionManager::default();
        local.session_config.keep_alive = Some(sessions.idle());
        FrontSessionManager { local, sessions }
    }
}

impl SessionManager for FrontSessionManager {
    type Error = <LocalSessionManager as SessionManager>::Error;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let (id, transport) = self.local.create_session().await?;
        self.sessions.created(&id);
        Ok((id, transport))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.local.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.local.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        // Forgotten first: no request is admitted to a session being closed.
        self.sessions.closed(id);
        self.local.close_session(id).await
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        SessionManager::create_stream(&self.local, id, message).await
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.local.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        SessionManager::create_standalone_stream(&self.local, id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        SessionManager::resume(&self.local, id, last_event_id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    fn granted(r: Reserve) -> Reservation {
        match r {
            Reserve::Granted(r) => r,
            other => panic!("expected a place, got {other:?}"),
        }
    }

    /// Opens session `id` of `owner` as the front does: reserve, create, claim.
    fn open(s: &Arc<Sessions>, id: &str, owner: &str) -> Vec<String> {
        let r = granted(s.reserve());
        s.created(id);
        let close = s.claim(id, owner);
        r.opened();
        close
    }

    #[test]
    fn a_counter_is_made_only_with_its_session_and_never_again() {
        let s = Sessions::new(10, Duration::from_secs(60), 10);
        assert!(s.steps("a").is_none(), "an unknown id has no counter");
        assert!(!s.touch("a", "p"));
        open(&s, "a", "p");
        let steps = s.steps("a").unwrap();
        let live = CancellationToken::new();
        assert_eq!(steps.take("t", &live).1, 0);
        assert_eq!(s.steps("a").unwrap().take("t", &live).1, 1);
        s.closed("a");
        assert!(s.steps("a").is_none(), "a closed session's counter is gone");
        assert!(!s.touch("a", "p"), "and a request naming it is refused");
        assert!(s.steps("a").is_none(), "nothing made it again");
    }

    #[test]
    fn a_session_is_another_principals_unknown() {
        let s = Sessions::new(10, Duration::from_secs(60), 10);
        open(&s, "a", "p");
        assert!(s.touch("a", "p"));
        assert!(!s.touch("a", "q"));
        // Created but not yet claimed (its `initialize` being answered).
        s.created("b");
        assert!(!s.touch("b", "p"));
    }

    #[test]
    fn at_the_cap_the_least_recently_used_goes_only_once_idle() {
        let idle = Duration::from_secs(60);
        let s = Sessions::new(3, idle, 10);
        for id in ["a", "b", "c"] {
            open(&s, id, "p");
        }
        // `a` was opened first but used last: `b` is the least recently used.
        assert!(s.touch("a", "p"));
        let now = Instant::now();
        match s.reserve_at(now) {
            Reserve::Full(wait) => assert!(wait <= idle && wait > idle / 2, "{wait:?}"),
            other => panic!("every session is live: {other:?}"),
        }
        assert_eq!(s.open(), 3, "nothing was closed");
        assert_eq!(s.reserve_at(now + idle), Reserve::Evict("b".into()));
        s.closed("b");
        s.count_eviction();
        let r = granted(s.reserve_at(now + idle));
        // The reservation holds the place while `initialize` is answered; an
        // `initialize` that opened nothing gives it back.
        assert!(matches!(s.reserve_at(now), Reserve::Full(_)));
        drop(r);
        let r = granted(s.reserve_at(now));
        // Its session, once created, holds the place in its stead.
        s.created("d");
        assert!(matches!(s.reserve_at(now), Reserve::Full(_)));
        s.claim("d", "p");
        r.opened();
        assert!(matches!(s.reserve_at(now), Reserve::Full(_)));
        assert_eq!(s.open(), 3);
        assert!(s.touch("a", "p") && s.touch("c", "p"));
        assert_eq!(s.evicted(), 1);
    }

    #[test]
    fn a_closed_session_frees_its_place_at_once() {
        let s = Sessions::new(2, Duration::from_secs(3600), 10);
        open(&s, "a", "p");
        open(&s, "b", "p");
        assert!(matches!(s.reserve(), Reserve::Full(_)));
        s.closed("a");
        assert!(matches!(s.reserve(), Reserve::Granted(_)));
        assert!(s.touch("b", "p"));
    }

    #[test]
    fn a_principal_beyond_its_cap_loses_its_least_recently_used() {
        let s = Sessions::new(100, Duration::from_secs(60), 2);
        assert!(open(&s, "a", "p").is_empty());
        assert!(open(&s, "b", "p").is_empty());
        assert!(open(&s, "x", "q").is_empty());
        assert!(s.touch("a", "p"));
        assert_eq!(open(&s, "c", "p"), vec!["b".to_owned()]);
        s.closed("b");
        assert_eq!(open(&s, "d", "p"), vec!["a".to_owned()]);
    }
}
