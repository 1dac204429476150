//! An intent: a new step recorded and started (or answered at once), a
//! repeat answered from its record or attached to the call in flight.

use super::deferred::RUN_BEFORE_REREAD;
use super::{Apply, GateCore, Out, ms};
use crate::contract::{Address, Call, Intent, Rejection, RejectionReason, Texts, parse_intent};
use crate::kafka::Input;
use crate::state::{FastEntry, NotWaiting, Phase, StateError, StepRecord, Waiter, WorkflowEnd};
use crate::tools::ToolConfig;
use std::time::Duration;

/// The largest intent whose step is recorded once, settled. Its record is
/// written only after the call, so a record the changelog refuses (its
/// `max.message.bytes` lowered below it after the gate started) would be
/// refused after the effect; far under any topic's limit (Kafka's default is
/// 1 MiB, `stepgate topics create` sets 4 MiB) that cannot happen, and a
/// larger step is recorded `started` first, refused before its call.
pub(super) const DEFER_MAX_INTENT_BYTES: usize = 4 * 1024;

impl GateCore {
    /// An intent from an agent.
    pub(super) fn apply_intent(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
    ) -> Result<(), StateError> {
        let p = input.partition;
        // Below the watermark, the committed state already reflects this intent
        // (re-read because a fast-path call before it was unanswered): only
        // fast-path calls, which record nothing, are run again.
        let replayed = self.applied.get(&p).is_some_and(|a| input.offset < *a);
        // Counted once, where it is decided: an intent re-routed to its
        // workflow's partition is counted there, not where it was published.
        // Whether a copy says it was re-routed (`stepgate-forwarded-from`,
        // a header any writer of the topic can set) changes neither its count
        // nor its decision: it decides only that a copy found outside its
        // partition is not re-routed again.
        let counted = !replayed;
        let reply = input.reply_partition(self.intent_partitions);
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = match parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names) {
            Ok(i) => i,
            Err(_) if replayed => return Ok(()),
            Err(rejection) => {
                if counted {
                    self.metrics.intent_received(None);
                }
                self.reject(input, rejection, ax.now_ms);
                return Ok(());
            }
        };
        // A step is deduplicated within its workflow's partition only.
        if self.settings.wrong_partition != super::WrongPartition::Accept
            && let Some(n) = self.intent_partitions
            && let owner = crate::contract::partition_for(&intent.workflow_id, n)
            && owner != p
        {
            if replayed {
                return Ok(());
            }
            // Re-routed to the owner in this batch's transaction (with this
            // input's offset: once), deduplicated there, answered here. Never
            // twice: a re-routed copy found outside its partition too (the
            // partition count changed in between) is refused.
            if self.settings.wrong_partition == super::WrongPartition::Forward && !input.forwarded()
            {
                // Counted as received by the owner, which decides it.
                self.metrics.intent_forwarded(&intent.tool);
                let mut headers: Vec<_> = input
                    .headers
                    .iter()
                    .filter(|(k, _)| {
                        !k.eq_ignore_ascii_case(crate::contract::headers::REPLY_PARTITION)
                    })
                    .cloned()
                    .collect();
                headers.push((
                    crate::contract::headers::REPLY_PARTITION.to_owned(),
                    Some(p.to_string().into_bytes()),
                ));
                headers.push((
                    crate::contract::headers::FORWARDED_FROM.to_owned(),
                    Some(format!("{p}:{}", input.offset).into_bytes()),
                ));
                self.outs.push(Out::Forward {
                    partition: owner,
                    key: input.key.clone(),
                    payload: input.payload.clone(),
                    headers,
                    timestamp_ms: input.timestamp_ms,
                });
                return Ok(());
            }
            if counted {
                self.metrics.intent_received(Some(&intent.tool));
            }
            let rejection = Rejection {
                reason: RejectionReason::WrongPartition,
                message: Texts::wrong_partition(&intent.tool, &intent.workflow_id, p, owner),
                address: Some(Address {
                    step: intent.step_key(),
                    call_id: intent.call_id,
                }),
            };
            self.reject(input, rejection, ax.now_ms);
            return Ok(());
        }
        if counted {
            self.metrics.intent_received(Some(&intent.tool));
        }
        let tool = &self.tools[&intent.tool];
        let step = intent.step_key();
        // Re-read below the watermark: a recorded step's intent was applied,
        // unless its step was deferred (no record until settled) — then its
        // call, or a repeat waiting on it, is decided again.
        // (A decision that rests on a deferred step's record — a repeat
        // waiting on it, a conflicting call refused — writes the record in
        // its batch, so a re-read of that intent finds it.)
        let deferrable = self.defers(tool, payload.len());
        if replayed && tool.recorded() && (!deferrable || ax.recorded(p, &step)?) {
            return Ok(());
        }
        let traceparent = input.traceparent();
        let _span = tracing::info_span!(
            "intent",
            step = %step,
            call_id = intent.call_id.as_deref().unwrap_or(""),
            traceparent = traceparent.as_deref().unwrap_or("")
        )
        .entered();
        // The decision's span (under the intent's traceparent), and the parent
        // of the calls it starts; nothing unless traces are configured.
        let mut decision = self.metrics.traces().decision(
            &step,
            intent.call_id.as_deref(),
            traceparent.as_deref(),
            (input.topic.as_str(), p, input.offset),
        );
        let tool = tool.clone();
        let existing = if tool.recorded() {
            ax.step(p, &step)?
        } else {
            None
        };
        // Older than the retention with no record: perhaps a re-read (lost
        // group offsets) of a call whose record was purged. Not run, and not
        // answered: its call_id may have had its answer long ago.
        if existing.is_none()
            && let Some(ts) = input.timestamp_ms
            && ax.now_ms.saturating_sub(ts) > ms(self.settings.retention)
        {
            // (Re-read, it may be a deferred step whose gate was down past
            // the retention: dead-lettered as on a first read, not answered.)
            let age = Duration::from_millis(ax.now_ms.saturating_sub(ts).max(0) as u64);
            let rejection = Rejection {
                reason: RejectionReason::Expired,
                message: Texts::expired(&step.tool, &step.workflow_id, age),
                address: None,
            };
            decision.rejected(rejection.reason.as_str(), &rejection.message);
            self.reject(input, rejection, ax.now_ms);
            return Ok(());
        }
        // A workflow ended by a `last_step` tool takes no new steps (repeats of
        // its recorded steps are still answered).
        if existing.is_none()
            && let Some(end) = ax.workflow_end(p, &step.workflow_id)?
            && end.step != step
        {
            // A deferred step's record is written when a step ending its
            // workflow begins: re-read with none, it was refused then.
            if replayed {
                return Ok(());
            }
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
            decision.rejected(rejection.reason.as_str(), &rejection.message);
            self.reject(input, rejection, ax.now_ms);
            return Ok(());
        }
        if !tool.recorded() {
            // Intent in, answer out: nothing durable in between.
            decision.decided("fast_path");
            let entry = FastEntry {
                step: step.clone(),
                call_id: intent.call_id.clone(),
                arguments: intent.arguments.clone(),
                traceparent: traceparent.clone(),
                dispatch: 1,
                deadline_ms: 0,
                intent_ts_ms: input.timestamp_ms,
                reply_partition: reply,
            };
            self.fast.insert((p, input.offset), entry);
            self.metrics.fast_path_call(&step);
            self.immediate.push((
                p,
                Call {
                    step,
                    arguments: intent.arguments,
                    dispatch: 1,
                    fast_ref: Some(input.offset),
                    traceparent: decision.traceparent().or(traceparent),
                    call_id: intent.call_id,
                    token: None,
                },
            ));
            return Ok(());
        }
        // Another call than the one recorded (by the tool's identity
        // arguments): not a retry. Not run, not given the recorded answer.
        let conflict: Vec<(String, String, String)> = existing
            .as_ref()
            .map(|r| tool.identity_conflict(&r.arguments, &intent.arguments))
            .unwrap_or_default()
            .into_iter()
            .map(|(f, recorded, sent)| (f, recorded.to_string(), sent.to_string()))
            .collect();
        // The dedup rate's denominator: every call decided as this step (new,
        // re-run or repeat); not an identity conflict, which is another call.
        if conflict.is_empty() {
            self.metrics.effectful_call(&step);
        }
        let new_step = if tool.awaits_approval() {
            "awaiting_approval"
        } else {
            "new_step"
        };
        match existing {
            None => {
                decision.decided(new_step);
                let parent = decision.traceparent();
                if deferrable {
                    self.begin_deferred(ax, input, &tool, intent, replayed, parent);
                } else {
                    self.begin_step(ax, input, &tool, intent, None, parent)?
                }
            }
            Some(record) if !conflict.is_empty() => {
                ax.write_deferred(p, &record.step);
                self.metrics.identity_conflict(&step);
                let rejection = Rejection {
                    reason: RejectionReason::IdentityConflict,
                    message: Texts::identity_conflict(&step.tool, &conflict),
                    address: Some(Address {
                        step,
                        call_id: intent.call_id,
                    }),
                };
                decision.rejected(rejection.reason.as_str(), &rejection.message);
                self.reject(input, rejection, ax.now_ms);
            }
            // An operator confirmed the last run did not happen, or a keyed
            // tool could not be reached: run it now (with the same key).
            Some(record) if record.phase.runs_again() => {
                decision.decided("rerun");
                let parent = decision.traceparent();
                self.begin_step(ax, input, &tool, intent, Some(record), parent)?
            }
            Some(mut record) => {
                let rephrased =
                    record.note_repeat(intent.call_id.clone(), &intent.arguments, ax.now_ms);
                let in_flight = record.result.is_none() || record.phase.in_flight();
                decision.repeat(in_flight, rephrased, record.call_id.as_deref());
                match (&record.result, record.phase.in_flight()) {
                    (Some(first), false) => {
                        let at_once = ax.committed_final(p, &step, first)?;
                        let answer = Out::Result {
                            partition: reply,
                            result: first.for_repeat(intent.call_id),
                            traceparent,
                            since_ms: input.timestamp_ms,
                        };
                        self.metrics.repeat(&step, false, rephrased);
                        if at_once {
                            self.at_once.push(answer);
                        } else {
                            self.outs.push(answer);
                        }
                        // A verbatim repeat of a settled step changes nothing
                        // worth a changelog record (metrics and the audit count
                        // it); a rephrased one is kept for the audit.
                        if !rephrased {
                            return Ok(());
                        }
                    }
                    _ => {
                        self.metrics.repeat(&step, true, rephrased);
                        let waiter = Waiter {
                            call_id: intent.call_id,
                            intent_ts_ms: input.timestamp_ms,
                            traceparent,
                            reply_partition: Some(reply).filter(|r| *r != p),
                        };
                        if let Err(why) = record.add_waiter(waiter) {
                            if why == NotWaiting::OverBudget {
                                tracing::warn!(step = %step, "a repeat of an in-flight step is not kept waiting: the step has too many waiting callers (it is answered from the record when asked again)");
                            }
                            self.metrics.repeat_not_waiting(why.as_str());
                            if !rephrased {
                                return Ok(());
                            }
                        }
                    }
                }
                // A waiter, or a rephrased copy, of a deferred step is kept
                // durably: its record is written now (from here on the step
                // is recorded `started`, as a large intent's is).
                ax.write_deferred(p, &step);
                ax.put_step(p, &record)?;
            }
        }
        Ok(())
    }

    /// Record a step as `started` (its call starts once that is committed) — or,
    /// for an `approval` tool, hold it for a person. `previous` is the record of a run an operator
    /// declared not executed (its history is kept); `parent` the `traceparent`
    /// its call carries (the decision's span, when traced).
    pub(super) fn begin_step(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        tool: &ToolConfig,
        intent: Intent,
        previous: Option<StepRecord>,
        parent: Option<String>,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let reply = input.reply_partition(self.intent_partitions);
        let step = intent.step_key();
        let traceparent = input.traceparent();
        let awaits_approval = tool.awaits_approval();
        let phase = if awaits_approval {
            Phase::AwaitingApproval
        } else {
            Phase::Started
        };
        let mut record = StepRecord {
            call_id: intent.call_id.clone(),
            metadata: intent.metadata.clone(),
            traceparent: traceparent.clone(),
            intent_ts_ms: input.timestamp_ms,
            reply_partition: Some(reply).filter(|r| *r != p),
            ..StepRecord::new(
                step.clone(),
                tool.category,
                phase,
                intent.arguments.clone(),
                p,
                ax.now_ms,
                ax.now_ms + ms(self.settings.retention),
            )
        };
        if let Some(prev) = previous {
            record.dispatch = prev.dispatch + 1;
            record.repeats = prev.repeats + 1;
            record.rephrased_count = prev.rephrased_count;
            record.rephrased = prev.rephrased;
            record.operator_log = prev.operator_log;
            record.evidence = prev.evidence;
            record.settled_through = prev.settled_through;
            // Earlier runs' reports still count as theirs (evidence).
            record.tokens = prev.tokens;
            if prev.phase == Phase::Unreached {
                // Asked again with the key: the runs that may have reached
                // the tool are still unaccounted for.
                record.unseen_reader = prev.unseen_reader;
                record.open_dispatches = prev.open_dispatches;
            }
        }
        if tool.ends_workflow() {
            ax.write_deferred_of(p, &step.workflow_id);
            ax.batch.put_workflow_end(
                p,
                &WorkflowEnd {
                    step: step.clone(),
                    at_ms: ax.now_ms,
                },
            );
        }
        if awaits_approval {
            self.hold_for_approval(p, tool, &mut record, ax.now_ms);
        } else {
            self.metrics.step_forwarded(&step, tool.category.as_str());
            self.start(p, &mut record, ax.now_ms, parent);
        }
        ax.put_step(p, &record)
    }

    /// Whether a tool's new step, from an intent of `intent_bytes`, is
    /// recorded once, settled (`core/deferred.rs`): re-running it with the
    /// same key is safe, nothing but this process runs it (a pool's call is
    /// published with its record), no person holds it, it ends no workflow,
    /// and its record is small ([`DEFER_MAX_INTENT_BYTES`]).
    pub(super) fn defers(&self, tool: &ToolConfig, intent_bytes: usize) -> bool {
        #[cfg(test)]
        if self.settings.start_record {
            return false;
        }
        intent_bytes <= DEFER_MAX_INTENT_BYTES
            && tool.recorded()
            && tool.category.rerun_is_safe()
            && tool.pool.is_none()
            && !tool.awaits_approval()
            && !tool.ends_workflow()
    }

    /// Start a step of a re-runnable tool with no record written: its record
    /// stays in memory until it settles, and its intent's offset holds the
    /// partition's committed offset back. Its call starts once the batch
    /// that decided it has committed (so the offset's `applied` mark says it
    /// may have run) — a `keyed` one read for the first time at once
    /// (docs/design.md "One commit for a keyed step"). Re-read (`replayed`), it may have run before — in a
    /// process that crashed or lost the partition, or in this one before its
    /// session restarted — and was never heard from: that run is assumed
    /// ([`RUN_BEFORE_REREAD`]), so a "not performed" of this one alone is
    /// answered as in doubt.
    fn begin_deferred(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        tool: &ToolConfig,
        intent: Intent,
        replayed: bool,
        parent: Option<String>,
    ) {
        let p = input.partition;
        let reply = input.reply_partition(self.intent_partitions);
        let step = intent.step_key();
        let mut record = StepRecord {
            call_id: intent.call_id,
            metadata: intent.metadata,
            traceparent: input.traceparent(),
            intent_ts_ms: input.timestamp_ms,
            reply_partition: Some(reply).filter(|r| *r != p),
            ..StepRecord::new(
                step.clone(),
                tool.category,
                Phase::Started,
                intent.arguments,
                p,
                ax.now_ms,
                ax.now_ms + ms(self.settings.retention),
            )
        };
        let running = self.running.get(&(p, step.clone())).copied();
        // Any reader of a keyed step may have sent its call before a commit;
        // a first reading here does.
        let sent_before_commit = tool.category == crate::tools::Category::Keyed;
        let early = !replayed && sent_before_commit;
        if replayed {
            // Above any run of this process still going (its outcome is then
            // a stale dispatch's: evidence, never the answer).
            let earlier = running.unwrap_or(RUN_BEFORE_REREAD).max(RUN_BEFORE_REREAD);
            record.dispatch = earlier + 1;
            record.open_dispatches = vec![RUN_BEFORE_REREAD];
            if earlier != RUN_BEFORE_REREAD {
                record.open_dispatches.push(earlier);
            }
        } else if let Some(earlier) = running {
            // Read again from below its deciding batch (a session restarted
            // before that batch committed) while its call, sent before that
            // commit, still runs here.
            record.dispatch = earlier + 1;
            record.open_dispatches = vec![earlier];
        }
        // Sent before any commit, as every gate of the group sends it: a
        // process that read it before this one may have sent it too and
        // stopped before its commit. Re-read below the applied mark, the
        // same holds: a reader before the one whose batch committed may have
        // sent it, under a run number a later reader used again (each read
        // above the mark numbers its run 1), so a "not invoked" reported for
        // that number does not rule out the run assumed before this one.
        record.unseen_reader = sent_before_commit;
        self.metrics.step_forwarded(&step, tool.category.as_str());
        if early {
            let call = self.mark_started(p, &mut record, ax.now_ms, parent);
            self.invoked(p, &call);
            self.immediate.push((p, call));
        } else {
            self.start(p, &mut record, ax.now_ms, parent);
        }
        ax.defer_step(p, record, input.offset);
    }

    /// Mark a recorded step `started` with its deadline, and invoke its tool
    /// once the batch carrying that record has committed. Its call carries
    /// `parent` as its `traceparent` (the span of the decision that started
    /// it), else the step's own (the agent's).
    pub(super) fn start(
        &mut self,
        partition: i32,
        record: &mut StepRecord,
        now_ms: i64,
        parent: Option<String>,
    ) {
        let call = self.mark_started(partition, record, now_ms, parent);
        self.awaiting_commit
            .insert((partition, record.step.clone()), record.dispatch);
        self.outs.push(Out::Invoke { partition, call });
    }

    /// [`GateCore::start`]'s record and deadline; the call, for the caller to
    /// send after the commit or at once.
    fn mark_started(
        &mut self,
        partition: i32,
        record: &mut StepRecord,
        now_ms: i64,
        parent: Option<String>,
    ) -> Call {
        let deadline =
            now_ms + ms(self.tool_deadline(&record.step.tool) + self.settings.in_doubt_grace);
        record.phase = Phase::Started;
        record.started_at_ms = Some(now_ms);
        if !record.open_dispatches.contains(&record.dispatch) {
            record.open_dispatches.push(record.dispatch);
        }
        record.deadline_ms = Some(deadline);
        self.due.insert((deadline, partition, record.step.clone()));
        // The dispatch's token: its reports on `progress` count only with it.
        let token = self.tokens.next_token();
        record.remember_token(record.dispatch, &token);
        Call {
            step: record.step.clone(),
            arguments: record.arguments.clone(),
            dispatch: record.dispatch,
            fast_ref: None,
            traceparent: parent.or_else(|| record.traceparent.clone()),
            call_id: record.call_id.clone(),
            token: Some(token),
        }
    }
}
