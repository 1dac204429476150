//! What the gate remembers about a step.

use crate::contract::{Action, Arguments, Outcome, StepKey, ToolResult};
use crate::kafka;
use crate::tools::Category;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Where a step is in its lifecycle (`docs/design.md` "Step lifecycle").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Recorded durably (committed) before the tool is invoked: the call may
    /// have taken effect from here on. `intended` and `started` are one record.
    Started,
    /// The outcome (ok or error) is stored in `result`.
    Completed,
    /// Started, no outcome known: may have taken effect. Stored like an outcome.
    InDoubt,
    /// Waiting for a person's approval (`policy = "approval"`): not forwarded yet.
    AwaitingApproval,
    /// An operator confirmed an in-doubt call did not take effect: the step's
    /// next call runs it.
    NotExecuted,
    /// A `keyed` step whose last run could not reach its tool, while an
    /// earlier run (by this process or one it cannot see) may have: answered
    /// so, and the step's next call asks the tool again with the same key,
    /// which answers with the earlier effect if there was one. Never a
    /// person's job.
    Unreached,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Started => "started",
            Phase::Completed => "completed",
            Phase::InDoubt => "in_doubt",
            Phase::AwaitingApproval => "awaiting_approval",
            Phase::NotExecuted => "not_executed",
            Phase::Unreached => "unreached",
        }
    }

    /// Whether the step's next call runs it again (an operator confirmed it
    /// did not take effect, or a keyed tool could not be reached: asked
    /// again with the same key).
    pub fn runs_again(self) -> bool {
        matches!(self, Phase::NotExecuted | Phase::Unreached)
    }

    /// Where an executor's outcome leaves a step.
    pub fn settled_by(outcome: &Outcome) -> Phase {
        match outcome {
            Outcome::InDoubt { .. } => Phase::InDoubt,
            _ => Phase::Completed,
        }
    }

    /// The only phase an operator's action applies to.
    pub fn acted_on_by(action: &Action) -> Phase {
        match action {
            Action::ResolveExecuted { .. } | Action::ResolveNotExecuted | Action::ResolveFailed => {
                Phase::InDoubt
            }
            Action::Approve | Action::Deny => Phase::AwaitingApproval,
        }
    }

    /// Nobody has settled it yet: it may have taken effect and its answer is
    /// not final (or a person still has to decide). Never purged by retention.
    pub fn unresolved(self) -> bool {
        matches!(
            self,
            Phase::Started | Phase::InDoubt | Phase::AwaitingApproval
        )
    }

    /// No outcome yet: repeats wait for it.
    pub fn in_flight(self) -> bool {
        matches!(self, Phase::Started | Phase::AwaitingApproval)
    }
}

/// A repeat that arrived while its step was in flight, answered with the outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    pub call_id: Option<String>,
    /// When the repeat was published (its Kafka timestamp), for latency metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent_ts_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The partition its answer goes to, when not the step's: the repeat was
    /// published to another partition and re-routed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_partition: Option<i32>,
}

/// A repeat whose arguments differ from the first call's: the same step, rephrased
/// by the model. Kept for audit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RephrasedCall {
    pub call_id: Option<String>,
    pub arguments: Arguments,
    pub at_ms: i64,
}

/// An operator's decision applied to a step: who, when, what (for audit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorEntry {
    /// The command's id.
    pub id: String,
    /// `resolve_executed`, `resolve_not_executed`, `approve` or `deny`.
    pub action: String,
    pub by: String,
    /// When the operator decided (RFC 3339).
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The phase the step was in before.
    pub from: Phase,
}

/// At most this many rephrased repeats are kept per step (the count is exact).
pub const MAX_REPHRASED_KEPT: usize = 16;

/// Rephrased repeats' arguments are kept while all of them take at most this
/// many bytes (as JSON); later ones are only counted. Like the limits below, it
/// keeps a step record writable to the changelog whatever callers send: a
/// record over the producer's limit would fail every batch that carries it.
pub const REPHRASED_BUDGET_BYTES: usize = 64 * 1024;

/// At most this many repeats (distinct `call_id`s) wait for one step's outcome.
pub const MAX_WAITERS: usize = 256;

/// ... taking at most this many bytes (`call_id`s and `traceparent`s).
pub const WAITERS_BUDGET_BYTES: usize = 64 * 1024;

