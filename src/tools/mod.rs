//! Tools: the registry of configured tools and the HTTP tool protocol (tools
//! served by an MCP server: [`mcp`]). A tool's config is [`tool`]'s, and its
//! checks are `validate.rs`'s.
//!
//! `POST <url>` with the arguments as the JSON body and the headers
//! `Idempotency-Key` (stable per step key), `Stepgate-Workflow-Id`,
//! `Stepgate-Step-Index`, `Stepgate-Attempt` and `traceparent` when present.
//! 2xx → `ok` with the JSON body as output (a body over `max_output_bytes` →
//! the error `output_too_large`: the tool ran); 3xx → never followed, the error
//! `tool_redirected` (in doubt for a 302/303 of a keyed or unkeyed tool: services
//! send those after performing a POST); a busy status (default 409, 423, 425: a
//! request with this key is still being processed) → never "not performed": a
//! `keyed` tool is asked again with the same key until it answers (at most
//! `busy_wait`, then `in_doubt`), an `unkeyed` one is `in_doubt`, a read is
//! retried like a 5xx; other 4xx → a definite `error` (429 is retried,
//! nothing was performed); 5xx, timeout or a broken connection after the request
//! was sent → "may have run": retried with the same key unless the tool is
//! `unkeyed`, which is `in_doubt` at once; a refused connection (nothing sent) is
//! retried for every category. A tool with `max_concurrency` has that many slots
//! per registry; each try waits for one (at most `queue_timeout`) before its
//! `timeout` starts.

pub mod mcp;
pub mod reconcile;
pub mod tool;
mod transport;
pub(crate) mod validate;

use crate::contract::{Call, ErrorBody, Outcome, Texts, headers};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use std::collections::BTreeMap;
use std::sync::Arc;
use thiserror::Error;
use tokio::sync::{Semaphore, SemaphorePermit};
pub use tool::{Category, Policy, ToolAnnotations, ToolConfig};
use transport::{Http, Route, SendError, Sent};

/// How much of a non-2xx body is read: enough for the excerpt in the message.
const ERROR_BODY_PREFIX: usize = 4096;

/// The configured tools, by name.
#[derive(Clone)]
pub struct ToolRegistry {
    tools: BTreeMap<String, ToolConfig>,
    names: Vec<String>,
    http: Http,
    /// How each HTTP tool's URL is called.
    routes: BTreeMap<String, Route>,
    /// The slots of each tool with `max_concurrency`, shared by every clone.
    slots: BTreeMap<String, Arc<Semaphore>>,
    /// Each tool's configured `headers`, values marked sensitive (never in a
    /// `Debug`); an error (naming the header, not a value) when one has no
    /// value, which [`crate::config::Config::resolve_tool_headers`] prevents.
    headers: BTreeMap<String, Result<HeaderMap, String>>,
    /// Sessions with the MCP servers of tools served over MCP.
    mcp: mcp::McpSessions,
}

/// How one HTTP try ended.
enum Try {
    Done(Outcome),
    /// Nothing reached the tool; safe to try again.
    NotSent(String),
    /// The request was sent; the tool may have acted.
    MaybeRan(String),
    /// The tool answered with one of its `busy_statuses`: a request with this
    /// key is still being processed (by an earlier try, or elsewhere).
    Busy(u16, String),
}

/// A try that could not start; its `Display` is the detail in the message.
#[derive(Debug, Error)]
enum SlotError {
    #[error("all {slots} of its concurrent call slots stayed busy for {waited}")]
    Busy { slots: u32, waited: String },
}

/// A 2xx body, read up to the tool's cap.
enum Capped {
    Whole(Vec<u8>),
    /// Over the cap; the declared length when the tool sent one.
    TooLarge(Option<u64>),
}

impl ToolRegistry {
    /// The registry of `tools`, with an HTTP client keeping up to
    /// `concurrency` idle connections per host (`executor.concurrency`).
    pub fn new(tools: &BTreeMap<String, ToolConfig>, concurrency: usize) -> Self {
        Self::with_http(tools, Http::new(concurrency), Http::routes(tools))
    }

