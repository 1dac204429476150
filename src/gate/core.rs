//! The gate's decisions, free of Kafka: inputs and time in, state writes and
//! messages out. One [`GateCore`] serves every partition a gate owns.

use crate::config::{Config, Policy, ToolConfig};
use crate::contract::{
    Action, Address, ApprovalEvent, ApprovalKind, Call, Command, DlqRecord, ErrorBody, Intent,
    Outcome, Progress, ProgressEvent, Rejection, RejectionReason, Status, StepKey, Texts,
    ToolResult, parse_intent,
};
pub use crate::kafka::Input;
use crate::state::{
    Batch, FastEntry, OperatorEntry, Phase, StateError, StateStore, StepRecord, Waiter, WorkflowEnd,
};
use crate::telemetry::Metrics;
use chrono::{DateTime, TimeZone, Utc};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// A message the gate wants produced (in the same transaction as its state).
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// To the executors, in the intent's partition.
    Call { partition: i32, call: Call },
    /// A final answer to an agent, in the intent's partition.
    Result {
        partition: i32,
        result: ToolResult,
        traceparent: Option<String>,
        /// When the answered intent was published, for the answer-latency metric.
        since_ms: Option<i64>,
    },
    /// To the operators' approvals topic, in the step's partition.
    Approval {
        partition: i32,
        event: ApprovalEvent,
    },
    /// A refused input, with its original key and headers.
    Dlq {
        key: Option<Vec<u8>>,
        headers: Vec<(String, Option<Vec<u8>>)>,
        record: DlqRecord,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Step(StepKey),
    Fast(i64),
}

/// Settings the gate's decisions depend on.
#[derive(Debug, Clone)]
pub struct GateSettings {
    pub retention: Duration,
    pub in_doubt_grace: Duration,
    pub fast_path_timeout: Duration,
    pub max_intent_bytes: usize,
}

pub struct GateCore {
    tools: BTreeMap<String, ToolConfig>,
    tool_names: Vec<String>,
    settings: GateSettings,
    metrics: Arc<Metrics>,
    /// (deadline ms, partition, what): started steps and fast calls to check.
    due: BTreeSet<(i64, i32, Due)>,
    outs: Vec<Out>,
}

fn ms(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or_else(Utc::now)
}

impl GateCore {
    pub fn new(config: &Config, metrics: Arc<Metrics>) -> Self {
        GateCore {
            tools: config.tools.clone(),
            tool_names: config.tool_names(),
            settings: GateSettings {
                retention: config.state.retention.0,
                in_doubt_grace: config.gate.in_doubt_grace.0,
                fast_path_timeout: config.gate.fast_path_timeout.0,
                max_intent_bytes: config.gate.max_intent_bytes,
            },
            metrics,
            due: BTreeSet::new(),
            outs: Vec::new(),
        }
    }

