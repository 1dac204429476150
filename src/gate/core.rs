//! The gate's decisions, free of Kafka: inputs, outcomes and time in; state
//! writes, messages and invocations out. One [`GateCore`] serves every partition
//! a gate owns.

use crate::config::Config;
use crate::contract::{ApprovalEvent, Call, DlqRecord, Progress, Status, StepKey, ToolResult};
pub use crate::kafka::Input;
use crate::state::{
    Batch, FastEntry, Indexed, Phase, StateError, StateStore, StepRecord, Tokens, WorkflowEnd,
};
use crate::telemetry::Metrics;
use crate::tools::ToolConfig;
use chrono::{DateTime, TimeZone, Utc};
use deferred::Deferred;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use timers::Purged;

/// What the core decided, in the order it decided it: a message to produce, or
/// a call to start — each [`When`] it takes effect, relative to the commit of
/// the batch that decided it. The session drains them after each input
/// ([`GateCore::take_outs`]): what goes `Now` it does at once, the rest it
/// keeps with the open batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Invoke a started step's tool: after the batch's commit, or at once (a
    /// fast path's call, a first-read keyed step's, one whose commit had
    /// landed after all).
    Invoke {
        partition: i32,
        call: Call,
        when: When,
    },
    /// A final answer to an agent, in the intent's partition.
    Result {
        partition: i32,
        result: ToolResult,
        traceparent: Option<String>,
        /// When the answered intent was published, for the answer-latency metric.
        since_ms: Option<i64>,
        /// `Now`: it rests only on committed state (a repeat of a committed
        /// `ok` or `error` outcome), and is sent before its batch commits
        /// (docs/design.md "Repeats answered at once").
        when: When,
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

/// When an [`Out`] takes effect: "before or after the commit" is one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// With the batch that decided it: a record in its transaction, a call
    /// started once it has committed.
    WithBatch,
    /// Before that batch commits: a call started at once, an answer sent at
    /// once outside the transaction (the batch's commit waits for its
    /// acknowledgement).
    Now,
}

impl Out {
    pub fn when(&self) -> When {
        match self {
            Out::Invoke { when, .. } | Out::Result { when, .. } => *when,
            Out::Approval { .. } | Out::Forward { .. } | Out::Dlq { .. } => When::WithBatch,
        }
    }
}

/// Settings the gate's decisions depend on: sizes, times, and how an intent
/// found outside its workflow's partition is met. None of them changes what
/// the gate writes to Kafka or when.
#[derive(Debug, Clone)]
pub struct GateSettings {
    pub retention: Duration,
    pub in_doubt_grace: Duration,
    pub max_intent_bytes: usize,
    pub wrong_partition: WrongPartition,
    /// Tests only: record a keyed step `started` before its call, as a large
    /// one is, to reach the two-record path with a small intent.
    #[cfg(test)]
    pub start_record: bool,
}

/// What the gate does with an intent outside its workflow's partition
/// (`gate.check_partition`, `gate.forward_wrong_partition`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrongPartition {
    /// Re-route it to its workflow's partition, answered where it was published.
    Forward,
    /// Refuse it (`wrong_partition`).
    Refuse,
    /// Take it where it is (agents that partition otherwise, knowingly).
    Accept,
}

impl WrongPartition {
    pub fn of(config: &crate::config::GateConfig) -> Self {
        match (config.check_partition, config.forward_wrong_partition) {
            (false, _) => WrongPartition::Accept,
            (true, true) => WrongPartition::Forward,
            (true, false) => WrongPartition::Refuse,
        }
    }
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
    /// What it decided since the session last took it ([`Out`]).
    outs: Vec<Out>,
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
    /// Steps of re-runnable tools whose call runs before anything is written
    /// (recorded once settled); lent to each input's `Apply`.
    deferred: Deferred,
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
    /// Where each dispatch's token comes from (`StepRecord::tokens`).
    tokens: Tokens,
    /// Each pool's key (`[pools.<name>] key`, resolved at start): a worker's
    /// Outcome v1 counts only when signed with its tool's pool's key.
    pool_keys: HashMap<String, Vec<u8>>,
}