    fn with_http(
        tools: &BTreeMap<String, ToolConfig>,
        http: Http,
        routes: BTreeMap<String, Route>,
    ) -> Self {
        let slots = tools
            .iter()
            .filter_map(|(name, t)| {
                let n = t.max_concurrency?;
                Some((name.clone(), Arc::new(Semaphore::new(n as usize))))
            })
            .collect();
        let headers = tools
            .iter()
            .map(|(name, t)| (name.clone(), tool_headers(t)))
            .collect();
        ToolRegistry {
            tools: tools.clone(),
            names: tools.keys().cloned().collect(),
            http,
            routes,
            slots,
            headers,
            mcp: mcp::McpSessions::default(),
        }
    }

    /// Sorted names of every configured tool.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn get(&self, name: &str) -> Option<&ToolConfig> {
        self.tools.get(name)
    }

    pub fn category(&self, name: &str) -> Option<Category> {
        self.tools.get(name).map(|t| t.category)
    }

    /// Invoke a call's tool, with the retries its category allows.
    pub async fn invoke(&self, call: &Call) -> Outcome {
        self.invoke_if(call, &|| true)
            .await
            .expect("a call that may always start is sent")
    }

    /// [`ToolRegistry::invoke`], unless `may_send` says no before anything
    /// was sent to the tool (checked before each try until one is sent, once
    /// the try holds its slot): `None` then, the call was never invoked.
    pub async fn invoke_if(
        &self,
        call: &Call,
        may_send: &(dyn Fn() -> bool + Sync),
    ) -> Option<Outcome> {
        if call.is_lookup() {
            return Some(self.lookup(call).await);
        }
        let tool_name = &call.step.tool;
        let Some(tool) = self.tools.get(tool_name) else {
            return Some(Outcome::Error {
                error: ErrorBody {
                    kind: "tool_unreachable".into(),
                    message: Texts::tool_unreachable(
                        tool_name,
                        0,
                        "no executor has this tool configured",
                    ),
                },
            });
        };
        // Every configured tool has an entry; `None` is unreachable.
        let no_headers = HeaderMap::new();
        let extra_headers = match self.headers.get(tool_name) {
            Some(Ok(h)) => h,
            // Nothing is sent without its credentials: definitely not performed.
            Some(Err(detail)) => {
                return Some(Outcome::Error {
                    error: ErrorBody {
                        kind: "tool_unreachable".into(),
                        message: Texts::tool_unreachable(tool_name, 0, detail),
                    },
                });
            }
            None => &no_headers,
        };
        let tries = tool.retries + 1;
        let mut maybe_ran: Option<String> = None;
        let mut last = String::new();
        // Tries spent, and the asks of a keyed tool that answered "still
        // processing" (they spend no try: the tool has the call).
        let (mut n, mut busy_asks) = (0u32, 0u32);
        let mut busy_since: Option<std::time::Instant> = None;
        // Whether any try may have reached the tool (then the call was invoked).
        let mut sent = false;
        while n < tries {
            if busy_asks > 0 {
                tokio::time::sleep(tool.backoff_before(busy_asks)).await;
            } else if n > 0 {
                tokio::time::sleep(tool.backoff_before(n)).await;
            }
            // Held for this try only: a backoff frees the slot for other calls.
            let _slot = match self.slot(tool_name, tool).await {
                Ok(slot) => slot,
                Err(e) => {
                    last = e.to_string();
                    n += 1;
                    continue;
                }
            };
            if !sent && !may_send() {
                return None;
            }
            // The request's timeout starts only now, inside `try_once`.
            let tried = if tool.mcp_tool.is_some() {
                mcp::try_once(&self.mcp, &self.http.reqwest, tool, call, extra_headers).await
            } else {
                self.try_once(tool, call, extra_headers).await
            };
            sent |= !matches!(tried, Try::NotSent(_));
            match tried {
                // The provider is still working on this key: its answer is
                // the outcome, so a keyed tool is asked again with it.
                Try::Busy(code, detail) if tool.category == Category::Keyed => {
                    let since = *busy_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= tool.busy_wait.0 {
                        return Some(Outcome::InDoubt {
                            error: ErrorBody {
                                kind: "outcome_unknown".into(),
                                message: Texts::in_doubt_still_processing(
                                    tool_name,
                                    code,
                                    &humantime::format_duration(tool.busy_wait.0).to_string(),
                                ),
                            },
                        });
                    }
                    busy_asks += 1;
                    maybe_ran = Some(detail);
                    continue;
                }
                Try::Done(outcome) => return Some(outcome),
                Try::NotSent(detail) => last = detail,
                // Busy, for a read or an unkeyed call: it may have run.
                Try::MaybeRan(detail) | Try::Busy(_, detail) => {
                    if !tool.category.rerun_is_safe() {
                        return Some(in_doubt(tool_name, &detail));
                    }
                    maybe_ran = Some(detail.clone());
                    last = detail;
                }
            }
            busy_asks = 0;
            n += 1;
        }
        Some(match (maybe_ran, tool.category) {
            // Nothing ever reached the tool: definitely not performed.
            (None, _) => Outcome::Error {
                error: ErrorBody {
                    kind: "tool_unreachable".into(),
                    message: Texts::tool_unreachable(tool_name, tries, &last),
                },
            },
            (Some(_), Category::ReadOnly | Category::Idempotent) => Outcome::Error {
                error: ErrorBody {
                    kind: "tool_failed".into(),
                    message: Texts::tool_failed_safe(tool_name, tries, &last),
                },
            },
            (Some(detail), _) => in_doubt(tool_name, &detail),
        })
    }

    /// Wait for one of the tool's slots (none to wait for without `max_concurrency`).
    async fn slot(
        &self,
        name: &str,
        tool: &ToolConfig,
    ) -> Result<Option<SemaphorePermit<'_>>, SlotError> {
        let Some(slots) = self.slots.get(name) else {
            return Ok(None);
        };
        let busy = || SlotError::Busy {
            slots: tool.max_concurrency.unwrap_or_default(),
            waited: humantime::format_duration(tool.queue_timeout.0).to_string(),
        };
        match tokio::time::timeout(tool.queue_timeout.0, slots.acquire()).await {
            Ok(Ok(permit)) => Ok(Some(permit)),
            // Never closed; were it, no slot would ever come.
            Ok(Err(_closed)) => Err(busy()),
            Err(_elapsed) => Err(busy()),
        }
    }

    async fn try_once(&self, tool: &ToolConfig, call: &Call, extra_headers: &HeaderMap) -> Try {
        let step = &call.step;
        let key = step.idempotency_key();
        // The arguments as the intent carried them, byte for byte; parsed only
        // when the key must be set inside the body.
        let body = match &tool.idempotency_field {
            None => call.arguments.as_str().to_owned(),
            Some(path) => {
                let mut body = match call.arguments.parse() {
                    Ok(map) => serde_json::Value::Object(map),
                    Err(e) => return Try::NotSent(unreadable_arguments(&e)),
                };
                set_path(&mut body, path, serde_json::Value::String(key.clone()));
                body.to_string()
            }
        };
        // The configured headers first; none of them is one of the protocol's
        // (config validation refuses those), so nothing below is doubled.
        let mut req_headers = extra_headers.clone();
        let protocol = [
            (
                tool.idempotency_header.as_str(),
                HeaderValue::from_str(&key),
            ),
            (headers::STEP_INDEX, Ok(HeaderValue::from(step.step_index))),
            (headers::ATTEMPT, Ok(HeaderValue::from(step.attempt))),
            (
                headers::WORKFLOW_ID,
                HeaderValue::from_bytes(step.workflow_id.as_bytes())
                    .or_else(|_| HeaderValue::from_str(&percent_escape(&step.workflow_id))),
            ),
        ];
        for (name, value) in protocol {
            match (HeaderName::from_bytes(name.as_bytes()), value) {
                (Ok(name), Ok(value)) => {
                    req_headers.append(name, value);
                }
                // Nothing was sent: the request could not be built.
                _ => {
                    return Try::NotSent(format!(
                        "the request could not be built (its header `{name}`; nothing was sent)"
                    ));
                }
            }
        }
        req_headers.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        // An invalid traceparent is dropped, never sent: as a header value it
        // could fail the request before anything was sent, and the trace is
        // not worth the call.
        if let Some(tp) = call
            .traceparent
            .as_deref()
            .filter(|tp| crate::contract::headers::is_valid_traceparent(tp))
            .and_then(|tp| HeaderValue::from_str(tp).ok())
        {
            req_headers.append(headers::TRACEPARENT, tp);
        }
        // The tool's `timeout` covers the whole try: connecting, sending and
        // reading the answer.
        let deadline = tokio::time::Instant::now() + tool.timeout.0;
        let route = self.routes.get(&step.tool).unwrap_or(&Route::Reqwest);
        let sending = self.http.post(route, &tool.url, req_headers, body.into());
        let mut resp = match tokio::time::timeout_at(deadline, sending).await {
            Ok(Ok(r)) => r,
            Ok(Err(SendError::NotSent(detail))) => return Try::NotSent(detail),
            Ok(Err(SendError::MaybeRan(detail))) => return Try::MaybeRan(detail),
            Err(_elapsed) => return Try::MaybeRan("timed out".into()),
        };
        let status = resp.status;
        let code = status.as_u16();
        if status.is_redirection() {
            return Try::Done(redirected(tool, &step.tool, code));
        }
        if status.is_success() {
            let reading = read_capped(&mut resp, tool.max_output_bytes);
            let body = match tokio::time::timeout_at(deadline, reading).await {
                Ok(Ok(Capped::Whole(b))) => b,
                Ok(Ok(Capped::TooLarge(size))) => {
                    return Try::Done(Outcome::Error {
                        error: ErrorBody {
                            kind: "output_too_large".into(),
                            message: Texts::output_too_large(
                                &step.tool,
                                size,
                                tool.max_output_bytes,
                            ),
                        },
                    });
                }
                // The tool answered but the body broke off: it ran, the answer is lost.
                Ok(Err(detail)) => return Try::MaybeRan(detail),
                Err(_elapsed) => return Try::MaybeRan("timed out".into()),
            };
            let output = if body.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_slice(&body).unwrap_or_else(|_| {
                    serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
                })
            };
            // As deep as arguments may be, no deeper: every record that carries
            // the output (step record, answer) stays readable by every reader.
            if crate::contract::nested_deeper_than(&output, crate::contract::MAX_NESTING_DEPTH) {
                return Try::Done(Outcome::Error {
                    error: ErrorBody {
                        kind: "output_too_deep".into(),
                        message: Texts::output_too_deep(
                            &step.tool,
                            crate::contract::MAX_NESTING_DEPTH,
                        ),
                    },
                });
            }
            return Try::Done(Outcome::Ok { output });
        }
        if code == 429 {
            return Try::NotSent("HTTP 429, rate limited".to_owned());
        }
        if tool.busy_statuses.contains(&code) {
            return Try::Busy(
                code,
                format!("HTTP {code}: a request with this call's key is still in progress"),
            );
        }
        if status.is_client_error() {
            let body = read_prefix(&mut resp, ERROR_BODY_PREFIX, deadline).await;
            // A refusal often quotes the credential it refused ("invalid API
            // key …"); the excerpt goes to a model and into Kafka records.
            let excerpt = crate::redact::redact_url_in(
                &without_secrets(&String::from_utf8_lossy(&body), extra_headers),
                &tool.url,
            );
            return Try::Done(Outcome::Error {
                error: ErrorBody {
                    kind: "tool_refused".into(),
                    message: Texts::tool_refused(&step.tool, code, &excerpt),
                },
            });
        }
        Try::MaybeRan(format!("HTTP {code}"))
    }
}

