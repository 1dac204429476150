//! The wire contract: every message stepgate reads or writes, mirroring `schemas/`.
//!
//! Nothing outside this module builds or parses these JSON shapes by hand.
//! Public messages: [`Intent`] (v1, from agents), [`ToolResult`] (v1, to agents),
//! [`DlqRecord`]. Internal: [`Progress`] (outcomes handed between gates); [`Call`]
//! (in-process, gate → invoker).

mod operator;
mod texts;
mod validate;

pub use operator::{Action, ApprovalEvent, ApprovalKind, Command};
pub use texts::Texts;
pub use validate::{Address, Rejection, RejectionReason, parse_intent};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::fmt;

/// Maximum length of a `workflow_id`, in bytes.
pub const MAX_WORKFLOW_ID_BYTES: usize = 255;
/// Header names of the HTTP tool protocol (DESIGN.md "Tools").
pub mod headers {
    /// The step's idempotency key (the header name is configurable per tool).
    pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
    pub const WORKFLOW_ID: &str = "Stepgate-Workflow-Id";
    pub const STEP_INDEX: &str = "Stepgate-Step-Index";
    pub const ATTEMPT: &str = "Stepgate-Attempt";
    pub const TRACEPARENT: &str = "traceparent";
}

/// Maximum length of a tool name.
pub const MAX_TOOL_NAME_CHARS: usize = 128;

/// The identity of a call: where it came from, never what it says.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StepKey {
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    pub attempt: u64,
}

impl StepKey {
    /// The provider idempotency key for this step: stable across every retry of the
    /// step, different for each `attempt`, at most 255 characters whatever the
    /// workflow id's length (so it is a digest of the step key, never of arguments).
    pub fn idempotency_key(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.workflow_id.as_bytes());
        h.update([0]);
        h.update(self.step_index.to_be_bytes());
        h.update(self.tool.as_bytes());
        h.update([0]);
        h.update(self.attempt.to_be_bytes());
        let digest = h.finalize();
        let mut hex = String::with_capacity(68);
        hex.push_str("sg1-");
        for b in digest.iter() {
            hex.push_str(&format!("{b:02x}"));
        }
        hex
    }
}

impl fmt::Display for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}#{}/{}@{}",
            self.workflow_id, self.step_index, self.tool, self.attempt
        )
    }
}

/// Intent v1: an agent asks for one tool call at one step of a workflow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Intent {
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    #[serde(default)]
    pub attempt: u64,
    pub arguments: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

impl Intent {
    pub fn step_key(&self) -> StepKey {
        StepKey {
            workflow_id: self.workflow_id.clone(),
            step_index: self.step_index,
            tool: self.tool.clone(),
            attempt: self.attempt,
        }
    }
}

/// The status of a final answer (Result v1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The tool succeeded; `output` holds its answer.
    Ok,
    /// The tool ran, or was definitely refused, and failed.
    Error,
    /// The call may have taken effect and its outcome is unknown.
    InDoubt,
    /// The intent was invalid and nothing was executed.
    Rejected,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Error => "error",
            Status::InDoubt => "in_doubt",
            Status::Rejected => "rejected",
        }
    }
}

/// `error` of a Result v1: a machine-readable kind and a message written for a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub kind: String,
    pub message: String,
}

/// Result v1: the final answer to one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    pub attempt: u64,
    /// The answered call's own `call_id` (`null` when its intent had none).
    pub call_id: Option<String>,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    pub deduplicated: bool,
    pub completed_at: String,
}

impl ToolResult {
    /// A fresh answer for `key` from an outcome.
    pub fn from_outcome(
        key: &StepKey,
        call_id: Option<String>,
        outcome: Outcome,
        at: DateTime<Utc>,
    ) -> Self {
        let (status, output, error) = match outcome {
            Outcome::Ok { output } => (Status::Ok, Some(output), None),
            Outcome::Error { error } => (Status::Error, None, Some(error)),
            Outcome::InDoubt { error } => (Status::InDoubt, None, Some(error)),
        };
        ToolResult {
            workflow_id: key.workflow_id.clone(),
            step_index: key.step_index,
            tool: key.tool.clone(),
            attempt: key.attempt,
            call_id,
            status,
            output,
            error,
            deduplicated: false,
            completed_at: timestamp(at),
        }
    }

    /// The answer to a repeat: identical to the stored first answer except the
    /// repeat's own `call_id` and `deduplicated: true`.
    pub fn for_repeat(&self, call_id: Option<String>) -> Self {
        ToolResult {
            call_id,
            deduplicated: true,
            ..self.clone()
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a ToolResult always serialises")
    }
}

/// RFC 3339 with milliseconds and `Z`, as every timestamp on the wire.
pub fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// What an invocation produced, as the executor reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    Ok { output: Value },
    Error { error: ErrorBody },
    InDoubt { error: ErrorBody },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Ok { .. } => "ok",
            Outcome::Error { .. } => "error",
            Outcome::InDoubt { .. } => "in_doubt",
        }
    }
}

