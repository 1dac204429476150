//! A tool's `reconcile` lookup: how the gate asks what became of a call that
//! is in doubt. It runs like a tool call, in the invoker (off the gate's
//! loop); its answer comes back as an outcome and is settled in the gate's
//! transaction (`gate/core/reconcile.rs`).
//!
//! The lookup is `POST <url>` (or MCP `tools/call` of `mcp_tool` at `mcp`)
//! with the tool's own `headers` (its credentials), the call's idempotency key
//! under the tool's `idempotency_header` (and in MCP's
//! `_meta.idempotency_key`), the `Stepgate-*` headers of the step, and this
//! JSON body:
//!
//! ```json
//! {"workflow_id": "order-7781", "step_index": 4, "tool": "send_fax", "attempt": 0,
//!  "idempotency_key": "sg1-…", "arguments": {…the call's…},
//!  "in_doubt_since": "2026-11-29T08:00:02.410Z", "ask": 1}
//! ```
//!
//! It answers 2xx with `{"status": "executed", "output": …}` (the call took
//! effect; `output` becomes the step's answer), `{"status": "not_executed"}`
//! (it did not: the step's next call runs it, with the same key) or
//! `{"status": "unknown"}` (ask again later). Anything else — another status,
//! another body, a timeout, a refused connection — is a failed lookup, asked
//! again with backoff until `until`, then left to a person.

use super::tool::ReconcileConfig;
use super::{Capped, ToolConfig, ToolRegistry, Try, read_capped};
use crate::contract::{Call, ErrorBody, Outcome, headers};
use crate::duration::Dur;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;

/// The largest lookup answer read, in bytes (an `executed` answer's output
/// becomes the step's, which the tool's `max_output_bytes` bounds too).
const MAX_ANSWER_BYTES: u64 = 512 * 1024;

/// What a lookup answered, as the gate reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum LookupAnswer {
    /// The call took effect; its output.
    Executed(serde_json::Value),
    /// It did not.
    NotExecuted,
    /// The provider cannot tell yet.
    Unknown,
    /// The lookup itself failed: why, in brief.
    Failed(String),
}

impl LookupAnswer {
    pub fn as_str(&self) -> &'static str {
        match self {
            LookupAnswer::Executed(_) => "executed",
            LookupAnswer::NotExecuted => "not_executed",
            LookupAnswer::Unknown => "unknown",
            LookupAnswer::Failed(_) => "failed",
        }
    }

    /// A lookup's outcome (as the invoker reports it) read as its answer.
    pub fn of(outcome: &Outcome) -> LookupAnswer {
        #[derive(Deserialize)]
        struct Body {
            status: String,
            #[serde(default)]
            output: Option<serde_json::Value>,
        }
        let output = match outcome {
            Outcome::Ok { output } => output,
            Outcome::Error { error } | Outcome::InDoubt { error } => {
                return LookupAnswer::Failed(format!("{}: {}", error.kind, error.message));
            }
        };
        match serde_json::from_value::<Body>(output.clone()) {
            Ok(b) if b.status == "executed" => {
                LookupAnswer::Executed(b.output.unwrap_or(serde_json::Value::Null))
            }
            Ok(b) if b.status == "not_executed" => LookupAnswer::NotExecuted,
            Ok(b) if b.status == "unknown" => LookupAnswer::Unknown,
            Ok(b) => LookupAnswer::Failed(format!(
                "the lookup answered status {:?}; it must be \"executed\", \"not_executed\" or \"unknown\"",
                crate::contract::Texts::excerpt(&b.status)
            )),
            Err(_) => LookupAnswer::Failed(format!(
                "the lookup's answer is not {{\"status\": \"executed\" | \"not_executed\" | \"unknown\", \"output\": …}}: {}",
                crate::contract::Texts::excerpt(&output.to_string())
            )),
        }
    }
}

/// A lookup that did not answer usably, as an outcome (its kind is never a
/// step's).
fn failed(detail: String) -> Outcome {
    Outcome::Error {
        error: ErrorBody {
            kind: "lookup_failed".into(),
            message: detail,
        },
    }
}

