//! The gate's decisions, free of Kafka: inputs, outcomes and time in; state
//! writes, messages and invocations out. One [`GateCore`] serves every partition
//! a gate owns.

use crate::config::Config;
use crate::contract::{
    Action, Address, ApprovalEvent, ApprovalKind, Call, Command, DlqRecord, ErrorBody, Intent,
    Outcome, Progress, ProgressEvent, Rejection, RejectionReason, Status, StepKey, Texts,
    ToolResult, parse_intent,
};
pub use crate::kafka::Input;
use crate::state::{
    Batch, Evidence, FastEntry, MAX_EVIDENCE_KEPT, NotWaiting, OperatorEntry, Phase, StateError,
    StateStore, StepRecord, Waiter, WorkflowEnd,
};
use crate::telemetry::Metrics;
use crate::tools::{Category, ToolConfig};
use chrono::{DateTime, TimeZone, Utc};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// A message the gate wants produced (in the same transaction as its state), or
/// a call to start once that transaction has committed.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Invoke a started step's tool, after the batch's commit.
    Invoke { partition: i32, call: Call },
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
    /// An intent found outside its workflow's partition, re-routed there
    /// (intents topic, `partition`) with its key, value, timestamp and headers,
    /// and the headers naming where it came from and where it is answered.
    Forward {
        partition: i32,
        key: Option<Vec<u8>>,
        payload: Option<Vec<u8>>,
        headers: Vec<(String, Option<Vec<u8>>)>,
        timestamp_ms: Option<i64>,
    },
    /// A refused input, with its original key and headers.
    Dlq {
        key: Option<Vec<u8>>,
        headers: Vec<(String, Option<Vec<u8>>)>,
        record: DlqRecord,
    },
}

/// Settings the gate's decisions depend on.
#[derive(Debug, Clone)]
pub struct GateSettings {
    pub retention: Duration,
    pub in_doubt_grace: Duration,
    pub max_intent_bytes: usize,
    pub check_partition: bool,
    pub forward_wrong_partition: bool,
}

pub struct GateCore {
    tools: BTreeMap<String, ToolConfig>,
    tool_names: Vec<String>,
    settings: GateSettings,
    /// Partitions of the intents topic, as the session last read them (None
    /// until known: no partition check then).
    intent_partitions: Option<i32>,
    metrics: Arc<Metrics>,
    /// (deadline ms, partition, step): started steps to check.
    due: BTreeSet<(i64, i32, StepKey)>,
    outs: Vec<Out>,
    /// Fast-path calls to start at once (they record nothing first).
    immediate: Vec<(i32, Call)>,
    /// Fast-path calls awaiting their answer, by (partition, intent offset).
    /// Memory only: the intent's offset is not committed past them, so a
    /// restart re-reads and re-runs them.
    fast: BTreeMap<(i32, i64), FastEntry>,
    /// Invocations running in this process (kept across sessions: their
    /// outcomes still arrive), by step → dispatch.
    running: HashMap<(i32, StepKey), u32>,
    /// Calls decided (their `started` record in a batch) whose commit has not
    /// returned yet: not invoked, and not lost either — a commit slower than
    /// the tool's deadline must not turn them into doubt before they start.
    awaiting_commit: HashMap<(i32, StepKey), u32>,
    /// Per partition, the first intent offset not yet applied to the committed
    /// state; intents below it are re-read only to re-run fast-path calls.
    applied: HashMap<i32, i64>,
    /// Calls of a batch whose commit reported an error: it may have committed
    /// all the same (a lost reply). Kept across sessions; when the partition is
    /// loaded again, a step whose record is `started` with the same dispatch
    /// and is not running here was committed and never invoked: it is invoked
    /// then, instead of being declared in doubt at its deadline.
    unsure: Vec<(i32, Call)>,
    /// Per partition newly taken over, how long its deadlines wait: the
    /// outcomes handed over on `progress` are read first, so a long restore
    /// or a slow read never turns a known outcome into doubt.
    held: HashMap<i32, Hold>,
    /// The process is stopping: a call handed back not invoked is left for
    /// the next owner (due at once) instead of being started here.
    stopping: bool,
}

