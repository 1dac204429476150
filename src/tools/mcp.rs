//! The MCP tool protocol: a tool served by an existing MCP server (`mcp = "…"`
//! in its config) is called with MCP `tools/call` over Streamable HTTP instead
//! of a `POST` of its arguments, so the server gets stepgate's guarantees
//! without changes.
//!
//! The step's idempotency key travels where MCP carries request metadata:
//! `params._meta.idempotency_key` (with `traceparent` beside it when the intent
//! had one). One MCP session per endpoint is opened on first use and shared by
//! every call. A call that times out gives up its own request only (rmcp sends
//! `notifications/cancelled` for it): the session and the calls running on it
//! go on. A session whose transport broke is no longer handed out, and the
//! next try opens another; the calls still running on it keep it until they
//! end, so no call is cut off by another's failure.
//!
//! How a try ends, in the terms of the HTTP protocol (see [`super`]): a result
//! → `ok` (its `structuredContent`, else its content: one text block as JSON
//! when it parses, otherwise as text); a result with `isError` → the definite
//! error `tool_error` with the tool's text; a JSON-RPC refusal of the request
//! (unknown tool, invalid params) → `tool_refused`, nothing performed; a session
//! that cannot be opened → nothing sent, retried; a timeout, a broken
//! connection or an internal error after the request went out → "may have
//! run", retried with the same key unless the tool is `unkeyed`.
//!
//! Every text the server (or its transport) chose goes to a model and into
//! Kafka records, so it is shown as the HTTP path shows a refusal's body
//! ([`shown`]): without the tool's header secrets or URL credentials, on one
//! line, cut at 300 characters.

use super::Try;
use crate::contract::{Call, ErrorBody, Outcome, Texts};
use crate::redact::redact_url_in;
use crate::tools::ToolConfig;
use reqwest::header::HeaderMap;
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig};
use rmcp::model::{ContentBlock, ErrorCode, Implementation};
use rmcp::service::{RoleClient, RunningService, ServiceError, ServiceExt};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Mutex;

/// The `_meta` field carrying the step's idempotency key.
pub const META_IDEMPOTENCY_KEY: &str = "idempotency_key";

type Session = RunningService<RoleClient, ClientConfig>;

/// The HTTP client of MCP sessions: reqwest's, its errors without their URL.
/// A reqwest error prints the URL it was for, query and all (`?token=…`), and
/// rmcp puts transport errors into its own log lines and into the errors it
/// returns; every text below goes through [`redact_url_in`] as well.
#[derive(Clone)]
struct WithoutUrls(reqwest::Client);

fn url_free(e: StreamableHttpError<reqwest::Error>) -> StreamableHttpError<reqwest::Error> {
    match e {
        StreamableHttpError::Client(e) => StreamableHttpError::Client(e.without_url()),
        other => other,
    }
}

type Headers = HashMap<reqwest::header::HeaderName, reqwest::header::HeaderValue>;
type Events = futures::stream::BoxStream<'static, Result<sse_stream::Sse, SseError>>;

impl StreamableHttpClient for WithoutUrls {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: Headers,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        self.0
            .post_message(uri, message, session_id, auth_header, custom_headers)
            .await
            .map_err(url_free)
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: Headers,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        self.0
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
            .map_err(url_free)
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: Headers,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        self.0
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await
            .map_err(url_free)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: Headers,
    ) -> Result<(), StreamableHttpError<reqwest::Error>> {
        self.0
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
            .map_err(url_free)
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: Headers,
    ) -> Result<Events, StreamableHttpError<reqwest::Error>> {
        self.0
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
            .map_err(url_free)
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: Headers,
        max_sse_event_size: usize,
    ) -> Result<Events, StreamableHttpError<reqwest::Error>> {
        self.0
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
            .map_err(url_free)
    }
}
/// One endpoint's session, once opened. Each call holds it while its request
/// runs: a session taken out of its slot is closed when its last call ends.
type Slot = Arc<Mutex<Option<Arc<Session>>>>;

