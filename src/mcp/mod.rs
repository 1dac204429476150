//! `stepgate mcp`: an MCP server in front of stepgate. It lists the configured
//! tools (annotations from their category) and turns each `tools/call` into a
//! step: an intent on Kafka, answered by the gate like any other, the answer
//! returned as the call's result. It is an agent-side client of stepgate (it
//! reads no state of its own), so any number of them can run.
//!
//! **The step's identity.** A call that carries `_meta.workflow_id` and
//! `_meta.step_index` (and optionally `_meta.attempt`, default 0) is that step:
//! the full guarantee — a retry of the same step, rephrased or not, from this
//! session or any other, after a restart of anything, gets the first answer.
//! A call without them gets an identity from its MCP session: the workflow
//! `mcp-<session id>` and the call's ordinal in the session. Such a step is
//! still recorded before its tool runs and runs at most once (or is `in_doubt`)
//! whatever happens inside stepgate; and when a call's answer was lost (the
//! client cancelled it, or stepgate had none in time), the session's next call
//! of the same tool is taken as its retry and gets its answer. It cannot know a
//! retry that comes from another session (a reconnected client), nor one made
//! after a different call of the same tool. Stateless HTTP requests (protocol
//! 2026-07-28 has no sessions) must carry the step in `_meta`.
//!
//! **Sessions** ([`sessions`]): a session's counter lives exactly as long as
//! the session, and is never made again for an id that had one — a request
//! naming a session this process does not know (closed, idle beyond
//! `mcp.session_idle_timeout`, or opened before a restart) is refused with a
//! text saying to start a new session, never numbered from step 0 again. At
//! most `mcp.max_sessions` are open: beyond it the least recently used goes if
//! it is idle that long, and otherwise a new session is refused (503).
//!
//! **Who may call.** Over HTTP the front is an OAuth 2.1 resource server
//! ([`auth`], [`http`]): each request's bearer token names a principal, which
//! lists and calls only the tools its scopes grant and names only workflows in
//! its namespace (`<namespace>…`); its session-named workflows are
//! `<namespace>mcp-<session id>`. On stdio the host that started the process is
//! its one client.

pub mod auth;
pub mod http;
pub mod sessions;
pub mod tasks;

use crate::client::{Client, ClientError, StepCall};
use crate::config::{Config, McpConfig};
use crate::contract::{Status, ToolResult};
use crate::tools::{Category, ToolConfig};
use auth::Principal;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, CreateTaskResult,
    DiscoverResult, GetTaskParams, GetTaskResult, Implementation, ListToolsResult,
    PaginatedRequestParams, ProtocolVersion, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Map, Value, json};
use sessions::{FrontSessionManager, Sessions};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

/// The `_meta` fields naming a call's step.
pub const META_WORKFLOW_ID: &str = "workflow_id";
pub const META_STEP_INDEX: &str = "step_index";
pub const META_ATTEMPT: &str = "attempt";

/// The client extension (in `capabilities.extensions`) by which a client says
/// it names every call's step in `_meta`: `server/discover` offers it the
/// sessionless revisions too (see [`McpFront::discover`]).
pub const STEPS_EXTENSION: &str = "stepgate/steps";

#[derive(Debug, Error)]
pub enum McpFrontError {
    #[error("stepgate's Kafka client")]
    Client(#[from] ClientError),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the MCP server stopped")]
    Serve(#[source] std::io::Error),
    #[error("the MCP session on stdio")]
    Stdio(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(
        "refusing to serve MCP on {addr} without authorization: anyone who can reach it could \
         run every tool. Configure `[mcp.auth]` (an OAuth issuer, or static tokens), listen on a \
         loopback address, or pass --insecure-no-auth if something in front of it authorizes"
    )]
    Unprotected { addr: String },
    #[error(
        "serving MCP on {addr}, which is not a loopback address, needs the host names clients \
         use: --allowed-host NAME or `mcp.allowed_hosts` (the `Host` header is checked)"
    )]
    NoAllowedHosts { addr: String },
    #[error(
        "`mcp.resource` must be set to the URL clients use (e.g. \"https://mcp.example.com/mcp\") \
         when serving on {addr} with an OAuth issuer: tokens are checked to be issued for it"
    )]
    NoResource { addr: String },
    #[error("MCP authorization")]
    Auth(#[from] auth::AuthSetupError),
}

/// Where `stepgate mcp` serves.
#[derive(Debug, Clone)]
pub enum Transport {
    /// One session on standard input and output (an MCP client starts
    /// `stepgate mcp` as its subprocess).
    Stdio,
    /// Streamable HTTP at `http://<listen>/mcp`, behind the checks of
    /// [`http`]. `allowed_hosts` and `allowed_origins` add to the config's.
    Http {
        listen: String,
        allowed_hosts: Vec<String>,
        allowed_origins: Vec<String>,
        /// Serve beyond loopback without authorization (something in front
        /// of the front authorizes).
        insecure_no_auth: bool,
    },
}

/// What every session shares.
struct Shared {
    client: Client,
    tools: BTreeMap<String, ToolConfig>,
    /// `[mcp]`: authorization and limits of the HTTP front.
    config: McpConfig,
    /// How long a call waits for stepgate's answer.
    timeout: Duration,
    /// The HTTP sessions, with the steps of each for calls without a step in
    /// `_meta`.
    sessions: Arc<Sessions>,
    /// Calls made tasks ([`tasks`]).
    tasks: tasks::Tasks,
}

/// The steps of one MCP session.
#[derive(Default)]
pub struct SessionSteps {
    state: Mutex<StepState>,
}

