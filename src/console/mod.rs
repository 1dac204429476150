//! `stepgate console`: the web console for the people in the loop — the
//! calls held for approval (Inbox), the in-doubt steps, a workflow's timeline,
//! per-tool figures — served from an in-memory cache of the topics
//! ([`cache`]). It keeps no state of its own: any number may run.
//!
//! Decisions go the operators' one way ([`crate::operator::send_decision`]):
//! a command on `commands`, bound to the run the page showed, applied by the
//! gate that owns the step, which answers the agent at once. Who may do what
//! is [`auth`]'s; the pages are [`pages`]'.

pub mod auth;
pub mod cache;
pub mod gates;
pub mod pages;

use crate::config::{Config, ConsoleRole};
use crate::contract::{Action, Run, StepKey};
use crate::state::Phase;
use auth::{CSRF_COOKIE, Identities, Person, TOKEN_COOKIE, Unknown};
use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use cache::Shared;
use maud::Markup;
use pages::{Chrome, Notice, Redactor, Tab};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

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

/// Everything a request handler reads.
struct App {
    cfg: Config,
    ids: Identities,
    cache: Shared,
    redactor: Redactor,
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
    if !cfg.console.has_identity() {
        return Err(ConsoleError::NoIdentity);
    }
    let ids = Identities::new(&cfg.console, &cfg.mcp, env)?;
    // Every configured secret a page could echo: tool header values, tokens.
    let mut secrets = ids.secrets.clone();
    for t in cfg.tools.values() {
        secrets.extend(
            t.headers
                .values()
                .filter_map(|h| h.value())
                .map(str::to_owned),
        );
    }
    let cache: Shared = Arc::new(RwLock::new(cache::Cache::default()));
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
        cfg,
        ids,
        cache: cache.clone(),
        redactor: Redactor { secrets },
    });
    let router = router(app);
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router)
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
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
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
        .route("/overview", get(overview))
        .route("/approve", post(approve))
        .route("/deny", post(deny))
        .route("/resolve", post(resolve))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(app)
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

