//! In-doubt steps that settle themselves where the tool can be asked (its
//! `reconcile` lookup, `tools/reconcile.rs`), and the structured `in_doubt`
//! of every in-doubt answer.
//!
//! When a step of such a tool goes in doubt, the reconciler is settling it:
//! lookups start at its times (`every`, doubling, until `until`), run in the
//! invoker like tool calls — never on the gate's loop — and their answers come
//! back as outcomes, settled here, in the gate's transaction. A lookup that
//! reports the effect settles the step `ok` with its output; one that reports
//! nothing happened settles it `not_executed` (its next call runs it, with
//! the same key); unknown or failed answers are asked again, and past `until`
//! the step is left to a person with every answer as evidence. A settlement is
//! a decision like an operator's: in the step's `operator_log`, and a Command
//! v1 on `commands` (by [`RECONCILER`], with its evidence) for the audit and
//! the console — which the gate reads back as already applied.

use super::{Apply, GateCore, Out, When, at, ms};
use crate::contract::{
    Action, Arguments, Call, Command, ErrorBody, IN_DOUBT_VERSION, InDoubt, Learn, LookupEvidence,
    Outcome, Progress, ProgressEvent, Run, Settler, Texts, ToolResult, timestamp,
};
use crate::state::{MAX_LOOKUPS_KEPT, OperatorEntry, Phase, Reconciling, StateError, StepRecord};
use crate::tools::reconcile::LookupAnswer;

/// Who a reconciler's settlement is by, in the operator log, its command and
/// the audit.
const RECONCILER: &str = crate::contract::RECONCILER_BY;

impl GateCore {
    /// An in-doubt answer being settled: its structured `in_doubt` and, for
    /// a tool with a `reconcile` lookup, the reconciler taking the step on
    /// (the model is told a repeat of the step returns the outcome).
    pub(super) fn describe_in_doubt(
        &self,
        record: &mut StepRecord,
        result: &mut ToolResult,
        now_ms: i64,
    ) {
        let lookup = self
            .tools
            .get(&record.step.tool)
            .and_then(|t| t.reconcile.as_ref());
        let mut until = None;
        if let Some(r) = lookup
            && record.reconcile.is_none()
        {
            let until_ms = now_ms.saturating_add(ms(r.until()));
            until = Some(timestamp(at(until_ms)));
            record.reconcile = Some(Reconciling {
                since_ms: now_ms,
                until_ms,
                asked: 0,
                settling: Settler::Reconciler,
                lookups: Vec::new(),
            });
            if let Some(e) = result.error.as_mut() {
                e.message = Texts::in_doubt_reconciling(
                    &record.step.tool,
                    until.as_deref().unwrap_or_default(),
                );
            }
        }
        let settling = match &record.reconcile {
            Some(r) => r.settling,
            None => Settler::Person,
        };
        result.in_doubt = Some(InDoubt {
            version: IN_DOUBT_VERSION,
            idempotency_key: record.step.idempotency_key(),
            since: timestamp(at(now_ms)),
            settling,
            until,
            learn: Learn::RepeatStep,
        });
    }

    /// After a step was settled in doubt: the reconciler's first lookup due.
    pub(super) fn schedule_lookup(&mut self, p: i32, record: &mut StepRecord) {
        let Some(r) = &record.reconcile else {
            return;
        };
        if record.phase != Phase::InDoubt || r.settling != Settler::Reconciler {
            return;
        }
        let Some(cfg) = self
            .tools
            .get(&record.step.tool)
            .and_then(|t| t.reconcile.as_ref())
        else {
            return;
        };
        let next = r
            .since_ms
            .saturating_add(ms(cfg.ask_at(r.asked + 1)))
            .min(r.until_ms);
        record.deadline_ms = Some(next);
        self.due.insert((next, p, record.step.clone()));
    }

    /// An in-doubt step's time came: ask the tool (a lookup, started at once
    /// in the invoker), or — past `until`, or with no lookup configured any
    /// more — leave the step to a person.
    pub(super) fn lookup_due(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        mut record: StepRecord,
    ) -> Result<(), StateError> {
        let Some(mut r) = record.reconcile.clone() else {
            return Ok(());
        };
        if r.settling != Settler::Reconciler {
            return Ok(());
        }
        let cfg = self
            .tools
            .get(&record.step.tool)
            .and_then(|t| t.reconcile.clone());
        let Some(cfg) = cfg.filter(|_| ax.now_ms < r.until_ms) else {
            return self.leave_to_person(ax, p, record, r);
        };
        r.asked += 1;
        let body = serde_json::json!({
            "workflow_id": record.step.workflow_id,
            "step_index": record.step.step_index,
            "tool": record.step.tool,
            "attempt": record.step.attempt,
            "idempotency_key": record.step.idempotency_key(),
            "arguments": record.arguments.to_value(),
            "in_doubt_since": timestamp(at(r.since_ms)),
            "ask": r.asked,
        });
        let body = Arguments::try_from(body).unwrap_or_else(|_| Arguments::empty());
        // At once, like a fast path's call: a lookup records nothing first.
        self.outs.push(Out::Invoke {
            partition: p,
            call: Call::lookup(record.step.clone(), body, r.asked),
            when: When::Now,
        });
        // The next ask at its time; never before this one had its time to
        // answer, and the last one's answer still counts before `until`.
        let answered_by = ax.now_ms.saturating_add(ms(cfg.timeout()));
        let next = r
            .since_ms
            .saturating_add(ms(cfg.ask_at(r.asked + 1)))
            .max(answered_by)
            .min(r.until_ms.max(answered_by));
        record.deadline_ms = Some(next);
        self.due.insert((next, p, record.step.clone()));
        record.reconcile = Some(r);
        ax.put_step(p, &record)
    }