#[derive(Default)]
struct StepState {
    next: u64,
    /// Steps whose answer the client never received, by tool, oldest first.
    unanswered: HashMap<String, VecDeque<u64>>,
    /// Calls in flight, by tool: (call, step, the request's cancellation).
    in_flight: HashMap<String, Vec<(u64, u64, CancellationToken)>>,
    calls: u64,
}

impl SessionSteps {
    /// The step of the session's next call of `tool` (its request cancelled
    /// by `cancel`): an unanswered one first, then one whose call the client
    /// has cancelled (rmcp cancels before it hands over the next request, so
    /// the retry that follows a cancellation finds it even while that call is
    /// still winding up). Returns (call, step).
    fn take(&self, tool: &str, cancel: &CancellationToken) -> (u64, u64) {
        let mut s = self.state.lock().expect("session steps lock");
        let cancelled = s.in_flight.get_mut(tool).and_then(|calls| {
            let i = calls.iter().position(|(_, _, c)| c.is_cancelled())?;
            Some(calls.remove(i).1)
        });
        let step = match s.unanswered.get_mut(tool).and_then(VecDeque::pop_front) {
            Some(step) => {
                if let Some(other) = cancelled {
                    s.unanswered
                        .entry(tool.to_owned())
                        .or_default()
                        .push_back(other);
                }
                step
            }
            None => cancelled.unwrap_or_else(|| {
                s.next += 1;
                s.next - 1
            }),
        };
        s.calls += 1;
        let call = s.calls;
        s.in_flight
            .entry(tool.to_owned())
            .or_default()
            .push((call, step, cancel.clone()));
        (call, step)
    }

    /// Call `call` of `tool` ended; a `lost` answer leaves its step for the
    /// next call of the tool, unless a retry has taken it already.
    fn finish(&self, tool: &str, call: u64, lost: bool) {
        let mut s = self.state.lock().expect("session steps lock");
        let Some(calls) = s.in_flight.get_mut(tool) else {
            return;
        };
        let Some(i) = calls.iter().position(|(c, _, _)| *c == call) else {
            return;
        };
        let (_, step, _) = calls.remove(i);
        if lost {
            s.unanswered
                .entry(tool.to_owned())
                .or_default()
                .push_back(step);
        }
    }
}

/// Puts a session step back as unanswered unless [`Self::answered`] is
/// called: a call dropped midway (the client cancelled it, its connection
/// closed) leaves its step for the retry.
struct Pending {
    steps: Arc<SessionSteps>,
    tool: String,
    call: u64,
    answered: bool,
}

impl Pending {
    fn answered(mut self) {
        self.answered = true;
        self.steps.finish(&self.tool, self.call, false);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            self.steps.finish(&self.tool, self.call, true);
        }
    }
}

/// The MCP server handler (one per session or stateless request; they share
/// one Kafka client).
#[derive(Clone)]
pub struct McpFront {
    shared: Arc<Shared>,
    /// The session of a stdio server (one per process) and its steps; HTTP
    /// sessions are named by their `Mcp-Session-Id`, their steps in
    /// [`Shared::sessions`].
    stdio_session: Option<(String, Arc<SessionSteps>)>,
}

impl McpFront {
    /// Connect to Kafka for the tools of `config`; calls give up after `timeout`.
    pub async fn connect(config: &Config, timeout: Duration) -> Result<McpFront, McpFrontError> {
        let mut options = crate::client::options_from_config(config);
        options.timeout = timeout;
        let client = Client::new(options).await?;
        Ok(McpFront {
            shared: Arc::new(Shared {
                client,
                tools: config.tools.clone(),
                config: config.mcp.clone(),
                timeout,
                sessions: Sessions::new(
                    usize::try_from(config.mcp.max_sessions).unwrap_or(usize::MAX),
                    config.mcp.session_idle_timeout.into(),
                    usize::try_from(config.mcp.max_sessions_per_principal).unwrap_or(usize::MAX),
                ),
                tasks: tasks::Tasks::new(
                    usize::try_from(config.mcp.max_tasks).unwrap_or(usize::MAX),
                    usize::try_from(config.mcp.max_tasks_per_principal).unwrap_or(usize::MAX),
                    config.mcp.task_ttl.into(),
                    timeout,
                ),
            }),
            stdio_session: None,
        })
    }

    /// Serve until `stop` is cancelled (or, on stdio, until the client closes
    /// its end).
    pub async fn run(
        self,
        transport: Transport,
        stop: CancellationToken,
    ) -> Result<(), McpFrontError> {
        match transport {
            Transport::Stdio => {
                use rmcp::ServiceExt;
                let front = McpFront {
                    stdio_session: Some((
                        format!("stdio-{}", random_id()),
                        Arc::new(SessionSteps::default()),
                    )),
                    ..self
                };
                let service = front
                    .serve(rmcp::transport::stdio())
                    .await
                    .map_err(|e| McpFrontError::Stdio(Box::new(e)))?;
                let cancel = service.cancellation_token();
                tokio::select! {
                    r = service.waiting() => {
                        r.map_err(|e| McpFrontError::Stdio(Box::new(e)))?;
                    }
                    _ = stop.cancelled() => cancel.cancel(),
                }
                Ok(())
            }
            Transport::Http {
                listen,
                allowed_hosts,
                allowed_origins,
                insecure_no_auth,
            } => {
                self.serve_http(
                    &listen,
                    allowed_hosts,
                    allowed_origins,
                    insecure_no_auth,
                    stop,
                )
                .await
            }
        }
    }