/// What one input is applied to: the committed state, the batch its writes
/// go to (read through: what this batch and the one committing wrote comes
/// first), and the time it is decided at. Built once per input — once per
/// tick for deadlines and purges — by the entry points, and passed `&mut` to
/// the handlers of each kind, as Restate's state machine hands each command
/// its apply context. What a handler decides beyond the state (messages,
/// calls, deadlines) goes to the [`GateCore`]; helpers that only shape a
/// record or an answer (`start`, `reject`, `note_evidence`) take the time alone.
struct Apply<'a> {
    store: &'a StateStore,
    batch: &'a mut Batch,
    /// Records of steps recorded once settled (`core/deferred.rs`): read
    /// first, and kept there while their call runs.
    deferred: &'a mut Deferred,
    now_ms: i64,
    /// An intent's partition's applied mark (the session's, kept with the
    /// group's committed offset): the first intent offset no committed batch
    /// decided. None for other inputs.
    applied: Option<i64>,
    /// The step [`Apply::step`] last read from the batch, and its index
    /// fields then: a handler reads a step, then writes it, and the write
    /// need not read it again. Only `Apply`'s own writes change a step's
    /// record while it lives (one input, applied synchronously), and each
    /// of them forgets what it touches.
    last_read: RefCell<Option<(i32, StepKey, Option<Indexed>)>>,
}

impl<'a> Apply<'a> {
    /// Whether an intent at `offset` is read again below the applied mark: a
    /// batch that committed decided it (re-read because the committed offset
    /// was held at an unanswered call before it).
    fn replayed(&self, offset: i64) -> bool {
        self.applied.is_some_and(|a| offset < a)
    }

    /// A step's record as the batch sees it (a deferred step's, in memory).
    fn step(&self, p: i32, step: &StepKey) -> Result<Option<StepRecord>, StateError> {
        if let Some(r) = self.deferred.get(p, step) {
            return Ok(Some(r.clone()));
        }
        let r = self.batch.step(self.store, p, step)?;
        *self.last_read.borrow_mut() = Some((p, step.clone(), r.as_ref().map(Indexed::of)));
        Ok(r)
    }

    /// What [`Apply::step`] last read of `step`, if that was the last step
    /// read, taken (any write of it makes it stale).
    fn take_read(&mut self, p: i32, step: &StepKey) -> Option<Option<Indexed>> {
        match self.last_read.take() {
            Some((q, s, old)) if q == p && s == *step => Some(old),
            _ => None,
        }
    }

    /// Write a step's record: in memory while a deferred step's call runs,
    /// else in the batch (a deferred step settled is written once, here).
    fn put_step(&mut self, p: i32, record: &StepRecord) -> Result<(), StateError> {
        let read = self.take_read(p, &record.step);
        match self.deferred.update(p, record) {
            deferred::Update::Kept => return Ok(()),
            deferred::Update::Left => {
                self.batch.put_first_step(self.store, p, record);
                return Ok(());
            }
            deferred::Update::NotDeferred => {}
        }
        match read {
            Some(old) => {
                self.batch.put_step_known(p, old, record);
                Ok(())
            }
            None => self.batch.put_step(self.store, p, record),
        }
    }

    fn delete_step(&mut self, p: i32, step: &StepKey) -> Result<(), StateError> {
        self.last_read.take();
        self.deferred.remove(p, step);
        self.batch.delete_step(self.store, p, step)
    }

    /// A deferred step's record (in memory), if the step is deferred.
    fn deferred_step(&self, p: i32, step: &StepKey) -> Option<StepRecord> {
        self.deferred.get(p, step).cloned()
    }

    /// A step's record whose call may run before anything is written: its
    /// intent (at `offset`) holds the partition's committed offset back.
    fn defer_step(&mut self, p: i32, record: StepRecord, offset: i64) {
        self.deferred.insert(p, record, offset);
    }

    /// A deferred step's record written to the batch now, as `started`: a
    /// decision rests on it (a repeat waits on it, a call was refused by it,
    /// a step ending its workflow began), and a re-read of that decision's
    /// intent must find it. Nothing for a step not deferred.
    fn write_deferred(&mut self, p: i32, step: &StepKey) {
        self.last_read.take();
        if let Some(r) = self.deferred.remove(p, step) {
            self.batch.put_first_step(self.store, p, &r);
        }
    }

    /// [`Apply::write_deferred`] for every deferred step of a workflow.
    fn write_deferred_of(&mut self, p: i32, workflow_id: &str) {
        for step in self.deferred.of_workflow(p, workflow_id) {
            self.write_deferred(p, &step);
        }
    }