/// Refuse a config whose records could not be written: those derived from
/// the largest intent ([`kafka::check_sizes`]), and the largest step record — the
/// first call's arguments and metadata (up to `max_intent_bytes`), its tool's
/// answer and a late one (each up to the tool's `max_output_bytes`), the kept
/// rephrased copies and waiting repeats (bounded, see
/// [`REPHRASED_BUDGET_BYTES`]) and the envelope. A record over
/// the producer's limit would fail every batch that carried it.
pub fn check_record_sizes(cfg: &crate::config::Config) -> Result<(), kafka::KafkaSetupError> {
    kafka::check_sizes(&cfg.kafka, cfg.gate.max_intent_bytes)?;
    let producer = kafka::producer_max_bytes(&cfg.kafka)?;
    let fixed = cfg
        .gate
        .max_intent_bytes
        .saturating_add(REPHRASED_BUDGET_BYTES)
        .saturating_add(WAITERS_BUDGET_BYTES)
        .saturating_add(kafka::RECORD_ENVELOPE_BYTES);
    for (name, tool) in &cfg.tools {
        let output = usize::try_from(tool.max_output_bytes).unwrap_or(usize::MAX);
        let need = fixed.saturating_add(output.saturating_mul(2));
        if need > producer {
            return Err(kafka::KafkaSetupError::Sizes(format!(
                "`tools.{name}.max_output_bytes` is {output}: a step record of this tool holds its answer twice at most (the first and a late one) beside the intent (`gate.max_intent_bytes` {}) and {} bytes of kept repeats and envelope, up to {need} bytes, over the producer's `message.max.bytes` of {producer}. Lower it to at most {}, or lower `gate.max_intent_bytes`.",
                cfg.gate.max_intent_bytes,
                fixed - cfg.gate.max_intent_bytes,
                producer.saturating_sub(fixed) / 2
            )));
        }
    }
    Ok(())
}

/// Why a repeat of an in-flight step was not added to its waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotWaiting {
    /// Its `call_id` is already to be answered (the first call's, or a waiter's):
    /// one answer per `call_id`.
    AlreadyWaiting,
    /// [`MAX_WAITERS`] or [`WAITERS_BUDGET_BYTES`] reached: the caller is not
    /// answered with the outcome; asking again after it is answered from the record.
    OverBudget,
}

impl NotWaiting {
    pub fn as_str(self) -> &'static str {
        match self {
            NotWaiting::AlreadyWaiting => "already_waiting",
            NotWaiting::OverBudget => "over_budget",
        }
    }
}

fn waiter_bytes(w: &Waiter) -> usize {
    w.call_id.as_ref().map_or(0, String::len) + w.traceparent.as_ref().map_or(0, String::len)
}