    async fn serve_http(
        self,
        listen: &str,
        mut allowed_hosts: Vec<String>,
        mut allowed_origins: Vec<String>,
        insecure_no_auth: bool,
        stop: CancellationToken,
    ) -> Result<(), McpFrontError> {
        use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
        let cfg = self.shared.config.clone();
        let listen_error = |source| McpFrontError::Listen {
            addr: listen.to_owned(),
            source,
        };
        let loopback = http_preflight(listen, &allowed_hosts, &cfg, insecure_no_auth).await?;
        allowed_hosts.extend(cfg.allowed_hosts.iter().cloned());
        allowed_origins.extend(cfg.allowed_origins.iter().cloned());
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(listen_error)?;
        let local = listener.local_addr().map_err(listen_error)?;
        let resource = cfg
            .resource
            .clone()
            .unwrap_or_else(|| format!("http://{local}/mcp"));
        let authorizer = auth::Authorizer::new(&cfg.auth, &resource, &|k| std::env::var(k).ok())?;
        if let Some(a) = &authorizer {
            a.warm_up().await;
        }
        let metadata_url = http::metadata_url(&resource);
        let mut metadata = json!({
            "resource": resource,
            "bearer_methods_supported": ["header"],
            "resource_name": "stepgate",
        });
        if let Some(a) = &authorizer {
            metadata["scopes_supported"] = json!(a.scopes_supported());
        }
        if let Some(issuer) = cfg.auth.issuer.as_ref().filter(|_| authorizer.is_some()) {
            metadata["authorization_servers"] = json!([issuer]);
        }
        // rmcp checks Host and Origin too, with the same lists (the guard's
        // checks are stricter and come first).
        let mut rmcp_hosts = allowed_hosts.clone();
        if loopback {
            rmcp_hosts.extend(http::LOOPBACK_HOSTS.map(String::from));
        }
        let config = StreamableHttpServerConfig::default()
            .with_cancellation_token(stop.child_token())
            .with_allowed_hosts(rmcp_hosts)
            .with_allowed_origins(allowed_origins.clone())
            .enforce_origin_validation()
            .with_max_request_body_bytes(
                usize::try_from(cfg.max_request_bytes).unwrap_or(usize::MAX),
            );
        let sessions = self.shared.sessions.clone();
        if sessions.idle() <= self.shared.timeout {
            // rmcp's keep-alive counts a call in flight as idle time.
            tracing::warn!(
                idle = %humantime::format_duration(sessions.idle()),
                timeout = %humantime::format_duration(self.shared.timeout),
                "mcp.session_idle_timeout is not above --timeout: a session whose only call takes \
                 longer than it is closed before the call is answered"
            );
        }
        let session_manager = Arc::new(FrontSessionManager::new(sessions.clone()));
        let guard = Arc::new(http::Guard {
            authorizer,
            tools: self.shared.tools.keys().cloned().collect(),
            allowed_hosts: allowed_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            loopback,
            allowed_origins,
            max_body: usize::try_from(cfg.max_request_bytes).unwrap_or(usize::MAX),
            limiter: http::Guard::limiter(cfg.requests_per_second, cfg.burst),
            failures: http::FailedAuth::default(),
            // Checked by the config's validation.
            trusted_proxies: cfg
                .trusted_proxies
                .iter()
                .filter_map(|p| crate::config::TrustedProxy::parse(p).ok())
                .collect(),
            sessions,
            session_manager: session_manager.clone(),
            metadata_url,
            metadata,
            front: self.clone(),
        });
        let front = self;
        let service: StreamableHttpService<McpFront, FrontSessionManager> =
            StreamableHttpService::new(move || Ok(front.clone()), session_manager, config);
        let mcp = axum::Router::new().nest_service("/mcp", service).layer(
            axum::middleware::from_fn_with_state(guard.clone(), http::guard),
        );
        let well_known = axum::Router::new()
            .route(
                "/.well-known/oauth-protected-resource",
                axum::routing::get(http::protected_resource_metadata),
            )
            .route(
                "/.well-known/oauth-protected-resource/{*resource}",
                axum::routing::get(http::protected_resource_metadata),
            )
            .with_state(guard.clone());
        let router = mcp.merge(well_known);
        // Idle principals' rate-limit state is dropped now and then.
        let limits = guard.clone();
        let sweep_stop = stop.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    _ = every.tick() => {
                        limits.limiter.retain_recent();
                        limits.failures.sweep();
                    }
                    _ = sweep_stop.cancelled() => return,
                }
            }
        });
        tracing::info!(
            addr = %local,
            authorization = if guard.authorizer.is_some() { "bearer tokens" } else { "none" },
            "stepgate mcp serving Streamable HTTP at /mcp"
        );
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .with_graceful_shutdown(async move { stop.cancelled_owned().await })
        .await
        .map_err(McpFrontError::Serve)
    }

    /// The session a request came in, if it came in one: this process's on
    /// stdio, the `Mcp-Session-Id` on HTTP.
    fn session_id(&self, ctx: &RequestContext<RoleServer>) -> Option<String> {
        match &self.stdio_session {
            Some((id, _)) => Some(id.clone()),
            None => Some(
                ctx.extensions
                    .get::<axum::http::request::Parts>()?
                    .headers
                    .get("mcp-session-id")?
                    .to_str()
                    .ok()?
                    .to_owned(),
            ),
        }
    }

    /// Who sent a request: on stdio, the host that started this process;
    /// over HTTP, the principal [`http::guard`] found for it (none: refused).
    fn principal(&self, ctx: &RequestContext<RoleServer>) -> Option<Arc<Principal>> {
        if self.stdio_session.is_some() {
            return Some(Arc::new(Principal::anonymous()));
        }
        ctx.extensions
            .get::<axum::http::request::Parts>()?
            .extensions
            .get::<Arc<Principal>>()
            .cloned()
    }

    /// The steps of the session a request came in: this process's on stdio;
    /// over HTTP, those of the open session `id`, or `None` when it is not
    /// open (they are never made here: see [`sessions`]).
    fn session_steps(&self, id: &str) -> Option<Arc<SessionSteps>> {
        match &self.stdio_session {
            Some((_, steps)) => Some(steps.clone()),
            None => self.shared.sessions.steps(id),
        }
    }

    /// The tools `principal` may call.
    fn tool_list(&self, principal: &Principal) -> Value {
        let tools: Vec<Value> = self
            .shared
            .tools
            .iter()
            .filter(|(name, _)| principal.may_call(name))
            .map(|(name, t)| {
                let description = t.description.clone().unwrap_or_else(|| {
                    format!(
                        "`{name}` ({}), called through stepgate",
                        t.category.as_str()
                    )
                });
                let schema = t
                    .input_schema
                    .clone()
                    .unwrap_or_else(|| Map::from_iter([("type".into(), json!("object"))]));
                json!({
                    "name": name,
                    "description": description,
                    "inputSchema": schema,
                    "annotations": annotations(t),
                    "_meta": {"stepgate/category": t.category.as_str()},
                })
            })
            .collect();
        // The results built here from JSON say `resultType` themselves
        // (2026-07-28 requires it; rmcp strips it for older revisions).
        json!({ "tools": tools, "resultType": "complete" })
    }
}

