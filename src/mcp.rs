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

use crate::client::{Client, ClientError, StepCall};
use crate::config::Config;
use crate::contract::{Status, ToolResult};
use crate::tools::{Category, ToolConfig};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

/// The `_meta` fields naming a call's step.
pub const META_WORKFLOW_ID: &str = "workflow_id";
pub const META_STEP_INDEX: &str = "step_index";
pub const META_ATTEMPT: &str = "attempt";

/// Sessions whose step counters are kept; the oldest is forgotten beyond this.
const MAX_SESSIONS: usize = 10_000;

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
}

/// Where `stepgate mcp` serves.
#[derive(Debug, Clone)]
pub enum Transport {
    /// One session on standard input and output (an MCP client starts
    /// `stepgate mcp` as its subprocess).
    Stdio,
    /// Streamable HTTP at `http://<listen>/mcp`; requests must name one of
    /// `allowed_hosts` in their `Host` header (DNS-rebinding protection).
    Http {
        listen: String,
        allowed_hosts: Vec<String>,
    },
}

/// What every session shares.
struct Shared {
    client: Client,
    tools: BTreeMap<String, ToolConfig>,
    /// Steps by session id, for calls without a step in `_meta`.
    sessions: Mutex<Sessions>,
}

#[derive(Default)]
struct Sessions {
    by_id: HashMap<String, Arc<SessionSteps>>,
    /// Session ids, oldest first, to forget beyond [`MAX_SESSIONS`].
    order: VecDeque<String>,
}

/// The steps of one MCP session.
#[derive(Default)]
struct SessionSteps {
    state: Mutex<StepState>,
}

#[derive(Default)]
struct StepState {
    next: u64,
    /// Steps whose answer the client never received, by tool, oldest first.
    unanswered: HashMap<String, VecDeque<u64>>,
}

impl SessionSteps {
    /// The step of the session's next call of `tool`: an unanswered one first.
    fn take(&self, tool: &str) -> u64 {
        let mut s = self.state.lock().expect("session steps lock");
        if let Some(step) = s.unanswered.get_mut(tool).and_then(VecDeque::pop_front) {
            return step;
        }
        let step = s.next;
        s.next += 1;
        step
    }

    fn leave_unanswered(&self, tool: &str, step: u64) {
        let mut s = self.state.lock().expect("session steps lock");
        s.unanswered
            .entry(tool.to_owned())
            .or_default()
            .push_back(step);
    }
}

/// Puts a session step back as unanswered unless [`Self::answered`] is
/// called: a call dropped midway (the client cancelled it, its connection
/// closed) leaves its step for the retry.
struct Pending {
    steps: Arc<SessionSteps>,
    tool: String,
    step: u64,
    answered: bool,
}

impl Pending {
    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            self.steps.leave_unanswered(&self.tool, self.step);
        }
    }
}

/// The MCP server handler (one per session or stateless request; they share
/// one Kafka client).
#[derive(Clone)]
pub struct McpFront {
    shared: Arc<Shared>,
    /// The session of a stdio server (one per process); HTTP sessions are
    /// named by their `Mcp-Session-Id`.
    stdio_session: Option<String>,
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
                sessions: Mutex::new(Sessions::default()),
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
                    stdio_session: Some(format!("stdio-{}", random_id())),
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
            } => {
                use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
                use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
                let mut config = StreamableHttpServerConfig::default()
                    .with_cancellation_token(stop.child_token());
                config.allowed_hosts.extend(allowed_hosts);
                let front = self;
                let service: StreamableHttpService<McpFront, LocalSessionManager> =
                    StreamableHttpService::new(
                        move || Ok(front.clone()),
                        Default::default(),
                        config,
                    );
                let router = axum::Router::new().nest_service("/mcp", service);
                let listener = tokio::net::TcpListener::bind(&listen)
                    .await
                    .map_err(|source| McpFrontError::Listen {
                        addr: listen.clone(),
                        source,
                    })?;
                tracing::info!(addr = %listen, "stepgate mcp serving Streamable HTTP at /mcp");
                axum::serve(listener, router)
                    .with_graceful_shutdown(async move { stop.cancelled_owned().await })
                    .await
                    .map_err(McpFrontError::Serve)
            }
        }
    }

    /// The session a request came in, if it came in one: this process's on
    /// stdio, the `Mcp-Session-Id` on HTTP.
    fn session_id(&self, ctx: &RequestContext<RoleServer>) -> Option<String> {
        match &self.stdio_session {
            Some(id) => Some(id.clone()),
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

    /// The steps of session `id`.
    fn session_steps(&self, id: &str) -> Arc<SessionSteps> {
        let mut sessions = self.shared.sessions.lock().expect("sessions lock");
        if let Some(steps) = sessions.by_id.get(id) {
            return steps.clone();
        }
        if sessions.order.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions.order.pop_front()
        {
            sessions.by_id.remove(&oldest);
        }
        let steps = Arc::new(SessionSteps::default());
        sessions.by_id.insert(id.to_owned(), steps.clone());
        sessions.order.push_back(id.to_owned());
        steps
    }

    fn tool_list(&self) -> Value {
        let tools: Vec<Value> = self
            .shared
            .tools
            .iter()
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
        json!({ "tools": tools })
    }
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
        },
    });
    if let Some(output @ Value::Object(_)) = &answer.output {
        result["structuredContent"] = output.clone();
    }
    serde_json::from_value(result)
        .map_err(|e| McpError::internal_error(format!("stepgate's answer as MCP: {e}"), None))
}