    /// Messages decided since the last call.
    pub fn take_outs(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.outs)
    }

    pub fn has_outs(&self) -> bool {
        !self.outs.is_empty()
    }

    /// Forget everything in memory (a session restarts from committed state).
    pub fn reset(&mut self) {
        self.due.clear();
        self.outs.clear();
    }

    /// Load a partition's pending deadlines after it was assigned and reconciled.
    pub fn load_partition(&mut self, store: &StateStore, partition: i32) -> Result<(), StateError> {
        for (step, d) in store.deadlines(partition)? {
            self.due.insert((d, partition, Due::Step(step)));
        }
        for (offset, e) in store.fast_entries(partition)? {
            self.due
                .insert((e.deadline_ms, partition, Due::Fast(offset)));
        }
        Ok(())
    }

    /// Forget a partition that moved away.
    pub fn drop_partition(&mut self, partition: i32) {
        self.due.retain(|(_, p, _)| *p != partition);
    }

    /// An intent from an agent.
    pub fn on_intent(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.metrics.intent_received();
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = match parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names) {
            Ok(i) => i,
            Err(rejection) => {
                self.reject(input, rejection, now_ms);
                return Ok(());
            }
        };
        let p = input.partition;
        let step = intent.step_key();
        let traceparent = input.traceparent();
        let _span = tracing::info_span!(
            "intent",
            step = %step,
            call_id = intent.call_id.as_deref().unwrap_or(""),
            traceparent = traceparent.as_deref().unwrap_or("")
        )
        .entered();
        let tool = self.tools[&intent.tool].clone();
        let existing = if tool.recorded() {
            batch.step(store, p, &step)?
        } else {
            None
        };
        // A workflow ended by a `last_step` tool takes no new steps (repeats of
        // its recorded steps are still answered).
        if existing.is_none()
            && let Some(end) = batch.workflow_end(store, p, &step.workflow_id)?
            && end.step != step
        {
            let message = Texts::workflow_ended(
                &step.tool,
                &step.workflow_id,
                end.step.step_index,
                &end.step.tool,
            );
            let rejection = Rejection {
                reason: RejectionReason::WorkflowEnded,
                message,
                address: Some(Address {
                    step,
                    call_id: intent.call_id,
                }),
            };
            self.reject(input, rejection, now_ms);
            return Ok(());
        }
        if !tool.recorded() {
            let deadline_ms = now_ms + ms(self.settings.fast_path_timeout);
            let entry = FastEntry {
                step: step.clone(),
                call_id: intent.call_id,
                arguments: intent.arguments.clone(),
                traceparent: traceparent.clone(),
                dispatch: 1,
                deadline_ms,
                intent_ts_ms: input.timestamp_ms,
            };
            batch.put_fast(p, input.offset, &entry);
            self.due.insert((deadline_ms, p, Due::Fast(input.offset)));
            self.metrics.fast_path_call(&step);
            self.outs.push(Out::Call {
                partition: p,
                call: Call {
                    step,
                    arguments: intent.arguments,
                    dispatch: 1,
                    fast_ref: Some(input.offset),
                    traceparent,
                },
            });
            return Ok(());
        }
        match existing {
            None => self.begin_step(store, batch, input, &tool, intent, None, now_ms)?,
            // An operator confirmed the last run did not happen: run it now.
            Some(record) if record.phase == Phase::NotExecuted => {
                self.begin_step(store, batch, input, &tool, intent, Some(record), now_ms)?
            }
            Some(mut record) => {
                let rephrased =
                    record.note_repeat(intent.call_id.clone(), &intent.arguments, now_ms);
                match (&record.result, record.phase.in_flight()) {
                    (Some(first), false) => {
                        let answer = first.for_repeat(intent.call_id);
                        self.metrics.repeat(&step, false, rephrased);
                        self.outs.push(Out::Result {
                            partition: p,
                            result: answer,
                            traceparent,
                            since_ms: input.timestamp_ms,
                        });
                    }
                    _ => {
                        self.metrics.repeat(&step, true, rephrased);
                        record.waiters.push(Waiter {
                            call_id: intent.call_id,
                            intent_ts_ms: input.timestamp_ms,
                            traceparent,
                        });
                    }
                }
                batch.put_step(store, p, &record)?;
            }
        }
        Ok(())
    }

    /// Record a step's intent durably, then forward it — or, for an `approval`
    /// tool, hold it for a person. `previous` is the record of a run an operator
    /// declared not executed (its history is kept).
    #[allow(clippy::too_many_arguments)]
    fn begin_step(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        tool: &ToolConfig,
        intent: Intent,
        previous: Option<StepRecord>,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let step = intent.step_key();
        let traceparent = input.traceparent();
        let awaits_approval =
            tool.category == crate::config::Category::Unkeyed && tool.policy == Policy::Approval;
        let phase = if awaits_approval {
            Phase::AwaitingApproval
        } else {
            Phase::Intended
        };
        let mut record = StepRecord {
            step: step.clone(),
            category: tool.category,
            phase,
            arguments: intent.arguments.clone(),
            call_id: intent.call_id.clone(),
            metadata: intent.metadata.clone(),
            traceparent: traceparent.clone(),
            dispatch: 1,
            intended_at_ms: now_ms,
            started_at_ms: None,
            deadline_ms: None,
            result: None,
            waiters: Vec::new(),
            repeats: 0,
            rephrased_count: 0,
            rephrased: Vec::new(),
            late_outcome: None,
            expires_at_ms: now_ms + ms(self.settings.retention),
            intent_ts_ms: input.timestamp_ms,
            operator_log: Vec::new(),
            partition: p,
        };
        if let Some(prev) = previous {
            record.dispatch = prev.dispatch + 1;
            record.repeats = prev.repeats + 1;
            record.rephrased_count = prev.rephrased_count;
            record.rephrased = prev.rephrased;
            record.operator_log = prev.operator_log;
        }
        if tool.category == crate::config::Category::Unkeyed && tool.policy == Policy::LastStep {
            batch.put_workflow_end(
                p,
                &WorkflowEnd {
                    step: step.clone(),
                    at_ms: now_ms,
                },
            );
        }
        if awaits_approval {
            self.metrics.approval_requested(&step);
            self.outs.push(Out::Approval {
                partition: p,
                event: ApprovalEvent {
                    step,
                    event: ApprovalKind::Requested {
                        arguments: intent.arguments,
                        call_id: intent.call_id,
                        metadata: intent.metadata,
                    },
                    at: crate::contract::timestamp(at(now_ms)),
                },
            });
        } else {
            self.metrics.step_forwarded(&step, tool.category.as_str());
            self.forward(p, &record);
        }
        batch.put_step(store, p, &record)
    }

    /// Send a recorded step's call to the executors.
    fn forward(&mut self, partition: i32, record: &StepRecord) {
        self.outs.push(Out::Call {
            partition,
            call: Call {
                step: record.step.clone(),
                arguments: record.arguments.clone(),
                dispatch: record.dispatch,
                fast_ref: None,
                traceparent: record.traceparent.clone(),
            },
        });
    }

    /// An operator's command: settle an in-doubt step, approve or deny a held one.
    /// A command that does not fit the step's state goes to the DLQ, with why.
    pub fn on_command(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
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
                    now_ms,
                );
                return Ok(());
            }
        };
        let action = command.action.as_str();
        let Some(mut record) = batch.step(store, p, &command.step)? else {
            let problem = format!(
                "no step {} in partition {p} (never recorded, purged, or the command went to the wrong partition)",
                command.step
            );
            self.bad_command(input, &command, &problem, now_ms);
            return Ok(());
        };
        // Applied already (the command was re-sent): nothing more to do.
        if record.operator_log.iter().any(|e| e.id == command.id) {
            return Ok(());
        }
        let entry = OperatorEntry {
            id: command.id.clone(),
            action: action.to_owned(),
            by: command.by.clone(),
            at: command.at.clone(),
            reason: command.reason.clone(),
            from: record.phase,
        };
        let wanted = Phase::acted_on_by(&command.action);
        if record.phase != wanted {
            let problem = format!(
                "`{action}` applies to a step that is {}; step {} is {}",
                wanted.as_str(),
                command.step,
                record.phase.as_str()
            );
            self.bad_command(input, &command, &problem, now_ms);
            return Ok(());
        }
        let decided = |kind| ApprovalEvent {
            step: command.step.clone(),
            event: kind,
            at: command.at.clone(),
        };
        match &command.action {
            Action::ResolveExecuted { output } => {
                record.operator_log.push(entry);
                let outcome = Outcome::Ok {
                    output: output.clone(),
                };
                self.settle(store, batch, p, record, outcome, Phase::Completed, now_ms)?;
            }
            Action::ResolveNotExecuted => {
                record.operator_log.push(entry);
                let outcome = Outcome::Error {
                    error: ErrorBody {
                        kind: "not_executed".into(),
                        message: Texts::resolved_not_executed(&command.step.tool),
                    },
                };
                self.settle(store, batch, p, record, outcome, Phase::NotExecuted, now_ms)?;
            }
            Action::Approve => {
                record.operator_log.push(entry);
                record.phase = Phase::Intended;
                self.outs.push(Out::Approval {
                    partition: p,
                    event: decided(ApprovalKind::Approved {
                        by: command.by.clone(),
                        reason: command.reason.clone(),
                    }),
                });
                self.metrics
                    .step_forwarded(&record.step, record.category.as_str());
                self.forward(p, &record);
                batch.put_step(store, p, &record)?;
            }
            Action::Deny => {
                record.operator_log.push(entry);
                self.outs.push(Out::Approval {
                    partition: p,
                    event: decided(ApprovalKind::Denied {
                        by: command.by.clone(),
                        reason: command.reason.clone(),
                    }),
                });
                let outcome = Outcome::Error {
                    error: ErrorBody {
                        kind: "denied".into(),
                        message: Texts::denied(&command.step.tool, command.reason.as_deref()),
                    },
                };
                self.settle(store, batch, p, record, outcome, Phase::Completed, now_ms)?;
            }
        }
        self.metrics
            .operator_command(&command.step, action, &command.by, None);
        Ok(())
    }

    fn bad_command(&mut self, input: &Input, command: &Command, problem: &str, now_ms: i64) {
        self.metrics.operator_command(
            &command.step,
            command.action.as_str(),
            &command.by,
            Some(problem),
        );
        let rejection = Rejection::new(RejectionReason::BadCommand, problem.to_owned());
        self.reject(input, rejection, now_ms);
    }

    fn reject(&mut self, input: &Input, rejection: Rejection, now_ms: i64) {
        self.metrics.rejected(
            rejection.reason.as_str(),
            &rejection.message,
            input.partition,
            input.offset,
        );
        let payload = input.payload.as_deref().unwrap_or_default();
        if let Some(addr) = &rejection.address {
            self.outs.push(Out::Result {
                partition: input.partition,
                result: ToolResult {
                    workflow_id: addr.step.workflow_id.clone(),
                    step_index: addr.step.step_index,
                    tool: addr.step.tool.clone(),
                    attempt: addr.step.attempt,
                    call_id: addr.call_id.clone(),
                    status: Status::Rejected,
                    output: None,
                    error: Some(ErrorBody {
                        kind: rejection.reason.as_str().to_owned(),
                        message: rejection.message.clone(),
                    }),
                    deduplicated: false,
                    completed_at: crate::contract::timestamp(at(now_ms)),
                },
                traceparent: input.traceparent(),
                since_ms: input.timestamp_ms,
            });
        }
        self.outs.push(Out::Dlq {
            key: input.key.clone(),
            headers: input.headers.clone(),
            record: DlqRecord::new(
                &rejection,
                &input.topic,
                input.partition,
                input.offset,
                payload,
                at(now_ms),
            ),
        });
    }

    /// Progress from an executor: `started`, or an outcome.
    pub fn on_progress(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let payload = input.payload.as_deref().unwrap_or_default();
        let progress: Progress = match serde_json::from_slice(payload) {
            Ok(pr) => pr,
            Err(e) => {
                // Only stepgate writes this topic; keep the evidence and go on.
                let rejection = Rejection::new(
                    RejectionReason::MalformedJson,
                    format!("unreadable progress record: {e}"),
                );
                self.reject(input, rejection, now_ms);
                return Ok(());
            }
        };
        if let Some(fast_ref) = progress.fast_ref {
            if let ProgressEvent::Finished { outcome } = progress.event
                && let Some(entry) = batch.fast(store, p, fast_ref)?
            {
                batch.delete_fast(p, fast_ref);
                let result =
                    ToolResult::from_outcome(&entry.step, entry.call_id, outcome, at(now_ms));
                self.outs.push(Out::Result {
                    partition: p,
                    result,
                    traceparent: entry.traceparent,
                    since_ms: entry.intent_ts_ms,
                });
            }
            return Ok(());
        }
        let Some(mut record) = batch.step(store, p, &progress.step)? else {
            tracing::debug!(step = %progress.step, "progress for a step with no record (purged?): ignored");
            return Ok(());
        };
        match progress.event {
            ProgressEvent::Started => {
                if record.phase == Phase::Intended && progress.dispatch == record.dispatch {
                    let deadline = now_ms
                        + ms(self.tool_deadline(&record.step.tool) + self.settings.in_doubt_grace);
                    record.phase = Phase::Started;
                    record.started_at_ms = Some(progress.at_ms);
                    record.deadline_ms = Some(deadline);
                    batch.put_step(store, p, &record)?;
                    self.due
                        .insert((deadline, p, Due::Step(record.step.clone())));
                }
            }
            ProgressEvent::Finished { outcome } => {
                if record.phase.in_flight() {
                    let phase = Phase::settled_by(&outcome);
                    self.settle(store, batch, p, record, outcome, phase, now_ms)?;
                } else if record.phase == Phase::InDoubt && record.late_outcome.is_none() {
                    self.metrics.late_outcome(&record.step);
                    record.late_outcome = Some(outcome);
                    batch.put_step(store, p, &record)?;
                }
            }
        }
        Ok(())
    }

    fn tool_deadline(&self, tool: &str) -> Duration {
        self.tools
            .get(tool)
            .map(ToolConfig::deadline)
            .unwrap_or(Duration::from_secs(30))
    }

    /// Store an outcome, leaving the step in `phase`, and answer the first
    /// caller and every waiting repeat.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        p: i32,
        mut record: StepRecord,
        outcome: Outcome,
        phase: Phase,
        now_ms: i64,
    ) -> Result<(), StateError> {
        if let Outcome::InDoubt { error } = &outcome {
            self.metrics.in_doubt(&record.step, &error.kind);
        }
        record.phase = phase;
        let result =
            ToolResult::from_outcome(&record.step, record.call_id.clone(), outcome, at(now_ms));
        self.outs.push(Out::Result {
            partition: p,
            result: result.clone(),
            traceparent: record.traceparent.clone(),
            since_ms: record.intent_ts_ms,
        });
        for w in record.waiters.drain(..) {
            self.outs.push(Out::Result {
                partition: p,
                result: result.for_repeat(w.call_id),
                traceparent: w.traceparent,
                since_ms: w.intent_ts_ms,
            });
        }
        record.result = Some(result);
        record.deadline_ms = None;
        record.expires_at_ms = now_ms + ms(self.settings.retention);
        batch.put_step(store, p, &record)
    }

    /// Act on every deadline that has passed: re-forward where re-running is safe,
    /// declare the rest in doubt.
    pub fn on_deadlines(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        now_ms: i64,
    ) -> Result<(), StateError> {
        while let Some((deadline, p, due)) = self.due.first().cloned() {
            if deadline > now_ms {
                break;
            }
            self.due.pop_first();
            match due {
                Due::Step(step) => {
                    let Some(mut record) = batch.step(store, p, &step)? else {
                        continue;
                    };
                    if record.phase != Phase::Started || record.deadline_ms != Some(deadline) {
                        continue; // settled or re-dispatched since
                    }
                    if record.category.rerun_is_safe() {
                        record.dispatch += 1;
                        record.phase = Phase::Intended;
                        record.started_at_ms = None;
                        record.deadline_ms = None;
                        batch.put_step(store, p, &record)?;
                        self.metrics.reforwarded(&step, record.dispatch);
                        self.forward(p, &record);
                    } else {
                        let outcome = Outcome::InDoubt {
                            error: ErrorBody {
                                kind: "executor_lost".into(),
                                message: Texts::in_doubt_lost(&step.tool),
                            },
                        };
                        let phase = Phase::settled_by(&outcome);
                        self.settle(store, batch, p, record, outcome, phase, now_ms)?;
                    }
                }
                Due::Fast(offset) => {
                    let Some(mut entry) = batch.fast(store, p, offset)? else {
                        continue;
                    };
                    if entry.deadline_ms != deadline {
                        continue;
                    }
                    entry.dispatch += 1;
                    entry.deadline_ms = now_ms + ms(self.settings.fast_path_timeout);
                    batch.put_fast(p, offset, &entry);
                    self.due.insert((entry.deadline_ms, p, Due::Fast(offset)));
                    self.metrics.reforwarded(&entry.step, entry.dispatch);
                    self.outs.push(Out::Call {
                        partition: p,
                        call: Call {
                            step: entry.step,
                            arguments: entry.arguments,
                            dispatch: entry.dispatch,
                            fast_ref: Some(offset),
                            traceparent: entry.traceparent,
                        },
                    });
                }
            }
        }
        Ok(())
    }

    /// Remove up to `limit` expired records of each partition.
    pub fn purge(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        partitions: impl IntoIterator<Item = i32>,
        now_ms: i64,
        limit: usize,
    ) -> Result<usize, StateError> {
        let mut n = 0;
        for p in partitions {
            for (expires_at, step) in store.expired(p, now_ms, limit)? {
                match batch.step(store, p, &step)? {
                    Some(r) if r.expires_at_ms == expires_at => {
                        batch.delete_step(store, p, &step)?;
                        if batch
                            .workflow_end(store, p, &step.workflow_id)?
                            .is_some_and(|e| e.step == step)
                        {
                            batch.delete_workflow_end(p, &step.workflow_id);
                        }
                        n += 1;
                    }
                    _ => batch.delete_expiry(p, &step, expires_at),
                }
            }
        }
        self.metrics.purged(n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
