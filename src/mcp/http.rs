//! `stepgate mcp --listen`: Streamable HTTP at `/mcp`, behind the checks the
//! MCP specification asks of an HTTP server, in this order:
//! 1. `Host` is one of the configured names; the loopback names only when the
//!    front listens on loopback and only from a loopback peer (a client that
//!    sends `Host: localhost` from elsewhere is refused) — 403.
//! 2. `Origin`, when present, is one of the allowed origins — 403.
//! 3. A bearer token that names a [`Principal`] — 401 with a challenge that
//!    points at the Protected Resource Metadata (RFC 9728), served at
//!    `/.well-known/oauth-protected-resource` (and under `/mcp`); but 429 for
//!    a client address that presented too many refused tokens lately. A
//!    token that is accepted is never refused for its address, and behind a
//!    trusted proxy (`mcp.trusted_proxies`) the address is the client's, from
//!    `X-Forwarded-For`, not the proxy's.
//! 4. The principal's request rate — 429.
//! 5. The body's size — 413; and a `tools/call` of a tool the principal's
//!    scopes do not grant — 403 `insufficient_scope`.
//! 6. An `Mcp-Session-Id` names an open session of the principal (one that
//!    is closed, evicted, from before a restart, or another's is answered as
//!    unknown: 404 with [`UNKNOWN_SESSION`]); a principal's sessions are
//!    capped, its least recently used closed beyond the cap; and a new session
//!    beyond `mcp.max_sessions` closes the least recently used one if it is
//!    idle, else is refused — 503 with `Retry-After` (see [`super::sessions`]).

use super::auth::{AuthError, Authorizer, Principal};
use super::sessions::{FrontSessionManager, Reserve, Sessions, UNKNOWN_SESSION};
use super::tasks;
use crate::config::TrustedProxy;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota};
use rmcp::transport::streamable_http_server::session::SessionManager;
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

/// The loopback names, allowed in `Host` only on a loopback listener.
pub const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// What the checks in front of `/mcp` need; one per front.
pub struct Guard {
    pub authorizer: Option<Authorizer>,
    /// The configured tools (a call of another is the handler's to refuse).
    pub tools: BTreeSet<String>,
    /// `host` or `host:port`, lower case.
    pub allowed_hosts: Vec<String>,
    /// Whether the front listens on a loopback address.
    pub loopback: bool,
    pub allowed_origins: Vec<String>,
    pub max_body: usize,
    pub limiter: DefaultKeyedRateLimiter<String>,
    /// Refused tokens per client address ([`FAILED_AUTH_PER_SECOND`]), and
    /// the addresses refused until a time for having too many.
    pub failures: FailedAuth,
    /// `mcp.trusted_proxies`: peers whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Vec<TrustedProxy>,
    /// The open sessions: their owners, last uses and caps.
    pub sessions: Arc<Sessions>,
    pub session_manager: Arc<FrontSessionManager>,
    /// The Protected Resource Metadata's URL, for challenges.
    pub metadata_url: String,
    /// The Protected Resource Metadata document.
    pub metadata: Value,
    /// The front, for the requests answered here ([`super::tasks`]).
    pub front: super::McpFront,
}

impl Guard {
    pub fn limiter<K: std::hash::Hash + Eq + Clone>(
        requests_per_second: u32,
        burst: u32,
    ) -> DefaultKeyedRateLimiter<K> {
        let rate = NonZeroU32::new(requests_per_second).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(burst).unwrap_or(rate);
        DefaultKeyedRateLimiter::keyed(Quota::per_second(rate).allow_burst(burst))
    }
}

/// Refused tokens a client address may present per second, sustained and at
/// once: beyond them its refused tokens are answered 429 (with `Retry-After`)
/// for a while, which slows a client guessing tokens. A token that is
/// accepted is never refused for it: one client behind a shared address (a
/// NAT, a proxy not in `mcp.trusted_proxies`) cannot lock the others out.
pub const FAILED_AUTH_PER_SECOND: u32 = 5;
pub const FAILED_AUTH_BURST: u32 = 20;