impl Transport {
    /// What can be refused before anything is connected or bound: serving
    /// HTTP beyond loopback without authorization (unless `insecure_no_auth`),
    /// without a host name to check, or with an issuer but no `resource`.
    pub async fn check(&self, config: &McpConfig) -> Result<(), McpFrontError> {
        match self {
            Transport::Stdio => Ok(()),
            Transport::Http {
                listen,
                allowed_hosts,
                insecure_no_auth,
                ..
            } => http_preflight(listen, allowed_hosts, config, *insecure_no_auth)
                .await
                .map(|_| ()),
        }
    }
}

/// [`Transport::check`] for HTTP; whether `listen` is a loopback address.
async fn http_preflight(
    listen: &str,
    allowed_hosts: &[String],
    cfg: &McpConfig,
    insecure_no_auth: bool,
) -> Result<bool, McpFrontError> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|source| McpFrontError::Listen {
            addr: listen.to_owned(),
            source,
        })?
        .collect();
    let loopback = !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback());
    let addr = listen.to_owned();
    if !loopback && !cfg.auth.enabled() && !insecure_no_auth {
        return Err(McpFrontError::Unprotected { addr });
    }
    if !loopback && allowed_hosts.is_empty() && cfg.allowed_hosts.is_empty() {
        return Err(McpFrontError::NoAllowedHosts { addr });
    }
    if !loopback && cfg.auth.issuer.is_some() && cfg.resource.is_none() {
        return Err(McpFrontError::NoResource { addr });
    }
    Ok(loopback)
}

/// MCP annotations of a tool: as configured, else what its category says.
fn annotations(t: &ToolConfig) -> Value {
    if let Some(a) = t.annotations {
        return serde_json::to_value(a).unwrap_or_else(|_| json!({}));
    }
    match t.category {
        Category::ReadOnly => json!({"readOnlyHint": true}),
        Category::Idempotent => json!({"readOnlyHint": false, "idempotentHint": true}),
        Category::Keyed | Category::Unkeyed => {
            json!({"readOnlyHint": false, "idempotentHint": false})
        }
    }
}

/// A step named in `_meta`: `Ok(None)` when the call names none.
fn step_from_meta(meta: Option<&Map<String, Value>>) -> Result<Option<(String, u64, u64)>, String> {
    let Some(meta) = meta else { return Ok(None) };
    let Some(wf) = meta.get(META_WORKFLOW_ID) else {
        return Ok(None);
    };
    let wf = wf
        .as_str()
        .filter(|s| !s.is_empty())
        .ok_or("`_meta.workflow_id` must be a non-empty string")?;
    let step = meta
        .get(META_STEP_INDEX)
        .ok_or("`_meta.workflow_id` was given without `_meta.step_index`")?
        .as_u64()
        .ok_or("`_meta.step_index` must be an integer ≥ 0")?;
    let attempt = match meta.get(META_ATTEMPT) {
        None | Some(Value::Null) => 0,
        Some(a) => a.as_u64().ok_or("`_meta.attempt` must be an integer ≥ 0")?,
    };
    Ok(Some((wf.to_owned(), step, attempt)))
}