    /// Whether `result` is a step's final, committed answer: in the
    /// committed state (not only in a batch, or in memory), `ok` or `error`
    /// (never `in_doubt`, which an operator may still resolve). Such an answer
    /// rests on nothing a failed commit could undo, and no later input
    /// changes it: any gate that reads the step answers the same.
    fn committed_final(
        &self,
        p: i32,
        step: &StepKey,
        result: &ToolResult,
    ) -> Result<bool, StateError> {
        if self.deferred.contains(p, step) || result.status == Status::InDoubt {
            return Ok(false);
        }
        Ok(self
            .store
            .step(p, step)?
            .is_some_and(|r| r.phase == Phase::Completed && r.result.as_ref() == Some(result)))
    }

    /// Whether a step's record is in the committed state or the batch (not
    /// only in memory, deferred).
    fn recorded(&self, p: i32, step: &StepKey) -> Result<bool, StateError> {
        Ok(!self.deferred.contains(p, step) && self.batch.step(self.store, p, step)?.is_some())
    }

    /// Whether (and by which step) a workflow was ended by a `last_step` tool.
    fn workflow_end(&self, p: i32, workflow_id: &str) -> Result<Option<WorkflowEnd>, StateError> {
        self.batch.workflow_end(self.store, p, workflow_id)
    }

    /// Up to `limit` records of `p` expired by now that the batch has not removed.
    fn expired(&self, p: i32, limit: usize) -> Result<Vec<(i64, StepKey)>, StateError> {
        self.batch.expired(self.store, p, self.now_ms, limit)
    }
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

/// The inputs in: each builds its `Apply` once and hands it to the handler
/// of its kind (`core/intent.rs`, `command.rs`, `outcome.rs`, `timers.rs`).
/// Reads and writes go to `store` through `batch`; messages and calls to
/// [`GateCore::take_outs`].
impl GateCore {
    /// An intent from an agent; `applied` is its partition's applied mark
    /// (intents below it were decided by a batch that committed).
    pub fn on_intent(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        applied: i64,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.with_apply(store, batch, now_ms, Some(applied), |core, ax| {
            core.apply_intent(ax, input)
        })
    }

    /// An operator's command: settle an in-doubt step, approve or deny a held one.
    pub fn on_command(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.with_apply(store, batch, now_ms, None, |core, ax| {
            core.apply_command(ax, input)
        })
    }

    /// A record of `progress`: the outcome of a call whose partition moved
    /// while it ran, or a pool worker's.
    pub fn on_progress(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        input: &Input,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.with_apply(store, batch, now_ms, None, |core, ax| {
            core.apply_progress(ax, input)
        })
    }

    /// An invocation's outcome, for a partition `p` this gate owns.
    pub fn on_outcome(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        p: i32,
        progress: Progress,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.with_apply(store, batch, now_ms, None, |core, ax| {
            core.apply_outcome(ax, p, progress)
        })
    }

    /// Act on every deadline that has passed by `now_ms`.
    pub fn on_deadlines(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        now_ms: i64,
    ) -> Result<(), StateError> {
        self.with_apply(store, batch, now_ms, None, |core, ax| {
            core.apply_deadlines(ax)
        })
    }

    /// Remove up to `limit` expired records of each partition.
    pub fn purge(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        partitions: impl IntoIterator<Item = i32>,
        now_ms: i64,
        limit: usize,
    ) -> Result<Purged, StateError> {
        self.with_apply(store, batch, now_ms, None, |core, ax| {
            core.apply_purge(ax, partitions, limit)
        })
    }