/// The record of one step key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: StepKey,
    pub category: Category,
    pub phase: Phase,
    /// The first call's arguments: what was executed.
    pub arguments: Arguments,
    /// The first call's `call_id`.
    pub call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// How many times the call was forwarded (re-forwarded only when re-running is safe).
    pub dispatch: u32,
    pub intended_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<i64>,
    /// Past this, a started call with no outcome is in doubt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<i64>,
    /// The first answer, as sent to the first caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    /// Repeats waiting for the outcome.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiters: Vec<Waiter>,
    /// Calls of this step after the first (in flight or later).
    pub repeats: u64,
    /// How many of those had different arguments.
    pub rephrased_count: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rephrased: Vec<RephrasedCall>,
    /// The first outcome that did not settle the step — it arrived after the
    /// step was declared in doubt, or came from an older dispatch: kept whole
    /// for the operator who resolves it, never sent to the agent by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub late_outcome: Option<Outcome>,
    /// Every outcome that did not settle the step, in brief (the newest
    /// [`MAX_EVIDENCE_KEPT`]): evidence of what each dispatch did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<Evidence>,
    /// Dispatches that were started and whose outcome has not arrived (nor
    /// been settled by an operator): each may still be running, or may have
    /// taken effect. While one is open, no later dispatch's "not performed"
    /// is told to the agent as such.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_dispatches: Vec<u32>,
    /// This dispatch was handed back never invoked (its process stopped
    /// while the call waited): the step's owner runs it again at once,
    /// whatever the tool's category.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_invoked: Option<u32>,
    /// A pool tool's dispatch a worker said it took (Outcome v1 `started`):
    /// at the deadline, a current dispatch not taken was never invoked
    /// (`no_worker`), one taken is treated as a call of this process's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken: Option<u32>,
    /// Dispatches up to this one were accounted for by an operator's
    /// resolution: their evidence no longer casts doubt on a later run.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub settled_through: u32,
    pub expires_at_ms: i64,
    /// When the first call was published (its Kafka timestamp), for latency metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent_ts_ms: Option<i64>,
    /// Operators' decisions about this step, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operator_log: Vec<OperatorEntry>,
    /// The input partition the step lives in (where operator commands go).
    #[serde(default)]
    pub partition: i32,
    /// Where the first caller's answer goes, when not `partition`: its intent
    /// was published to another partition and re-routed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_partition: Option<i32>,
    /// A keyed step whose call may be sent before any commit: a process that
    /// read the same intent before this one (and crashed, or was fenced,
    /// before its commit) may have sent it too, with the same key. The tool's
    /// own answer under the key covers that run; an outcome in which nothing
    /// reached the tool (`tool_unreachable`, `tool_redirected`) does not: the
    /// step is left [`Phase::Unreached`], asked again by its next call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unseen_reader: bool,
    /// The digests of the step's newest dispatches' tokens (at most
    /// [`MAX_TOKENS_KEPT`]): a report on `progress` counts for a dispatch only
    /// with that dispatch's token, which only the call's holder has (this
    /// gate's invoker, or the pool worker that read its Call v1). The digest,
    /// not the token: who reads the changelog cannot make one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<DispatchToken>,
}

/// A dispatch's token as its step's record keeps it (see [`StepRecord::tokens`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchToken {
    pub dispatch: u32,
    /// [`token_digest`] of the token.
    pub digest: String,
}

/// At most this many dispatches' token digests are kept per step (the
/// newest): a report of an older dispatch cannot be checked and counts for
/// nothing, so that dispatch stays one that may have run.
pub const MAX_TOKENS_KEPT: usize = 16;

/// The digest of a dispatch's token, as a step record keeps it: the first
/// 128 bits of SHA-256 over a label and the token, in hex.
pub fn token_digest(token: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"stepgate-dispatch-token-v1\n");
    h.update(token.as_bytes());
    crate::contract::hex(&h.finalize()[..16])
}

/// Where dispatch tokens come from: 128 bits each, SHA-256 of a 256-bit seed
/// and a counter. The seed is the OS's randomness ([`Tokens::from_os`]); a
/// fixed one ([`Tokens::seeded`]) makes a simulation replay exactly.
pub struct Tokens {
    seed: [u8; 32],
    counter: u64,
}

impl Tokens {
    pub fn from_os() -> Tokens {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).expect("the OS's randomness is readable");
        Tokens { seed, counter: 0 }
    }

    pub fn seeded(seed: u64) -> Tokens {
        let mut s = [0u8; 32];
        s[..8].copy_from_slice(&seed.to_be_bytes());
        Tokens {
            seed: s,
            counter: 0,
        }
    }

    /// A new token: 32 lowercase hex characters.
    pub fn next_token(&mut self) -> String {
        use sha2::{Digest, Sha256};
        self.counter += 1;
        let mut h = Sha256::new();
        h.update(self.seed);
        h.update(self.counter.to_be_bytes());
        crate::contract::hex(&h.finalize()[..16])
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens(..)")
    }
}

/// An outcome that did not settle its step, in brief.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// The dispatch that produced it.
    pub dispatch: u32,
    /// `ok`, `error`, `in_doubt`, or `not_invoked` (the call never left its
    /// process).
    pub status: String,
    /// The error's kind, for a non-`ok` outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Why it did not settle the step: `stale_dispatch` (a newer dispatch is
    /// the step's current one), `after_in_doubt` or `after_settled`.
    pub why: String,
    pub at_ms: i64,
}

/// At most this many [`Evidence`] entries are kept per step (the newest).
pub const MAX_EVIDENCE_KEPT: usize = 16;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A workflow ended by a `last_step` tool: its new steps are rejected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkflowEnd {
    /// The step that ended it.
    pub step: StepKey,
    pub at_ms: i64,
}