    /// A reconcile lookup's answer (from this process's invoker): settle the
    /// step as executed or not, or keep the answer as evidence and ask again
    /// at the next time.
    pub(super) fn on_lookup_answer(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        progress: Progress,
    ) -> Result<(), StateError> {
        let Some(ask) = progress.lookup_ask() else {
            return Ok(());
        };
        // Never left the process (its partition moved): the next time asks.
        let ProgressEvent::Finished { outcome } = progress.event else {
            return Ok(());
        };
        let Some(mut record) = ax.step(p, &progress.step)? else {
            return Ok(());
        };
        let Some(mut r) = record.reconcile.clone() else {
            return Ok(());
        };
        if record.phase != Phase::InDoubt {
            return Ok(()); // settled meanwhile (a person, or an earlier answer)
        }
        let answer = LookupAnswer::of(&outcome);
        self.metrics
            .lookup_answered(&record.step, ask, answer.as_str());
        let detail = match &answer {
            LookupAnswer::Failed(why) => Some(Texts::excerpt(why)),
            _ => None,
        };
        r.lookups.push(LookupEvidence {
            ask,
            at: timestamp(at(ax.now_ms)),
            answer: answer.as_str().to_owned(),
            detail,
        });
        if let Some(over) = r.lookups.len().checked_sub(MAX_LOOKUPS_KEPT) {
            r.lookups.drain(..over);
        }
        // Left to a person already: the answer is evidence for them.
        let settles = r.settling == Settler::Reconciler;
        record.reconcile = Some(r);
        match answer {
            LookupAnswer::Executed(output) if settles => {
                let why = format!(
                    "the tool's reconcile lookup (ask {ask}) reported that the call took effect"
                );
                self.reconciled(
                    ax,
                    p,
                    &mut record,
                    ask,
                    Action::ResolveExecuted {
                        output: output.clone(),
                    },
                    why,
                );
                self.metrics.reconciled(&record.step, "executed");
                self.settle(ax, p, record, Outcome::Ok { output }, Phase::Completed)
            }
            LookupAnswer::NotExecuted if settles => {
                let why = format!(
                    "the tool's reconcile lookup (ask {ask}) reported that the call did not take effect"
                );
                self.reconciled(ax, p, &mut record, ask, Action::ResolveNotExecuted, why);
                self.metrics.reconciled(&record.step, "not_executed");
                let outcome = Outcome::Error {
                    error: ErrorBody {
                        kind: "not_executed".into(),
                        message: Texts::reconciled_not_executed(&record.step.tool),
                    },
                };
                self.settle(ax, p, record, outcome, Phase::NotExecuted)
            }
            _ => ax.put_step(p, &record),
        }
    }

    /// Record the reconciler's settlement as a decision: in the operator
    /// log, and as a Command v1 with its evidence (for the audit and the
    /// console; the gate reads it back as already applied).
    fn reconciled(
        &mut self,
        ax: &Apply<'_>,
        p: i32,
        record: &mut StepRecord,
        ask: u32,
        action: Action,
        why: String,
    ) {
        let id = format!(
            "{RECONCILER}-{}-{}-{ask}",
            record.intended_at_ms, record.dispatch
        );
        let now = timestamp(at(ax.now_ms));
        record.operator_log.push(OperatorEntry {
            id: id.clone(),
            action: action.as_str().to_owned(),
            by: RECONCILER.to_owned(),
            at: now.clone(),
            reason: Some(why.clone()),
            from: Phase::InDoubt,
        });
        // The lookup accounts for every run of the step, as an operator does.
        record.open_dispatches.clear();
        record.settled_through = record.dispatch;
        self.outs.push(Out::Command {
            partition: p,
            command: Command {
                id,
                step: record.step.clone(),
                action,
                by: RECONCILER.to_owned(),
                at: now,
                reason: Some(why),
                run: Some(Run {
                    dispatch: record.dispatch,
                    intended_at_ms: record.intended_at_ms,
                }),
                arguments_sha256: None,
                policy_version: None,
                evidence: record.reconcile.as_ref().map(|r| r.lookups.clone()),
            },
        });
    }

    /// The lookups could not tell by `until`: a person settles the step. Its
    /// stored answer (what later repeats get) says so from now on.
    fn leave_to_person(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        mut record: StepRecord,
        mut r: Reconciling,
    ) -> Result<(), StateError> {
        r.settling = Settler::Person;
        let asked = r.asked;
        record.reconcile = Some(r);
        record.deadline_ms = None;
        if let Some(result) = record.result.as_mut() {
            if let Some(d) = result.in_doubt.as_mut() {
                d.settling = Settler::Person;
                d.until = None;
            }
            if let Some(e) = result.error.as_mut() {
                e.message = Texts::in_doubt_unsettled(&record.step.tool, asked);
            }
        }
        self.metrics.reconciled(&record.step, "to_person");
        ax.put_step(p, &record)
    }
}