/// The 429 of a client address locked out for its refused tokens.
const REFUSED_TOO_OFTEN: &str = "Too Many Requests: too many refused bearer tokens came from this \
client address lately, and this token is not accepted either. Nothing was performed. Use a valid \
token (one is never refused for its address), or try again after Retry-After.";

/// Refused tokens by client address.
pub struct FailedAuth {
    limiter: DefaultKeyedRateLimiter<IpAddr>,
    blocked_until: Mutex<HashMap<IpAddr, std::time::Instant>>,
}

impl Default for FailedAuth {
    fn default() -> Self {
        FailedAuth {
            limiter: Guard::limiter(FAILED_AUTH_PER_SECOND, FAILED_AUTH_BURST),
            blocked_until: Mutex::new(HashMap::new()),
        }
    }
}

impl FailedAuth {
    /// How long `ip` is still refused, if it is.
    fn blocked(&self, ip: IpAddr) -> Option<std::time::Duration> {
        let blocked = self.blocked_until.lock().expect("failed auth lock");
        let until = *blocked.get(&ip)?;
        until.checked_duration_since(std::time::Instant::now())
    }

    /// `ip` presented a token that was refused.
    fn refused(&self, ip: IpAddr) {
        if let Err(not_until) = self.limiter.check_key(&ip) {
            let wait = not_until.wait_time_from(self.limiter.clock().now());
            self.blocked_until
                .lock()
                .expect("failed auth lock")
                .insert(ip, std::time::Instant::now() + wait);
        }
    }

    /// Forget addresses no longer refused.
    pub fn sweep(&self) {
        self.limiter.retain_recent();
        let now = std::time::Instant::now();
        self.blocked_until
            .lock()
            .expect("failed auth lock")
            .retain(|_, until| *until > now);
    }
}

/// The metadata document's URL for `resource` (RFC 9728 §3.1: the well-known
/// path inserted between the authority and the resource's path).
pub fn metadata_url(resource: &str) -> String {
    match reqwest::Url::parse(resource) {
        Ok(u) => {
            let path = u.path().trim_end_matches('/');
            format!(
                "{}/.well-known/oauth-protected-resource{path}",
                u.origin().ascii_serialization()
            )
        }
        Err(_) => resource.to_owned(),
    }
}

/// `GET /.well-known/oauth-protected-resource[/…]`.
pub async fn protected_resource_metadata(State(guard): State<Arc<Guard>>) -> Response {
    (
        [(header::CACHE_CONTROL, "max-age=300")],
        axum::Json(guard.metadata.clone()),
    )
        .into_response()
}

/// The checks before the body: Host, Origin, the token, the rate, the
/// session's owner. The principal and the request's session, or the refusal.
async fn admit(
    g: &Guard,
    parts: &axum::http::request::Parts,
) -> Result<(Principal, Option<String>), Response> {
    let peer = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    if let Err(why) = host_allowed(g, &parts.headers, &parts.uri, peer) {
        tracing::warn!(?peer, why, "MCP request refused: Host");
        return Err(plain(StatusCode::FORBIDDEN, &format!("Forbidden: {why}")));
    }
    if let Some(origin) = parts.headers.get(header::ORIGIN)
        && !origin_allowed(origin, &g.allowed_origins)
    {
        tracing::warn!(?peer, ?origin, "MCP request refused: Origin");
        return Err(plain(
            StatusCode::FORBIDDEN,
            "Forbidden: Origin is not allowed",
        ));
    }
    let principal = match &g.authorizer {
        None => Principal::anonymous(),
        Some(auth) => {
            let authorization = parts
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            // The token first: one that is accepted is never refused for
            // its address, which others may share.
            match auth.authorize(authorization).await {
                Ok(p) => p,
                Err(e) => {
                    let client =
                        peer.map(|p| client_address(p.ip(), &parts.headers, &g.trusted_proxies));
                    if let (AuthError::InvalidToken(_), Some(ip)) = (&e, client) {
                        g.failures.refused(ip);
                        if let Some(wait) = g.failures.blocked(ip) {
                            tracing::warn!(client = %ip, "MCP request refused: too many refused tokens from this address");
                            return Err(too_many(wait, REFUSED_TOO_OFTEN));
                        }
                    }
                    return Err(unauthorized(g, &e));
                }
            }
        }
    };
    let key = principal.key();
    if let Err(not_until) = g.limiter.check_key(&key) {
        return Err(too_many(
            not_until.wait_time_from(g.limiter.clock().now()),
            "Too Many Requests: this caller's request rate is limited (mcp.requests_per_second, \
             mcp.burst). Nothing in this request was performed; send it again after Retry-After.",
        ));
    }
    let session = parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Some(id) = &session {
        // Every session is recorded with its owner before the response that
        // names it leaves; one that is not open (closed, evicted, opened
        // before a restart) or is another principal's is unknown — the same
        // answer for each, so nothing of another's session is told.
        if !g.sessions.touch(id, &key) {
            return Err(unknown_session());
        }
    }
    Ok((principal, session))
}

