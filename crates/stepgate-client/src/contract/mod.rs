//! The wire contract: every message stepgate reads or writes, mirroring `schemas/`.
//!
//! Nothing outside this module builds or parses these JSON shapes by hand.
//! Public messages: [`Intent`] (v1, from agents), [`ToolResult`] (v1, to agents),
//! [`DlqRecord`]; for pool workers, [`PoolCall`] (Call v1) in and [`Progress`]
//! (as Outcome v1: `started` / `finished`) out, each signed with the pool's
//! key ([`sign`]). Internal: [`Progress`] (outcomes handed between gates);
//! [`Call`] (in-process, gate → invoker).
//! Partition ownership: [`partition_for`], the one canonical partitioner.

mod arguments;
pub mod codec;
mod operator;
mod partition;
pub mod sign;
mod texts;
mod validate;

#[cfg(test)]
mod fuzz;

pub use arguments::{Arguments, text_deeper_than};
pub use operator::{Action, ApprovalEvent, ApprovalKind, Command, Run};
pub use partition::{murmur2, partition_for};
pub use texts::Texts;
pub use validate::{
    Address, MAX_NESTING_DEPTH, Rejection, RejectionReason, nested_deeper_than, parse_intent,
    valid_tool_name,
};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::fmt;

/// Maximum length of a `workflow_id`, in bytes.
pub const MAX_WORKFLOW_ID_BYTES: usize = 255;
/// Header names of the HTTP tool protocol (`docs/tools.md`).
pub mod headers {
    /// The step's idempotency key (the header name is configurable per tool).
    pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
    pub const WORKFLOW_ID: &str = "Stepgate-Workflow-Id";
    pub const STEP_INDEX: &str = "Stepgate-Step-Index";
    pub const ATTEMPT: &str = "Stepgate-Attempt";
    pub const TRACEPARENT: &str = "traceparent";
    /// On an intent the gate re-routed to its workflow's partition: the
    /// partition the agent published it to, where its answer is written.
    /// Written by the gate when it re-routes an intent. Nothing proves who
    /// wrote it (agents write the same topic): it only says where the
    /// intent's own answer goes, and whether a copy found outside its
    /// workflow's partition may be re-routed again (never).
    pub const REPLY_PARTITION: &str = "stepgate-reply-partition";
    /// On a re-routed intent: `<partition>:<offset>` of the record the agent
    /// published. Like [`REPLY_PARTITION`], a claim, not a proof: an audit
    /// takes a copy as re-routed only when the record it names holds the same
    /// key and value, and the gate counts and decides the copy like any intent.
    pub const FORWARDED_FROM: &str = "stepgate-forwarded-from";
    /// On a Call v1 and an Outcome v1: the record's signature under its
    /// pool's key ([`super::sign`]).
    pub const SIGNATURE: &str = "stepgate-signature";

