//! An intent: classified first ([`IntentCase`]), then handled by its case's
//! one handler — refused, re-routed to its partition, run on the fast path, a
//! new step begun, run again, or a repeat answered from its record or
//! attached to the call in flight.

use super::deferred::RUN_BEFORE_REREAD;
use super::{Apply, GateCore, Out, When, WrongPartition, at, ms};
use crate::contract::headers::{FORWARDED_FROM, REPLY_PARTITION};
use crate::contract::{
    Address, ApprovalEvent, ApprovalKind, Call, Intent, Rejection, RejectionReason, StepKey, Texts,
    parse_intent,
};
use crate::kafka::Input;
use crate::state::{FastEntry, NotWaiting, Phase, StateError, StepRecord, Waiter, WorkflowEnd};
use crate::telemetry::Decision;
use crate::tools::ToolConfig;
use std::time::Duration;

/// The largest intent whose step is recorded once, settled. Its record is
/// written only after the call, so a record the changelog refuses (its
/// `max.message.bytes` lowered below it after the gate started) would be
/// refused after the effect; far under any topic's limit (Kafka's default is
/// 1 MiB, `stepgate topics create` sets 4 MiB) that cannot happen, and a
/// larger step is recorded `started` first, refused before its call.
pub(super) const DEFER_MAX_INTENT_BYTES: usize = 4 * 1024;

/// What an intent is, decided before anything is done with it. (Built once
/// per intent and matched at once: boxing its large case would cost an
/// allocation per intent for nothing.)
#[allow(clippy::large_enum_variant)]
enum IntentCase {
    /// Read again below the applied mark, and decided by a batch that
    /// committed (or refused when first read): nothing to do.
    Replayed,
    /// Refused before its step is looked at: unreadable or invalid (its tool
    /// unknown then), or outside its workflow's partition and not re-routed.
    Refused {
        rejection: Rejection,
        tool: Option<String>,
    },
    /// Outside its workflow's partition: re-routed to `owner`.
    Forward { owner: i32, tool: String },
    /// A step of this partition, decided under its decision's span.
    Step(Intent, StepCase),
}

/// What an intent of this partition is to its step; each case has one handler.
enum StepCase {
    /// Takes no new call: no record and older than the retention, or its
    /// workflow ended by a `last_step` tool.
    Closed(Rejection),
    /// A tool that records nothing (`read_only`/`idempotent`): run at once.
    Fast,
    /// A new step: recorded once settled (`deferred`), else `started` first
    /// or held for a person.
    New { deferred: bool },
    /// Another call than the one recorded (by the tool's identity arguments):
    /// not a retry, not run, not given the recorded answer.
    Conflict {
        record: StepRecord,
        fields: Vec<(String, String, String)>,
    },
    /// An operator confirmed the last run did not happen, or a keyed tool
    /// could not be reached: run now (with the same key).
    Rerun(StepRecord),
    /// A repeat of a settled step: answered from its record.
    Settled(StepRecord),
    /// A repeat of a step in flight: waits for its outcome.
    Waiting(StepRecord),
}

impl GateCore {
    /// An intent from an agent.
    pub(super) fn apply_intent(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
    ) -> Result<(), StateError> {
        // Below the applied mark, the committed state already reflects this
        // intent (re-read because a call before it was unanswered): only
        // calls that record nothing until settled are run again.
        let replayed = ax.replayed(input.offset);
        let case = self.classify(ax, input, replayed)?;
        if !replayed {
            self.count(&case);
        }
        match case {
            IntentCase::Replayed => Ok(()),
            IntentCase::Refused { rejection, .. } => {
                self.reject(input, rejection, ax.now_ms);
                Ok(())
            }
            IntentCase::Forward { owner, .. } => {
                self.forward(input, owner);
                Ok(())
            }
            IntentCase::Step(intent, case) => self.decide_step(ax, input, intent, case, replayed),
        }
    }