/// A tool's configured headers, values marked sensitive so that no `Debug`
/// (of the request, in a log) shows them.
fn tool_headers(tool: &ToolConfig) -> Result<HeaderMap, String> {
    let mut map = HeaderMap::new();
    for (name, spec) in &tool.headers {
        let name_ok = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("its header `{name}` has an invalid name"))?;
        let mut value = spec
            .value()
            .and_then(|v| HeaderValue::from_str(v).ok())
            .ok_or_else(|| format!("stepgate has no valid value for its header `{name}`"))?;
        value.set_sensitive(true);
        map.insert(name_ok, value);
    }
    Ok(map)
}

/// `text` with every configured header value replaced by `<redacted>`: the
/// whole value, and each of its words of 8 characters or more (the token of
/// `Bearer <token>`).
fn without_secrets(text: &str, secrets: &HeaderMap) -> String {
    let mut out = text.to_owned();
    for value in secrets.values().filter_map(|v| v.to_str().ok()) {
        for secret in
            std::iter::once(value).chain(value.split_whitespace().filter(|w| w.len() >= 8))
        {
            if !secret.is_empty() && out.contains(secret) {
                out = out.replace(secret, crate::redact::REDACTED);
            }
        }
    }
    out
}

/// Why a call whose body must be rebuilt (its idempotency key set inside, or
/// an MCP call's arguments) was not sent: its arguments text holds what no
/// JSON reader does. Only a step recorded before intents with such numbers
/// were refused can; sending `{}` instead would be a different call.
fn unreadable_arguments(e: &serde_json::Error) -> String {
    format!(
        "its arguments could not be read to build the request ({e}; a number beyond a 64-bit float?), so it was not sent"
    )
}

