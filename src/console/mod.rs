//! `stepgate console`: the web console for the people in the loop — the
//! calls held for approval (Inbox), the in-doubt steps, a workflow's timeline,
//! per-tool figures — served from an in-memory cache of the topics
//! ([`cache`]). It keeps no state of its own: any number may run.
//!
//! Decisions go the operators' one way ([`crate::operator::send_decision`]):
//! a command on `commands`, bound to the run the page showed, applied by the
//! gate that owns the step, which answers the agent at once. Who may do what
//! is [`auth`]'s; the pages are [`pages`]'.

//!
//! In front of every route a guard checks the `Host` (`console.allowed_hosts`,
//! as the MCP front does), refuses a proxy user header from a peer that is not
//! a trusted proxy or sent twice, and refuses a request carrying one of the
//! console's cookies twice. Every form is CSRF-checked ([`auth`]); banners
//! come only from links the console signed.

pub mod auth;
pub mod cache;
pub mod gates;
pub mod pages;

use crate::config::{Config, ConsoleRole, PeerNet};
use crate::contract::{Action, Run, StepKey};
use crate::redact::Redactor;
use crate::state::{Phase, StepRecord};
use auth::{COOKIES, CSRF_COOKIE, Identities, Peer, Person, SESSION_COOKIE, Unknown};
use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{ConnectInfo, Extension, Form, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use maud::Markup;
use pages::{Chrome, Notice, Page, Tab};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

// Who sent a call, as the MCP front records it in the intent's `metadata`:
// that principal may not decide the step.
use crate::mcp::auth::PRINCIPAL_METADATA;

/// How long a banner link stays valid.
const NOTICE_SECS: i64 = 600;

#[derive(Debug, Error)]
pub enum ConsoleError {
    #[error(
        "the console names no one: configure `[[console.tokens]]`, `console.mcp_auth` or `console.proxy_user_header`, and `[console.roles]` (see docs/console.md)"
    )]
    NoIdentity,
    #[error("the console's identities")]
    Auth(#[from] auth::ConsoleAuthError),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Kafka")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// Every check `stepgate console` makes before it serves, beyond the
/// config's own validation: something names people, and every token and key
/// it names can be read. `stepgate check-config` runs it too, so a config it
/// passes is one the console starts with.
pub fn check(
    cfg: &Config,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Identities, ConsoleError> {
    if !cfg.console.has_identity() {
        return Err(ConsoleError::NoIdentity);
    }
    Ok(Identities::new(&cfg.console, &cfg.mcp, env)?)
}

/// The cache, shared by its reader thread, the gates' scraper and the
/// request handlers.
pub type Shared = Arc<RwLock<cache::Cache>>;

/// Everything a request handler reads.
struct App {
    cfg: Config,
    ids: Identities,
    cache: Shared,
    redactor: Redactor,
    /// Whose proxy header and `X-Forwarded-Proto` are believed.
    trusted: Vec<PeerNet>,
    /// Whether the console listens on loopback (the loopback `Host` names).
    loopback: bool,
}

type AppState = Arc<App>;

/// A started console: where it listens, and the cache (for the benchmark).
pub struct Console {
    pub addr: SocketAddr,
    pub cache: Shared,
    pub server: tokio::task::JoinHandle<()>,
    pub reader: std::thread::JoinHandle<()>,
}

/// Start the console: its reader of the topics (a thread) and its HTTP server,
/// until `shutdown`. `env` reads `env:` token sources.
pub async fn start(
    cfg: Config,
    env: &dyn Fn(&str) -> Option<String>,
    shutdown: CancellationToken,
) -> Result<Console, ConsoleError> {
    let ids = check(&cfg, env)?;
    if !ids.shared_key {
        tracing::info!(
            "console.session_key is not set: this console signs sessions with a key of its own, so they end when it stops and another console does not accept them"
        );
    }
    let (redactor, _) = crate::operator::display_redactor(&cfg, env);
    let cache: Shared = Arc::new(RwLock::new(cache::Cache::new(cfg.tools.keys().cloned())));
    let reader = {
        let (k, group, c, stop) = (
            cfg.kafka.clone(),
            cfg.kafka.gate_group.clone(),
            cache.clone(),
            shutdown.clone(),
        );
        std::thread::Builder::new()
            .name("stepgate-console-reader".into())
            .spawn(move || {
                if let Err(e) = cache::follow(&k, &group, c.clone(), stop) {
                    tracing::error!(error = %e, "the console's reader of the topics stopped");
                    c.write().expect("cache lock").error = Some(e.to_string());
                }
            })
            .map_err(|source| ConsoleError::Listen {
                addr: "reader thread".into(),
                source,
            })?
    };
    if !cfg.console.gates.is_empty() {
        cache.write().expect("cache lock").gates = gates::unscraped(&cfg.console.gates);
        tokio::spawn(gates::follow(
            cfg.console.gates.clone(),
            cache.clone(),
            shutdown.clone(),
        ));
    }
    let addr_text = cfg.console.listen.clone();
    let listener = tokio::net::TcpListener::bind(&addr_text)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: addr_text.clone(),
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ConsoleError::Listen {
            addr: addr_text,
            source,
        })?;
    let app = Arc::new(App {
        trusted: cfg.console.trusted_peers(),
        loopback: cfg.console.loopback(),
        cfg,
        ids,
        cache: cache.clone(),
        redactor,
    });
    let router = router(app);
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        {
            tracing::error!(error = %e, "console server stopped");
        }
    });
    Ok(Console {
        addr,
        cache,
        server,
        reader,
    })
}

