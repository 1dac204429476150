//! An operator's command (resolve, approve, deny), bound to the run it decides.

use super::{Apply, GateCore, Out};
use crate::contract::{
    Action, ApprovalEvent, ApprovalKind, Command, ErrorBody, Outcome, Rejection, RejectionReason,
    Texts,
};
use crate::kafka::Input;
use crate::state::{OperatorEntry, Phase, StateError, StepRecord};

impl GateCore {
    /// An operator's command: settle an in-doubt step, approve or deny a held one.
    /// A command that does not fit the step's state goes to the DLQ, with why.
    pub(super) fn apply_command(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let payload = input.payload.as_deref().unwrap_or_default();
        let command: Command = match serde_json::from_slice(payload) {
            Ok(c) => c,
            Err(e) => {
                let message = format!("unreadable operator command: {e}");
                self.reject(
                    input,
                    Rejection::new(RejectionReason::BadCommand, message),
                    ax.now_ms,
                );
                return Ok(());
            }
        };
        let Some(mut record) = self.command_target(ax, input, &command)? else {
            return Ok(());
        };
        let action = command.action.as_str();
        // The operator's decision as a span of the step's trace (the agent's
        // span recorded with it); an approved call runs under it.
        let traced = self.metrics.traces().command(
            &record.step,
            action,
            &command.by,
            record.traceparent.as_deref(),
        );
        record.operator_log.push(OperatorEntry {
            id: command.id.clone(),
            action: action.to_owned(),
            by: command.by.clone(),
            at: command.at.clone(),
            reason: command.reason.clone(),
            from: record.phase,
        });
        match &command.action {
            Action::ResolveExecuted { .. } | Action::ResolveFailed | Action::ResolveNotExecuted => {
                self.resolve(ax, p, &command, record)?
            }
            Action::Approve => self.approve(ax, p, &command, record, traced.traceparent())?,
            Action::Deny => self.deny(ax, p, &command, record)?,
        }
        self.metrics
            .operator_command(&command.step, action, &command.by, None);
        Ok(())
    }

    /// The step a command decides about, if it applies to it: the step's
    /// current run, in the phase the action acts on. One that does not is
    /// refused with why (a command already applied, re-sent, is skipped).
    fn command_target(
        &mut self,
        ax: &Apply<'_>,
        input: &Input,
        command: &Command,
    ) -> Result<Option<StepRecord>, StateError> {
        let p = input.partition;
        let action = command.action.as_str();
        let Some(record) = ax.step(p, &command.step)? else {
            let problem = format!(
                "no step {} in partition {p} (never recorded, purged, or the command went to the wrong partition)",
                command.step
            );
            self.bad_command(input, command, &problem, ax.now_ms);
            return Ok(None);
        };
        // Applied already (the command was re-sent): nothing more to do.
        if record.operator_log.iter().any(|e| e.id == command.id) {
            return Ok(None);
        }
        // Bound to the run the operator looked at: a step re-run (or
        // re-created after a purge) since then is not what they decided about.
        if let Some(run) = command.run
            && (run.dispatch != record.dispatch || run.intended_at_ms != record.intended_at_ms)
        {
            let problem = format!(
                "stale command: `{action}` was decided about run {} (recorded at {} ms) of step {}, but the step's current run is {} (recorded at {} ms, {}): look at the step again and decide about the current run",
                run.dispatch,
                run.intended_at_ms,
                command.step,
                record.dispatch,
                record.intended_at_ms,
                record.phase.as_str()
            );
            self.metrics
                .operator_command(&command.step, action, &command.by, Some(&problem));
            let rejection = Rejection::new(RejectionReason::StaleCommand, problem);
            self.reject(input, rejection, ax.now_ms);
            return Ok(None);
        }
        let wanted = Phase::acted_on_by(&command.action);
        if record.phase != wanted {
            let problem = format!(
                "`{action}` applies to a step that is {}; step {} is {}",
                wanted.as_str(),
                command.step,
                record.phase.as_str()
            );
            self.bad_command(input, command, &problem, ax.now_ms);
            return Ok(None);
        }
        Ok(Some(record))
    }

    /// A resolution: the operator accounts for every run of the step, and
    /// settles it as executed, failed or not executed.
    fn resolve(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        command: &Command,
        mut record: StepRecord,
    ) -> Result<(), StateError> {
        record.open_dispatches.clear();
        record.settled_through = record.dispatch;
        let tool = &command.step.tool;
        let error = |kind: &str, message| Outcome::Error {
            error: ErrorBody {
                kind: kind.into(),
                message,
            },
        };
        let (outcome, phase) = match &command.action {
            Action::ResolveExecuted { output } => (
                Outcome::Ok {
                    output: output.clone(),
                },
                Phase::Completed,
            ),
            Action::ResolveFailed => (
                error(
                    "tool_failed",
                    Texts::resolved_failed(tool, command.reason.as_deref()),
                ),
                Phase::Completed,
            ),
            _ => (
                error("not_executed", Texts::resolved_not_executed(tool)),
                Phase::NotExecuted,
            ),
        };
        self.settle(ax, p, record, outcome, phase)
    }

    /// An approval: the held call starts, its call carrying `parent` (the
    /// operator's decision's span).
    fn approve(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        command: &Command,
        mut record: StepRecord,
        parent: Option<String>,
    ) -> Result<(), StateError> {
        self.outs.push(Out::Approval {
            partition: p,
            event: decided(
                command,
                ApprovalKind::Approved {
                    by: command.by.clone(),
                    reason: command.reason.clone(),
                },
            ),
        });
        self.metrics
            .step_forwarded(&record.step, record.category.as_str());
        self.start(p, &mut record, ax.now_ms, parent);
        ax.put_step(p, &record)
    }

    /// A denial: the held call is answered as an error, never run.
    fn deny(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        command: &Command,
        record: StepRecord,
    ) -> Result<(), StateError> {
        self.outs.push(Out::Approval {
            partition: p,
            event: decided(
                command,
                ApprovalKind::Denied {
                    by: command.by.clone(),
                    reason: command.reason.clone(),
                },
            ),
        });
        let outcome = Outcome::Error {
            error: ErrorBody {
                kind: "denied".into(),
                message: Texts::denied(&command.step.tool, command.reason.as_deref()),
            },
        };
        self.settle(ax, p, record, outcome, Phase::Completed)
    }

    pub(super) fn bad_command(
        &mut self,
        input: &Input,
        command: &Command,
        problem: &str,
        now_ms: i64,
    ) {
        self.metrics.operator_command(
            &command.step,
            command.action.as_str(),
            &command.by,
            Some(problem),
        );
        let rejection = Rejection::new(RejectionReason::BadCommand, problem.to_owned());
        self.reject(input, rejection, now_ms);
    }
}

/// The approval event of an operator's decision about a held call.
fn decided(command: &Command, event: ApprovalKind) -> ApprovalEvent {
    ApprovalEvent {
        step: command.step.clone(),
        event,
        at: command.at.clone(),
    }
}