/// Deadlines of a partition newly taken over wait until its `progress` has
/// been read up to where it ended at assignment, and at least `until_ms`
/// (`in_doubt_grace`: room for hand-overs written just after it).
#[derive(Debug, Clone, Copy)]
struct Hold {
    until_ms: i64,
    progress_read: bool,
}

/// The longest deadlines wait for `progress` to be read after a takeover
/// (a read that never catches up must not stop every deadline for good).
const HOLD_LIMIT_MS: i64 = 5 * 60 * 1000;

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
            intent_partitions: None,
            settings: GateSettings {
                retention: config.state.retention.0,
                in_doubt_grace: config.gate.in_doubt_grace.0,
                max_intent_bytes: config.gate.max_intent_bytes,
                check_partition: config.gate.check_partition,
                forward_wrong_partition: config.gate.forward_wrong_partition,
            },
            metrics,
            due: BTreeSet::new(),
            outs: Vec::new(),
            immediate: Vec::new(),
            fast: BTreeMap::new(),
            running: HashMap::new(),
            awaiting_commit: HashMap::new(),
            applied: HashMap::new(),
            unsure: Vec::new(),
            held: HashMap::new(),
            stopping: false,
        }
    }

    /// Messages decided since the last call.
    pub fn take_outs(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.outs)
    }

    pub fn has_outs(&self) -> bool {
        !self.outs.is_empty()
    }

    /// Fast-path calls decided since the last call, to start now.
    pub fn take_immediate(&mut self) -> Vec<(i32, Call)> {
        std::mem::take(&mut self.immediate)
    }

    /// The lowest intent offset of `partition` whose fast-path answer is still
    /// awaited: the partition's committed offset must not pass it.
    pub fn first_unanswered(&self, partition: i32) -> Option<i64> {
        self.fast
            .range((partition, i64::MIN)..=(partition, i64::MAX))
            .next()
            .map(|((_, o), _)| *o)
    }

    /// Forget everything in memory (a session restarts from committed state),
    /// except which invocations run.
    pub fn reset(&mut self) {
        self.awaiting_commit.clear();
        self.due.clear();
        self.outs.clear();
        self.immediate.clear();
        self.fast.clear();
        self.applied.clear();
        self.held.clear();
    }

    /// Load a partition's pending deadlines after it was assigned and restored;
    /// `applied` is the first intent offset its committed state does not reflect.
    /// Its deadlines wait `in_doubt_grace` from `now_ms`, while the outcomes
    /// waiting on `progress` are read.
    pub fn load_partition(
        &mut self,
        store: &StateStore,
        partition: i32,
        applied: i64,
        now_ms: i64,
    ) -> Result<(), StateError> {
        for (step, d) in store.deadlines(partition)? {
            self.due.insert((d, partition, step));
        }
        self.applied.insert(partition, applied);
        self.held.insert(
            partition,
            Hold {
                until_ms: now_ms + ms(self.settings.in_doubt_grace),
                progress_read: false,
            },
        );
        let (here, elsewhere): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unsure)
            .into_iter()
            .partition(|(p, _)| *p == partition);
        self.unsure = elsewhere;
        for (p, call) in here {
            let Some(record) = store.step(p, &call.step)? else {
                continue;
            };
            let committed_not_run = record.phase == Phase::Started
                && record.dispatch == call.dispatch
                && !self.running.contains_key(&(p, call.step.clone()));
            if committed_not_run {
                tracing::info!(step = %call.step, "its commit was reported failed but had landed: invoking it now");
                self.invoked(p, &call);
                self.immediate.push((p, call));
            }
        }
        Ok(())
    }

    /// A batch's commit reported an error: its calls were not started, and
    /// whether their `started` records committed is unknown until the
    /// partition is loaded again.
    pub fn commit_unknown(&mut self, calls: impl IntoIterator<Item = (i32, Call)>) {
        let calls: Vec<(i32, Call)> = calls.into_iter().collect();
        for (p, call) in &calls {
            self.awaiting_commit.remove(&(*p, call.step.clone()));
        }
        self.unsure.extend(calls);
        // Bounded: a partition that never comes back would keep its entries
        // for good. The oldest go first; theirs is the old outcome (in doubt
        // at the deadline).
        if let Some(over) = self.unsure.len().checked_sub(MAX_UNSURE) {
            self.unsure.drain(..over);
        }
    }

    /// The partition's `progress` has been read up to where it ended when the
    /// partition was assigned: its deadlines may fire (after the grace).
    pub fn progress_read(&mut self, partition: i32) {
        if let Some(h) = self.held.get_mut(&partition) {
            h.progress_read = true;
        }
    }

    /// The process is stopping (SIGTERM): calls handed back not invoked are
    /// left to the next owner.
    pub fn set_stopping(&mut self) {
        self.stopping = true;
    }

    /// Forget a partition that moved away (its running calls still report).
    pub fn drop_partition(&mut self, partition: i32) {
        self.awaiting_commit.retain(|(p, _), _| *p != partition);
        self.due.retain(|(_, p, _)| *p != partition);
        self.fast.retain(|(p, _), _| *p != partition);
        self.applied.remove(&partition);
        self.held.remove(&partition);
    }

    /// A call of this process finished (whoever owns its partition now).
    pub fn finished(&mut self, partition: i32, step: &StepKey, dispatch: u32) {
        let key = (partition, step.clone());
        if self.running.get(&key) == Some(&dispatch) {
            self.running.remove(&key);
        }
    }

    /// A started step's call was handed to the invoker (after its commit).
    pub fn invoked(&mut self, partition: i32, call: &Call) {
        self.awaiting_commit.remove(&(partition, call.step.clone()));
        if call.fast_ref.is_none() {
            self.running
                .insert((partition, call.step.clone()), call.dispatch);
        }
    }

    /// A pool tool's call went out with its batch (committed, or reported
    /// failed): no longer waiting for a commit; its workers report on it.
    pub fn published(&mut self, partition: i32, call: &Call) {
        self.awaiting_commit.remove(&(partition, call.step.clone()));
    }

    /// An intent from an agent.
    pub fn on_intent(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let p = input.partition;
        // Below the watermark, the committed state already reflects this intent
        // (re-read because a fast-path call before it was unanswered): only
        // fast-path calls, which record nothing, are run again.
        let replayed = self.applied.get(&p).is_some_and(|a| input.offset < *a);
        // A re-routed intent was counted where it was published.
        let counted = !replayed && !input.forwarded();
        let reply = input.reply_partition(self.intent_partitions);
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = match parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names) {
            Ok(i) => i,
            Err(_) if replayed => return Ok(()),
            Err(rejection) => {
                if counted {
                    self.metrics.intent_received(None);
                }
                self.reject(input, rejection, now_ms);
                return Ok(());
            }
        };
        if counted {
            self.metrics.intent_received(Some(&intent.tool));
        }
        // A step is deduplicated within its workflow's partition only.
        if self.settings.check_partition
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
            if self.settings.forward_wrong_partition && !input.forwarded() {
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
            let rejection = Rejection {
                reason: RejectionReason::WrongPartition,
                message: Texts::wrong_partition(&intent.tool, &intent.workflow_id, p, owner),
                address: Some(Address {
                    step: intent.step_key(),
                    call_id: intent.call_id,
                }),
            };
            self.reject(input, rejection, now_ms);
            return Ok(());
        }
        let tool = &self.tools[&intent.tool];
        if replayed && tool.recorded() {
            return Ok(());
        }
        let step = intent.step_key();
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
            batch.step(store, p, &step)?
        } else {
            None
        };
        // Older than the retention with no record: perhaps a re-read (lost
        // group offsets) of a call whose record was purged. Not run, and not
        // answered: its call_id may have had its answer long ago.
        if existing.is_none()
            && let Some(ts) = input.timestamp_ms
            && now_ms.saturating_sub(ts) > ms(self.settings.retention)
        {
            let age = Duration::from_millis(now_ms.saturating_sub(ts).max(0) as u64);
            let rejection = Rejection {
                reason: RejectionReason::Expired,
                message: Texts::expired(&step.tool, &step.workflow_id, age),
                address: None,
            };
            decision.rejected(rejection.reason.as_str(), &rejection.message);
            self.reject(input, rejection, now_ms);
            return Ok(());
        }
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
            decision.rejected(rejection.reason.as_str(), &rejection.message);
            self.reject(input, rejection, now_ms);
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
                self.begin_step(store, batch, input, &tool, intent, None, parent, now_ms)?
            }
            Some(_) if !conflict.is_empty() => {
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
                self.reject(input, rejection, now_ms);
            }
            // An operator confirmed the last run did not happen: run it now.
            Some(record) if record.phase == Phase::NotExecuted => {
                decision.decided("rerun");
                let parent = decision.traceparent();
                self.begin_step(
                    store,
                    batch,
                    input,
                    &tool,
                    intent,
                    Some(record),
                    parent,
                    now_ms,
                )?
            }
            Some(mut record) => {
                let rephrased =
                    record.note_repeat(intent.call_id.clone(), &intent.arguments, now_ms);
                let in_flight = record.result.is_none() || record.phase.in_flight();
                decision.repeat(in_flight, rephrased, record.call_id.as_deref());
                match (&record.result, record.phase.in_flight()) {
                    (Some(first), false) => {
                        let answer = first.for_repeat(intent.call_id);
                        self.metrics.repeat(&step, false, rephrased);
                        self.outs.push(Out::Result {
                            partition: reply,
                            result: answer,
                            traceparent,
                            since_ms: input.timestamp_ms,
                        });
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
                batch.put_step(store, p, &record)?;
            }
        }
        Ok(())
    }

    /// Record a step as `started` (its call starts once that is committed) — or,
    /// for an `approval` tool, hold it for a person. `previous` is the record of a run an operator
    /// declared not executed (its history is kept); `parent` the `traceparent`
    /// its call carries (the decision's span, when traced).
    #[allow(clippy::too_many_arguments)]
    fn begin_step(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        tool: &ToolConfig,
        intent: Intent,
        previous: Option<StepRecord>,
        parent: Option<String>,
        now_ms: i64,
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
                now_ms,
                now_ms + ms(self.settings.retention),
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
        }
        if tool.ends_workflow() {
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
                        arguments: intent.arguments.to_map(),
                        call_id: intent.call_id,
                        metadata: intent.metadata,
                    },
                    at: crate::contract::timestamp(at(now_ms)),
                },
            });
        } else {
            self.metrics.step_forwarded(&step, tool.category.as_str());
            self.start(p, &mut record, now_ms, parent);
        }
        batch.put_step(store, p, &record)
    }

    /// Mark a recorded step `started` with its deadline, and invoke its tool
    /// once the batch carrying that record has committed. Its call carries
    /// `parent` as its `traceparent` (the span of the decision that started
    /// it), else the step's own (the agent's).
    fn start(
        &mut self,
        partition: i32,
        record: &mut StepRecord,
        now_ms: i64,
        parent: Option<String>,
    ) {
        let deadline =
            now_ms + ms(self.tool_deadline(&record.step.tool) + self.settings.in_doubt_grace);
        record.phase = Phase::Started;
        record.started_at_ms = Some(now_ms);
        if !record.open_dispatches.contains(&record.dispatch) {
            record.open_dispatches.push(record.dispatch);
        }
        record.deadline_ms = Some(deadline);
        self.due.insert((deadline, partition, record.step.clone()));
        self.awaiting_commit
            .insert((partition, record.step.clone()), record.dispatch);
        self.outs.push(Out::Invoke {
            partition,
            call: Call {
                step: record.step.clone(),
                arguments: record.arguments.clone(),
                dispatch: record.dispatch,
                fast_ref: None,
                traceparent: parent.or_else(|| record.traceparent.clone()),
                call_id: record.call_id.clone(),
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
            self.reject(input, rejection, now_ms);
            return Ok(());
        }
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
        // The operator's decision as a span of the step's trace (the agent's
        // span recorded with it); an approved call runs under it.
        let traced = self.metrics.traces().command(
            &record.step,
            action,
            &command.by,
            record.traceparent.as_deref(),
        );
        let decided = |kind| ApprovalEvent {
            step: command.step.clone(),
            event: kind,
            at: command.at.clone(),
        };
        match &command.action {
            Action::ResolveExecuted { .. } | Action::ResolveFailed | Action::ResolveNotExecuted => {
                record.operator_log.push(entry);
                // The operator accounts for every run of the step.
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
                self.settle(store, batch, p, record, outcome, phase, now_ms)?;
            }
            Action::Approve => {
                record.operator_log.push(entry);
                self.outs.push(Out::Approval {
                    partition: p,
                    event: decided(ApprovalKind::Approved {
                        by: command.by.clone(),
                        reason: command.reason.clone(),
                    }),
                });
                self.metrics
                    .step_forwarded(&record.step, record.category.as_str());
                self.start(p, &mut record, now_ms, traced.traceparent());
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

    /// The intents topic's partition count (read at each session's start and
    /// assignment: adding partitions moves workflows).
    /// The intents topic's partition count, once known.
    pub fn intent_partitions(&self) -> Option<i32> {
        self.intent_partitions
    }

    pub fn set_intent_partitions(&mut self, n: i32) {
        self.intent_partitions = Some(n);
    }

    /// Set aside an input whose processing keeps failing (`error`): dead-letter
    /// it, and answer its caller when it is an intent that can be addressed.
    pub fn set_aside(&mut self, input: &Input, is_intent: bool, error: &str, now_ms: i64) {
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = is_intent
            .then(|| parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names).ok())
            .flatten();
        let (message, address) = match intent {
            Some(i) => (
                Texts::unprocessable(&i.tool),
                Some(Address {
                    step: i.step_key(),
                    call_id: i.call_id,
                }),
            ),
            None => (String::new(), None),
        };
        let rejection = Rejection {
            reason: RejectionReason::Unprocessable,
            message: format!("{message} (processing failed: {error})")
                .trim_start()
                .to_owned(),
            address,
        };
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
                partition: input.reply_partition(self.intent_partitions),
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

    /// A record of `progress`: the outcome of a call whose partition moved
    /// while it ran, or a pool worker's Outcome v1.
    pub fn on_progress(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        // The records `kafka::end_hanging_transactions` writes are aborted, so
        // read_committed never sees them on a broker; librdkafka's mock cluster
        // (the demo) fakes transactions and delivers them: not an input.
        if input.payload.is_none() && input.key.as_deref() == Some(crate::kafka::HANGING_PROBE_KEY)
        {
            return Ok(());
        }
        let payload = input.payload.as_deref().unwrap_or_default();
        let progress = match Progress::decode(payload) {
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
        // Fast-path outcomes are never handed over: their intent is re-read.
        if progress.fast_ref.is_some() {
            return Ok(());
        }
        self.on_outcome(store, batch, input.partition, progress, now_ms)
    }

    /// An invocation's outcome, for a partition this gate owns: answer a
    /// fast-path call, or settle a step — once: a step no longer in flight
    /// keeps its first outcome (a late one after `in_doubt` is kept for the
    /// operator).
    pub fn on_outcome(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        p: i32,
        progress: Progress,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let outcome = match progress.event {
            ProgressEvent::Finished { outcome } => outcome,
            ProgressEvent::NotInvoked => {
                return self.on_not_invoked(store, batch, p, &progress, now_ms);
            }
            // A pool's worker took the call.
            ProgressEvent::Started => return self.on_taken(store, batch, p, &progress, now_ms),
        };
        if let Some(fast_ref) = progress.fast_ref {
            if let Some(entry) = self.fast.remove(&(p, fast_ref)) {
                let result =
                    ToolResult::from_outcome(&entry.step, entry.call_id, outcome, at(now_ms));
                self.outs.push(Out::Result {
                    partition: entry.reply_partition,
                    result,
                    traceparent: entry.traceparent,
                    since_ms: entry.intent_ts_ms,
                });
            }
            return Ok(());
        }
        let Some(mut record) = batch.step(store, p, &progress.step)? else {
            tracing::warn!(step = %progress.step, dispatch = progress.dispatch, outcome = outcome.label(), "an outcome for a step with no record (purged after its retention): nothing to settle");
            return Ok(());
        };
        record.open_dispatches.retain(|d| *d != progress.dispatch);
        let settles = record.phase.in_flight() && record.phase != Phase::AwaitingApproval;
        // sim: stale-dispatch check. Only the step's current dispatch settles
        // it: an older one's "not performed" must not answer a step whose
        // re-run may have charged, and its `ok` is kept as evidence (the
        // current dispatch, with the same key, reports the same effect).
        if settles && progress.dispatch == record.dispatch {
            let outcome = self.unless_earlier_may_have_run(&record, outcome);
            let phase = Phase::settled_by(&outcome);
            return self.settle(store, batch, p, record, outcome, phase, now_ms);
        }
        let why = if progress.dispatch != record.dispatch {
            "stale_dispatch"
        } else if record.phase == Phase::InDoubt {
            "after_in_doubt"
        } else {
            "after_settled"
        };
        self.keep_evidence(&mut record, progress.dispatch, outcome, why, now_ms);
        batch.put_step(store, p, &record)
    }

    /// A pool's worker says it took the current dispatch of a step (before
    /// invoking it): the dispatch was claimed, and its deadline is moved to a
    /// whole tool deadline (and the grace) from now, as for a call running
    /// here. Anything else (a stale dispatch, a settled step) changes nothing.
    fn on_taken(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        p: i32,
        progress: &Progress,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let in_pool = self
            .tools
            .get(&progress.step.tool)
            .is_some_and(|t| t.pool.is_some());
        if !in_pool || progress.fast_ref.is_some() {
            return Ok(());
        }
        let Some(mut record) = batch.step(store, p, &progress.step)? else {
            return Ok(());
        };
        if record.phase != Phase::Started
            || record.dispatch != progress.dispatch
            || record.taken == Some(progress.dispatch)
        {
            return Ok(());
        }
        record.taken = Some(progress.dispatch);
        let later =
            now_ms + ms(self.tool_deadline(&record.step.tool) + self.settings.in_doubt_grace);
        if record.deadline_ms.is_none_or(|d| d < later) {
            record.deadline_ms = Some(later);
            self.due.insert((later, p, record.step.clone()));
        }
        batch.put_step(store, p, &record)
    }

    /// A call that never left its process (its partition moved, or the
    /// process stopped, while it waited for a slot): run its step again at
    /// once — safe for every category, since nothing was invoked — or, while
    /// this process stops, leave it due at once for the next owner.
    fn on_not_invoked(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        p: i32,
        progress: &Progress,
        now_ms: i64,
    ) -> Result<(), StateError> {
        if let Some(fast_ref) = progress.fast_ref {
            // A read: run it again here, or leave it to the owner, which
            // re-reads its intent (the offset is held back for it).
            if !self.stopping
                && let Some(entry) = self.fast.get_mut(&(p, fast_ref))
            {
                entry.dispatch += 1;
                self.immediate.push((
                    p,
                    Call {
                        step: entry.step.clone(),
                        arguments: entry.arguments.clone(),
                        dispatch: entry.dispatch,
                        fast_ref: Some(fast_ref),
                        traceparent: entry.traceparent.clone(),
                        call_id: entry.call_id.clone(),
                    },
                ));
            }
            return Ok(());
        }
        let Some(mut record) = batch.step(store, p, &progress.step)? else {
            tracing::warn!(step = %progress.step, dispatch = progress.dispatch, "a call handed back not invoked, for a step with no record (purged after its retention): nothing to run");
            return Ok(());
        };
        record.open_dispatches.retain(|d| *d != progress.dispatch);
        let current = progress.dispatch == record.dispatch && record.phase == Phase::Started;
        if !current {
            // Settled or re-run meanwhile: evidence that this run never ran.
            self.note_evidence(
                &mut record,
                progress.dispatch,
                "not_invoked",
                None,
                "stale_dispatch",
                now_ms,
            );
        } else if self.stopping {
            record.not_invoked = Some(record.dispatch);
            record.deadline_ms = Some(now_ms);
            self.due.insert((now_ms, p, record.step.clone()));
        } else {
            self.rerun_not_invoked(p, &mut record, now_ms);
        }
        batch.put_step(store, p, &record)
    }

    /// Dispatch again a step whose current dispatch was never invoked.
    fn rerun_not_invoked(&mut self, p: i32, record: &mut StepRecord, now_ms: i64) {
        record.not_invoked = None;
        record.dispatch += 1;
        tracing::info!(step = %record.step, dispatch = record.dispatch, "its last run was never invoked (its call queued where the partition or the process went away): run now");
        self.start(p, record, now_ms, None);
    }

    /// Keep an outcome that does not settle its step on the step's record:
    /// whole (the first such), in brief (the newest few), logged and counted.
    fn keep_evidence(
        &self,
        record: &mut StepRecord,
        dispatch: u32,
        outcome: Outcome,
        why: &str,
        now_ms: i64,
    ) {
        let kind = match &outcome {
            Outcome::Ok { .. } => None,
            Outcome::Error { error } | Outcome::InDoubt { error } => Some(error.kind.clone()),
        };
        self.note_evidence(record, dispatch, outcome.label(), kind, why, now_ms);
        if record.late_outcome.is_none() {
            record.late_outcome = Some(outcome);
        }
    }

    /// Log, count and keep in brief (the newest [`MAX_EVIDENCE_KEPT`]) what a
    /// dispatch reported that did not settle its step.
    fn note_evidence(
        &self,
        record: &mut StepRecord,
        dispatch: u32,
        status: &str,
        kind: Option<String>,
        why: &str,
        now_ms: i64,
    ) {
        self.metrics
            .late_outcome(&record.step, dispatch, record.dispatch, status, why);
        record.evidence.push(Evidence {
            dispatch,
            status: status.to_owned(),
            kind,
            why: why.to_owned(),
            at_ms: now_ms,
        });
        if let Some(over) = record.evidence.len().checked_sub(MAX_EVIDENCE_KEPT) {
            record.evidence.drain(..over);
        }
    }

    /// An outcome that says the action was not performed is told as such only
    /// when no other dispatch of the step may have run: for an effectful tool
    /// whose earlier dispatch is still unaccounted for (re-run after its
    /// deadline), it is in doubt.
    fn unless_earlier_may_have_run(&self, record: &StepRecord, outcome: Outcome) -> Outcome {
        let Outcome::Error { error } = &outcome else {
            return outcome;
        };
        let effectful = matches!(record.category, Category::Keyed | Category::Unkeyed);
        let not_performed = |status: &str, kind: Option<&str>| {
            status == "not_invoked"
                || (status == "error" && kind.is_some_and(|k| NOT_PERFORMED_KINDS.contains(&k)))
        };
        // An earlier run never heard from, or one that reported anything but
        // "not performed" (an `ok` of the same key, say), may have acted.
        let earlier_may_have_acted = record.open_dispatches.iter().any(|d| *d != record.dispatch)
            || record.evidence.iter().any(|e| {
                e.dispatch > record.settled_through
                    && e.dispatch < record.dispatch
                    && !not_performed(&e.status, e.kind.as_deref())
            });
        if !effectful
            || !earlier_may_have_acted
            || !NOT_PERFORMED_KINDS.contains(&error.kind.as_str())
        {
            return outcome;
        }
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "outcome_unknown".into(),
                message: Texts::in_doubt_earlier_try(&record.step.tool, &error.message),
            },
        }
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
        // A step settled a second time (an operator resolving it) already gave
        // its first caller a final answer: one final answer per call_id. The
        // new result answers the step's later calls.
        let answer_caller = record.result.is_none();
        record.phase = phase;
        let result =
            ToolResult::from_outcome(&record.step, record.call_id.clone(), outcome, at(now_ms));
        if answer_caller {
            self.outs.push(Out::Result {
                partition: record.reply_partition.unwrap_or(p),
                result: result.clone(),
                traceparent: record.traceparent.clone(),
                since_ms: record.intent_ts_ms,
            });
        }
        for w in record.waiters.drain(..) {
            self.outs.push(Out::Result {
                partition: w.reply_partition.unwrap_or(p),
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

    /// Act on every deadline that has passed: a call still running here gets
    /// more time (its outcome will come); otherwise re-run where that is safe,
    /// and declare the rest in doubt.
    pub fn on_deadlines(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.held.retain(|p, h| {
            let waiting = !h.progress_read || h.until_ms > now_ms;
            if waiting && now_ms > h.until_ms + HOLD_LIMIT_MS {
                tracing::warn!(partition = p, "the partition's progress was not read to its end within 5 minutes of its assignment: its deadlines are settled from now on");
                return false;
            }
            waiting
        });
        let mut waiting = Vec::new();
        while let Some((deadline, p, step)) = self.due.first().cloned() {
            if deadline > now_ms {
                break;
            }
            self.due.pop_first();
            if self.held.contains_key(&p) {
                waiting.push((deadline, p, step));
                continue;
            }
            let Some(mut record) = batch.step(store, p, &step)? else {
                continue;
            };
            if record.phase != Phase::Started || record.deadline_ms.is_some_and(|d| d != deadline) {
                continue; // settled or re-run since
            }
            // Handed back never invoked by a process that was stopping.
            if record.not_invoked == Some(record.dispatch) {
                self.rerun_not_invoked(p, &mut record, now_ms);
                batch.put_step(store, p, &record)?;
                continue;
            }
            let key = (p, step.clone());
            if self.running.get(&key) == Some(&record.dispatch)
                || self.awaiting_commit.get(&key) == Some(&record.dispatch)
            {
                // Running here (queued for a slot, retrying) or waiting for the
                // commit that starts it: the invocation reports itself.
                let later = now_ms + ms(self.tool_deadline(&step.tool));
                record.deadline_ms = Some(later);
                self.due.insert((later, p, step));
                batch.put_step(store, p, &record)?;
                continue;
            }
            // A pool's dispatch no worker took was never invoked: said so,
            // unless an earlier dispatch may have acted.
            if let Some(pool) = self.tools.get(&step.tool).and_then(|t| t.pool.clone())
                && record.taken != Some(record.dispatch)
            {
                let dispatch = record.dispatch;
                record.open_dispatches.retain(|d| *d != dispatch);
                self.metrics.pool_unclaimed(&pool, &step);
                let outcome = Outcome::Error {
                    error: ErrorBody {
                        kind: "no_worker".into(),
                        message: Texts::no_worker(&step.tool, &pool),
                    },
                };
                let outcome = self.unless_earlier_may_have_run(&record, outcome);
                let phase = Phase::settled_by(&outcome);
                self.settle(store, batch, p, record, outcome, phase, now_ms)?;
                continue;
            }
            if record.category.rerun_is_safe() {
                record.dispatch += 1;
                self.metrics.reforwarded(&step, record.dispatch);
                self.start(p, &mut record, now_ms, None);
                batch.put_step(store, p, &record)?;
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
        self.due.extend(waiting);
        Ok(())
    }

    /// Remove up to `limit` expired records of each partition (records this
    /// batch or the one committing already removed are not counted twice).
    pub fn purge(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        partitions: impl IntoIterator<Item = i32>,
        now_ms: i64,
        limit: usize,
    ) -> Result<Purged, StateError> {
        let mut out = Purged::default();
        for p in partitions {
            let expired = batch.expired(store, p, now_ms, limit)?;
            out.more |= expired.len() >= limit;
            for (expires_at, step) in expired {
                match batch.step(store, p, &step)? {
                    // Unresolved (in doubt, held for approval, started): kept
                    // until someone settles it, whatever the retention — its
                    // next retry must not find it gone and run it again. Its
                    // settlement sets a retention from then (`settle`).
                    Some(mut r) if r.expires_at_ms == expires_at && r.phase.unresolved() => {
                        r.expires_at_ms = KEPT_UNTIL_RESOLVED;
                        batch.put_step(store, p, &r)?;
                        out.kept += 1;
                    }
                    Some(r) if r.expires_at_ms == expires_at => {
                        batch.delete_step(store, p, &step)?;
                        if batch
                            .workflow_end(store, p, &step.workflow_id)?
                            .is_some_and(|e| e.step == step)
                        {
                            batch.delete_workflow_end(p, &step.workflow_id);
                        }
                        out.removed += 1;
                    }
                    _ => batch.delete_expiry(p, &step, expires_at),
                }
            }
        }
        self.metrics.purged(out.removed);
        if out.kept > 0 {
            tracing::info!(
                kept = out.kept,
                "unresolved steps past their retention kept until resolved (`stepgate steps list --unresolved`)"
            );
        }
        Ok(out)
    }
}

/// The expiry of a step record kept until resolved: never reached.
pub const KEPT_UNTIL_RESOLVED: i64 = i64::MAX;

/// Error kinds that say the tool did not perform the action.
const NOT_PERFORMED_KINDS: &[&str] = &[
    "tool_refused",
    "tool_unreachable",
    "tool_redirected",
    "no_worker",
];

/// Calls of commits reported failed kept for a later look (see `GateCore::unsure`).
const MAX_UNSURE: usize = 10_000;

/// What one purge round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// Step records removed.
    pub removed: usize,
    /// Unresolved step records past their retention, kept until resolved.
    pub kept: usize,
    /// Some partition had more expired records than the round's limit: the
    /// gate goes on at its next tick instead of waiting `purge_interval`.
    pub more: bool,
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