/// stepgate's answer as an MCP tool result: the text a model reads, the
/// output as structured content when it is an object, and the answer's own
/// fields under `_meta` (a repeat reads the same but for `stepgate/deduplicated`
/// and `stepgate/call_id`).
fn to_mcp(answer: &ToolResult) -> Result<CallToolResult, McpError> {
    let text = match (&answer.status, &answer.output, &answer.error) {
        (Status::Ok, Some(Value::String(s)), _) => s.clone(),
        (Status::Ok, Some(v), _) => v.to_string(),
        (Status::Ok, None, _) => "null".to_owned(),
        (_, _, Some(e)) => e.message.clone(),
        (status, _, None) => format!("The call ended `{}`.", status.as_str()),
    };
    let mut result = json!({
        "resultType": "complete",
        "content": [{"type": "text", "text": text}],
        "isError": answer.status != Status::Ok,
        "_meta": {
            "stepgate/status": answer.status.as_str(),
            "stepgate/workflow_id": answer.workflow_id,
            "stepgate/step_index": answer.step_index,
            "stepgate/attempt": answer.attempt,
            "stepgate/call_id": answer.call_id,
            "stepgate/deduplicated": answer.deduplicated,
            "stepgate/error_kind": answer.error.as_ref().map(|e| e.kind.clone()),
            "stepgate/completed_at": answer.completed_at,
        },
    });
    // Who settles an in-doubt step and how to learn its resolution: a client
    // waits on a step the reconciler settles (Result v1 `in_doubt`).
    if let Some(in_doubt) = &answer.in_doubt {
        result["_meta"]["stepgate/in_doubt"] = serde_json::to_value(in_doubt).map_err(|e| {
            McpError::internal_error(format!("stepgate's answer as MCP: {e}"), None)
        })?;
    }
    if let Some(output @ Value::Object(_)) = &answer.output {
        result["structuredContent"] = output.clone();
    }
    serde_json::from_value(result)
        .map_err(|e| McpError::internal_error(format!("stepgate's answer as MCP: {e}"), None))
}

fn error_result(text: String) -> Result<CallToolResult, McpError> {
    serde_json::from_value(json!({
        "resultType": "complete",
        "content": [{"type": "text", "text": text}],
        "isError": true,
    }))
    .map_err(|e| McpError::internal_error(e.to_string(), None))
}

fn random_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

impl ServerHandler for McpFront {
    /// Every revision rmcp knows, up to the current one (2026-07-28:
    /// sessionless, `server/discover`): a request of any of them is served.
    /// Which ones `server/discover` offers is [`Self::discover`]'s choice.
    fn supported_protocol_versions(&self) -> std::borrow::Cow<'static, [ProtocolVersion]> {
        std::borrow::Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::LATEST))
    }

    /// The revisions offered to a client that probes `server/discover`. Over
    /// HTTP, a call without a step in `_meta` is numbered by its MCP session,
    /// and the sessionless revisions (2026-07-28 on) have none: so they are
    /// offered only to a client that declares the [`STEPS_EXTENSION`] (it
    /// names its steps itself). Any other client is offered the revisions
    /// with the initialize handshake, and the MCP SDKs then open a session
    /// (as they do for a server that is stateful by design). On stdio the
    /// process is the session: every revision is offered.
    async fn discover(&self, ctx: RequestContext<RoleServer>) -> Result<DiscoverResult, McpError> {
        let names_steps = ctx
            .meta
            .client_capabilities()
            .and_then(|c| c.extensions)
            .is_some_and(|e| e.contains_key(STEPS_EXTENSION));
        let offered: Vec<ProtocolVersion> = self
            .supported_protocol_versions()
            .iter()
            .filter(|v| names_steps || self.stdio_session.is_some() || v.has_initialize())
            .cloned()
            .collect();
        Ok(DiscoverResult::from_server_info(offered, self.get_info()))
    }

    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder().enable_tools().enable_tasks();
        ServerConfig::new(capabilities.build())
            .with_server_info(Implementation::new("stepgate", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Each tool call here is a durable step that runs at most once. Send \
                 `_meta.workflow_id` and `_meta.step_index` (and `_meta.attempt` for a deliberate \
                 re-run) with every tools/call: a call repeating a step gets that step's first \
                 answer instead of running the tool again. A call without them is numbered by its \
                 MCP session.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let Some(principal) = self.principal(&ctx) else {
            return Err(McpError::invalid_request(
                "the request is not authorized",
                None,
            ));
        };
        serde_json::from_value(self.tool_list(&principal))
            .map_err(|e| McpError::internal_error(format!("the tool list: {e}"), None))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let Some(principal) = self.principal(&ctx) else {
            return Err(McpError::invalid_request(
                "the request is not authorized",
                None,
            ));
        };
        // rmcp hands the request's `_meta` over in the context.
        let meta = match &request.meta {
            Some(m) if !m.0.0.is_empty() => &m.0.0,
            _ => &ctx.meta.0.0,
        };
        let session = self.session_id(&ctx);
        let tool = request.name.to_string();
        let (call, pending) = match self.prepare_call(
            &principal,
            session.as_deref(),
            &tool,
            request.arguments.unwrap_or_default(),
            meta,
            &ctx.ct,
        )? {
            Prepared::Refused(result) => return Ok(result.into()),
            Prepared::Step { call, pending } => (call, pending),
        };
        // A session-numbered call stays a plain one: its step is the
        // session's to hand to a retry once the request is gone.
        if pending.is_none()
            && ctx
                .client_capabilities()
                .is_some_and(|c| c.supports_tasks())
        {
            return self.call_as_task(&principal, &tool, call).await;
        }
        tokio::select! {
            answer = self.answer(&tool, call, pending, None) => answer.map(Into::into),
            // The client gave up on this call: its step stays unanswered.
            _ = ctx.ct.cancelled() => {
                Err(McpError::internal_error("the call was cancelled", None))
            }
        }
    }

    /// `tasks/get` (the 2026-07-28 tasks extension): the task, with the
    /// call's result once it has one.
    async fn get_task(
        &self,
        request: GetTaskParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, McpError> {
        let task = self.own_task(&request.task_id, &ctx)?;
        Ok(GetTaskResult::new(task.detailed()))
    }

    /// `tasks/cancel`: the task stops waiting; the step, handed over
    /// already, is not undone (the task's status message says so).
    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let task = self.own_task(&request.task_id, &ctx)?;
        task.cancel_wait()
            .map_err(|text| McpError::invalid_params(text, None))
    }
}