fn router(app: AppState) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/inbox") }))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/static/htmx.min.js", get(htmx))
        .route("/static/console.css", get(css))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/inbox", get(inbox))
        .route("/live/inbox", get(live_inbox))
        .route("/in-doubt", get(in_doubt))
        .route("/live/in-doubt", get(live_in_doubt))
        .route("/workflows", get(workflows))
        .route("/workflows/{id}", get(workflow))
        .route("/arguments", get(arguments))
        .route("/overview", get(overview))
        .route("/approve", post(approve))
        .route("/deny", post(deny))
        .route("/resolve", post(resolve))
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard))
        // Probes name the pod's address, not the console's: no Host check.
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(app)
}

fn plain(status: StatusCode, text: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        text + "\n",
    )
        .into_response()
}

/// In front of every page and form: the `Host` must be one this console
/// answers to; the proxy's user header only from a trusted proxy, and once;
/// none of the console's cookies twice. What it learnt of the peer goes on
/// to the handler ([`Peer`]).
async fn guard(State(app): State<AppState>, mut req: Request, next: Next) -> Response {
    let addr = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let headers = req.headers();
    if let Err(why) = crate::mcp::http::host_allowed_in(
        &app.cfg.console.allowed_hosts,
        app.loopback,
        headers,
        req.uri(),
        addr,
    ) {
        tracing::warn!(peer = ?addr, why, "console request refused: Host");
        return plain(
            StatusCode::FORBIDDEN,
            format!(
                "This console does not answer to this Host ({why}). Reach it by one of the names in `console.allowed_hosts`."
            ),
        );
    }
    let peer = Peer::of(addr, headers, &app.trusted);
    if let Some(h) = &app.cfg.console.proxy_user_header {
        let n = headers.get_all(h.as_str()).iter().count();
        if n > 1 {
            return plain(
                StatusCode::BAD_REQUEST,
                format!(
                    "The header `{h}` came {n} times; it names the signed-in person and must come once, set by the proxy (a proxy that appends to a client's header must replace it instead)."
                ),
            );
        }
        if n == 1 && !peer.trusted {
            tracing::warn!(peer = ?addr, header = %h, "console request refused: the proxy user header from a peer that is not a trusted proxy");
            return plain(
                StatusCode::FORBIDDEN,
                format!(
                    "The header `{h}` is believed only from the console's trusted proxies (`console.trusted_proxies`); this request did not come through one."
                ),
            );
        }
    }
    for base in COOKIES {
        for name in [base.to_owned(), format!("__Host-{base}")] {
            if auth::cookie_values(headers, &name).len() > 1 {
                return plain(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "The cookie `{name}` came more than once (another site may have planted one). Clear this site's cookies and sign in again."
                    ),
                );
            }
        }
    }
    req.extensions_mut().insert(peer);
    next.run(req).await
}

/// On every response: a strict CSP (scripts and styles only from this
/// origin's files, forms only to it, no framing), and no caching.
async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    r
}

/// Ready once every topic has been read to its end.
async fn readyz(State(app): State<AppState>) -> (StatusCode, &'static str) {
    if app.cache.read().expect("cache lock").caught_up {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "reading the topics\n")
    }
}

async fn htmx() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        pages::HTMX,
    )
}

async fn css() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=300"),
        ],
        pages::CSS,
    )
}

