//! The parts of the contract about steps a person or a program still has to
//! settle: the structured `in_doubt` of Result v1, and the evidence a
//! reconciler's settlement carries.

use serde::{Deserialize, Serialize};

/// Who a settlement by stepgate's reconciler is by: its Command v1 `by` and
/// its operator-log entry (a person's decision carries their name).
pub const RECONCILER_BY: &str = "stepgate:reconciler";

/// The version of [`InDoubt`]'s shape: a field may be added without a change;
/// one removed or changed in meaning takes a new number.
pub const IN_DOUBT_VERSION: u32 = 1;

/// Result v1 `in_doubt`: present exactly when `status` is `in_doubt`, for a
/// program to act on without parsing `error.message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InDoubt {
    /// [`IN_DOUBT_VERSION`].
    pub version: u32,
    /// The idempotency key the call carried (`Idempotency-Key`): what to look
    /// the call up by at the provider.
    pub idempotency_key: String,
    /// When the step was declared in doubt (RFC 3339, UTC, milliseconds).
    pub since: String,
    /// Who is settling it now.
    pub settling: Settler,
    /// With `settling: reconciler`: when stepgate stops asking the tool and
    /// leaves the step to a person, if nothing settled it before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// How to learn the resolution: always [`Learn::RepeatStep`] — a repeat
    /// of this step (same workflow, step index, tool and attempt) returns the
    /// settled answer once there is one, and this same answer before.
    pub learn: Learn,
}

/// Who settles an in-doubt step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settler {
    /// An operator (`stepgate resolve`, the console's In doubt page).
    Person,
    /// stepgate asks the tool's `reconcile` lookup what happened.
    Reconciler,
}

impl Settler {
    pub fn as_str(self) -> &'static str {
        match self {
            Settler::Person => "person",
            Settler::Reconciler => "reconciler",
        }
    }
}

/// How a caller learns how an in-doubt step was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Learn {
    /// Send the same step again: it is answered from the step's record.
    RepeatStep,
}

/// One answer of a tool's reconcile lookup, as a settlement's evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupEvidence {
    /// Which lookup of the step it was (1 for the first).
    pub ask: u32,
    /// When its answer arrived (RFC 3339).
    pub at: String,
    /// `executed`, `not_executed`, `unknown`, or `failed` (the lookup itself
    /// did not answer usably).
    pub answer: String,
    /// What the lookup said or why it failed, in brief.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}