impl McpFront {
    /// The task `id` of the request's principal (another's reads as unknown).
    fn own_task(
        &self,
        id: &str,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Arc<tasks::Task>, McpError> {
        let principal = self
            .principal(ctx)
            .ok_or_else(|| McpError::invalid_request("the request is not authorized", None))?;
        self.shared
            .tasks
            .get(&principal.key(), id)
            .ok_or_else(|| McpError::invalid_params(tasks::unknown_task(id), None))
    }

    /// A call from a client that accepts tasks (the 2026-07-28 extension):
    /// answered within `mcp.task_after`, or else with its step's task, which
    /// `tasks/get` completes with the answer. The same step's call again,
    /// while its task stands, gets that task.
    async fn call_as_task(
        &self,
        principal: &Principal,
        tool: &str,
        call: StepCall,
    ) -> Result<CallToolResponse, McpError> {
        let tasks = &self.shared.tasks;
        let owner = principal.key();
        let cancel = CancellationToken::new();
        let (task, _) =
            tasks::for_step(self, &owner, tool, call, None, tasks.ttl_for(None), cancel)
                .map_err(|f| McpError::internal_error(tasks::full(f).1, None))?;
        let wait = Duration::from(self.shared.config.task_after);
        let _ = tokio::time::timeout(wait, task.finished()).await;
        match task.completed() {
            Some(result) => serde_json::from_value::<CallToolResult>(result)
                .map(Into::into)
                .map_err(|e| McpError::internal_error(e.to_string(), None)),
            None => Ok(CreateTaskResult::new(task.detailed().task).into()),
        }
    }
}

/// A `tools/call` made into a step, or refused with a text for the model.
enum Prepared {
    Refused(CallToolResult),
    Step {
        call: StepCall,
        /// A session-numbered step, left for the session's next call of the
        /// tool unless answered.
        pending: Option<Pending>,
    },
}

impl McpFront {
    /// The step a `tools/call` of `tool` by `principal` (in `session`, if it
    /// came in one) is, or why it is not one: the tool is not there for the
    /// principal (an error), the `_meta` is wrong, the workflow is outside
    /// the principal's namespace, or a session-numbered call has no session.
    /// `cancel` is the request's: a session's retry may take the step of a
    /// cancelled call.
    fn prepare_call(
        &self,
        principal: &Principal,
        session: Option<&str>,
        tool: &str,
        arguments: Map<String, Value>,
        meta: &Map<String, Value>,
        cancel: &CancellationToken,
    ) -> Result<Prepared, McpError> {
        let refused = |text: String| error_result(text).map(Prepared::Refused);
        if !self.shared.tools.contains_key(tool) || !principal.may_call(tool) {
            let known: Vec<&String> = self
                .shared
                .tools
                .keys()
                .filter(|t| principal.may_call(t))
                .collect();
            return Err(McpError::invalid_params(
                format!("there is no tool named `{tool}`; the tools are {known:?}"),
                None,
            ));
        }
        let named = match step_from_meta(Some(meta)) {
            Ok(named) => named,
            Err(problem) => {
                return refused(format!(
                    "This call to `{tool}` was not performed: {problem}. Correct the call's \
                     `_meta` and call the tool again."
                ));
            }
        };
        if let Some((workflow_id, _, _)) = &named
            && !principal.may_name(workflow_id)
        {
            // Decided before anything is asked of stepgate, and the same
            // whether that workflow exists or not: nothing about it is told.
            tracing::info!(principal = %principal.name, tool, "a call naming a workflow outside its namespace refused");
            return refused(format!(
                "This call to `{tool}` was not performed: `_meta.workflow_id` must start with \
                 `{}`, the namespace of the workflows this caller may name. Call the tool again \
                 with a workflow id in it.",
                principal.namespace
            ));
        }
        let mut pending = None;
        let (workflow_id, step_index, attempt) = match named {
            Some(step) => step,
            None => {
                let Some(session) = session else {
                    return refused(format!(
                        "This call to `{tool}` was not performed: it came without an MCP session \
                         (the client uses a sessionless MCP revision, 2026-07-28 or later), and \
                         a call without `_meta.workflow_id` and `_meta.step_index` is numbered by \
                         its session. Call the tool again with its step in `_meta`; or the MCP \
                         client connects with the initialize handshake (MCP 2025-11-25), which \
                         this server offers every client that does not declare the \
                         `{STEPS_EXTENSION}` extension."
                    ));
                };
                let Some(steps) = self.session_steps(session) else {
                    // Closed or evicted between the guard and here: its
                    // counter is gone, and is not made again at step 0.
                    return refused(format!(
                        "This call to `{tool}` was not performed: its MCP session is no longer \
                         open on this server (closed, or idle for longer than the server keeps \
                         an unused session), and a call without a step in `_meta` is numbered \
                         by its session. Start a new MCP session and call the tool again there, \
                         or send `_meta.workflow_id` and `_meta.step_index` with the call."
                    ));
                };
                let (call, step) = steps.take(tool, cancel);
                pending = Some(Pending {
                    steps,
                    tool: tool.to_owned(),
                    call,
                    answered: false,
                });
                (format!("{}mcp-{session}", principal.namespace), step, 0)
            }
        };
        let mut call = StepCall::new(&workflow_id, step_index, tool, Value::Object(arguments))
            .map_err(|e| McpError::invalid_params(e.to_string(), None))?
            .attempt(attempt);
        // Who sent it, for the console (no self-approval) and the audit.
        if let Some(sender) = principal.sender() {
            call.metadata = Some(Map::from_iter([(
                auth::PRINCIPAL_METADATA.to_owned(),
                Value::String(sender.to_owned()),
            )]));
        }
        Ok(Prepared::Step { call, pending })
    }