fn error_result(text: String) -> Result<CallToolResult, McpError> {
    serde_json::from_value(json!({"content": [{"type": "text", "text": text}], "isError": true}))
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
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Each tool call here is a durable step that runs at most once. Send \
             `_meta.workflow_id` and `_meta.step_index` (and `_meta.attempt` for a deliberate \
             re-run) with every tools/call: a call repeating a step gets that step's first \
             answer instead of running the tool again.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        serde_json::from_value(self.tool_list())
            .map_err(|e| McpError::internal_error(format!("the tool list: {e}"), None))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let tool = request.name.to_string();
        if !self.shared.tools.contains_key(&tool) {
            let known: Vec<&String> = self.shared.tools.keys().collect();
            return Err(McpError::invalid_params(
                format!("there is no tool named `{tool}`; the tools are {known:?}"),
                None,
            ));
        }
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        // rmcp hands the request's `_meta` over in the context.
        let meta = match &request.meta {
            Some(m) if !m.0.0.is_empty() => &m.0.0,
            _ => &ctx.meta.0.0,
        };
        let named = match step_from_meta(Some(meta)) {
            Ok(named) => named,
            Err(problem) => {
                return error_result(format!(
                    "This call to `{tool}` was not performed: {problem}. Correct the call's \
                     `_meta` and call the tool again."
                ))
                .map(Into::into);
            }
        };
        let mut pending = None;
        let (workflow_id, step_index, attempt) = match named {
            Some(step) => step,
            None => {
                let Some(session) = self.session_id(&ctx) else {
                    return error_result(format!(
                        "This call to `{tool}` was not performed: it came without an MCP session, \
                         so it needs its step in `_meta` (`workflow_id` and `step_index`). Call \
                         the tool again with them."
                    ))
                    .map(Into::into);
                };
                let steps = self.session_steps(&session);
                let step = steps.take(&tool);
                pending = Some(Pending {
                    steps,
                    tool: tool.clone(),
                    step,
                    answered: false,
                });
                (format!("mcp-{session}"), step, 0)
            }
        };
        let call = StepCall::new(&workflow_id, step_index, &tool, arguments)
            .map_err(|e| McpError::invalid_params(e.to_string(), None))?
            .attempt(attempt);
        let answer = tokio::select! {
            answer = self.shared.client.call(call) => answer,
            // The client gave up on this call: its step stays unanswered.
            _ = ctx.ct.cancelled() => {
                return Err(McpError::internal_error("the call was cancelled", None));
            }
        };
        match answer {
            Ok(answer) => {
                if let Some(p) = pending {
                    p.answered();
                }
                to_mcp(&answer).map(Into::into)
            }
            Err(ClientError::Timeout { waited, .. }) => error_result(format!(
                "stepgate has not answered this call to `{tool}` within {}, so whether it took \
                 effect is not known yet. Do not make a new call for it: repeat this same call \
                 (same tool, same step) and it returns the step's answer once there is one.",
                humantime::format_duration(waited)
            ))
            .map(Into::into),
            Err(e) => error_result(format!(
                "This call to `{tool}` could not be handed to stepgate ({e}), so it was not \
                 performed. Call the tool again."
            ))
            .map(Into::into),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(steps.take("send_email"), 0);
        let lost = Pending {
            steps: steps.clone(),
            tool: "send_email".into(),
            step: 0,
            answered: false,
        };
        drop(lost);
        // Another tool does not take it; the same tool's next call does.
        assert_eq!(steps.take("search"), 1);
        assert_eq!(steps.take("send_email"), 0);
        let kept = Pending {
            steps: steps.clone(),
            tool: "send_email".into(),
            step: 0,
            answered: false,
        };
        kept.answered();
        assert_eq!(steps.take("send_email"), 2);
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
}