    /// Build the input's `Apply` (lending it the deferred steps) and run
    /// `handler` with it.
    fn with_apply<R>(
        &mut self,
        store: &StateStore,
        batch: &mut Batch,
        now_ms: i64,
        applied: Option<i64>,
        handler: impl FnOnce(&mut Self, &mut Apply<'_>) -> R,
    ) -> R {
        let mut deferred = std::mem::take(&mut self.deferred);
        let out = handler(
            self,
            &mut Apply {
                store,
                batch,
                deferred: &mut deferred,
                now_ms,
                applied,
                last_read: RefCell::new(None),
            },
        );
        self.deferred = deferred;
        out
    }
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
                wrong_partition: WrongPartition::of(&config.gate),
                #[cfg(test)]
                start_record: false,
            },
            metrics,
            due: BTreeSet::new(),
            outs: Vec::new(),
            fast: BTreeMap::new(),
            running: HashMap::new(),
            deferred: Deferred::default(),
            awaiting_commit: HashMap::new(),
            unsure: Vec::new(),
            held: HashMap::new(),
            stopping: false,
            tokens: Tokens::from_os(),
            pool_keys: config
                .pools
                .iter()
                .filter_map(|(name, p)| Some((name.clone(), p.key_bytes()?.to_vec())))
                .collect(),
        }
    }

    /// Dispatch tokens from a fixed seed: a simulation replays exactly.
    #[cfg(test)]
    pub(crate) fn seed_tokens(&mut self, seed: u64) {
        self.tokens = Tokens::seeded(seed);
    }

    /// What it decided since the last call, in order ([`Out`]).
    pub fn take_outs(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.outs)
    }

    /// The lowest intent offset of `partition` whose fast-path answer is still
    /// awaited, or whose deferred step is not settled: the partition's
    /// committed offset must not pass it.
    pub fn first_unanswered(&self, partition: i32) -> Option<i64> {
        let fast = self
            .fast
            .range((partition, i64::MIN)..=(partition, i64::MAX))
            .next()
            .map(|((_, o), _)| *o);
        match (fast, self.deferred.first_offset(partition)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A step's record as the next input would see it (a deferred step's
    /// from memory), for the simulation's checks.
    #[cfg(test)]
    pub(crate) fn step_view(
        &self,
        store: &StateStore,
        batch: &Batch,
        p: i32,
        step: &StepKey,
    ) -> Result<Option<StepRecord>, StateError> {
        match self.deferred.get(p, step) {
            Some(r) => Ok(Some(r.clone())),
            None => batch.step(store, p, step),
        }
    }

    /// Whether a step's record is deferred (in memory only), for the
    /// simulation's checks.
    #[cfg(test)]
    pub(crate) fn is_deferred(&self, p: i32, step: &StepKey) -> bool {
        self.deferred.contains(p, step)
    }

    /// Steps whose call runs with no record written yet (a gauge).
    pub fn deferred_steps(&self) -> usize {
        self.deferred.len()
    }

    /// Forget everything in memory (a session restarts from committed state),
    /// except which invocations run.
    pub fn reset(&mut self) {
        self.awaiting_commit.clear();
        self.due.clear();
        self.outs.clear();
        self.fast.clear();
        self.deferred.clear();
        self.held.clear();
    }

    /// Load a partition's pending deadlines after it was assigned and restored.
    /// Its deadlines wait `in_doubt_grace` from `now_ms`, while the outcomes
    /// waiting on `progress` are read.
    pub fn load_partition(
        &mut self,
        store: &StateStore,
        partition: i32,
        now_ms: i64,
    ) -> Result<(), StateError> {
        for (step, d) in store.deadlines(partition)? {
            self.due.insert((d, partition, step));
        }
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
            // The very call's record committed (its token's, not a record
            // decided again since with the same dispatch number).
            let committed_not_run = record.phase == Phase::Started
                && record.dispatch == call.dispatch
                && record.token_matches(call.dispatch, call.token.as_deref())
                && !self.running.contains_key(&(p, call.step.clone()));
            if committed_not_run {
                tracing::info!(step = %call.step, "its commit was reported failed but had landed: invoking it now");
                self.invoked(p, &call);
                self.outs.push(Out::Invoke {
                    partition: p,
                    call,
                    when: When::Now,
                });
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
        self.deferred.drop_partition(partition);
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

    /// The intents topic's partition count, once known (read at each
    /// session's start and assignment: adding partitions moves workflows).
    pub fn intent_partitions(&self) -> Option<i32> {
        self.intent_partitions
    }

    pub fn set_intent_partitions(&mut self, n: i32) {
        self.intent_partitions = Some(n);
    }

    /// How long a tool's call may take before its step's deadline.
    fn tool_deadline(&self, tool: &str) -> Duration {
        self.tools
            .get(tool)
            .map(ToolConfig::deadline)
            .unwrap_or(Duration::from_secs(30))
    }
}

/// The expiry of a step record kept until resolved: never reached.
pub const KEPT_UNTIL_RESOLVED: i64 = i64::MAX;

/// Calls of commits reported failed kept for a later look (see `GateCore::unsure`).
const MAX_UNSURE: usize = 10_000;

mod command;
mod deferred;
mod intent;
mod outcome;
mod reject;
mod timers;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