/// `response`, once the request's body is read and dropped (at most `limit`
/// bytes, for at most [`DRAIN_TIME`]); if it could not be, the connection is
/// closed after the response.
async fn after_draining(body: Body, limit: usize, mut response: Response) -> Response {
    use futures::StreamExt as _;
    let mut stream = body.into_data_stream();
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    let mut seen = 0usize;
    let drained = loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(chunk))) => {
                seen += chunk.len();
                if seen > limit {
                    break false;
                }
            }
            Ok(None) => break true,
            Ok(Some(Err(_))) | Err(_) => break false,
        }
    };
    if !drained {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The checks in front of `/mcp` (see the module's doc).
pub async fn guard(State(g): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let (principal, session) = match admit(&g, &parts).await {
        Ok(admitted) => admitted,
        // The body is read (and dropped) before the refusal, so that a
        // client which sends all of it before reading the answer reads it.
        Err(refusal) => return after_draining(body, g.max_body, refusal).await,
    };
    let key = principal.key();
    let mut parts = parts;
    let method = parts.method.clone();
    // A new session's place under `mcp.max_sessions` until it is claimed.
    let mut reservation = None;
    // A response that announces the tasks (see `tasks::amend`).
    let mut amended = None;
    let body = if method == Method::POST {
        let length = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let bytes = match read_capped(body, g.max_body, length).await {
            ReadBody::Read(bytes) => bytes,
            ReadBody::TooLarge => return too_large_response(g.max_body),
            ReadBody::Broken => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    "Bad Request: the body could not be read",
                );
            }
        };
        // Read once, for every check below (rmcp reads the bytes again).
        let message = serde_json::from_slice::<Value>(&bytes).ok();
        if let Some(tool) = message
            .as_ref()
            .and_then(|m| forbidden_tool(m, &g.tools, &principal))
        {
            return insufficient_scope(&g, &tool);
        }
        if let Some(message) = &message {
            let revision = parts
                .headers
                .get("mcp-protocol-version")
                .and_then(|v| v.to_str().ok());
            if tasks::is_ours(message, revision) {
                return tasks::answer(&g.front, &principal, session.as_deref(), message).await;
            }
            // `execution.taskSupport` is 2025-11-25's vocabulary only.
            amended = match message.get("method").and_then(Value::as_str) {
                Some("initialize") => Some("initialize"),
                Some("tools/list") if revision == Some(tasks::TASKS_PROTOCOL) => Some("tools/list"),
                _ => None,
            };
        }
        if session.is_none() && message.as_ref().is_some_and(opens_session) {
            match place_for_a_session(&g).await {
                Ok(place) => reservation = Some(place),
                Err(refusal) => return refusal,
            }
        }
        Body::from(bytes)
    } else {
        body
    };
    parts.extensions.insert(Arc::new(principal));
    let mut response = next.run(Request::from_parts(parts, body)).await;
    if let Some(method) = amended {
        response = tasks::amend_response(method, response).await;
    }
    if session.is_some() {
        if method == Method::DELETE && response.status() == StatusCode::ACCEPTED {
            // The session is closed (rmcp says 202); the SDKs expect 200 or
            // 204 for that, and log anything else as a failed termination.
            *response.status_mut() = StatusCode::NO_CONTENT;
            return response;
        }
        // rmcp closed it after the guard let the request through.
        return rmcp_unknown_session(response).await;
    }
    let opened = response
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Some(opened) = opened {
        // Claimed before the response that names it leaves.
        let beyond = g.sessions.claim(&opened, &key);
        if let Some(place) = reservation.take() {
            place.opened();
        }
        for id in beyond {
            tracing::info!(
                principal = key,
                "closing the least recently used MCP session of a principal at its cap"
            );
            let _ = g
                .session_manager
                .close_session(&Arc::from(id.as_str()))
                .await;
        }
    }
    drop(reservation);
    response
}