/// The request's CSRF token, and a `Set-Cookie` when it is new.
fn csrf_of(headers: &HeaderMap) -> (String, Option<HeaderValue>) {
    match auth::cookie(headers, CSRF_COOKIE).filter(|c| c.len() >= 32) {
        Some(c) => (c, None),
        None => {
            let t = auth::new_csrf();
            let cookie =
                format!("{CSRF_COOKIE}={t}; Path=/; HttpOnly; SameSite=Strict; Max-Age=86400");
            (t, HeaderValue::from_str(&cookie).ok())
        }
    }
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

impl App {
    fn refresh_ms(&self) -> u128 {
        self.cfg.console.refresh.0.as_millis()
    }

    fn counts(&self) -> (usize, usize) {
        let c = self.cache.read().expect("cache lock");
        (
            c.waiting(Phase::AwaitingApproval).len(),
            c.waiting(Phase::InDoubt).len(),
        )
    }

    /// The person behind a request who may at least `needed`, or the answer
    /// to give instead: the login form (nobody), 401 (a bad token), 403 (no
    /// role, or too small a one).
    async fn person(&self, headers: &HeaderMap, needed: ConsoleRole) -> Result<Person, Response> {
        match self.ids.identify(headers).await {
            Ok(p) if p.may(needed) => Ok(p),
            Ok(p) => {
                let (csrf, set) = csrf_of(headers);
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
                let (csrf, set) = csrf_of(headers);
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
                // A stale login cookie is dropped.
                if let Ok(v) = HeaderValue::from_str(&format!(
                    "{TOKEN_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
                )) {
                    r.headers_mut().append(header::SET_COOKIE, v);
                }
                Err(r)
            }
        }
    }

    fn render(
        &self,
        headers: &HeaderMap,
        person: &Person,
        tab: Tab,
        title: &str,
        notice: Option<Notice>,
        body: impl FnOnce(&str) -> Markup,
    ) -> Response {
        let (csrf, set) = csrf_of(headers);
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

    fn held(&self) -> (Vec<pages::Held>, u64) {
        let c = self.cache.read().expect("cache lock");
        let held = c
            .waiting(Phase::AwaitingApproval)
            .into_iter()
            .map(|record| pages::Held {
                requested_at: c
                    .approval(&record.step)
                    .and_then(|a| a.requested_at.clone()),
                earlier: c.workflow(&record.step.workflow_id),
                record,
            })
            .collect();
        (held, c.attention_version)
    }

    fn doubts(&self) -> (Vec<pages::Doubt>, u64) {
        let c = self.cache.read().expect("cache lock");
        let d = c
            .waiting(Phase::InDoubt)
            .into_iter()
            .map(|record| pages::Doubt { record })
            .collect();
        (d, c.attention_version)
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[derive(Deserialize, Default)]
struct PageQuery {
    done: Option<String>,
    failed: Option<String>,
    v: Option<u64>,
    id: Option<String>,
}

fn notice_of(q: &PageQuery) -> Option<Notice> {
    match (&q.done, &q.failed) {
        (Some(d), _) => Some(Notice::Done(d.clone())),
        (_, Some(f)) => Some(Notice::Failed(f.clone())),
        _ => None,
    }
}

async fn login_page(State(app): State<AppState>, headers: HeaderMap) -> Response {
    if app.ids.identify(&headers).await.is_ok() {
        return Redirect::to("/inbox").into_response();
    }
    let (csrf, set) = csrf_of(&headers);
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
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    if !auth::form_allowed(&headers, &f.csrf) {
        return forged();
    }
    match app.ids.by_token(&f.token).await {
        Ok(_) => {
            let mut r = Redirect::to("/inbox").into_response();
            // The token itself, where no script can read it, sent only to this site.
            if let Ok(v) = HeaderValue::from_str(&format!(
                "{TOKEN_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200",
                f.token.trim()
            )) {
                r.headers_mut().append(header::SET_COOKIE, v);
            }
            r
        }
        Err(_) => {
            let (csrf, set) = csrf_of(&headers);
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
                pages::page(
                    "Sign in",
                    &chrome,
                    pages::login(Some("That token is not known here."), &csrf),
                ),
            )
        }
    }
}

#[derive(Deserialize)]
struct CsrfOnly {
    csrf: String,
}

async fn logout(headers: HeaderMap, Form(f): Form<CsrfOnly>) -> Response {
    if !auth::form_allowed(&headers, &f.csrf) {
        return forged();
    }
    let mut r = Redirect::to("/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&format!(
        "{TOKEN_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
    )) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

fn forged() -> Response {
    (
        StatusCode::FORBIDDEN,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "This form did not come from this console (its CSRF token or Origin does not match). Reload the page and try again.\n",
    )
        .into_response()
}

async fn inbox(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (held, v) = app.held();
    app.render(&headers, &p, Tab::Inbox, "Inbox", notice_of(&q), |csrf| {
        maud::html! {
            h1 { "Held for approval" }
            p.muted { "Oldest first. Approve runs the call at once; Deny answers the agent with your reason. Both are recorded with your name." }
            (pages::inbox_list(app.refresh_ms(), &held, &p, csrf, &app.redactor, now_ms(), v))
        }
    })
}

/// The live part of a page, only when it changed since version `v` (204
/// otherwise: htmx leaves the page, and whatever is typed in it, alone).
async fn live(
    app: &App,
    headers: &HeaderMap,
    q: &PageQuery,
    list: impl FnOnce(&Person, &str) -> (Markup, u64),
) -> Response {
    let p = match app.person(headers, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(_) => return StatusCode::UNAUTHORIZED.into_response(),
    };
    let (csrf, _) = csrf_of(headers);
    let (markup, version) = list(&p, &csrf);
    if q.v == Some(version) {
        return StatusCode::NO_CONTENT.into_response();
    }
    let (held, in_doubt) = app.counts();
    html_response(
        StatusCode::OK,
        None,
        maud::html! { (markup) (pages::counts_oob(held, in_doubt)) },
    )
}

async fn live_inbox(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    live(&app, &headers, &q, |p, csrf| {
        let (held, v) = app.held();
        (
            pages::inbox_list(app.refresh_ms(), &held, p, csrf, &app.redactor, now_ms(), v),
            v,
        )
    })
    .await
}

async fn in_doubt(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, ConsoleRole::Viewer).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (d, v) = app.doubts();
    app.render(&headers, &p, Tab::InDoubt, "In doubt", notice_of(&q), |csrf| {
        maud::html! {
            h1 { "In doubt" }
            p.muted { "Each step below was started and its outcome is unknown: it may have taken effect. The agent got `in_doubt` and its retries are held until you decide. Check at the provider with the Idempotency-Key, then resolve it." }
            (pages::in_doubt_list(app.refresh_ms(), &d, &p, csrf, &app.redactor, now_ms(), v))
        }
    })
}

async fn live_in_doubt(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    live(&app, &headers, &q, |p, csrf| {
        let (d, v) = app.doubts();
        (
            pages::in_doubt_list(app.refresh_ms(), &d, p, csrf, &app.redactor, now_ms(), v),
            v,
        )
    })
    .await
}

async fn workflows(
    State(app): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, ConsoleRole::Viewer).await {
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
    app.render(&headers, &p, Tab::Workflows, "Workflows", None, |_| {
        pages::workflow_search(&query, &found)
    })
}

async fn workflow(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Response {
    let p = match app.person(&headers, ConsoleRole::Viewer).await {
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
    app.render(&headers, &p, Tab::Workflows, &id, notice_of(&q), |_| {
        pages::timeline(
            &id,
            &timeline,
            app.cfg.console.trace_url.as_deref(),
            &app.redactor,
        )
    })
}

async fn overview(State(app): State<AppState>, headers: HeaderMap) -> Response {
    let p = match app.person(&headers, ConsoleRole::Viewer).await {
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
    app.render(&headers, &p, Tab::Overview, "Overview", None, |_| {
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

async fn approve(
    State(app): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<DecisionForm>,
) -> Response {
    decide(&app, &headers, f, ConsoleRole::Approver, "/inbox", |_| {
        Ok(Action::Approve)
    })
    .await
}

async fn deny(
    State(app): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<DecisionForm>,
) -> Response {
    decide(
        &app,
        &headers,
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
    headers: HeaderMap,
    Form(f): Form<DecisionForm>,
) -> Response {
    decide(
        &app,
        &headers,
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

/// Check who asks, the form, and the step; send the command bound to the
/// run the page showed; wait for the gate to apply it; back to `back` with
/// what happened.
async fn decide(
    app: &App,
    headers: &HeaderMap,
    f: DecisionForm,
    needed: ConsoleRole,
    back: &str,
    action: impl FnOnce(&DecisionForm) -> Result<Action, String>,
) -> Response {
    let p = match app.person(headers, needed).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    if !auth::form_allowed(headers, &f.csrf) {
        return forged();
    }
    let to = |key: &str, text: String| {
        Redirect::to(&format!("{back}?{key}={}", percent(&text))).into_response()
    };
    let action = match action(&f) {
        Ok(a) => a,
        Err(why) => return to("failed", why),
    };
    let step = f.step();
    let Some(record) = app.cache.read().expect("cache lock").waiting_record(&step) else {
        return to(
            "failed",
            format!(
                "{step} is no longer waiting for a person: someone may have decided it already. Look at its timeline."
            ),
        );
    };
    let wanted = Phase::acted_on_by(&action);
    if record.phase != wanted {
        return to(
            "failed",
            format!(
                "{step} is {}, not {}: nothing was sent.",
                record.phase.as_str(),
                wanted.as_str()
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
        action,
        &p.name,
        f.reason(),
        run,
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
            to(
                "done",
                format!(
                    "{name} by {} applied: {step} is now {}.",
                    p.name,
                    applied.phase.as_str()
                ),
            )
        }
        Err(e) => to("failed", format!("{name} of {step}: {e}")),
    }
}
