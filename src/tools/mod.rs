//! Tools: the registry of configured tools and the HTTP tool protocol.
//!
//! `POST <url>` with the arguments as the JSON body and the headers
//! `Idempotency-Key` (stable per step key), `Stepgate-Workflow-Id`,
//! `Stepgate-Step-Index`, `Stepgate-Attempt` and `traceparent` when present.
//! 2xx → `ok` with the JSON body as output; 4xx → a definite `error` (429 is
//! retried, nothing was performed); 5xx, timeout or a broken connection after the
//! request was sent → "may have run": retried with the same key unless the tool is
//! `unkeyed`, which is `in_doubt` at once; a refused connection (nothing sent) is
//! retried for every category.

use crate::config::{Category, Config, ToolConfig};
use crate::contract::{Call, ErrorBody, Outcome, Texts, headers};
use std::collections::BTreeMap;
use std::time::Duration;

/// The configured tools, by name.
#[derive(Clone)]
pub struct ToolRegistry {
    tools: BTreeMap<String, ToolConfig>,
    names: Vec<String>,
    http: reqwest::Client,
}

/// How one HTTP try ended.
enum Try {
    Done(Outcome),
    /// Nothing reached the tool; safe to try again.
    NotSent(String),
    /// The request was sent; the tool may have acted.
    MaybeRan(String),
}

impl ToolRegistry {
    pub fn new(config: &Config) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .user_agent(concat!("stepgate/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("the HTTP client builds with static settings");
        ToolRegistry {
            tools: config.tools.clone(),
            names: config.tool_names(),
            http,
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
        let tool_name = &call.step.tool;
        let Some(tool) = self.tools.get(tool_name) else {
            return Outcome::Error {
                error: ErrorBody {
                    kind: "tool_unreachable".into(),
                    message: Texts::tool_unreachable(
                        tool_name,
                        0,
                        "no executor has this tool configured",
                    ),
                },
            };
        };
        let tries = tool.retries + 1;
        let mut maybe_ran: Option<String> = None;
        let mut last = String::new();
        for n in 1..=tries {
            if n > 1 {
                tokio::time::sleep(tool.backoff_before(n - 1)).await;
            }
            match self.try_once(tool, call).await {
                Try::Done(outcome) => return outcome,
                Try::NotSent(detail) => last = detail,
                Try::MaybeRan(detail) => {
                    if !tool.category.rerun_is_safe() {
                        return in_doubt(tool_name, &detail);
                    }
                    maybe_ran = Some(detail.clone());
                    last = detail;
                }
            }
        }
        match (maybe_ran, tool.category) {
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
        }
    }

    async fn try_once(&self, tool: &ToolConfig, call: &Call) -> Try {
        let step = &call.step;
        let key = step.idempotency_key();
        let mut body = serde_json::Value::Object(call.arguments.clone());
        if let Some(path) = &tool.idempotency_field {
            set_path(&mut body, path, serde_json::Value::String(key.clone()));
        }
        let mut req = self
            .http
            .post(&tool.url)
            .timeout(tool.timeout.0)
            .header(tool.idempotency_header.as_str(), key)
            .header(headers::STEP_INDEX, step.step_index.to_string())
            .header(headers::ATTEMPT, step.attempt.to_string())
            .json(&body);
        match reqwest::header::HeaderValue::from_bytes(step.workflow_id.as_bytes()) {
            Ok(v) => req = req.header(headers::WORKFLOW_ID, v),
            Err(_) => req = req.header(headers::WORKFLOW_ID, percent_escape(&step.workflow_id)),
        }
        if let Some(tp) = &call.traceparent {
            req = req.header(headers::TRACEPARENT, tp);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Try::NotSent(describe(&e)),
            Err(e) => return Try::MaybeRan(describe(&e)),
        };
        let status = resp.status();
        let body = match resp.bytes().await {
            Ok(b) => b,
            // The tool answered but the body broke off: it ran, the answer is lost.
            Err(e) if status.is_success() => return Try::MaybeRan(describe(&e)),
            Err(_) => Default::default(),
        };
        if status.is_success() {
            let output = if body.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_slice(&body).unwrap_or_else(|_| {
                    serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
                })
            };
            return Try::Done(Outcome::Ok { output });
        }
        let code = status.as_u16();
        if code == 429 {
            return Try::NotSent("HTTP 429, rate limited".to_owned());
        }
        if status.is_client_error() {
            return Try::Done(Outcome::Error {
                error: ErrorBody {
                    kind: "tool_refused".into(),
                    message: Texts::tool_refused(&step.tool, code, &String::from_utf8_lossy(&body)),
                },
            });
        }
        Try::MaybeRan(format!("HTTP {code}"))
    }
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

fn in_doubt(tool: &str, detail: &str) -> Outcome {
    Outcome::InDoubt {
        error: ErrorBody {
            kind: "outcome_unknown".into(),
            message: Texts::in_doubt_unconfirmed(tool, detail),
        },
    }
}

fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        "connection refused".into()
    } else {
        "connection broken".into()
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