/// Internal, in-process: a call the gate hands to its invoker (never on a topic).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Call {
    pub step: StepKey,
    pub arguments: Map<String, Value>,
    /// 1 for the first run of a step; bumped when the gate runs it again.
    pub dispatch: u32,
    /// Set for fast-path calls (read-only / idempotent tools without a step log):
    /// the offset of the intent, which names the in-flight entry to answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_ref: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Internal: the outcome of a call whose partition moved while it ran, handed
/// to the partition's owner (topic `progress`, in the step's partition).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub step: StepKey,
    pub dispatch: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_ref: Option<i64>,
    /// Milliseconds since the epoch, clock of the process that ran the call.
    pub at_ms: i64,
    #[serde(flatten)]
    pub event: ProgressEvent,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ProgressEvent {
    /// Written by earlier versions' remote executors; ignored.
    Started,
    /// The invocation's outcome.
    Finished { outcome: Outcome },
}

/// A dead-letter record: the raw input and why it was refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DlqRecord {
    pub reason: RejectionReason,
    pub message: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub received_at: String,
    pub payload: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_encoding: Option<String>,
}

impl DlqRecord {
    pub fn new(
        rejection: &Rejection,
        topic: &str,
        partition: i32,
        offset: i64,
        payload: &[u8],
        at: DateTime<Utc>,
    ) -> Self {
        use base64::Engine as _;
        let (payload, payload_encoding) = match std::str::from_utf8(payload) {
            Ok(s) => (s.to_owned(), None),
            Err(_) => (
                base64::engine::general_purpose::STANDARD.encode(payload),
                Some("base64".to_owned()),
            ),
        };
        DlqRecord {
            reason: rejection.reason,
            message: rejection.message.clone(),
            topic: topic.to_owned(),
            partition,
            offset,
            received_at: timestamp(at),
            payload,
            payload_encoding,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(attempt: u64) -> StepKey {
        StepKey {
            workflow_id: "order-7781".into(),
            step_index: 3,
            tool: "send_email".into(),
            attempt,
        }
    }

    #[test]
    fn idempotency_key_is_stable_per_step_and_bounded() {
        assert_eq!(key(0).idempotency_key(), key(0).idempotency_key());
        assert_ne!(key(0).idempotency_key(), key(1).idempotency_key());
        let long = StepKey {
            workflow_id: "w".repeat(255),
            ..key(0)
        };
        assert!(long.idempotency_key().len() <= 255);
        assert!(key(0).idempotency_key().starts_with("sg1-"));
    }

    #[test]
    fn idempotency_key_separates_fields() {
        // "a" + step 1 and "a\0..." must never collide through concatenation.
        let a = StepKey {
            workflow_id: "ab".into(),
            step_index: 1,
            tool: "t".into(),
            attempt: 0,
        };
        let b = StepKey {
            workflow_id: "a".into(),
            tool: "bt".into(),
            ..a.clone()
        };
        assert_ne!(a.idempotency_key(), b.idempotency_key());
    }

    #[test]
    fn a_repeat_differs_only_in_call_id_and_deduplicated() {
        let first = ToolResult::from_outcome(
            &key(0),
            Some("call_1".into()),
            Outcome::Ok {
                output: serde_json::json!({"message_id": "m-1"}),
            },
            Utc::now(),
        );
        let repeat = first.for_repeat(Some("call_2".into()));
        assert_eq!(repeat.call_id.as_deref(), Some("call_2"));
        assert!(repeat.deduplicated && !first.deduplicated);
        assert_eq!(
            ToolResult {
                call_id: first.call_id.clone(),
                deduplicated: false,
                ..repeat
            },
            first
        );
    }

    #[test]
    fn result_json_always_has_call_id_even_when_null() {
        let r = ToolResult::from_outcome(
            &key(0),
            None,
            Outcome::Ok {
                output: serde_json::json!({}),
            },
            Utc::now(),
        );
        let v: Value = serde_json::from_slice(&r.to_json()).unwrap();
        assert!(v.get("call_id").unwrap().is_null());
        assert!(v.get("error").is_none());
    }

    #[test]
    fn dlq_payload_is_base64_when_not_utf8() {
        let rej = Rejection::new(RejectionReason::MalformedJson, "bad".into());
        let d = DlqRecord::new(&rej, "t", 0, 1, &[0xff, 0xfe], Utc::now());
        assert_eq!(d.payload_encoding.as_deref(), Some("base64"));
        assert_eq!(d.payload, "//4=");
    }
}