/// The address of the client a request came from: its TCP peer, unless the
/// peer is a trusted proxy — then the right-most address of
/// `X-Forwarded-For` (each proxy appends the one it was reached from) that
/// is not itself a trusted proxy; what is left of it was written by the
/// client and is not believed.
pub fn client_address(peer: IpAddr, headers: &HeaderMap, trusted: &[TrustedProxy]) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|t| t.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    let mut client = peer;
    for hop in hops.iter().rev() {
        let Some(ip) = hop
            .parse::<IpAddr>()
            .ok()
            .or_else(|| hop.parse::<SocketAddr>().ok().map(|a| a.ip()))
        else {
            // Not an address: no trusted proxy wrote it.
            break;
        };
        client = ip;
        if !is_trusted(ip) {
            break;
        }
    }
    client
}

/// Whether a request body opens a session (an `initialize`, or a batch with one).
fn opens_session(value: &Value) -> bool {
    let is_initialize = |m: &Value| m.get("method").and_then(Value::as_str) == Some("initialize");
    match value {
        Value::Array(a) => a.iter().any(is_initialize),
        v => is_initialize(v),
    }
}

/// A place for a new session under `mcp.max_sessions`: closing the least
/// recently used session if it is idle beyond `mcp.session_idle_timeout`, and
/// otherwise refusing (503) — an open session in use is never closed for it.
async fn place_for_a_session(g: &Guard) -> Result<super::sessions::Reservation, Response> {
    // Each round closes one idle session; a few rounds make room unless other
    // requests take the places as fast.
    for _ in 0..8 {
        match g.sessions.reserve() {
            Reserve::Granted(place) => return Ok(place),
            Reserve::Evict(id) => {
                tracing::info!(
                    open = g.sessions.open(),
                    cap = g.sessions.cap(),
                    "closing the least recently used MCP session, idle beyond \
                     mcp.session_idle_timeout, for a new one"
                );
                let _ = g
                    .session_manager
                    .close_session(&Arc::from(id.as_str()))
                    .await;
                g.sessions.count_eviction();
            }
            Reserve::Full(wait) => return Err(no_place_for_a_session(g, wait)),
        }
    }
    Err(no_place_for_a_session(g, std::time::Duration::from_secs(1)))
}

/// 503: every open session was used within the idle bound.
fn no_place_for_a_session(g: &Guard, wait: std::time::Duration) -> Response {
    let wait = wait.as_secs().max(1);
    tracing::warn!(
        open = g.sessions.open(),
        cap = g.sessions.cap(),
        retry_after = wait,
        "a new MCP session refused: every open session is in use"
    );
    let mut r = plain(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!(
            "Service Unavailable: this server already has its most MCP sessions open ({cap}, \
             mcp.max_sessions), each used within the last {idle}, so it opens no new one: it \
             does not close a session in use. No session was opened and nothing was performed. \
             Try again in {wait} s (Retry-After), when the least recently used session will \
             have been idle long enough to be closed, or close sessions no longer needed (a \
             DELETE with their Mcp-Session-Id).",
            cap = g.sessions.cap(),
            idle = humantime::format_duration(g.sessions.idle()),
        ),
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(wait));
    r
}

/// 404 for a session that is not open: what happened and what to do.
fn unknown_session() -> Response {
    plain(StatusCode::NOT_FOUND, UNKNOWN_SESSION)
}

