//! A held call's lifecycle (`policy = "approval"`): its terms (the argument
//! bytes and the tool's policy version a person approves), its times
//! (`escalate_after`, `notify.expiring_before`, `approval_ttl`), and which
//! decisions it refuses. All of it is decided here, in the gate's
//! transaction — the gate is the only writer of a step's state — so an
//! approval and the expiry read in one batch are ordered by that batch: the
//! first one read wins, and the other is refused or finds nothing to do.

use super::{Apply, GateCore, Out, at, ms};
use crate::contract::{
    Action, ApprovalEvent, ApprovalKind, Command, ErrorBody, Outcome, Rejection, RejectionReason,
    Texts, timestamp,
};
use crate::kafka::Input;
use crate::state::{Hold, Phase, StateError, StepRecord};
use crate::tools::ToolConfig;

/// The hold's lifecycle events, as `Hold::told` records them.
const ESCALATED: &str = "escalated";
const EXPIRING: &str = "expiring";
const EXPIRED: &str = "expired";

/// SHA-256 (lowercase hex) of a call's argument bytes, as the tool receives them.
pub(crate) fn arguments_sha256(record: &StepRecord) -> String {
    use sha2::{Digest, Sha256};
    crate::contract::hex(&Sha256::digest(record.arguments.as_str().as_bytes()))
}

impl GateCore {
    /// Hold a step of an approval tool for a person: its terms and times on
    /// the record, its next time due, and the `requested` event.
    pub(super) fn hold_for_approval(
        &mut self,
        p: i32,
        tool: &ToolConfig,
        record: &mut StepRecord,
        now_ms: i64,
    ) {
        let (ttl, escalate) = tool.approval_times(&record.step.workflow_id);
        let expires_at_ms = ttl.map(|t| now_ms.saturating_add(ms(t)));
        let expiring_at_ms = match (expires_at_ms, self.settings.expiring_before) {
            (Some(e), Some(before)) if ttl.is_some_and(|t| t > before) => Some(e - ms(before)),
            _ => None,
        };
        let hold = Hold {
            since_ms: now_ms,
            arguments_sha256: arguments_sha256(record),
            policy_version: tool.policy_version(),
            expires_at_ms,
            ttl: ttl.map(|t| humantime::format_duration(t).to_string()),
            escalate_at_ms: escalate.map(|e| now_ms.saturating_add(ms(e))),
            expiring_at_ms,
            told: Vec::new(),
        };
        self.metrics.approval_requested(&record.step);
        self.outs.push(Out::Approval {
            partition: p,
            event: ApprovalEvent {
                step: record.step.clone(),
                event: ApprovalKind::Requested {
                    arguments: record.arguments.to_map(),
                    call_id: record.call_id.clone(),
                    metadata: record.metadata.clone(),
                    arguments_sha256: Some(hold.arguments_sha256.clone()),
                    policy_version: Some(hold.policy_version.clone()),
                    expires_at: hold.expires_at_ms.map(|t| timestamp(at(t))),
                    escalate_at: hold.escalate_at_ms.map(|t| timestamp(at(t))),
                },
                at: timestamp(at(now_ms)),
            },
        });
        record.phase = Phase::AwaitingApproval;
        record.deadline_ms = hold.next_at_ms();
        if let Some(d) = record.deadline_ms {
            self.due.insert((d, p, record.step.clone()));
        }
        record.hold = Some(hold);
    }

    /// A step's time that is not a started call's deadline came: a held
    /// call's lifecycle, or an in-doubt step's next lookup.
    pub(super) fn lifecycle_due(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        record: StepRecord,
    ) -> Result<(), StateError> {
        match record.phase {
            Phase::AwaitingApproval => self.hold_due(ax, p, record),
            Phase::InDoubt => self.lookup_due(ax, p, record),
            _ => Ok(()),
        }
    }

    /// A held call's time came: escalate it, warn of its expiry, or expire
    /// it; held under a policy the tool no longer has, ask again.
    pub(super) fn hold_due(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        mut record: StepRecord,
    ) -> Result<(), StateError> {
        let Some(mut hold) = record.hold.clone() else {
            return Ok(());
        };
        let now = ax.now_ms;
        if let Some(tool) = self.tools.get(&record.step.tool).cloned()
            && tool.policy_version() != hold.policy_version
        {
            self.ask_again(p, &tool, &mut record, now);
            return ax.put_step(p, &record);
        }
        if hold.expires_at_ms.is_some_and(|e| now >= e) {
            return self.expire(ax, p, record);
        }
        let mut events = Vec::new();
        if hold.escalate_at_ms.is_some_and(|e| now >= e) && !hold.told(ESCALATED) {
            hold.told.push(ESCALATED.into());
            events.push(ApprovalKind::Escalated {
                expires_at: hold.expires_at_ms.map(|t| timestamp(at(t))),
            });
            self.metrics.approval_event(&record.step, ESCALATED);
        }
        if let (Some(w), Some(e)) = (hold.expiring_at_ms, hold.expires_at_ms)
            && now >= w
            && !hold.told(EXPIRING)
        {
            hold.told.push(EXPIRING.into());
            events.push(ApprovalKind::Expiring {
                expires_at: timestamp(at(e)),
            });
            self.metrics.approval_event(&record.step, EXPIRING);
        }
        for event in events {
            self.outs.push(Out::Approval {
                partition: p,
                event: ApprovalEvent {
                    step: record.step.clone(),
                    event,
                    at: timestamp(at(now)),
                },
            });
        }
        record.deadline_ms = hold.next_at_ms();
        if let Some(d) = record.deadline_ms {
            self.due.insert((d, p, record.step.clone()));
        }
        record.hold = Some(hold);
        ax.put_step(p, &record)
    }