/// Put `value` at a dotted path of `body`, creating objects on the way (a
/// non-object in the way is replaced: the provider's field wins).
fn set_path(body: &mut serde_json::Value, path: &str, value: serde_json::Value) {
    let mut cur = body;
    let mut parts = path.split('.').peekable();
    while let Some(part) = parts.next() {
        if !cur.is_object() {
            *cur = serde_json::Value::Object(Default::default());
        }
        let obj = cur.as_object_mut().expect("made an object above");
        if parts.peek().is_none() {
            obj.insert(part.to_owned(), value);
            return;
        }
        cur = obj
            .entry(part.to_owned())
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
    }
}

/// Read a 2xx body chunk by chunk, stopping as soon as it exceeds `cap` bytes
/// (at once when the declared length does): a tool cannot make us buffer more.
async fn read_capped(resp: &mut Sent, cap: u64) -> Result<Capped, String> {
    let declared = resp.declared_length();
    if let Some(len) = declared.filter(|&len| len > cap) {
        return Ok(Capped::TooLarge(Some(len)));
    }
    // Trust a declared length only so far: the cap may be set high.
    let mut body = Vec::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
    while let Some(chunk) = resp.chunk().await? {
        if (body.len() + chunk.len()) as u64 > cap {
            return Ok(Capped::TooLarge(None));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Capped::Whole(body))
}

/// The first `max` bytes of a body, for a message; a body that breaks off or
/// is still arriving at `deadline` gives what arrived.
async fn read_prefix(resp: &mut Sent, max: usize, deadline: tokio::time::Instant) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < max {
        match tokio::time::timeout_at(deadline, resp.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                let take = chunk.len().min(max - out.len());
                out.extend_from_slice(&chunk[..take]);
            }
            Ok(Ok(None) | Err(_)) | Err(_) => break,
        }
    }
    out
}

/// A 3xx answer, never followed. 302 and 303 are what web frameworks send
/// after performing a POST ("see the result there"), so from a tool that is not
/// safe to re-run they leave the outcome in doubt; every other 3xx (301, 307,
/// 308, …) means the action is somewhere else and was not performed here.
fn redirected(tool: &ToolConfig, name: &str, code: u16) -> Outcome {
    let error = |message| ErrorBody {
        kind: "tool_redirected".into(),
        message,
    };
    match (code, tool.category) {
        (302 | 303, Category::ReadOnly | Category::Idempotent) => Outcome::Error {
            error: error(Texts::tool_redirected_safe(name, code)),
        },
        (302 | 303, Category::Keyed | Category::Unkeyed) => Outcome::InDoubt {
            error: error(Texts::tool_redirected_in_doubt(name, code)),
        },
        _ => Outcome::Error {
            error: error(Texts::tool_redirected(name, code)),
        },
    }
}

fn in_doubt(tool: &str, detail: &str) -> Outcome {
    Outcome::InDoubt {
        error: ErrorBody {
            kind: "outcome_unknown".into(),
            message: Texts::in_doubt_unconfirmed(tool, detail),
        },
    }
}

fn percent_escape(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_graphic() || b == b' ' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