/// Open MCP sessions, one per endpoint URL; shared by the registry's clones.
#[derive(Clone, Default)]
pub(super) struct McpSessions {
    /// Locked only to find an endpoint's slot: a handshake holds that slot
    /// alone, so an endpoint that is slow to answer delays no other.
    slots: Arc<std::sync::Mutex<HashMap<String, Slot>>>,
}

impl McpSessions {
    fn slot(&self, url: &str) -> Slot {
        self.slots
            .lock()
            .expect("MCP sessions lock")
            .entry(url.to_owned())
            .or_default()
            .clone()
    }

    /// The endpoint's open session, or a new one. `Err` when none could be
    /// opened (what happened, [`shown`]): no call was sent.
    async fn session(
        &self,
        http: &reqwest::Client,
        tool: &ToolConfig,
        headers: &HeaderMap,
    ) -> Result<Arc<Session>, String> {
        let slot = self.slot(&tool.url);
        let mut open = slot.lock().await;
        if let Some(s) = open.as_ref().filter(|s| !s.is_transport_closed()) {
            return Ok(s.clone());
        }
        let custom = headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let config = StreamableHttpClientTransportConfig::with_uri(tool.url.as_str())
            .custom_headers(custom)
            // The result travels whole, with its JSON-RPC envelope; the cap on
            // the output itself is checked below.
            .max_json_response_size(
                (tool.max_output_bytes as usize)
                    .saturating_mul(2)
                    .max(65_536),
            );
        let transport =
            StreamableHttpClientTransport::with_client(WithoutUrls(http.clone()), config);
        let client = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("stepgate", env!("CARGO_PKG_VERSION")),
        );
        let session = tokio::time::timeout(tool.timeout.0, client.serve(transport))
            .await
            .map_err(|_| {
                format!(
                    "no MCP session could be opened within {}",
                    humantime::format_duration(tool.timeout.0)
                )
            })?
            .map_err(|e| {
                format!(
                    "no MCP session could be opened ({})",
                    shown(&e.to_string(), tool, headers)
                )
            })?;
        let session = Arc::new(session);
        *open = Some(session.clone());
        Ok(session)
    }

    /// Stop handing out `broken` (its transport failed), so that the next try
    /// opens a new session; the calls still running on it keep it until they
    /// end. A session another call already replaced is left as it is.
    async fn retire(&self, url: &str, broken: &Arc<Session>) {
        let slot = self.slot(url);
        let mut open = slot.lock().await;
        if open.as_ref().is_some_and(|s| Arc::ptr_eq(s, broken)) {
            *open = None;
        }
    }
}

/// Whether a request failed because the session's transport did (rather than
/// the request alone): later calls then need another session.
fn transport_broken(session: &Session, e: &ServiceError) -> bool {
    matches!(
        e,
        ServiceError::TransportClosed | ServiceError::TransportSend(_)
    ) || session.is_transport_closed()
}