impl StepRecord {
    /// A step's first record: dispatched once, no outcome, no repeats. Set
    /// the rest with struct update syntax (`StepRecord { call_id, ..new }`).
    pub fn new(
        step: StepKey,
        category: Category,
        phase: Phase,
        arguments: Arguments,
        partition: i32,
        at_ms: i64,
        expires_at_ms: i64,
    ) -> Self {
        StepRecord {
            step,
            category,
            phase,
            arguments,
            call_id: None,
            metadata: None,
            traceparent: None,
            dispatch: 1,
            intended_at_ms: at_ms,
            started_at_ms: None,
            deadline_ms: None,
            result: None,
            waiters: Vec::new(),
            repeats: 0,
            rephrased_count: 0,
            rephrased: Vec::new(),
            late_outcome: None,
            evidence: Vec::new(),
            open_dispatches: Vec::new(),
            not_invoked: None,
            taken: None,
            settled_through: 0,
            expires_at_ms,
            intent_ts_ms: None,
            operator_log: Vec::new(),
            partition,
            reply_partition: None,
            unseen_reader: false,
            tokens: Vec::new(),
        }
    }

    /// Keep the digest of `dispatch`'s token (the newest
    /// [`MAX_TOKENS_KEPT`] are kept).
    pub fn remember_token(&mut self, dispatch: u32, token: &str) {
        self.tokens.retain(|t| t.dispatch != dispatch);
        self.tokens.push(DispatchToken {
            dispatch,
            digest: token_digest(token),
        });
        if let Some(over) = self.tokens.len().checked_sub(MAX_TOKENS_KEPT) {
            self.tokens.drain(..over);
        }
    }

    /// Whether `token` is `dispatch`'s. A missing token, or a dispatch whose
    /// digest is not kept, is no match. (The digests are compared plainly:
    /// matching one takes a preimage of SHA-256, not timing.)
    pub fn token_matches(&self, dispatch: u32, token: Option<&str>) -> bool {
        let Some(token) = token else {
            return false;
        };
        let digest = token_digest(token);
        self.tokens
            .iter()
            .any(|t| t.dispatch == dispatch && t.digest == digest)
    }

    /// Count a repeat, keeping its arguments when the model rephrased them.
    /// Returns whether it was rephrased.
    pub fn note_repeat(
        &mut self,
        call_id: Option<String>,
        arguments: &Arguments,
        at_ms: i64,
    ) -> bool {
        self.repeats += 1;
        let rephrased = !arguments.same_as(&self.arguments);
        if rephrased {
            self.rephrased_count += 1;
            // Sized only while a copy could still be kept.
            let fits = self.rephrased.len() < MAX_REPHRASED_KEPT && {
                let kept: usize = self.rephrased.iter().map(|r| r.arguments.text_len()).sum();
                kept.saturating_add(arguments.text_len()) <= REPHRASED_BUDGET_BYTES
            };
            if fits {
                self.rephrased.push(RephrasedCall {
                    call_id,
                    arguments: arguments.clone(),
                    at_ms,
                });
            }
        }
        rephrased
    }

    /// Add a repeat that waits for the outcome, within the budgets.
    pub fn add_waiter(&mut self, w: Waiter) -> Result<(), NotWaiting> {
        if w.call_id.is_some()
            && (w.call_id == self.call_id || self.waiters.iter().any(|x| x.call_id == w.call_id))
        {
            return Err(NotWaiting::AlreadyWaiting);
        }
        let bytes: usize = self.waiters.iter().map(waiter_bytes).sum();
        if self.waiters.len() >= MAX_WAITERS
            || bytes.saturating_add(waiter_bytes(&w)) > WAITERS_BUDGET_BYTES
        {
            return Err(NotWaiting::OverBudget);
        }
        self.waiters.push(w);
        Ok(())
    }
}

/// A fast-path call in flight (read-only/idempotent tools without a step log).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FastEntry {
    pub step: StepKey,
    pub call_id: Option<String>,
    pub arguments: Arguments,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    pub dispatch: u32,
    /// Forwarded again when no answer has come by then.
    pub deadline_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent_ts_ms: Option<i64>,
    /// Where its answer goes (the partition the agent published to).
    pub reply_partition: i32,
}