    /// Whether `tp` is a W3C `traceparent` worth carrying: version `00` exactly as
    /// `00-<32 hex>-<16 hex>-<2 hex>` (lowercase), or a later version (not `ff`)
    /// that starts that way (anything after must follow a `-`, in visible ASCII);
    /// the trace id and the parent id not all zeros. Anything else is dropped where
    /// it is read, so a bad header can neither fail a tool's request nor travel on.
    pub fn is_valid_traceparent(tp: &str) -> bool {
        let b = tp.as_bytes();
        let hex = |s: &[u8]| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
        let zeros = |s: &[u8]| s.iter().all(|&c| c == b'0');
        if b.len() < 55 {
            return false;
        }
        let (version, trace_id, parent_id, flags) = (&b[0..2], &b[3..35], &b[36..52], &b[53..55]);
        let shape = b[2] == b'-' && b[35] == b'-' && b[52] == b'-';
        let fields = hex(version) && hex(trace_id) && hex(parent_id) && hex(flags);
        let rest_ok = match version {
            b"00" => b.len() == 55,
            b"ff" => false,
            _ => b.len() == 55 || (b[55] == b'-' && b[56..].iter().all(|c| c.is_ascii_graphic())),
        };
        shape && fields && rest_ok && !zeros(trace_id) && !zeros(parent_id)
    }
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
        format!("sg1-{}", hex(&h.finalize()))
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
    pub arguments: Arguments,
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
    pub arguments: Arguments,
    /// 1 for the first run of a step; bumped when the gate runs it again.
    pub dispatch: u32,
    /// Set for fast-path calls (read-only / idempotent tools without a step log):
    /// the offset of the intent, which names the in-flight entry to answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_ref: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The `call_id` of the call that started this run (the step's first
    /// caller's), for the tool call's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// This dispatch's token (recorded steps; none on the fast path): its
    /// outcome handed over on `progress` carries it back, and only an outcome
    /// with its dispatch's token settles the step (`state::DispatchToken`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Call v1 (public, `schemas/call.v1.json`): a call of a pool tool, published
/// by the step's owner on the pool's calls topic in the transaction that
/// records the step `started`, for the pool's workers. They answer it with
/// Outcome v1 ([`Progress`] with [`ProgressEvent::Started`] /
/// [`ProgressEvent::Finished`]) on `progress`, in `partition`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolCall {
    pub step: StepKey,
    pub dispatch: u32,
    /// The step's partition: where its outcomes go on `progress`.
    pub partition: i32,
    /// `read_only` | `idempotent` | `keyed` | `unkeyed`: whether the worker
    /// commits that it took the call before invoking it (`unkeyed`).
    pub category: String,
    pub arguments: Arguments,
    /// [`StepKey::idempotency_key`], so workers in any language send the same.
    pub idempotency_key: String,
    /// Not taken by then (ms since the epoch), it is never taken: the gate
    /// answers it `no_worker` at its deadline.
    pub take_by_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The dispatch's token: the worker copies it into each Outcome v1 of
    /// this call; an outcome without it settles nothing.
    pub token: String,
}

impl PoolCall {
    /// Call v1 of an in-process [`Call`], for a tool of `category` whose step
    /// lives in `partition`.
    pub fn new(call: &Call, partition: i32, category: &str, take_by_ms: i64) -> Self {
        PoolCall {
            step: call.step.clone(),
            dispatch: call.dispatch,
            partition,
            category: category.to_owned(),
            arguments: call.arguments.clone(),
            idempotency_key: call.step.idempotency_key(),
            take_by_ms,
            call_id: call.call_id.clone(),
            traceparent: call.traceparent.clone(),
            token: call.token.clone().unwrap_or_default(),
        }
    }