/// rmcp's own 404 for a session it does not have (closed after the guard let
/// the request through), with [`UNKNOWN_SESSION`]'s text instead of its own.
async fn rmcp_unknown_session(response: Response) -> Response {
    const RMCP_TEXT: &[u8] = b"Not Found: Session not found";
    if response.status() != StatusCode::NOT_FOUND {
        return response;
    }
    let (parts, body) = response.into_parts();
    // Only a small body known in full (rmcp's is): a stream is passed on.
    if axum::body::HttpBody::size_hint(&body).exact() != Some(RMCP_TEXT.len() as u64) {
        return Response::from_parts(parts, body);
    }
    match axum::body::to_bytes(body, RMCP_TEXT.len()).await {
        Ok(bytes) if bytes.as_ref() == RMCP_TEXT => unknown_session(),
        Ok(bytes) => Response::from_parts(parts, Body::from(bytes)),
        Err(_) => unknown_session(),
    }
}

/// A request body as read by [`read_capped`].
enum ReadBody {
    Read(Bytes),
    /// Larger than the cap (what came beyond it was read and dropped).
    TooLarge,
    Broken,
}

/// The most of an oversized body read (and dropped) before answering 413, so
/// that a client which sends its whole body before reading the answer (most
/// do) reads the 413 rather than a reset connection; beyond it, or past
/// [`DRAIN_TIME`], the connection is closed.
const DRAIN_LIMIT: u64 = 16 * 1024 * 1024;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// The body, if it is at most `max` bytes; otherwise [`ReadBody::TooLarge`],
/// having read no more than [`DRAIN_LIMIT`] and kept no more than `max`.
async fn read_capped(body: Body, max: usize, length: Option<u64>) -> ReadBody {
    use futures::StreamExt as _;
    let too_large = length.is_some_and(|n| n > max as u64);
    if length.is_some_and(|n| n > DRAIN_LIMIT) {
        return ReadBody::TooLarge;
    }
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen: u64 = 0;
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(chunk))) => {
                seen += chunk.len() as u64;
                if too_large || seen > max as u64 {
                    kept = Vec::new();
                    if seen > DRAIN_LIMIT {
                        return ReadBody::TooLarge;
                    }
                } else {
                    kept.extend_from_slice(&chunk);
                }
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => return ReadBody::Broken,
            Err(_) if too_large || seen > max as u64 => return ReadBody::TooLarge,
            Err(_) => return ReadBody::Broken,
        }
    }
    if too_large || seen > max as u64 {
        ReadBody::TooLarge
    } else {
        ReadBody::Read(Bytes::from(kept))
    }
}

/// A `tools/call` (or one in a batch) of a configured tool `principal` may
/// not call.
fn forbidden_tool(
    value: &Value,
    tools: &BTreeSet<String>,
    principal: &Principal,
) -> Option<String> {
    let messages: Vec<&Value> = match value {
        Value::Array(a) => a.iter().collect(),
        v => vec![v],
    };
    messages.into_iter().find_map(|m| {
        if m.get("method")?.as_str()? != "tools/call" {
            return None;
        }
        let name = m.get("params")?.get("name")?.as_str()?;
        (tools.contains(name) && !principal.may_call(name)).then(|| name.to_owned())
    })
}

/// Whether `Host` (or the URI's authority) is allowed, from `peer`.
fn host_allowed(
    g: &Guard,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    peer: Option<SocketAddr>,
) -> Result<(), &'static str> {
    host_allowed_in(&g.allowed_hosts, g.loopback, headers, uri, peer)
}

/// Whether `Host` (or the URI's authority) is one of `allowed_hosts` (`host`
/// or `host:port`), from `peer`; the loopback names only from a loopback peer,
/// and only on a `loopback` listener unless listed. The console checks the
/// same way.
pub fn host_allowed_in(
    allowed_hosts: &[String],
    loopback: bool,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    peer: Option<SocketAddr>,
) -> Result<(), &'static str> {
    let raw = match headers.get(header::HOST) {
        Some(h) => h.to_str().map_err(|_| "the Host header is not text")?,
        None => uri
            .authority()
            .map(|a| a.as_str())
            .ok_or("the request names no Host")?,
    };
    let authority =
        axum::http::uri::Authority::try_from(raw).map_err(|_| "the Host header is malformed")?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let port = authority.port_u16();
    if LOOPBACK_HOSTS.contains(&host.as_str()) {
        // Only a loopback client reaches a loopback listener; on any other, a
        // loopback name is what a rebinding page or a spoofing client sends.
        let peer_loopback = peer.is_some_and(|p| p.ip().is_loopback());
        let configured = allowed_hosts.iter().any(|a| host_matches(a, &host, port));
        return if peer_loopback && (loopback || configured) {
            Ok(())
        } else {
            Err("a loopback Host from a client that is not on loopback")
        };
    }
    if allowed_hosts.iter().any(|a| host_matches(a, &host, port)) {
        Ok(())
    } else {
        Err("the Host header names a host this server does not serve")
    }
}