    /// The step's answer as the call's result; `published` is told once the
    /// step is on the intents topic (see [`Client::call_published`]).
    async fn answer(
        &self,
        tool: &str,
        call: StepCall,
        pending: Option<Pending>,
        published: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Result<CallToolResult, McpError> {
        match self.shared.client.call_published(call, published).await {
            Ok(answer) => {
                if let Some(p) = pending {
                    p.answered();
                }
                to_mcp(&answer)
            }
            Err(ClientError::Timeout { waited, .. }) => error_result(format!(
                "stepgate has not answered this call to `{tool}` within {}, so whether it took \
                 effect is not known yet. Do not make a new call for it: repeat this same call \
                 (same tool, same step) and it returns the step's answer once there is one.",
                humantime::format_duration(waited)
            )),
            Err(e) => error_result(format!(
                "This call to `{tool}` could not be handed to stepgate ({e}), so it was not \
                 performed. Call the tool again."
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: &str = r#"
[tools.search]
category = "read_only"
url = "http://127.0.0.1:1/search"
"#;

    #[test]
    fn the_mcp_section_is_checked_when_loaded() {
        let load = |mcp: &str| Config::from_toml_str(&format!("{TOOLS}\n{mcp}"), Vec::new());
        let ok = load(
            r#"
[mcp]
trusted_proxies = ["10.0.0.0/8", "::1"]
[mcp.auth]
issuer = "https://auth.example.com"
jwks_url = "https://user:jwks-secret@auth.example.com/jwks"
[mcp.auth.scopes]
s = ["search"]
[[mcp.auth.tokens]]
name = "bot"
token = "a-literal-token-of-some-length"
scopes = ["s"]
"#,
        )
        .unwrap();
        assert!(ok.mcp.auth.enabled());
        // A literal token, and credentials in a URL, are not shown by check-config.
        let shown = toml::to_string(&ok.redacted()).unwrap();
        assert!(!shown.contains("a-literal-token"), "{shown}");
        assert!(!shown.contains("jwks-secret"), "{shown}");
        for (bad, field) in [
            ("[mcp.auth]\nissuer = \"https://a.example\"", "`mcp.auth`"),
            (
                "[mcp.auth]\nissuer = \"https://a\"\njwks_url = \"https://a/k\"",
                "mcp.auth.scopes",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"send_email\"]",
                "mcp.auth.scopes.s",
            ),
            (
                "[mcp.auth]\nalgorithms = [\"HS256\"]",
                "mcp.auth.algorithms",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"*\"]\n[[mcp.auth.tokens]]\nname = \"b\"\ntoken = \"env:T\"\nscopes = [\"x\"]",
                "mcp.auth.tokens[0]",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"*\"]\n[[mcp.auth.tokens]]\nname = \"b\"\ntoken = \"short\"\nscopes = [\"s\"]",
                "mcp.auth.tokens[0]",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"*\"]\n[[mcp.auth.tokens]]\nname = \"b\"\ntoken = \"env:T\"\nscopes = [\"s\"]\nnamespace = \"b\"",
                "mcp.auth.tokens[0]",
            ),
            ("[mcp]\nresource = \"mcp.example.com\"", "mcp.resource"),
            (
                "[mcp.auth]\nissuer = \"https://a.example\"\njwks_url = \"http://a.example/k\"\n[mcp.auth.scopes]\ns = [\"*\"]",
                "mcp.auth.jwks_url",
            ),
            (
                "[mcp.auth]\nissuer = \"http://a.example\"\njwks_url = \"https://a.example/k\"\n[mcp.auth.scopes]\ns = [\"*\"]",
                "mcp.auth.issuer",
            ),
            (
                "[mcp.auth]\nissuer = \"https://a.example\"\njwks_url = \"https://a.example/k\"\njwks_max_stale = \"1m\"\n[mcp.auth.scopes]\ns = [\"*\"]",
                "mcp.auth.jwks_max_stale",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"*\"]\n[[mcp.auth.tokens]]\nname = \"acme\"\ntoken = \"env:A\"\nscopes = [\"s\"]\n[[mcp.auth.tokens]]\nname = \"acme/eu\"\ntoken = \"env:B\"\nscopes = [\"s\"]",
                "mcp.auth.tokens[1]",
            ),
            (
                "[mcp.auth.scopes]\ns = [\"*\"]\n[[mcp.auth.tokens]]\nname = \"b\"\ntoken = \"env:T\"\nscopes = [\"s\"]\nnamespace = \"jwt:b/\"",
                "mcp.auth.tokens[0]",
            ),
            (
                "[mcp]\ntrusted_proxies = [\"proxy.internal\"]",
                "mcp.trusted_proxies[0]",
            ),
            (
                "[mcp]\nmax_tasks_per_principal = 0",
                "mcp.max_tasks_per_principal",
            ),
            ("[mcp]\nmax_request_bytes = 0", "mcp.max_request_bytes"),
            ("[mcp]\nmax_sessions = 0", "mcp.max_sessions"),
            (
                "[mcp]\nsession_idle_timeout = \"500ms\"",
                "mcp.session_idle_timeout",
            ),
        ] {
            let e = load(bad).expect_err(bad).to_string();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }

    #[test]
    fn a_step_in_meta_is_read_and_checked() {
        let meta = |v: Value| v.as_object().cloned();
        assert_eq!(step_from_meta(None), Ok(None));
        assert_eq!(
            step_from_meta(meta(json!({"progressToken": 1})).as_ref()),
            Ok(None)
        );
        assert_eq!(
            step_from_meta(meta(json!({"workflow_id": "wf", "step_index": 3})).as_ref()),
            Ok(Some(("wf".into(), 3, 0)))
        );
        assert_eq!(
            step_from_meta(
                meta(json!({"workflow_id": "wf", "step_index": 3, "attempt": 2})).as_ref()
            ),
            Ok(Some(("wf".into(), 3, 2)))
        );
        for bad in [
            json!({"workflow_id": "wf"}),
            json!({"workflow_id": "", "step_index": 1}),
            json!({"workflow_id": 7, "step_index": 1}),
            json!({"workflow_id": "wf", "step_index": -1}),
            json!({"workflow_id": "wf", "step_index": "1"}),
            json!({"workflow_id": "wf", "step_index": 1, "attempt": "x"}),
        ] {
            assert!(step_from_meta(meta(bad.clone()).as_ref()).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_lost_answer_leaves_its_step_for_the_next_call_of_the_tool() {
        let steps = Arc::new(SessionSteps::default());
        let pending = |tool: &str, call: u64| Pending {
            steps: steps.clone(),
            tool: tool.into(),
            call,
            answered: false,
        };
        let live = CancellationToken::new();
        let (call, step) = steps.take("send_email", &live);
        assert_eq!(step, 0);
        drop(pending("send_email", call));
        // Another tool does not take it; the same tool's next call does.
        assert_eq!(steps.take("search", &live).1, 1);
        let (call, step) = steps.take("send_email", &live);
        assert_eq!(step, 0);
        pending("send_email", call).answered();
        assert_eq!(steps.take("send_email", &live).1, 2);
    }

    #[test]
    fn a_retry_takes_the_step_of_a_call_cancelled_but_not_yet_wound_up() {
        let steps = Arc::new(SessionSteps::default());
        let first = CancellationToken::new();
        let (lost_call, step) = steps.take("refund", &first);
        assert_eq!(step, 0);
        // The client cancels; its retry comes before the call has wound up.
        first.cancel();
        let (retry_call, retry_step) = steps.take("refund", &CancellationToken::new());
        assert_eq!(retry_step, 0);
        // The cancelled call winding up does not leave the step again.
        drop(Pending {
            steps: steps.clone(),
            tool: "refund".into(),
            call: lost_call,
            answered: false,
        });
        Pending {
            steps: steps.clone(),
            tool: "refund".into(),
            call: retry_call,
            answered: false,
        }
        .answered();
        assert_eq!(steps.take("refund", &CancellationToken::new()).1, 1);
    }

    #[test]
    fn an_answer_reads_the_same_repeated() {
        let first = ToolResult {
            workflow_id: "wf".into(),
            step_index: 1,
            tool: "t".into(),
            attempt: 0,
            call_id: Some("a".into()),
            status: Status::Ok,
            output: Some(json!({"ticket": 7})),
            error: None,
            deduplicated: false,
            completed_at: "2026-12-01T00:00:00Z".into(),
            in_doubt: None,
        };
        let repeat = ToolResult {
            call_id: Some("b".into()),
            deduplicated: true,
            ..first.clone()
        };
        let (a, b) = (to_mcp(&first).unwrap(), to_mcp(&repeat).unwrap());
        assert_eq!(a.content, b.content);
        assert_eq!(a.structured_content, Some(json!({"ticket": 7})));
        assert_eq!(a.structured_content, b.structured_content);
        assert_eq!(a.is_error, Some(false));
    }

    #[test]
    fn an_in_doubt_answer_says_who_settles_it() {
        use crate::contract::{IN_DOUBT_VERSION, InDoubt, Learn, Settler};
        let in_doubt = InDoubt {
            version: IN_DOUBT_VERSION,
            idempotency_key: "k".into(),
            since: "2026-12-01T00:00:00Z".into(),
            settling: Settler::Reconciler,
            until: Some("2026-12-01T00:10:00Z".into()),
            learn: Learn::RepeatStep,
        };
        let answer = ToolResult {
            workflow_id: "wf".into(),
            step_index: 1,
            tool: "fax".into(),
            attempt: 0,
            call_id: Some("a".into()),
            status: Status::InDoubt,
            output: None,
            error: Some(crate::contract::ErrorBody {
                kind: "in_doubt".into(),
                message: "m".into(),
            }),
            deduplicated: false,
            completed_at: "2026-12-01T00:00:00Z".into(),
            in_doubt: Some(in_doubt.clone()),
        };
        let mcp = serde_json::to_value(to_mcp(&answer).unwrap()).unwrap();
        assert_eq!(mcp["_meta"]["stepgate/status"], "in_doubt");
        assert_eq!(
            mcp["_meta"]["stepgate/in_doubt"],
            serde_json::to_value(&in_doubt).unwrap()
        );
        assert_eq!(mcp["_meta"]["stepgate/in_doubt"]["settling"], "reconciler");
        assert_eq!(
            mcp["_meta"]["stepgate/completed_at"],
            "2026-12-01T00:00:00Z"
        );
    }
}