    /// Nobody decided in time: the call is answered `approval_expired`
    /// (nothing ran), and every later decision is refused.
    fn expire(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        mut record: StepRecord,
    ) -> Result<(), StateError> {
        let Some(mut hold) = record.hold.take() else {
            return Ok(());
        };
        let ttl = hold.ttl.clone().unwrap_or_default();
        hold.told.push(EXPIRED.into());
        record.hold = Some(hold);
        self.metrics.approval_event(&record.step, EXPIRED);
        self.outs.push(Out::Approval {
            partition: p,
            event: ApprovalEvent {
                step: record.step.clone(),
                event: ApprovalKind::Expired { ttl: ttl.clone() },
                at: timestamp(at(ax.now_ms)),
            },
        });
        let outcome = Outcome::Error {
            error: ErrorBody {
                kind: "approval_expired".into(),
                message: Texts::approval_expired(&record.step.tool, &ttl),
            },
        };
        self.settle(ax, p, record, outcome, Phase::Completed)
    }

    /// Held under a policy the tool no longer has: held again, under the
    /// policy in force, with new times and a new `requested` event.
    fn ask_again(&mut self, p: i32, tool: &ToolConfig, record: &mut StepRecord, now_ms: i64) {
        self.metrics.approval_event(&record.step, "asked_again");
        self.hold_for_approval(p, tool, record, now_ms);
    }

    /// Whether an `approve`/`deny` is refused by the call's hold (it was
    /// dead-lettered then, with why): after the expiry (which this decides
    /// first, if the hold's time passed and no tick has seen it yet), by the
    /// principal that sent the call, about other terms than the held call's,
    /// or an approval under a policy the tool no longer has (the call is
    /// asked for again).
    pub(super) fn decision_refused(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        command: &Command,
        record: &StepRecord,
    ) -> Result<bool, StateError> {
        if !matches!(command.action, Action::Approve | Action::Deny) {
            return Ok(false);
        }
        let p = input.partition;
        let action = command.action.as_str();
        let step = &command.step;
        let Some(hold) = record.hold.clone() else {
            return Ok(false);
        };
        let expired_at = hold.expires_at_ms.map(|t| timestamp(at(t)));
        let expired_before = record.phase == Phase::Completed && hold.told(EXPIRED);
        let expires_now = record.phase == Phase::AwaitingApproval
            && hold.expires_at_ms.is_some_and(|e| ax.now_ms >= e);
        if expires_now {
            // Its time passed before this decision was read: it expires now,
            // in this transaction, and the decision comes too late.
            self.expire(ax, p, record.clone())?;
        }
        if expired_before || expires_now {
            let problem = format!(
                "`{action}` of {step} refused: the call's approval expired at {} (after {}) before this decision was read: it was answered `approval_expired` and nothing ran. A new call of the tool asks for approval again.",
                expired_at.as_deref().unwrap_or("?"),
                hold.ttl.as_deref().unwrap_or("?")
            );
            self.refuse(
                input,
                command,
                RejectionReason::ApprovalExpired,
                problem,
                ax.now_ms,
            );
            return Ok(true);
        }
        if record.phase != Phase::AwaitingApproval {
            return Ok(false);
        }
        let sender = record
            .metadata
            .as_ref()
            .and_then(|m| m.get(crate::mcp::auth::PRINCIPAL_METADATA))
            .and_then(|v| v.as_str());
        if sender.is_some_and(|s| s == command.by) {
            let problem = format!(
                "`{action}` of {step} refused: it is decided by `{}`, the principal that sent the call. Nobody decides their own call: another person must.",
                command.by
            );
            self.refuse(
                input,
                command,
                RejectionReason::SelfDecision,
                problem,
                ax.now_ms,
            );
            return Ok(true);
        }
        let differs =
            |sent: &Option<String>, held: &str| sent.as_deref().is_some_and(|s| s != held);
        if differs(&command.arguments_sha256, &hold.arguments_sha256)
            || differs(&command.policy_version, &hold.policy_version)
        {
            let problem = format!(
                "`{action}` of {step} refused: it was decided about other terms than the held call's (arguments {}, policy {}; decided about arguments {}, policy {}): look at the held call again and decide about it",
                hold.arguments_sha256,
                hold.policy_version,
                command.arguments_sha256.as_deref().unwrap_or("-"),
                command.policy_version.as_deref().unwrap_or("-"),
            );
            self.refuse(
                input,
                command,
                RejectionReason::StaleCommand,
                problem,
                ax.now_ms,
            );
            return Ok(true);
        }
        if command.action == Action::Approve
            && let Some(tool) = self.tools.get(&step.tool).cloned()
            && tool.policy_version() != hold.policy_version
        {
            let mut record = record.clone();
            self.ask_again(p, &tool, &mut record, ax.now_ms);
            ax.put_step(p, &record)?;
            let problem = format!(
                "`approve` of {step} refused: the tool's policy changed since the call was held (version {} then, {} now). It is held again under the policy in force: look at it again and decide.",
                hold.policy_version,
                tool.policy_version()
            );
            self.refuse(
                input,
                command,
                RejectionReason::StaleCommand,
                problem,
                ax.now_ms,
            );
            return Ok(true);
        }
        Ok(false)
    }

    fn refuse(
        &mut self,
        input: &Input,
        command: &Command,
        reason: RejectionReason,
        problem: String,
        now_ms: i64,
    ) {
        self.metrics.operator_command(
            &command.step,
            command.action.as_str(),
            &command.by,
            Some(&problem),
        );
        self.reject(input, Rejection::new(reason, problem), now_ms);
    }
}