impl ToolRegistry {
    /// Ask the tool's `reconcile` lookup about `call`'s step (a lookup call,
    /// [`Call::is_lookup`]: its arguments are the lookup's body). Never
    /// retried here: the gate asks again at its next time.
    pub(super) async fn lookup(&self, call: &Call) -> Outcome {
        let name = &call.step.tool;
        let Some(tool) = self.tools.get(name) else {
            return failed(format!("no tool `{name}` is configured in this process"));
        };
        let Some(r) = &tool.reconcile else {
            return failed(format!("the tool `{name}` has no `reconcile` lookup"));
        };
        let extra = match self.headers.get(name) {
            Some(Ok(h)) => h.clone(),
            Some(Err(detail)) => return failed(detail.clone()),
            None => HeaderMap::new(),
        };
        let tried = match (&r.url, &r.mcp) {
            (Some(url), _) => self.lookup_http(tool, r, url, call, extra).await,
            (None, Some(mcp)) => {
                // The lookup as an MCP tool of its own: its endpoint, its name,
                // the lookup's timeout, no retries; the tool's credentials.
                let as_tool = ToolConfig {
                    url: mcp.clone(),
                    mcp_tool: r.mcp_tool.clone(),
                    timeout: Dur(r.timeout()),
                    retries: 0,
                    idempotency_field: None,
                    max_output_bytes: MAX_ANSWER_BYTES,
                    ..tool.clone()
                };
                super::mcp::try_once(&self.mcp, &self.http.reqwest, &as_tool, call, &extra).await
            }
            (None, None) => return failed("the lookup has no `url` or `mcp`".into()),
        };
        match tried {
            Try::Done(outcome) => outcome,
            Try::NotSent(d) | Try::MaybeRan(d) | Try::Busy(_, d) => failed(d),
        }
    }

    async fn lookup_http(
        &self,
        tool: &ToolConfig,
        r: &ReconcileConfig,
        url: &str,
        call: &Call,
        mut req_headers: HeaderMap,
    ) -> Try {
        let step = &call.step;
        let protocol = [
            (
                tool.idempotency_header.as_str(),
                HeaderValue::from_str(&step.idempotency_key()),
            ),
            (headers::STEP_INDEX, Ok(HeaderValue::from(step.step_index))),
            (headers::ATTEMPT, Ok(HeaderValue::from(step.attempt))),
            (
                headers::WORKFLOW_ID,
                HeaderValue::from_bytes(step.workflow_id.as_bytes())
                    .or_else(|_| HeaderValue::from_str(&super::percent_escape(&step.workflow_id))),
            ),
        ];
        for (name, value) in protocol {
            match (HeaderName::from_bytes(name.as_bytes()), value) {
                (Ok(name), Ok(value)) => {
                    req_headers.append(name, value);
                }
                _ => return Try::NotSent(format!("the lookup's header `{name}` could not be set")),
            }
        }
        req_headers.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let deadline = tokio::time::Instant::now() + r.timeout();
        let body = call.arguments.as_str().to_owned();
        let sending = self
            .http
            .post(&super::Route::Reqwest, url, req_headers, body.into());
        let mut resp = match tokio::time::timeout_at(deadline, sending).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(super::SendError::NotSent(d))) => return Try::NotSent(d),
            Ok(Err(super::SendError::MaybeRan(d))) => return Try::MaybeRan(d),
            Err(_) => return Try::MaybeRan("the lookup timed out".into()),
        };
        let code = resp.status.as_u16();
        if !resp.status.is_success() {
            return Try::NotSent(format!("the lookup answered HTTP {code}"));
        }
        let body = match tokio::time::timeout_at(deadline, read_capped(&mut resp, MAX_ANSWER_BYTES))
            .await
        {
            Ok(Ok(Capped::Whole(b))) => b,
            Ok(Ok(Capped::TooLarge(_))) => {
                return Try::NotSent(format!(
                    "the lookup's answer is over {MAX_ANSWER_BYTES} bytes"
                ));
            }
            Ok(Err(d)) => return Try::MaybeRan(d),
            Err(_) => return Try::MaybeRan("the lookup timed out".into()),
        };
        match serde_json::from_slice::<serde_json::Value>(&body) {
            // Its output may become the step's: bounded as the tool's are.
            Ok(_) if body.len() as u64 > tool.max_output_bytes => Try::NotSent(format!(
                "the lookup's answer is over the tool's max_output_bytes ({})",
                tool.max_output_bytes
            )),
            Ok(output)
                if crate::contract::nested_deeper_than(
                    &output,
                    crate::contract::MAX_NESTING_DEPTH,
                ) =>
            {
                Try::NotSent("the lookup's answer is nested too deep".into())
            }
            Ok(output) => Try::Done(Outcome::Ok { output }),
            Err(_) => Try::NotSent(format!(
                "the lookup's answer is not JSON: {}",
                crate::contract::Texts::excerpt(&String::from_utf8_lossy(&body))
            )),
        }
    }
}