    /// The in-process call a worker invokes.
    pub fn to_call(&self) -> Call {
        Call {
            step: self.step.clone(),
            arguments: self.arguments.clone(),
            dispatch: self.dispatch,
            fast_ref: None,
            traceparent: self.traceparent.clone(),
            call_id: self.call_id.clone(),
            token: Some(self.token.clone()),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a PoolCall always serialises")
    }
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
    /// The call's token ([`Call::token`], Call v1 `token`), echoed: the
    /// step's owner takes a report from `progress` only with its dispatch's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(flatten)]
    pub event: ProgressEvent,
}

impl Progress {
    /// A record of the progress topic: a gate's ([`codec`]-encoded) or a pool
    /// worker's Outcome v1 (JSON: an object, and `{` is no version byte).
    pub fn decode(bytes: &[u8]) -> Result<Progress, codec::DecodeError> {
        match bytes.first() {
            Some(b'{') => Ok(serde_json::from_slice(bytes)?),
            _ => codec::decode(bytes),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ProgressEvent {
    /// A pool's worker took the call (Outcome v1), before invoking it: the
    /// dispatch was not left unclaimed.
    Started,
    /// The invocation's outcome.
    Finished { outcome: Outcome },
    /// The call was never invoked: its partition moved, or its process was
    /// stopping, while it waited for a slot. Its step may be run at once.
    NotInvoked,
}

/// At most this many bytes of a refused input's payload are copied into its
/// dead-letter record; the record also carries the whole payload's length and
/// SHA-256. A refused input can be as large as the broker accepts (and a
/// base64 or `\u0000`-escaped copy of it larger still), so a whole copy could
/// exceed the producer's `message.max.bytes`: the DLQ write failed, the gate
/// session restarted on the same record, and the gate wedged for good.
pub const DLQ_PAYLOAD_PREFIX_BYTES: usize = 64 * 1024;

/// At most this many bytes of a dead-letter record's `message` are kept.
pub const DLQ_MESSAGE_MAX_BYTES: usize = 4 * 1024;

/// Upper bound of a [`DlqRecord`]'s JSON, whatever the input: the prefix
/// escaped at worst six bytes per byte (`\u0000`), the message likewise, the
/// topic (capped at 255 bytes) likewise, and the fixed fields. Far below the
/// 1 000 000 bytes of librdkafka's default `message.max.bytes`, leaving room
/// for the original key and headers the record keeps.
pub const DLQ_RECORD_MAX_BYTES: usize =
    6 * (DLQ_PAYLOAD_PREFIX_BYTES + DLQ_MESSAGE_MAX_BYTES + MAX_TOPIC_BYTES) + 1024;

/// Kafka topic names are at most 249 characters; a longer one is cut.
const MAX_TOPIC_BYTES: usize = 255;

/// A dead-letter record: why an input was refused, and a bounded copy of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DlqRecord {
    pub reason: RejectionReason,
    pub message: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub received_at: String,
    /// The first [`DLQ_PAYLOAD_PREFIX_BYTES`] of the payload (cut at a character
    /// boundary when UTF-8), or the base64 of them.
    pub payload: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_encoding: Option<String>,
    /// Length of the whole original payload, in bytes.
    pub payload_bytes: u64,
    /// SHA-256 of the whole original payload, lowercase hex.
    pub payload_sha256: String,
    /// Whether `payload` holds less than the whole original payload.
    pub payload_truncated: bool,
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
        let truncated = payload.len() > DLQ_PAYLOAD_PREFIX_BYTES;
        let prefix = &payload[..payload.len().min(DLQ_PAYLOAD_PREFIX_BYTES)];
        let text = match std::str::from_utf8(prefix) {
            Ok(s) => Some(s),
            // The cut split a character: keep the text up to it.
            Err(e) if truncated && e.error_len().is_none() => {
                std::str::from_utf8(&prefix[..e.valid_up_to()]).ok()
            }
            Err(_) => None,
        };
        let (payload_text, payload_encoding) = match text {
            Some(s) => (s.to_owned(), None),
            None => (
                base64::engine::general_purpose::STANDARD.encode(prefix),
                Some("base64".to_owned()),
            ),
        };
        let copied = match &payload_encoding {
            None => payload_text.len(),
            Some(_) => prefix.len(),
        };
        DlqRecord {
            reason: rejection.reason,
            message: cut_at_char(&rejection.message, DLQ_MESSAGE_MAX_BYTES).to_owned(),
            topic: cut_at_char(topic, MAX_TOPIC_BYTES).to_owned(),
            partition,
            offset,
            received_at: timestamp(at),
            payload: payload_text,
            payload_encoding,
            payload_bytes: payload.len() as u64,
            payload_sha256: hex(&Sha256::digest(payload)),
            payload_truncated: copied < payload.len(),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a DlqRecord always serialises")
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character.
fn cut_at_char(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut n = max;
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

/// Lowercase hex, by table: it runs for every tool call (the idempotency
/// key), where a formatter per byte was 1.6 % of a flood's CPU. The one hex
/// encoder of the code (also the console's CSRF tokens).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
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
        // Pinned: a provider dedups a re-run after an upgrade only if the key
        // is byte for byte the one sent before (sha256 of the step key fields,
        // lowercase hex, as computed outside Rust).
        assert_eq!(
            key(2).idempotency_key(),
            "sg1-9efad3cffb769e63208a7c1120b4acf8da3f65be03bb2ae135d1b8430fb62de1"
        );
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
        assert_eq!(d.payload_bytes, 2);
        assert!(!d.payload_truncated);
    }

    fn rej() -> Rejection {
        Rejection::new(RejectionReason::Oversized, "too big".into())
    }

    #[test]
    fn dlq_payload_is_a_bounded_prefix_with_length_and_digest() {
        // 900 kB of non-UTF-8 bytes wedged the gate: its whole base64 copy was
        // over librdkafka's 1 000 000-byte message.max.bytes.
        let big: Vec<u8> = (0..900_000u32).map(|i| (i % 251) as u8 | 0x80).collect();
        let d = DlqRecord::new(&rej(), "t", 0, 1, &big, Utc::now());
        assert_eq!(d.payload_encoding.as_deref(), Some("base64"));
        assert!(d.payload_truncated);
        assert_eq!(d.payload_bytes, 900_000);
        assert_eq!(d.payload_sha256, hex(&Sha256::digest(&big)));
        use base64::Engine as _;
        let copied = base64::engine::general_purpose::STANDARD
            .decode(&d.payload)
            .unwrap();
        assert_eq!(copied, big[..DLQ_PAYLOAD_PREFIX_BYTES]);
        assert!(d.to_json().len() <= DLQ_RECORD_MAX_BYTES);

        // Control bytes escape to six bytes each in JSON: still bounded.
        let zeros = vec![0u8; 2_000_000];
        let d = DlqRecord::new(&rej(), "t", 0, 1, &zeros, Utc::now());
        assert_eq!(d.payload_encoding, None);
        assert_eq!(d.payload.len(), DLQ_PAYLOAD_PREFIX_BYTES);
        let json = d.to_json();
        assert!(json.len() > 6 * DLQ_PAYLOAD_PREFIX_BYTES);
        assert!(json.len() <= DLQ_RECORD_MAX_BYTES);
    }

    #[test]
    fn dlq_prefix_of_utf8_ends_on_a_character() {
        // 'é' is two bytes; an odd cut would split one.
        let text = format!("x{}", "é".repeat(DLQ_PAYLOAD_PREFIX_BYTES));
        let d = DlqRecord::new(&rej(), "t", 0, 1, text.as_bytes(), Utc::now());
        assert_eq!(d.payload_encoding, None, "still UTF-8 text");
        assert_eq!(d.payload.len(), DLQ_PAYLOAD_PREFIX_BYTES - 1);
        assert!(text.starts_with(&d.payload));
        assert!(d.payload_truncated);
        assert_eq!(d.payload_bytes, text.len() as u64);
        // Whole and short: copied as is, not truncated.
        let d = DlqRecord::new(&rej(), "t", 0, 1, b"{oops", Utc::now());
        assert_eq!((d.payload.as_str(), d.payload_truncated), ("{oops", false));
        assert_eq!(
            d.payload_sha256,
            // sha256("{oops"), from `printf '{oops' | sha256sum`.
            "935aaf3a54c0648c74df48a8025f20086019843f5b9fbffe5540b9cba0edcc97"
        );
    }

    #[test]
    fn dlq_message_and_topic_are_bounded() {
        let long = Rejection::new(RejectionReason::BadCommand, "m".repeat(100_000));
        let d = DlqRecord::new(&long, &"t".repeat(10_000), 0, 1, b"", Utc::now());
        assert_eq!(d.message.len(), DLQ_MESSAGE_MAX_BYTES);
        assert_eq!(d.topic.len(), MAX_TOPIC_BYTES);
        assert!(d.to_json().len() <= DLQ_RECORD_MAX_BYTES);
    }

    #[test]
    fn traceparents_are_checked_as_w3c_says() {
        for ok in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            // A later version may add fields after a dash.
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert!(headers::is_valid_traceparent(ok), "{ok}");
        }
        for bad in [
            "",
            "00-abc-01",
            // All-zero ids are invalid.
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            // Uppercase hex, a version 00 with more, version ff.
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // Control characters or spaces (no valid header value).
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-a b",
            "00_0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331_01",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
        ] {
            assert!(!headers::is_valid_traceparent(bad), "{bad:?}");
        }
    }
}