/// A path segment or query value, percent-encoded.
pub fn percent(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn html_response(status: StatusCode, set: Option<HeaderValue>, body: Markup) -> Response {
    let mut r = (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body.into_string(),
    )
        .into_response();
    if let Some(c) = set {
        r.headers_mut().append(header::SET_COOKIE, c);
    }
    r
}

/// A banner, as a link carries it: signed by the console, so that a link
/// made by anyone else shows none (a banner is not a place for free text).
#[derive(Debug, Serialize, Deserialize)]
struct Flash {
    ok: bool,
    text: String,
    /// The workflow the banner links to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    wf: Option<String>,
    /// When it was made (ms): old links show nothing.
    at: i64,
}

impl App {
    fn refresh_ms(&self) -> u128 {
        self.cfg.console.refresh.0.as_millis()
    }

    /// The held and in-doubt counts (nothing cloned).
    fn counts(&self) -> (usize, usize) {
        let c = self.cache.read().expect("cache lock");
        (
            c.count_waiting(Phase::AwaitingApproval),
            c.count_waiting(Phase::InDoubt),
        )
    }

    fn version(&self) -> u64 {
        self.cache.read().expect("cache lock").attention_version
    }

    /// The CSRF token of the forms `principal` is shown, and the `Set-Cookie`
    /// of the random cookie it is derived from when the request has none.
    fn csrf(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
        principal: &str,
    ) -> (String, Option<HeaderValue>) {
        match peer.cookie(headers, CSRF_COOKIE).filter(|c| c.len() >= 32) {
            Some(nonce) => (self.ids.csrf_token(&nonce, principal), None),
            None => {
                let nonce = auth::new_nonce();
                (
                    self.ids.csrf_token(&nonce, principal),
                    peer.set_cookie(CSRF_COOKIE, &nonce, 86_400),
                )
            }
        }
    }

    /// A link to `back` with a signed banner.
    fn notice_link(&self, back: &str, ok: bool, text: String, wf: Option<&str>) -> String {
        let f = Flash {
            ok,
            text,
            wf: wf.map(str::to_owned),
            at: now_ms(),
        };
        let sealed = self.ids.signer.seal(
            "notice",
            serde_json::to_string(&f).unwrap_or_default().as_bytes(),
        );
        format!("{back}?notice={sealed}")
    }

    /// The banner a link carries, when the console signed it lately.
    fn notice(&self, q: &PageQuery) -> Option<Notice> {
        let f: Flash = q
            .notice
            .as_deref()
            .and_then(|n| self.ids.signer.open("notice", n))
            .and_then(|v| serde_json::from_slice(&v).ok())?;
        let age = now_ms() - f.at;
        if !(0..=NOTICE_SECS * 1000).contains(&age) {
            return None;
        }
        Some(Notice {
            ok: f.ok,
            text: f.text,
            workflow: f.wf.map(|w| (pages::workflow_href(&w), w)),
        })
    }

    /// The person behind a request who may at least `needed`, or the answer
    /// to give instead: the login form (nobody), 401 (a bad token), 403 (no
    /// role, or too small a one).
    async fn person(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
        needed: ConsoleRole,
    ) -> Result<Person, Response> {
        match self.ids.identify(headers, peer).await {
            Ok(p) if p.may(needed) => Ok(p),
            Ok(p) => {
                let (csrf, set) = self.csrf(headers, peer, &p.name);
                let text = match p.role {
                    None => format!(
                        "You are signed in as {}, who has no role in this console. Ask for one in `[console.roles]`.",
                        p.name
                    ),
                    Some(r) => format!(
                        "You are signed in as {} ({}); this needs the {} role.",
                        p.name,
                        r.as_str(),
                        needed.as_str()
                    ),
                };
                let chrome = Chrome {
                    person: Some(&p),
                    csrf: &csrf,
                    tab: Tab::None,
                    held: 0,
                    in_doubt: 0,
                    notice: None,
                };
                Err(html_response(
                    StatusCode::FORBIDDEN,
                    set,
                    pages::page("Forbidden", &chrome, pages::message("Not allowed", &text)),
                ))
            }
            Err(Unknown::Anonymous) => Err(Redirect::to("/login").into_response()),
            Err(Unknown::BadToken(why)) => {
                let (csrf, set) = self.csrf(headers, peer, "");
                let mut r = html_response(
                    StatusCode::UNAUTHORIZED,
                    set,
                    pages::page(
                        "Sign in",
                        &Chrome {
                            person: None,
                            csrf: &csrf,
                            tab: Tab::None,
                            held: 0,
                            in_doubt: 0,
                            notice: None,
                        },
                        pages::login(Some(&why), &csrf),
                    ),
                );
                // A stale session is dropped.
                if let Some(v) = peer.set_cookie(SESSION_COOKIE, "", 0) {
                    r.headers_mut().append(header::SET_COOKIE, v);
                }
                Err(r)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn render(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
        person: &Person,
        tab: Tab,
        title: &str,
        notice: Option<Notice>,
        body: impl FnOnce(&str) -> Markup,
    ) -> Response {
        let (csrf, set) = self.csrf(headers, peer, &person.name);
        let (held, in_doubt) = self.counts();
        let chrome = Chrome {
            person: Some(person),
            csrf: &csrf,
            tab,
            held,
            in_doubt,
            notice,
        };
        html_response(
            StatusCode::OK,
            set,
            pages::page(title, &chrome, body(&csrf)),
        )
    }

    /// One page of the held calls (only its records cloned).
    fn held(&self, page: usize) -> (Vec<pages::Held>, Page, u64) {
        let c = self.cache.read().expect("cache lock");
        let total = c.count_waiting(Phase::AwaitingApproval);
        let page = page_of(page, total);
        let (records, total) =
            c.waiting_page(Phase::AwaitingApproval, page.skip(), pages::PER_PAGE);
        let held = records
            .into_iter()
            .map(|record| pages::Held {
                requested_at: c
                    .approval(&record.step)
                    .and_then(|a| a.requested_at.clone()),
                earlier: c.workflow(&record.step.workflow_id),
                record,
            })
            .collect();
        (held, Page { total, ..page }, c.attention_version)
    }

    /// One page of the in-doubt steps.
    fn doubts(&self, page: usize) -> (Vec<pages::Doubt>, Page, u64) {
        let c = self.cache.read().expect("cache lock");
        let total = c.count_waiting(Phase::InDoubt);
        let page = page_of(page, total);
        let (records, total) = c.waiting_page(Phase::InDoubt, page.skip(), pages::PER_PAGE);
        let d = records
            .into_iter()
            .map(|record| pages::Doubt { record })
            .collect();
        (d, Page { total, ..page }, c.attention_version)
    }

    /// A step's whole record: from the cache when it waits for a person,
    /// else read back from the changelog.
    async fn record(&self, step: &StepKey) -> Option<StepRecord> {
        let (waiting, entry) = {
            let c = self.cache.read().expect("cache lock");
            (
                c.waiting_record(step),
                c.workflow(&step.workflow_id)
                    .into_iter()
                    .find(|(k, _)| k == step)
                    .map(|(_, e)| e),
            )
        };
        if waiting.is_some() {
            return waiting;
        }
        let e = entry?;
        let k = self.cfg.kafka.clone();
        let step = step.clone();
        tokio::task::spawn_blocking(move || {
            cache::read_records(&k, e.partition, &[e.offset])
                .ok()?
                .into_iter()
                .find(|r| r.step == step)
        })
        .await
        .ok()
        .flatten()
    }
}

/// Page `n` (from 1) of a list of `total`, within its pages.
fn page_of(n: usize, total: usize) -> Page {
    let p = Page { number: 1, total };
    Page {
        number: n.clamp(1, p.pages()),
        total,
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[derive(Deserialize, Default)]
struct PageQuery {
    notice: Option<String>,
    v: Option<u64>,
    id: Option<String>,
    page: Option<String>,
}

impl PageQuery {
    fn page(&self) -> usize {
        self.page
            .as_deref()
            .and_then(|p| p.parse().ok())
            .unwrap_or(1)
    }
}

async fn login_page(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
) -> Response {
    if app.ids.identify(&headers, &peer).await.is_ok() {
        return Redirect::to("/inbox").into_response();
    }
    let (csrf, set) = app.csrf(&headers, &peer, "");
    let chrome = Chrome {
        person: None,
        csrf: &csrf,
        tab: Tab::None,
        held: 0,
        in_doubt: 0,
        notice: None,
    };
    html_response(
        StatusCode::OK,
        set,
        pages::page("Sign in", &chrome, pages::login(None, &csrf)),
    )
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
    csrf: String,
}

async fn login(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let Ok(Form(f)) = form else {
        return forged();
    };
    if !app.ids.form_allowed(&headers, &peer, "", &f.csrf) {
        return forged();
    }
    match app.ids.by_token(&f.token).await {
        Ok((person, ends)) => {
            let mut r = Redirect::to("/inbox").into_response();
            // A signed session naming the principal, never the token itself;
            // where no script can read it, sent only to this site.
            let session = app.ids.new_session(&person, &f.token, ends);
            let max_age = (ends - chrono::Utc::now().timestamp()).max(0);
            if let Some(v) = peer.set_cookie(SESSION_COOKIE, &session, max_age) {
                r.headers_mut().append(header::SET_COOKIE, v);
            }
            r
        }
        Err(e) => {
            let why = match e {
                Unknown::BadToken(why) => why,
                Unknown::Anonymous => "Paste a token.".into(),
            };
            let (csrf, set) = app.csrf(&headers, &peer, "");
            let chrome = Chrome {
                person: None,
                csrf: &csrf,
                tab: Tab::None,
                held: 0,
                in_doubt: 0,
                notice: None,
            };
            html_response(
                StatusCode::UNAUTHORIZED,
                set,
                pages::page("Sign in", &chrome, pages::login(Some(&why), &csrf)),
            )
        }
    }
}

#[derive(Deserialize)]
struct CsrfOnly {
    csrf: String,
}

async fn logout(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    form: Result<Form<CsrfOnly>, FormRejection>,
) -> Response {
    let Ok(Form(f)) = form else {
        return forged();
    };
    let who = app
        .ids
        .identify(&headers, &peer)
        .await
        .map(|p| p.name)
        .unwrap_or_default();
    if !app.ids.form_allowed(&headers, &peer, &who, &f.csrf) {
        return forged();
    }
    let mut r = Redirect::to("/login").into_response();
    if let Some(v) = peer.set_cookie(SESSION_COOKIE, "", 0) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

/// The answer to a form the console did not make, or cannot read: 403.
fn forged() -> Response {
    plain(
        StatusCode::FORBIDDEN,
        "This form did not come from this console (its CSRF token is missing or wrong, a field is missing or malformed, or its Origin is another site's). Reload the page and try again.".into(),
    )
}

async fn inbox(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (held, page, v) = app.held(q.page());
    app.render(&headers, &peer, &p, Tab::Inbox, "Inbox", app.notice(&q), |csrf| {
        maud::html! {
            h1 { "Held for approval" }
            p.muted { "Oldest first. Approve runs the call at once; Deny answers the agent with your reason. Both are recorded with your name." }
            (pages::inbox_list(app.refresh_ms(), &held, page, &p, csrf, &app.redactor, now_ms(), v))
        }
    })
}

/// The live part of a page, only when it changed since version `v`: the
/// version is compared first, so an unchanged list costs no rendering (204:
/// htmx leaves the page, and whatever is typed in it, alone).
async fn live(
    app: &App,
    headers: &HeaderMap,
    peer: &Peer,
    q: &PageQuery,
    list: impl FnOnce(&Person, &str) -> Markup,
) -> Response {
    let p = match app.person(headers, peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(_) => return StatusCode::UNAUTHORIZED.into_response(),
    };
    if q.v == Some(app.version()) {
        return StatusCode::NO_CONTENT.into_response();
    }
    let (csrf, _) = app.csrf(headers, peer, &p.name);
    let markup = list(&p, &csrf);
    let (held, in_doubt) = app.counts();
    html_response(
        StatusCode::OK,
        None,
        maud::html! { (markup) (pages::counts_oob(held, in_doubt)) },
    )
}

async fn live_inbox(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    live(&app, &headers, &peer, &q, |p, csrf| {
        let (held, page, v) = app.held(q.page());
        pages::inbox_list(
            app.refresh_ms(),
            &held,
            page,
            p,
            csrf,
            &app.redactor,
            now_ms(),
            v,
        )
    })
    .await
}

async fn in_doubt(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (d, page, v) = app.doubts(q.page());
    app.render(&headers, &peer, &p, Tab::InDoubt, "In doubt", app.notice(&q), |csrf| {
        maud::html! {
            h1 { "In doubt" }
            p.muted { "Each step below was started and its outcome is unknown: it may have taken effect. The agent got `in_doubt` and its retries are held until you decide. Check at the provider with the Idempotency-Key, then resolve it." }
            (pages::in_doubt_list(app.refresh_ms(), &d, page, &p, csrf, &app.redactor, now_ms(), v))
        }
    })
}

async fn live_in_doubt(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    live(&app, &headers, &peer, &q, |p, csrf| {
        let (d, page, v) = app.doubts(q.page());
        pages::in_doubt_list(
            app.refresh_ms(),
            &d,
            page,
            p,
            csrf,
            &app.redactor,
            now_ms(),
            v,
        )
    })
    .await
}

async fn workflows(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let query = q.id.clone().unwrap_or_default().trim().to_owned();
    let found = if query.is_empty() {
        Vec::new()
    } else {
        app.cache
            .read()
            .expect("cache lock")
            .workflows_starting(&query, 100)
    };
    if found.len() == 1 && found[0] == query {
        return Redirect::to(&pages::workflow_href(&query)).into_response();
    }
    app.render(
        &headers,
        &peer,
        &p,
        Tab::Workflows,
        "Workflows",
        None,
        |_| pages::workflow_search(&query, &found),
    )
}

async fn workflow(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let steps = app.cache.read().expect("cache lock").workflow(&id);
    // The whole records, read back from the changelog by offset.
    let mut by_partition: std::collections::BTreeMap<i32, Vec<i64>> = Default::default();
    for (_, e) in &steps {
        by_partition.entry(e.partition).or_default().push(e.offset);
    }
    let k = app.cfg.kafka.clone();
    let records = tokio::task::spawn_blocking(move || {
        let mut all = Vec::new();
        for (p, offsets) in by_partition {
            match cache::read_records(&k, p, &offsets) {
                Ok(r) => all.extend(r),
                Err(e) => tracing::warn!(error = %e, "reading a workflow's records"),
            }
        }
        all
    })
    .await
    .unwrap_or_default();
    let timeline: Vec<pages::TimelineStep> = {
        let c = app.cache.read().expect("cache lock");
        steps
            .into_iter()
            .map(|(key, entry)| pages::TimelineStep {
                record: records.iter().find(|r| r.step == key).cloned(),
                decisions: c.decisions(&key).to_vec(),
                approval: c.approval(&key).cloned(),
                key,
                entry,
            })
            .collect()
    };
    app.render(
        &headers,
        &peer,
        &p,
        Tab::Workflows,
        &id,
        app.notice(&q),
        |_| {
            pages::timeline(
                &id,
                &timeline,
                app.cfg.console.trace_url.as_deref(),
                &app.redactor,
            )
        },
    )
}

#[derive(Deserialize)]
struct StepQuery {
    workflow_id: String,
    step_index: u64,
    tool: String,
    #[serde(default)]
    attempt: u64,
}

/// One step's whole arguments (a card shows the first few KiB).
async fn arguments(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    q: Result<Query<StepQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let Ok(Query(q)) = q else {
        return plain(
            StatusCode::BAD_REQUEST,
            "Name the step: ?workflow_id=…&step_index=…&tool=…&attempt=…".into(),
        );
    };
    let step = StepKey {
        workflow_id: q.workflow_id,
        step_index: q.step_index,
        tool: q.tool,
        attempt: q.attempt,
    };
    let Some(rec) = app.record(&step).await else {
        return plain(
            StatusCode::NOT_FOUND,
            format!("No recorded step {step} (settled steps expire after the retention)."),
        );
    };
    let reveal = pages::Reveal::of(&p, rec.phase);
    app.render(
        &headers,
        &peer,
        &p,
        Tab::Workflows,
        "Arguments",
        None,
        |_| pages::arguments_page(&rec, &app.redactor, reveal),
    )
}

async fn overview(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
) -> Response {
    let p = match app.person(&headers, &peer, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (tools, lag, gate_views, steps, caught) = {
        let c = app.cache.read().expect("cache lock");
        (
            c.tool_figures(),
            c.lag.clone(),
            c.gates.clone(),
            c.step_count(),
            c.caught_up_after,
        )
    };
    // Without listed gates the page says how to list them.
    let restore = (!app.cfg.console.gates.is_empty()).then(|| {
        let partitions: Vec<i32> = lag.iter().map(|l| l.partition).collect();
        gates::derive(&partitions, &gate_views)
    });
    app.render(&headers, &peer, &p, Tab::Overview, "Overview", None, |_| {
        pages::overview(&tools, &lag, restore.as_deref(), &gate_views, steps, caught)
    })
}

/// A decision's form: the step and the run the page showed.
#[derive(Deserialize)]
struct DecisionForm {
    csrf: String,
    workflow_id: String,
    step_index: u64,
    tool: String,
    attempt: u64,
    dispatch: u32,
    intended_at_ms: i64,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    outcome: Option<String>,
    #[serde(default)]
    output: Option<String>,
    /// A held call's terms as the page showed them.
    #[serde(default)]
    arguments_sha256: Option<String>,
    #[serde(default)]
    policy_version: Option<String>,
}

impl DecisionForm {
    fn step(&self) -> StepKey {
        StepKey {
            workflow_id: self.workflow_id.clone(),
            step_index: self.step_index,
            tool: self.tool.clone(),
            attempt: self.attempt,
        }
    }

    fn reason(&self) -> Option<String> {
        self.reason
            .as_ref()
            .map(|r| r.trim().to_owned())
            .filter(|r| !r.is_empty())
    }
}

type DecisionPost = Result<Form<DecisionForm>, FormRejection>;

async fn approve(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    f: DecisionPost,
) -> Response {
    decide(
        &app,
        &headers,
        &peer,
        f,
        ConsoleRole::Approver,
        "/inbox",
        |_| Ok(Action::Approve),
    )
    .await
}

async fn deny(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    f: DecisionPost,
) -> Response {
    decide(
        &app,
        &headers,
        &peer,
        f,
        ConsoleRole::Approver,
        "/inbox",
        |f| match f.reason() {
            Some(_) => Ok(Action::Deny),
            None => Err("A denial needs a reason: the agent is told it.".into()),
        },
    )
    .await
}

async fn resolve(
    State(app): State<AppState>,
    Extension(peer): Extension<Peer>,
    headers: HeaderMap,
    f: DecisionPost,
) -> Response {
    decide(
        &app,
        &headers,
        &peer,
        f,
        ConsoleRole::Operator,
        "/in-doubt",
        |f| match f.outcome.as_deref() {
            Some("not_executed") => Ok(Action::ResolveNotExecuted),
            Some("failed") if f.reason.as_deref().is_some_and(|r| !r.trim().is_empty()) => {
                Ok(Action::ResolveFailed)
            }
            Some("failed") => Err("Say what failed: the agent is told it.".into()),
            Some("executed") => {
                let text = f.output.clone().unwrap_or_default();
                serde_json::from_str(&text)
                    .map(|output| Action::ResolveExecuted { output })
                    .map_err(|e| {
                        format!("The output must be JSON (it is what the agent receives): {e}")
                    })
            }
            _ => Err("Say whether it was executed or not.".into()),
        },
    )
    .await
}

/// What a decision did, in plain words, naming the step's tool and workflow.
fn done_text(action: &Action, step: &StepKey, by: &str, r: &StepRecord) -> String {
    let call = format!(
        "{} in workflow {} (step {})",
        step.tool, step.workflow_id, step.step_index
    );
    match action {
        Action::Approve => match (&r.phase, r.result.as_ref().map(|x| x.status.as_str())) {
            (Phase::Completed, Some("ok")) => {
                format!("Approved by {by}: {call} ran, and the agent has its answer (ok).")
            }
            (Phase::Completed, Some(s)) => {
                format!("Approved by {by}: {call} ran, and the agent has its answer ({s}).")
            }
            _ => format!(
                "Approved by {by}: {call} is running; the agent gets its answer when it ends."
            ),
        },
        Action::Deny => {
            format!("Denied by {by}: {call} will not run; the agent is told your reason.")
        }
        Action::ResolveExecuted { .. } => format!(
            "Marked as executed by {by}: {call} is settled, and the agent receives the output you gave."
        ),
        Action::ResolveNotExecuted => format!(
            "Marked as not executed by {by}: the agent's next call of {call} runs it again."
        ),
        Action::ResolveFailed => format!(
            "Marked as failed by {by}: the agent is told what you found about {call}; it is not run again."
        ),
    }
}

/// Check who asks, the form, and the step; send the command bound to the
/// run the page showed; wait for the gate to apply it; back to `back` with
/// what happened.
#[allow(clippy::too_many_arguments)]
async fn decide(
    app: &App,
    headers: &HeaderMap,
    peer: &Peer,
    form: DecisionPost,
    needed: ConsoleRole,
    back: &str,
    action: impl FnOnce(&DecisionForm) -> Result<Action, String>,
) -> Response {
    let p = match app.person(headers, peer, needed).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let Ok(Form(f)) = form else {
        return forged();
    };
    if !app.ids.form_allowed(headers, peer, &p.name, &f.csrf) {
        return forged();
    }
    let step = f.step();
    let wf = step.workflow_id.clone();
    let to = |ok: bool, text: String| {
        Redirect::to(&app.notice_link(back, ok, text, Some(&wf))).into_response()
    };
    let call = format!(
        "{} in workflow {} (step {})",
        step.tool, step.workflow_id, step.step_index
    );
    let action = match action(&f) {
        Ok(a) => a,
        Err(why) => return to(false, format!("Nothing was sent: {why}")),
    };
    let Some(record) = app.cache.read().expect("cache lock").waiting_record(&step) else {
        return to(
            false,
            format!(
                "{call} is no longer waiting for a person: someone may have decided it already. Nothing was sent."
            ),
        );
    };
    let wanted = Phase::acted_on_by(&action);
    if record.phase != wanted {
        return to(
            false,
            format!(
                "{call} is {}, not {}: nothing was sent.",
                record.phase.as_str(),
                wanted.as_str()
            ),
        );
    }
    // No one decides a call their own credential made: an agent's token
    // that is also a console login must not approve its own held call.
    let sender = record
        .metadata
        .as_ref()
        .and_then(|m| m.get(PRINCIPAL_METADATA))
        .and_then(|v| v.as_str());
    if sender == Some(p.name.as_str()) {
        tracing::warn!(step = %step, by = %p.name, "console: a decision by the principal that sent the call refused");
        return to(
            false,
            format!(
                "You cannot decide {call}: it was sent with your own credential ({}). Another person must decide it. Nothing was sent.",
                p.name
            ),
        );
    }
    let name = action.as_str();
    let run = Run {
        dispatch: f.dispatch,
        intended_at_ms: f.intended_at_ms,
    };
    tracing::info!(step = %step, action = name, by = %p.name, "console: decision sent");
    match crate::operator::send_decision(
        &app.cfg.kafka,
        record.partition,
        step.clone(),
        action.clone(),
        &p.name,
        f.reason(),
        run,
        f.arguments_sha256
            .clone()
            .zip(f.policy_version.clone())
            .map(
                |(arguments_sha256, policy_version)| crate::operator::HeldTerms {
                    arguments_sha256,
                    policy_version,
                },
            ),
        app.cfg.console.decision_wait.0,
    )
    .await
    {
        Ok(applied) => {
            // Until this console's own reader has seen it, the page would
            // still list the step.
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until
                && app
                    .cache
                    .read()
                    .expect("cache lock")
                    .waiting_record(&step)
                    .is_some_and(|r| {
                        r.phase == wanted
                            && r.intended_at_ms == run.intended_at_ms
                            && r.dispatch == run.dispatch
                    })
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            to(true, done_text(&action, &step, &p.name, &applied))
        }
        Err(e) => to(
            false,
            format!(
                "{} of {call} was not applied: {}",
                name,
                app.redactor.text(&e.to_string())
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Category;

    /// A console over a cache of `held` calls, each with `bytes` of
    /// arguments, serving on loopback; its address.
    async fn serve(held: usize, bytes: usize) -> (SocketAddr, Shared) {
        let cfg = Config {
            console: toml::from_str(
                r#"
roles = { victor = "viewer" }
tokens = [{ name = "victor", token = "victor-viewer-token-00001" }]
"#,
            )
            .unwrap(),
            ..Config::default()
        };
        let ids = check(&cfg, &|_| None).unwrap();
        let cache: Shared = Arc::new(RwLock::new(cache::Cache::default()));
        let memo = "m".repeat(bytes);
        for i in 0..held {
            let args = serde_json::json!({"i": i, "memo": memo});
            let r = StepRecord::new(
                StepKey {
                    workflow_id: format!("wf-{i}"),
                    step_index: 0,
                    tool: "wire".into(),
                    attempt: 0,
                },
                Category::Unkeyed,
                Phase::AwaitingApproval,
                crate::contract::Arguments::from(args.as_object().unwrap()),
                0,
                i as i64,
                i64::MAX,
            );
            cache.write().unwrap().insert_waiting(r);
        }
        let app = Arc::new(App {
            trusted: cfg.console.trusted_peers(),
            loopback: true,
            redactor: Redactor::default(),
            cfg,
            ids,
            cache: cache.clone(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                router(app).into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        });
        (addr, cache)
    }

    /// The live poll compares the version before rendering anything: with
    /// large held calls, an unchanged Inbox answers 204 at once (it rendered
    /// every held call on each poll of each open tab, then only a page of
    /// them — still megabytes of arguments).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unchanged_live_list_is_not_rendered() {
        // 40 calls of 1 MB (the largest intent): a page of them is 20 MB.
        let (addr, cache) = serve(40, 1_000_000).await;
        let v = cache.read().unwrap().attention_version;
        let client = reqwest::Client::new();
        let get = |path: String| {
            client
                .get(format!("http://{addr}{path}"))
                .bearer_auth("victor-viewer-token-00001")
                .send()
        };
        // The first poll of a page that changed: one page is rendered.
        let r = get("/live/inbox?page=1&v=0".into()).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let page = r.text().await.unwrap();
        assert_eq!(
            page.matches("<article class=\"card held\"").count(),
            pages::PER_PAGE
        );
        assert!(
            page.len() < 400_000,
            "a page of capped cards: {} bytes",
            page.len()
        );
        // Unchanged: 204, in far less time than rendering 20 MB of arguments.
        let mut slowest = Duration::ZERO;
        for _ in 0..5 {
            let t = Instant::now();
            let r = get(format!("/live/inbox?page=1&v={v}")).await.unwrap();
            assert_eq!(r.status().as_u16(), 204);
            slowest = slowest.max(t.elapsed());
        }
        assert!(
            slowest < Duration::from_millis(300),
            "an unchanged poll took {slowest:?}"
        );
    }

    /// The guard refuses another site's `Host`, and a form of the console's
    /// without its CSRF token gets 403.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_guard_checks_the_host() {
        let (addr, _) = serve(0, 0).await;
        let r = reqwest::Client::new()
            .get(format!("http://{addr}/inbox"))
            .header("host", "rebound.example")
            .bearer_auth("victor-viewer-token-00001")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 403);
        let r = reqwest::Client::new()
            .get(format!("http://{addr}/healthz"))
            .header("host", "10.1.2.3:9470")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "probes name the pod's address");
    }
}