fn host_matches(allowed: &str, host: &str, port: Option<u16>) -> bool {
    let Ok(a) = axum::http::uri::Authority::try_from(allowed) else {
        return false;
    };
    let a_host = a
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    a_host == host && a.port_u16().is_none_or(|p| Some(p) == port)
}

/// Whether an `Origin` value is one of `allowed` (`scheme://host[:port]`,
/// the port `*` for any; without a port, the scheme's default).
fn origin_allowed(origin: &HeaderValue, allowed: &[String]) -> bool {
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    if origin == "null" {
        return allowed.iter().any(|a| a == "null");
    }
    let Some((scheme, host, port)) = split_origin(origin) else {
        return false;
    };
    let Some(port) = port.or_else(|| default_port(&scheme)) else {
        return false;
    };
    allowed.iter().any(|a| {
        let Some((a_scheme, a_host, a_port)) = split_origin(&a.replace(":*", "")) else {
            return false;
        };
        let any_port = a.ends_with(":*");
        a_scheme == scheme
            && a_host == host
            && (any_port || a_port.or_else(|| default_port(&a_scheme)) == Some(port))
    })
}

/// `scheme://host[:port]` → its parts, lower case.
fn split_origin(s: &str) -> Option<(String, String, Option<u16>)> {
    let (scheme, rest) = s.split_once("://")?;
    let authority = axum::http::uri::Authority::try_from(rest.trim_end_matches('/')).ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    Some((
        scheme.to_ascii_lowercase(),
        authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase(),
        authority.port_u16(),
    ))
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    }
}

fn plain(status: StatusCode, text: &str) -> Response {
    (status, text.to_owned()).into_response()
}

/// 429, to be tried again after `wait`.
fn too_many(wait: std::time::Duration, why: &str) -> Response {
    let mut r = plain(StatusCode::TOO_MANY_REQUESTS, why);
    r.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(wait.as_secs().max(1)),
    );
    r
}

