//! What operators send the gate (topic `commands`) and what the gate tells them
//! about calls awaiting approval (topic `approvals`). Both are keyed by
//! `workflow_id` and written to the partition number of the step they concern,
//! so the gate that owns the step reads the command in order with its intents.

use super::{LookupEvidence, StepKey};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Command v1: an operator's decision about one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    /// Unique per command: how its author recognises it in the step's log.
    pub id: String,
    #[serde(flatten)]
    pub step: StepKey,
    #[serde(flatten)]
    pub action: Action,
    /// Who decided (a person or a system), for audit.
    pub by: String,
    /// When it was decided (RFC 3339).
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The run of the step this decision is about, as the operator saw it:
    /// the record's `dispatch` and `intended_at_ms`. When the step moved on
    /// (re-run, re-created after a purge) the command is refused as
    /// `stale_command` instead of deciding a run nobody looked at. Commands
    /// without it apply to whatever run is current (hand-written ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<Run>,
    /// `approve`/`deny`: the held call's `arguments_sha256` as the person
    /// was shown it (its approval event's). A decision about other bytes
    /// than the held call's is refused (`stale_command`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments_sha256: Option<String>,
    /// `approve`/`deny`: the tool's `policy_version` as the person was shown
    /// it. Refused when the call was held under another version; when the
    /// gate's tool changed since the call was held, it is asked for again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// A settlement by stepgate's reconciler: the lookups' answers it rests
    /// on (never read by the gate: the record of why, for the audit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<Vec<LookupEvidence>>,
}

/// Which run of a step a command decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// The step record's `dispatch`.
    pub dispatch: u32,
    /// The step record's `intended_at_ms` (when the record was created).
    pub intended_at_ms: i64,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// An in-doubt step did take effect; `output` becomes its `ok` answer.
    ResolveExecuted { output: Value },
    /// An in-doubt step did not take effect; its next call runs it.
    ResolveNotExecuted,
    /// An in-doubt step ran and failed without effect; the command's `reason`
    /// (what the person found) becomes its `error` answer, and it is not run
    /// again for this step.
    ResolveFailed,
    /// A call awaiting approval may run.
    Approve,
    /// A call awaiting approval must not run.
    Deny,
}

impl Action {
    pub fn as_str(&self) -> &'static str {
        match self {
            Action::ResolveExecuted { .. } => "resolve_executed",
            Action::ResolveNotExecuted => "resolve_not_executed",
            Action::ResolveFailed => "resolve_failed",
            Action::Approve => "approve",
            Action::Deny => "deny",
        }
    }
}

/// Approval v1: a call waiting for a person, or the decision about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalEvent {
    #[serde(flatten)]
    pub step: StepKey,
    #[serde(flatten)]
    pub event: ApprovalKind,
    /// When this happened (RFC 3339).
    pub at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ApprovalKind {
    /// A call that runs only once a person approves it.
    Requested {
        arguments: Map<String, Value>,
        call_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metadata: Option<Map<String, Value>>,
        /// SHA-256 (lowercase hex) of the arguments' bytes exactly as the
        /// tool receives them; a decision may carry it back, and one about
        /// other bytes is refused.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        arguments_sha256: Option<String>,
        /// The tool's policy version the call is held under.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        policy_version: Option<String>,
        /// When the hold expires unanswered (RFC 3339), with `approval_ttl`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at: Option<String>,
        /// When it is escalated (RFC 3339), with `escalate_after`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        escalate_at: Option<String>,
    },
    /// Nobody decided by the tool's `escalate_after`: whoever is paged next
    /// should look.
    Escalated {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at: Option<String>,
    },
    /// The hold expires soon (`notify.expiring_before` ahead of it).
    Expiring { expires_at: String },
    /// Nobody decided by the tool's `approval_ttl`: answered `approval_expired`,
    /// nothing ran; a later decision is refused.
    Expired {
        /// The hold's time to live, as configured (`"30m"`).
        ttl: String,
    },
    Approved {
        by: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    Denied {
        by: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}