    /// Which case an intent is (reading its step's record, never writing).
    fn classify(
        &self,
        ax: &Apply<'_>,
        input: &Input,
        replayed: bool,
    ) -> Result<IntentCase, StateError> {
        let p = input.partition;
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = match parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names) {
            Ok(i) => i,
            Err(_) if replayed => return Ok(IntentCase::Replayed),
            Err(rejection) => {
                return Ok(IntentCase::Refused {
                    rejection,
                    tool: None,
                });
            }
        };
        // A step is deduplicated within its workflow's partition only.
        if let Some(owner) = self.owner_elsewhere(&intent, p) {
            return Ok(self.elsewhere(input, intent, owner, replayed));
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
            return Ok(IntentCase::Replayed);
        }
        let existing = if tool.recorded() {
            ax.step(p, &step)?
        } else {
            None
        };
        if existing.is_none() {
            if let Some(rejection) = self.expired(input, &step, ax.now_ms) {
                return Ok(IntentCase::Step(intent, StepCase::Closed(rejection)));
            }
            // A workflow ended by a `last_step` tool takes no new steps
            // (repeats of its recorded steps are still answered).
            if let Some(end) = ax.workflow_end(p, &step.workflow_id)?
                && end.step != step
            {
                // A deferred step's record is written when a step ending its
                // workflow begins: re-read with none, it was refused then.
                if replayed {
                    return Ok(IntentCase::Replayed);
                }
                let rejection = workflow_ended(&intent, &end);
                return Ok(IntentCase::Step(intent, StepCase::Closed(rejection)));
            }
        }
        let case = match existing {
            _ if !tool.recorded() => StepCase::Fast,
            None => StepCase::New {
                deferred: deferrable,
            },
            Some(record) => {
                let fields: Vec<(String, String, String)> = tool
                    .identity_conflict(&record.arguments, &intent.arguments)
                    .into_iter()
                    .map(|(f, recorded, sent)| (f, recorded.to_string(), sent.to_string()))
                    .collect();
                if !fields.is_empty() {
                    StepCase::Conflict { record, fields }
                } else if record.phase.runs_again() {
                    StepCase::Rerun(record)
                } else if record.result.is_some() && !record.phase.in_flight() {
                    StepCase::Settled(record)
                } else {
                    StepCase::Waiting(record)
                }
            }
        };
        Ok(IntentCase::Step(intent, case))
    }

    /// Counted once, where it is decided: an intent re-routed to its
    /// workflow's partition is counted there, not where it was published.
    /// Whether a copy says it was re-routed (`stepgate-forwarded-from`, a
    /// header any writer of the topic can set) changes neither its count nor
    /// its decision: it decides only that a copy found outside its partition
    /// is not re-routed again.
    fn count(&self, case: &IntentCase) {
        match case {
            IntentCase::Replayed => {}
            // Counted as received by the owner, which decides it.
            IntentCase::Forward { tool, .. } => self.metrics.intent_forwarded(tool),
            IntentCase::Refused { tool, .. } => self.metrics.intent_received(tool.as_deref()),
            IntentCase::Step(intent, _) => self.metrics.intent_received(Some(&intent.tool)),
        }
    }

    /// The partition an intent's workflow lives in, when the gate checks it
    /// (`gate.check_partition`) and it is not `p`.
    fn owner_elsewhere(&self, intent: &Intent, p: i32) -> Option<i32> {
        if self.settings.wrong_partition == WrongPartition::Accept {
            return None;
        }
        let owner = crate::contract::partition_for(&intent.workflow_id, self.intent_partitions?);
        (owner != p).then_some(owner)
    }

    /// An intent outside its workflow's partition: re-routed to the owner in
    /// this batch's transaction (with this input's offset: once),
    /// deduplicated there, answered here. Never twice: a re-routed copy found
    /// outside its partition too (the partition count changed in between) is
    /// refused.
    fn elsewhere(&self, input: &Input, intent: Intent, owner: i32, replayed: bool) -> IntentCase {
        if replayed {
            return IntentCase::Replayed;
        }
        if self.settings.wrong_partition == WrongPartition::Forward && !input.forwarded() {
            return IntentCase::Forward {
                owner,
                tool: intent.tool,
            };
        }
        let p = input.partition;
        let rejection = Rejection {
            reason: RejectionReason::WrongPartition,
            message: Texts::wrong_partition(&intent.tool, &intent.workflow_id, p, owner),
            address: Some(Address {
                step: intent.step_key(),
                call_id: intent.call_id,
            }),
        };
        IntentCase::Refused {
            rejection,
            tool: Some(intent.tool),
        }
    }

    /// Older than the retention with no record: perhaps a re-read (lost group
    /// offsets) of a call whose record was purged. Not run, and not answered:
    /// its call_id may have had its answer long ago. (Re-read, it may be a
    /// deferred step whose gate was down past the retention: dead-lettered as
    /// on a first read, not answered.)
    fn expired(&self, input: &Input, step: &StepKey, now_ms: i64) -> Option<Rejection> {
        let ts = input.timestamp_ms?;
        if now_ms.saturating_sub(ts) <= ms(self.settings.retention) {
            return None;
        }
        let age = Duration::from_millis(now_ms.saturating_sub(ts).max(0) as u64);
        Some(Rejection {
            reason: RejectionReason::Expired,
            message: Texts::expired(&step.tool, &step.workflow_id, age),
            address: None,
        })
    }

    /// The intent re-routed to its workflow's partition, `owner`, with its
    /// key, value, timestamp and headers, and the headers naming where it came
    /// from and where it is answered.
    fn forward(&mut self, input: &Input, owner: i32) {
        let p = input.partition;
        let mut headers: Vec<_> = input
            .headers
            .iter()
            .filter(|(k, _)| !k.eq_ignore_ascii_case(REPLY_PARTITION))
            .cloned()
            .collect();
        headers.push((REPLY_PARTITION.to_owned(), Some(p.to_string().into_bytes())));
        headers.push((
            FORWARDED_FROM.to_owned(),
            Some(format!("{p}:{}", input.offset).into_bytes()),
        ));
        self.outs.push(Out::Forward {
            partition: owner,
            key: input.key.clone(),
            payload: input.payload.clone(),
            headers,
            timestamp_ms: input.timestamp_ms,
        });
    }

    /// A case of this partition's step, under the intent's span and its
    /// decision's (the parent of the calls it starts; nothing unless traces
    /// are configured).
    fn decide_step(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        intent: Intent,
        case: StepCase,
        replayed: bool,
    ) -> Result<(), StateError> {
        let step = intent.step_key();
        let traceparent = input.traceparent();
        let _span = tracing::info_span!(
            "intent",
            step = %step,
            call_id = intent.call_id.as_deref().unwrap_or(""),
            traceparent = traceparent.as_deref().unwrap_or("")
        )
        .entered();
        let mut decision = self.metrics.traces().decision(
            &step,
            intent.call_id.as_deref(),
            traceparent.as_deref(),
            (input.topic.as_str(), input.partition, input.offset),
        );
        // The dedup rate's denominator: every call decided as this step (new,
        // re-run or repeat); not an identity conflict, which is another call.
        if let StepCase::New { .. }
        | StepCase::Rerun(_)
        | StepCase::Settled(_)
        | StepCase::Waiting(_) = case
        {
            self.metrics.effectful_call(&step);
        }
        match case {
            StepCase::Closed(rejection) => {
                decision.rejected(rejection.reason.as_str(), &rejection.message);
                self.reject(input, rejection, ax.now_ms);
                Ok(())
            }
            StepCase::Fast => {
                self.run_fast(input, intent, decision);
                Ok(())
            }
            StepCase::New { deferred } => {
                self.begin_new(ax, input, intent, deferred, replayed, decision)
            }
            StepCase::Conflict { record, fields } => {
                self.refuse_conflict(ax, input, intent, &record, &fields, decision);
                Ok(())
            }
            StepCase::Rerun(record) => {
                decision.decided("rerun");
                let tool = self.tools[&intent.tool].clone();
                let parent = decision.traceparent();
                self.begin_step(ax, input, &tool, intent, Some(record), parent)
            }
            StepCase::Settled(record) => self.answer_repeat(ax, input, intent, record, decision),
            StepCase::Waiting(record) => self.wait_repeat(ax, input, intent, record, decision),
        }
    }

    /// Intent in, answer out: nothing durable in between. The call starts at
    /// once, and the intent's offset is held until it is answered.
    fn run_fast(&mut self, input: &Input, intent: Intent, mut decision: Decision) {
        decision.decided("fast_path");
        let p = input.partition;
        let step = intent.step_key();
        let traceparent = input.traceparent();
        let entry = FastEntry {
            step: step.clone(),
            call_id: intent.call_id.clone(),
            arguments: intent.arguments.clone(),
            traceparent: traceparent.clone(),
            dispatch: 1,
            deadline_ms: 0,
            intent_ts_ms: input.timestamp_ms,
            reply_partition: input.reply_partition(self.intent_partitions),
        };
        self.fast.insert((p, input.offset), entry);
        self.metrics.fast_path_call(&step);
        let call = Call {
            step,
            arguments: intent.arguments,
            dispatch: 1,
            fast_ref: Some(input.offset),
            traceparent: decision.traceparent().or(traceparent),
            call_id: intent.call_id,
            token: None,
        };
        self.outs.push(Out::Invoke {
            partition: p,
            call,
            when: When::Now,
        });
    }

    /// A new step: recorded once settled, or `started` first, or held for a
    /// person.
    fn begin_new(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        intent: Intent,
        deferred: bool,
        replayed: bool,
        mut decision: Decision,
    ) -> Result<(), StateError> {
        let tool = self.tools[&intent.tool].clone();
        decision.decided(if tool.awaits_approval() {
            "awaiting_approval"
        } else {
            "new_step"
        });
        let parent = decision.traceparent();
        if deferred {
            self.begin_deferred(ax, input, &tool, intent, replayed, parent);
            Ok(())
        } else {
            self.begin_step(ax, input, &tool, intent, None, parent)
        }
    }

    /// Another call than the recorded one: refused. A deferred step's record
    /// is written now, so a re-read of this intent finds it.
    fn refuse_conflict(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        intent: Intent,
        record: &StepRecord,
        fields: &[(String, String, String)],
        mut decision: Decision,
    ) {
        ax.write_deferred(input.partition, &record.step);
        let step = intent.step_key();
        self.metrics.identity_conflict(&step);
        let rejection = Rejection {
            reason: RejectionReason::IdentityConflict,
            message: Texts::identity_conflict(&step.tool, fields),
            address: Some(Address {
                step,
                call_id: intent.call_id,
            }),
        };
        decision.rejected(rejection.reason.as_str(), &rejection.message);
        self.reject(input, rejection, ax.now_ms);
    }

    /// A repeat of a settled step, answered from its record: at once when
    /// that answer rests only on committed state, else with the batch.
    fn answer_repeat(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        intent: Intent,
        mut record: StepRecord,
        mut decision: Decision,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let rephrased = record.note_repeat(intent.call_id.clone(), &intent.arguments, ax.now_ms);
        decision.repeat(false, rephrased, record.call_id.as_deref());
        self.metrics.repeat(&record.step, false, rephrased);
        if let Some(first) = &record.result {
            let when = if ax.committed_final(p, &record.step, first)? {
                When::Now
            } else {
                When::WithBatch
            };
            self.outs.push(Out::Result {
                partition: input.reply_partition(self.intent_partitions),
                result: first.for_repeat(intent.call_id),
                traceparent: input.traceparent(),
                since_ms: input.timestamp_ms,
                when,
            });
        }
        // A verbatim repeat of a settled step changes nothing worth a
        // changelog record (metrics and the audit count it); a rephrased one
        // is kept for the audit.
        if !rephrased {
            return Ok(());
        }
        keep_repeat(ax, p, &record)
    }

    /// A repeat of a step in flight: kept as a waiter on its record,
    /// answered with its outcome.
    fn wait_repeat(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
        intent: Intent,
        mut record: StepRecord,
        mut decision: Decision,
    ) -> Result<(), StateError> {
        let p = input.partition;
        let rephrased = record.note_repeat(intent.call_id.clone(), &intent.arguments, ax.now_ms);
        decision.repeat(true, rephrased, record.call_id.as_deref());
        self.metrics.repeat(&record.step, true, rephrased);
        let reply = input.reply_partition(self.intent_partitions);
        let waiter = Waiter {
            call_id: intent.call_id,
            intent_ts_ms: input.timestamp_ms,
            traceparent: input.traceparent(),
            reply_partition: Some(reply).filter(|r| *r != p),
        };
        if let Err(why) = record.add_waiter(waiter) {
            if why == NotWaiting::OverBudget {
                tracing::warn!(step = %record.step, "a repeat of an in-flight step is not kept waiting: the step has too many waiting callers (it is answered from the record when asked again)");
            }
            self.metrics.repeat_not_waiting(why.as_str());
            if !rephrased {
                return Ok(());
            }
        }
        keep_repeat(ax, p, &record)
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
            self.metrics.approval_requested(&step);
            self.outs.push(Out::Approval {
                partition: p,
                event: ApprovalEvent {
                    step,
                    event: ApprovalKind::Requested {
                        arguments: intent.arguments.to_map(),
                        call_id: intent.call_id,
                        metadata: intent.metadata,
                    },
                    at: crate::contract::timestamp(at(ax.now_ms)),
                },
            });
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
            self.outs.push(Out::Invoke {
                partition: p,
                call,
                when: When::Now,
            });
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
        self.outs.push(Out::Invoke {
            partition,
            call,
            when: When::WithBatch,
        });
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

/// A waiter, or a rephrased copy, of a step: its record written with it — a
/// deferred step's now durably, `started` (from here on the step is recorded
/// as a large intent's is).
fn keep_repeat(ax: &mut Apply<'_>, p: i32, record: &StepRecord) -> Result<(), StateError> {
    ax.write_deferred(p, &record.step);
    ax.put_step(p, record)
}

/// The refusal of a step in a workflow a `last_step` tool ended.
fn workflow_ended(intent: &Intent, end: &WorkflowEnd) -> Rejection {
    Rejection {
        reason: RejectionReason::WorkflowEnded,
        message: Texts::workflow_ended(
            &intent.tool,
            &intent.workflow_id,
            end.step.step_index,
            &end.step.tool,
        ),
        address: Some(Address {
            step: intent.step_key(),
            call_id: intent.call_id.clone(),
        }),
    }
}