fn too_large_response(max: usize) -> Response {
    let mut r = plain(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("Payload Too Large: a request body may be at most {max} bytes"),
    );
    // What is left of the body, if anything, is not read.
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A `WWW-Authenticate` parameter's quoted value (RFC 9110 quoted-string).
fn quoted(s: &str) -> String {
    let escaped: String = s
        .chars()
        .filter(|c| !c.is_control())
        .flat_map(|c| match c {
            '"' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    format!("\"{escaped}\"")
}

fn challenge(status: StatusCode, params: &[(&str, &str)], body: Value) -> Response {
    let value = params
        .iter()
        .map(|(k, v)| format!("{k}={}", quoted(v)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut r = (status, axum::Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {value}")) {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    r
}

fn unauthorized(g: &Guard, e: &AuthError) -> Response {
    let meta = g.metadata_url.as_str();
    match e {
        AuthError::Missing => challenge(
            StatusCode::UNAUTHORIZED,
            &[("resource_metadata", meta)],
            json!({"error": "unauthorized", "error_description": e.to_string()}),
        ),
        AuthError::InvalidToken(why) => challenge(
            StatusCode::UNAUTHORIZED,
            &[
                ("error", "invalid_token"),
                ("error_description", why),
                ("resource_metadata", meta),
            ],
            json!({"error": "invalid_token", "error_description": why}),
        ),
        AuthError::KeysUnavailable(_) => {
            tracing::warn!(error = %e, "MCP request not checked");
            let mut r = plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable: this server cannot check tokens now: it has no current \
                 copy of its authorization server's signing keys (the JWK Set at \
                 mcp.auth.jwks_url could not be fetched). Nothing in this request was \
                 performed. Try again later; if it lasts, the server's operator must make the \
                 JWK Set reachable again.",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(10));
            r
        }
    }
}

fn insufficient_scope(g: &Guard, tool: &str) -> Response {
    let scopes = g
        .authorizer
        .as_ref()
        .map(|a| a.scopes_granting(tool).join(" "))
        .unwrap_or_default();
    let why = format!("calling `{tool}` needs one of the scopes: {scopes}");
    challenge(
        StatusCode::FORBIDDEN,
        &[
            ("error", "insufficient_scope"),
            ("scope", &scopes),
            ("error_description", &why),
            ("resource_metadata", &g.metadata_url),
        ],
        json!({"error": "insufficient_scope", "error_description": why}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_url_inserts_the_well_known_path() {
        assert_eq!(
            metadata_url("https://mcp.example.com/mcp"),
            "https://mcp.example.com/.well-known/oauth-protected-resource/mcp"
        );
        assert_eq!(
            metadata_url("http://127.0.0.1:9480/"),
            "http://127.0.0.1:9480/.well-known/oauth-protected-resource"
        );
    }

    #[test]
    fn origins_match_by_scheme_host_and_port() {
        let allowed = vec![
            "https://app.example.com".to_owned(),
            "http://localhost:*".to_owned(),
        ];
        let ok = |o: &str| origin_allowed(&HeaderValue::from_str(o).unwrap(), &allowed);
        assert!(ok("https://app.example.com"));
        assert!(ok("https://app.example.com:443"));
        assert!(ok("http://localhost:5173"));
        assert!(!ok("https://app.example.com:8443"));
        assert!(!ok("http://app.example.com"));
        assert!(!ok("https://evil.example"));
        assert!(!ok("https://app.example.com.evil.example"));
        assert!(!ok("null"));
        assert!(!ok("garbage"));
    }

    #[test]
    fn host_patterns_name_a_host_and_maybe_a_port() {
        assert!(host_matches(
            "mcp.example.com",
            "mcp.example.com",
            Some(8443)
        ));
        assert!(host_matches(
            "mcp.example.com:443",
            "mcp.example.com",
            Some(443)
        ));
        assert!(!host_matches(
            "mcp.example.com:443",
            "mcp.example.com",
            None
        ));
        assert!(!host_matches("mcp.example.com", "example.com", None));
        assert!(host_matches("[::1]", "::1", Some(1)));
    }

    #[test]
    fn behind_a_trusted_proxy_the_client_is_the_right_most_untrusted_hop() {
        let trusted = ["127.0.0.1", "10.0.0.0/8"].map(|p| TrustedProxy::parse(p).unwrap());
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
            }
            h
        };
        let client =
            |peer: &str, values: &[&str]| client_address(ip(peer), &with(values), &trusted);
        // A peer that is not a trusted proxy is the client, whatever it says.
        assert_eq!(client("198.51.100.1", &["203.0.113.9"]), ip("198.51.100.1"));
        // Through the proxy: the hop it appended.
        assert_eq!(client("127.0.0.1", &["203.0.113.7"]), ip("203.0.113.7"));
        // Through two trusted proxies; what the client wrote (left) is not believed.
        assert_eq!(
            client("127.0.0.1", &["198.51.100.2, 203.0.113.7, 10.1.2.3"]),
            ip("203.0.113.7")
        );
        assert_eq!(
            client("127.0.0.1", &["198.51.100.2", "203.0.113.7:4711, 10.1.2.3"]),
            ip("203.0.113.7")
        );
        assert_eq!(
            client("127.0.0.1", &["[2001:db8::7]:443"]),
            ip("2001:db8::7")
        );
        // No header, or nothing but trusted hops and garbage: the last trusted one.
        assert_eq!(client("127.0.0.1", &[]), ip("127.0.0.1"));
        assert_eq!(client("127.0.0.1", &["unknown, 10.1.2.3"]), ip("10.1.2.3"));
    }

    #[test]
    fn a_challenge_value_is_quoted() {
        assert_eq!(quoted(r#"a "b" \c"#), r#""a \"b\" \\c""#);
    }
}