/// One `tools/call` of an MCP tool.
pub(super) async fn try_once(
    sessions: &McpSessions,
    http: &reqwest::Client,
    tool: &ToolConfig,
    call: &Call,
    headers: &HeaderMap,
) -> Try {
    let step = &call.step;
    let remote = tool.mcp_name(&step.tool).unwrap_or(&step.tool).to_owned();
    let session = match sessions.session(http, tool, headers).await {
        Ok(session) => session,
        Err(detail) => return Try::NotSent(detail),
    };
    let key = step.idempotency_key();
    let mut arguments = match call.arguments.parse() {
        Ok(map) => map,
        Err(e) => return Try::NotSent(super::unreadable_arguments(&e)),
    };
    if let Some(path) = &tool.idempotency_field {
        let mut body = Value::Object(arguments);
        super::set_path(&mut body, path, Value::String(key.clone()));
        arguments = match body {
            Value::Object(map) => map,
            _ => unreachable!("set_path keeps an object an object"),
        };
    }
    let mut meta = Map::new();
    meta.insert(META_IDEMPOTENCY_KEY.to_owned(), Value::String(key));
    if let Some(tp) = call
        .traceparent
        .as_deref()
        .filter(|tp| crate::contract::headers::is_valid_traceparent(tp))
    {
        meta.insert(
            crate::contract::headers::TRACEPARENT.to_owned(),
            Value::String(tp.to_owned()),
        );
    }
    let params: CallToolRequestParams = match serde_json::from_value(json!({
        "name": remote,
        "arguments": arguments,
        "_meta": meta,
    })) {
        Ok(p) => p,
        Err(e) => return Try::NotSent(format!("the MCP request could not be built ({e})")),
    };
    // On a timeout the request's future is dropped, which cancels that
    // request alone; the session stays for the other calls.
    let answer = tokio::time::timeout(tool.timeout.0, session.call_tool(params)).await;
    match answer {
        Err(_elapsed) => Try::MaybeRan(format!(
            "no MCP answer within {}",
            humantime::format_duration(tool.timeout.0)
        )),
        Ok(Ok(result)) => Try::Done(outcome(tool, &step.tool, result, headers)),
        Ok(Err(ServiceError::McpError(e))) if refused(e.code) => Try::Done(Outcome::Error {
            error: ErrorBody {
                kind: "tool_refused".into(),
                message: Texts::mcp_refused(
                    &step.tool,
                    e.code.0,
                    &shown(&e.message, tool, headers),
                ),
            },
        }),
        Ok(Err(e)) => {
            if transport_broken(&session, &e) {
                sessions.retire(&tool.url, &session).await;
            }
            // `code: message(data)`, every part of it the server's.
            Try::MaybeRan(format!("MCP: {}", shown(&e.to_string(), tool, headers)))
        }
    }
}

/// A text the MCP server or its transport chose, as it may reach a model and
/// Kafka records: the tool's header values (an echoed credential) and URL
/// credentials redacted, then one line of at most 300 characters.
fn shown(text: &str, tool: &ToolConfig, headers: &HeaderMap) -> String {
    if text.trim().is_empty() {
        return String::new();
    }
    Texts::excerpt(&redact_url_in(
        &super::without_secrets(text, headers),
        &tool.url,
    ))
}

/// JSON-RPC errors that say the request was refused before the tool ran.
fn refused(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::METHOD_NOT_FOUND
            | ErrorCode::INVALID_PARAMS
            | ErrorCode::INVALID_REQUEST
            | ErrorCode::PARSE_ERROR
    )
}

/// An MCP tool result as a step outcome.
fn outcome(tool: &ToolConfig, name: &str, result: CallToolResult, headers: &HeaderMap) -> Outcome {
    let text = || {
        result
            .content
            .iter()
            .filter_map(|c| match c {
                ContentBlock::Text(t) => Some(t.text.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    if result.is_error == Some(true) {
        return Outcome::Error {
            error: ErrorBody {
                kind: "tool_error".into(),
                message: Texts::tool_reported_error(name, &shown(&text(), tool, headers)),
            },
        };
    }
    let output = match (&result.structured_content, result.content.as_slice()) {
        (Some(structured), _) => structured.clone(),
        (None, [ContentBlock::Text(t)]) => {
            serde_json::from_str(&t.text).unwrap_or_else(|_| Value::String(t.text.clone()))
        }
        (None, []) => Value::Null,
        (None, blocks) => serde_json::to_value(blocks).unwrap_or(Value::Null),
    };
    let size = serde_json::to_vec(&output).map(|v| v.len()).unwrap_or(0) as u64;
    if size > tool.max_output_bytes {
        return Outcome::Error {
            error: ErrorBody {
                kind: "output_too_large".into(),
                message: Texts::output_too_large(name, Some(size), tool.max_output_bytes),
            },
        };
    }
    if crate::contract::nested_deeper_than(&output, crate::contract::MAX_NESTING_DEPTH) {
        return Outcome::Error {
            error: ErrorBody {
                kind: "output_too_deep".into(),
                message: Texts::output_too_deep(name, crate::contract::MAX_NESTING_DEPTH),
            },
        };
    }
    Outcome::Ok { output }
}
