//! The gate: a consumer group over `intents`, operators' `commands` and the
//! `progress` of calls whose partition moved; the owner of a partition invokes
//! its tools ([`crate::executor::Invoker`]).
//!
//! One pass per step. A batch's decisions ([`GateCore`]) — step records, answers,
//! input offsets — are committed in one Kafka transaction, the step records as
//! changelog records; only after it commits are they applied to RocksDB (a cache
//! of the changelog) and the batch's calls started. So a new recorded step costs
//! two commits: `started` with the intent's offset, then the outcome with the
//! answer. While one batch commits, the next is decided; it is closed when that
//! commit returns (or at `gate.max_batch` inputs), so at low load an answer waits
//! for about one commit. If a commit fails, the batch after it is dropped and the
//! session restarts from what Kafka committed.

mod core;
mod lost;

pub use self::core::{GateCore, GateSettings, Input, Out};

use crate::config::Config;
use crate::contract::{Call, Progress, ToolResult};
use crate::executor::{Finished, Invoker};
use crate::kafka::{self, OutRecord, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::state::{Batch, StateError, StateStore};
use crate::telemetry::{Health, Metrics};
use futures::FutureExt;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[derive(Debug, Error)]
pub enum GateError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("state")]
    State(#[from] StateError),
    #[error("partitions were revoked while a batch was open; it is re-read from the last commit")]
    Rebalanced,
    #[error("no partitions assigned for {0:?}: rejoining with a fresh consumer")]
    Unassigned(Duration),
    #[error("restore")]
    Restore(#[from] crate::state::RestoreError),
    #[error("the commit task failed")]
    Join(#[from] tokio::task::JoinError),
    /// librdkafka stops a client for good on a fatal error (e.g. its static
    /// member id was taken by another consumer): only a new one goes on.
    #[error("the gate's consumer failed for good ({0}): starting a new one")]
    FatalConsumer(String),
    /// The topics' layout breaks deduplication (partition counts changed
    /// under running workflows, or unequal): the gate stops rather than
    /// deduplicate in the wrong partition.
    #[error("{0}")]
    Layout(String),
}

impl GateError {
    /// The `reason` label of `stepgate_gate_session_failures_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            e if e.refused_record().is_some() => "record_refused",
            GateError::Kafka(KafkaError::Transaction(_)) => "transaction",
            GateError::Kafka(_) => "kafka",
            GateError::State(_) => "state",
            GateError::Rebalanced => "rebalanced",
            GateError::Unassigned(_) => "unassigned",
            GateError::Restore(_) => "restore",
            GateError::Join(_) => "internal",
            GateError::FatalConsumer(_) => "fatal_consumer",
            GateError::Layout(_) => "layout",
        }
    }

    /// The broker (or the producer's own limit) refused a record for what it
    /// is — too large for the topic, a topic this gate may not write, an
    /// invalid record — rather than for its own state: sent again, it fails
    /// again. Its code's name.
    fn refused_record(&self) -> Option<&'static str> {
        use rdkafka::types::RDKafkaErrorCode as C;
        let GateError::Kafka(KafkaError::MessageProduction(code)) = self else {
            return None;
        };
        match code {
            C::MessageSizeTooLarge => Some("message_size_too_large"),
            C::MessageBatchTooLarge => Some("message_batch_too_large"),
            C::TopicAuthorizationFailed => Some("topic_authorization_failed"),
            C::InvalidRecord => Some("invalid_record"),
            C::PolicyViolation => Some("policy_violation"),
            C::InvalidMessage => Some("invalid_message"),
            _ => None,
        }
    }
}

/// The offset-metadata tag carrying, per intents partition, the first offset
/// not yet applied: the committed offset may lag it (held at an unanswered
/// fast-path call), and intents re-read below it are not applied twice.
const APPLIED_TAG: &str = "stepgate-applied:";

/// The committed offset's metadata: the applied mark and the intents topic's
/// partition count it was written with (`stepgate-applied:<n> partitions:<m>`).
fn applied_metadata(applied: i64, partitions: Option<i32>) -> String {
    match partitions {
        Some(n) => format!("{APPLIED_TAG}{applied} partitions:{n}"),
        None => format!("{APPLIED_TAG}{applied}"),
    }
}

/// [`applied_metadata`] read back (either part may be missing: written by an
/// earlier version, or by another tool).
fn parse_applied(meta: &str) -> (Option<i64>, Option<i32>) {
    let Some(rest) = meta.strip_prefix(APPLIED_TAG) else {
        return (None, None);
    };
    let mut parts = rest.split_whitespace();
    let applied = parts.next().and_then(|s| s.parse().ok());
    let partitions = parts
        .find_map(|p| p.strip_prefix("partitions:"))
        .and_then(|s| s.parse().ok());
    (applied, partitions)
}

/// The topics' partition counts ([`kafka::layout_counts`]), as read now,
/// against what the state was written with: a changed layout, or one the
/// start-up check refuses, stops the gate.
fn check_layout(
    core: &mut GateCore,
    t: &crate::config::TopicsConfig,
    n: &kafka::Layout,
) -> Result<(), GateError> {
    let intents = n.intents as i32;
    if let Some(was) = core.intent_partitions()
        && was != intents
    {
        return Err(layout_changed(&t.intents, was, intents));
    }
    kafka::check_counts(t, n).map_err(|e| {
        GateError::Layout(format!(
            "{e} The running gate stops rather than answer in the wrong partition (docs/runbook.md \"Growing partitions\")."
        ))
    })?;
    core.set_intent_partitions(intents);
    Ok(())
}

/// [`kafka::layout_counts`] in a task (a broker outage must not hold the loop).
fn read_layout(
    k: &crate::config::KafkaConfig,
) -> JoinHandle<Result<kafka::Layout, kafka::KafkaSetupError>> {
    let k = k.clone();
    tokio::task::spawn_blocking(move || kafka::layout_counts(&k))
}

/// How often a running gate reads the topics' partition counts again (a
/// consumer sees new partitions only at its next metadata refresh, minutes later).
const LAYOUT_EVERY: Duration = Duration::from_secs(10);

fn layout_changed(intents: &str, was: i32, now: i32) -> GateError {
    GateError::Layout(format!(
        "`{intents}` has {now} partitions, but this deployment's state was written with {was}: a workflow lives in partition murmur2(workflow_id) % partitions, so workflows have moved away from their recorded steps, and a retry of a recorded step would run again. stepgate stops rather than deduplicate in the wrong partition. Never change the partition count in place: create a new topic set with the count you want and cut agents over to it (docs/runbook.md \"Growing partitions\"); to go back, restore the old count."
    ))
}

/// Per-partition bookkeeping of an owned partition.
struct Owned {
    /// First intents offset not yet applied (consumed and decided).
    applied: i64,
    /// The intents offset last committed for this partition.
    committed: i64,
}

/// Run the gate until `shutdown`; recoverable failures restart the session from
/// the last committed offsets. Calls running when a session ends keep running,
/// and their outcomes are settled by the next session (or handed to the
/// partition's new owner).
pub async fn run(
    config: Arc<Config>,
    store: Arc<StateStore>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), GateError> {
    let mut core = GateCore::new(&config, metrics.clone());
    let (invoker, mut outcomes) = Invoker::new(&config, metrics.clone());
    // Outcomes received but not yet committed, carried into the next session.
    let mut carry: Vec<Finished> = Vec::new();
    let mut poison = Poison::default();
    let mut last_commits = lost::LastCommits::default();
    let mut backoff = RESTART_BACKOFF;
    loop {
        health.beat();
        let began = Instant::now();
        let mut session = Session {
            config: &config,
            store: &store,
            metrics: &metrics,
            health: &health,
            invoker: &invoker,
            owned: HashMap::new(),
            assigned: BTreeSet::new(),
            ever_assigned: false,
            backlog: std::mem::take(&mut carry),
            progress_ends: HashMap::new(),
            linger: Linger::default(),
            poison: &mut poison,
            last_commits: &mut last_commits,
            paused: BTreeSet::new(),
            trust: None,
        };
        let result = session.run(&mut core, &mut outcomes, &shutdown).await;
        if !session.paused.is_empty() {
            // The consumer (and its pause) is gone with the session.
            metrics.intents_paused(false);
        }
        // Its partitions may go to another gate now: calls still queued here
        // are handed back not invoked (settled by the next session or owner).
        invoker.ownership().clear();
        carry.append(&mut session.backlog);
        health.set_gate_ready(false);
        core.reset();
        match result {
            // Stopped gracefully (its last batches committed and applied): the
            // next process on this state may trust it.
            Ok(()) => {
                store.end_gate()?;
                return Ok(());
            }
            Err(GateError::Rebalanced) => {
                info!("partitions revoked mid-batch: resuming from the last committed transaction");
            }
            // Not something a new session mends: stop, saying why.
            Err(e @ GateError::Layout(_)) => {
                metrics.session_failed(e.reason());
                return Err(e);
            }
            Err(e) => {
                metrics.session_failed(e.reason());
                error!(error = %crate::telemetry::error_chain(&e), reason = e.reason(), "gate session failed; resuming from the last committed transaction");
                // Failures far apart are not a failing loop: each restarts soon
                // (the partitions it held wait on it).
                if began.elapsed() > STABLE_SESSION {
                    backoff = RESTART_BACKOFF;
                }
                if !kafka::wait_before_restart(&shutdown, &mut backoff).await {
                    return Ok(());
                }
            }
        }
    }
}

struct Session<'a> {
    config: &'a Config,
    store: &'a Arc<StateStore>,
    metrics: &'a Arc<Metrics>,
    health: &'a Health,
    invoker: &'a Invoker,
    owned: HashMap<i32, Owned>,
    assigned: BTreeSet<i32>,
    /// Whether this session's consumer has been given its partitions yet: only
    /// then can an outcome's partition be known to belong elsewhere.
    ever_assigned: bool,
    /// Outcomes waiting for the session to know its partitions.
    backlog: Vec<Finished>,
    /// Per partition taken over, where its `progress` ended then: its
    /// deadlines wait until the consumer has read that far.
    progress_ends: HashMap<i32, i64>,
    linger: Linger,
    poison: &'a mut Poison,
    /// The producers' last acknowledged transactions, checked by the next session.
    last_commits: &'a mut lost::LastCommits,
    /// `intents` partitions paused while the invoker is full (backpressure).
    paused: BTreeSet<i32>,
    /// How old a partition's local state may be and still be resumed from
    /// (from the changelog's `delete.retention.ms`, read once per session).
    trust: Option<crate::state::Trust>,
}

/// Inputs whose processing failed on a record stepgate cannot read, counted
/// across sessions. Such a failure repeats each time the input is re-read, so
/// after [`Poison::SET_ASIDE_AFTER`] of them the input is set aside — dead-lettered
/// with the reason (and answered, when its caller can be told) — and the
/// partition moves on. Failures of the broker or the disk are not counted:
/// they pass, and the input is processed then.
#[derive(Default)]
struct Poison {
    failures: HashMap<(String, i32, i64), (u32, String)>,
    /// Batches whose records the broker refused for what they are (see
    /// [`GateError::refused_record`]), by their first input. Kept apart from
    /// `failures`: the input itself is processed fine each time.
    refused: HashMap<(String, i32, i64), (u32, String)>,
    /// After a refusal, this many batches of one input each follow, so the
    /// input whose records are refused is the first of its batch.
    careful: u32,
}

impl Poison {
    const SET_ASIDE_AFTER: u32 = 3;

    fn key(input: &Input) -> (String, i32, i64) {
        (input.topic.clone(), input.partition, input.offset)
    }

    fn failed(&mut self, input: &Input, error: &StateError) {
        let e = self.failures.entry(Self::key(input)).or_default();
        e.0 += 1;
        e.1 = crate::telemetry::error_chain(error);
    }

    /// One-input batches after a refused record.
    const CAREFUL_BATCHES: u32 = 64;

    /// A batch starting with `first` was refused (its session fails).
    fn refused(&mut self, first: (String, i32, i64), error: &GateError) {
        let e = self.refused.entry(first).or_default();
        e.0 += 1;
        e.1 = format!(
            "a record it produces is refused by Kafka: {}",
            crate::telemetry::error_chain(error)
        );
        self.careful = Self::CAREFUL_BATCHES;
    }

    /// A batch starting with `first` committed.
    fn committed(&mut self, first: Option<&(String, i32, i64)>) {
        if let Some(k) = first
            && !self.refused.is_empty()
        {
            self.refused.remove(k);
        }
        self.careful = self.careful.saturating_sub(1);
    }

    /// The error to set this input aside with, once it failed often enough.
    /// (Every input asks: nothing is built while no input has failed.)
    fn set_aside(&self, input: &Input) -> Option<&str> {
        if self.failures.is_empty() && self.refused.is_empty() {
            return None;
        }
        let key = Self::key(input);
        self.failures
            .get(&key)
            .or_else(|| self.refused.get(&key))
            .filter(|(n, _)| *n >= Self::SET_ASIDE_AFTER)
            .map(|(_, e)| e.as_str())
    }

    fn forget(&mut self, input: &Input) {
        if !self.failures.is_empty() {
            self.failures.remove(&Self::key(input));
        }
    }
}

/// Whether the next batch waits a little for the outcomes of calls just started.
///
/// A batch closes when the previous commit returns — which is also when the
/// calls it recorded start. A fast tool's outcome then arrives a moment after
/// the next batch closed and waits out that whole commit before its own. When
/// calls have lately taken well under half a commit, the next batch waits (at
/// most 1.5× their recent duration) for the calls just started, and their
/// outcomes ride in it: one commit less of latency for the cost of a short wait.
/// Slow tools (or a flood, where calls queue for the pool) make it wait for nothing.
#[derive(Default)]
struct Linger {
    /// Moving averages: hand-over → outcome, and a batch's commit.
    call: Duration,
    commit: Duration,
    /// Calls started by the last landed batch and not yet finished, and until when to wait for them.
    outstanding: usize,
    until: Option<tokio::time::Instant>,
}

impl Linger {
    fn ewma(avg: &mut Duration, sample: Duration) {
        *avg = if avg.is_zero() {
            sample
        } else {
            (*avg * 7 + sample) / 8
        };
    }

    fn landed(&mut self, calls: usize, commit: Duration) {
        Self::ewma(&mut self.commit, commit);
        let wait = self.call * 3 / 2;
        if calls > 0 && !self.call.is_zero() && wait < self.commit / 2 {
            self.outstanding = calls;
            self.until = Some(tokio::time::Instant::now() + wait);
        } else {
            self.until = None;
        }
    }

    fn finished(&mut self, took: Duration) {
        Self::ewma(&mut self.call, took);
        self.outstanding = self.outstanding.saturating_sub(1);
        if self.outstanding == 0 {
            self.until = None;
        }
    }

    /// The deadline while the next batch should wait.
    fn waiting(&mut self) -> Option<tokio::time::Instant> {
        if self.until.is_some_and(|t| t <= tokio::time::Instant::now()) {
            self.until = None;
        }
        self.until
    }
}

/// What one batch has gathered.
struct Pending {
    batch: Batch,
    inputs: usize,
    /// Per intents partition, the next offset after the last intent consumed.
    intents_next: BTreeMap<i32, i64>,
    /// Next offsets of the other inputs (progress, commands).
    others_next: BTreeMap<(String, i32), i64>,
    /// Outcomes decided in this batch (carried to the next session if it fails).
    outcomes: Vec<Finished>,
    /// Outcomes of partitions owned elsewhere, handed over through `progress`.
    orphans: Vec<Finished>,
    /// Its first input (topic, partition, offset): the one set aside if its
    /// records keep being refused.
    first_input: Option<(String, i32, i64)>,
}

impl Pending {
    fn on_top_of(below: Option<Arc<Batch>>) -> Pending {
        Pending {
            batch: Batch::on_top_of(below),
            inputs: 0,
            intents_next: BTreeMap::new(),
            others_next: BTreeMap::new(),
            outcomes: Vec::new(),
            orphans: Vec::new(),
            first_input: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.inputs == 0 && self.batch.is_empty() && self.outcomes.is_empty()
    }
}

/// The gate's transactional producers, used in turn: one batch's commit returns
/// before the broker has written its transaction markers, and a transactional
/// producer's next transaction is refused (`CONCURRENT_TRANSACTIONS`, retried by
/// librdkafka after 20 ms) until they are written. With two, back-to-back
/// batches never wait for that: each producer's previous transaction has had a
/// whole commit to complete. Both ids derive from the instance, so a restarted
/// instance fences its predecessor's; the group metadata sent with the offsets
/// fences a zombie member (KIP-447) whichever producer it uses.
struct Producers {
    all: [FutureProducer; 2],
    turn: usize,
}

impl Producers {
    async fn init(k: &crate::config::KafkaConfig) -> Result<Producers, GateError> {
        let id = format!("{}-gate-{}", k.gate_group, k.instance_id);
        let id_b = format!("{id}-b");
        let (a, b) = tokio::try_join!(
            kafka::init_txn_producer(k, &id),
            kafka::init_txn_producer(k, &id_b),
        )?;
        Ok(Producers {
            all: [a, b],
            turn: 0,
        })
    }

    /// The producer of the next batch, and which of them it is.
    fn next(&mut self) -> (usize, FutureProducer) {
        self.turn = (self.turn + 1) % self.all.len();
        (self.turn, self.all[self.turn].clone())
    }
}

/// What a batch's commit task reports once the broker acknowledged it.
struct Landed {
    /// Per partition, the changelog offset after its last record.
    changelog_next: BTreeMap<i32, i64>,
    /// Where each record landed (partition, offset), in order.
    landed: Vec<(i32, i64)>,
    /// A test hook aborted it instead (see `crash_point::lose_commit_marker`).
    marker_lost: bool,
}

/// A batch whose transaction is being committed.
struct InFlight {
    task: JoinHandle<Result<Landed, GateError>>,
    batch: Arc<Batch>,
    /// Its records and input offsets, kept once it commits (`lost`).
    records: Arc<Vec<OutRecord>>,
    input_offsets: Vec<lost::InputOffset>,
    /// Which of the producers commits it.
    slot: usize,
    invokes: Vec<(i32, Call)>,
    /// Calls of pool tools published in it (for their pools' workers).
    published: Vec<(i32, Call, String)>,
    results: Vec<(String, bool, Option<i64>)>,
    outcomes: Vec<Finished>,
    /// Per intents partition: (applied, committed) once this batch commits.
    offsets: BTreeMap<i32, (i64, i64)>,
    started: Instant,
    first_input: Option<(String, i32, i64)>,
}

impl Session<'_> {
    async fn run(
        &mut self,
        core: &mut GateCore,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let k = &self.config.kafka;
        let (ctx, mut events) = RebalanceContext::new(self.metrics.clone(), &k.gate_group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(k, &k.gate_group, &format!("{}-gate", k.instance_id))
                .create_with_context(ctx)?,
        );
        let mut producer = Producers::init(k).await?;
        consumer.subscribe(&[&k.topics.intents, &k.topics.progress, &k.topics.commands])?;
        info!(intents = %k.topics.intents, progress = %k.topics.progress, commands = %k.topics.commands, "gate consuming");

        let mut in_flight: Option<InFlight> = None;
        let mut pending = Pending::on_top_of(None);
        let result = self
            .serve(
                core,
                &consumer,
                &mut producer,
                &mut events,
                outcomes,
                &mut pending,
                &mut in_flight,
                shutdown,
            )
            .await;
        // A commit in flight ends either way: what committed is honoured (applied,
        // its calls started); what did not is re-read.
        let landed = match in_flight.take() {
            Some(f) => self.land(core, f).await,
            None => Ok(()),
        };
        let result = match (result, landed) {
            (Ok(()), Ok(())) => {
                self.shut_down(core, &consumer, &mut producer, outcomes, pending)
                    .await
            }
            (Err(e), _) | (Ok(()), Err(e)) => {
                self.backlog.extend(pending.outcomes);
                Err(e)
            }
        };
        // Off the async threads and bounded: a consumer's close waits for the
        // group to let it go, and rust-rdkafka's drop polls for that without
        // limit — a close that cannot complete (a member fenced mid-rebalance)
        // would otherwise leave the gate silent, never restarting its session.
        let close = async move {
            kafka::close_within("the gate's producers", producer, CLOSE_LIMIT).await;
            kafka::close_within("the gate's consumer", consumer, CLOSE_LIMIT).await;
        };
        if result.is_ok() {
            close.await;
        } else {
            // A failed session's partitions may already be another gate's,
            // which holds their deadlines only `in_doubt_grace` for calls
            // handed back: give up ownership now, so the queued calls come
            // back not invoked at once, and let the next session (which
            // publishes the hand-overs) start without waiting on the old
            // clients' close. Its consumer's static member id and producers'
            // transactional ids fence these.
            self.invoker.ownership().clear();
            tokio::spawn(close);
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn serve(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &mut Producers,
        events: &mut mpsc::UnboundedReceiver<RebalanceEvent>,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        pending: &mut Pending,
        in_flight: &mut Option<InFlight>,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let k = &self.config.kafka;
        let purge_interval = self.config.state.purge_interval.0;
        let mut last_purge = Instant::now();
        let mut purge_backlog = false;
        let mut last_size = Instant::now();
        let grace = self.config.gate.in_doubt_grace.0;
        let mut healthy_since = Instant::now();
        let stuck_after = k.session_timeout.0 * 3;
        let mut unassigned_since = Instant::now();
        let mut last_layout = Instant::now();
        let mut layout: Option<JoinHandle<Result<kafka::Layout, kafka::KafkaSetupError>>> = None;
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let max_batch = if self.poison.careful > 0 {
                1
            } else {
                self.config.gate.max_batch
            };
            self.health.beat();
            stall_point::maybe_stall();
            let linger = self.linger.waiting();
            let step = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(ev) = events.recv() => Step::Rebalance(ev),
                done = wait_commit(in_flight) => Step::Committed(done.map_err(GateError::from).and_then(|r| r)),
                Some(f) = outcomes.recv() => Step::Outcome(f),
                _ = tick.tick() => Step::Tick,
                _ = tokio::time::sleep_until(linger.unwrap_or_else(tokio::time::Instant::now)), if linger.is_some() => Step::Lingered,
                msg = consumer.recv(), if pending.inputs < max_batch => {
                    Step::Input(msg.map(|m| kafka::to_input(&m)))
                }
            };
            match step {
                Step::Rebalance(ev) => {
                    if let RebalanceEvent::Revoked(parts) = &ev {
                        // A revoke waits for the commit in flight: it either
                        // landed (and is honoured) or is re-read by the next owner.
                        if let Some(f) = in_flight.take() {
                            self.land(core, f).await?;
                        }
                        let all = self
                            .assigned
                            .iter()
                            .all(|p| parts.iter().any(|(_, q)| q == p));
                        if all && (!pending.is_empty() || core.has_outs()) {
                            self.discard_open_batch(core, pending);
                        }
                    }
                    let open = !pending.is_empty() || core.has_outs();
                    self.on_rebalance(core, consumer, producer, ev, open)
                        .await?;
                    if self.ever_assigned {
                        for f in std::mem::take(&mut self.backlog) {
                            self.on_finished(core, consumer, pending, f).await?;
                        }
                    }
                }
                Step::Committed(r) => {
                    let f = in_flight.take().expect("a commit was in flight");
                    self.landed(core, f, r)?;
                }
                Step::Outcome(f) => self.on_finished(core, consumer, pending, f).await?,
                Step::Lingered => {}
                Step::Tick => {
                    if let Some((code, reason)) = consumer.client().fatal_error() {
                        return Err(GateError::FatalConsumer(format!("{code:?}: {reason}")));
                    }
                    // A member left without partitions for this long (e.g.
                    // fenced while the broker restarted) starts over.
                    if self.assigned.is_empty() && unassigned_since.elapsed() > stuck_after {
                        return Err(GateError::Unassigned(stuck_after));
                    }
                    if !self.assigned.is_empty() {
                        unassigned_since = Instant::now();
                    }
                    self.check_progress_read(core, consumer);
                    // The layout, read again now and then (in a task: a
                    // broker outage must not hold the loop).
                    if layout.as_ref().is_some_and(JoinHandle::is_finished) {
                        match layout.take().expect("checked").await {
                            Ok(Ok(n)) => check_layout(core, &k.topics, &n)?,
                            Ok(Err(e)) => {
                                warn!(error = %e, "could not read the topics' partition counts")
                            }
                            Err(e) => warn!(error = %e, "partition count task failed"),
                        }
                    } else if layout.is_none() && last_layout.elapsed() >= LAYOUT_EVERY {
                        last_layout = Instant::now();
                        layout = Some(read_layout(k));
                    }
                    let now = now_ms();
                    // Outcomes may be queued behind an outage (ours or the
                    // broker's): only settle deadlines after a grace period of
                    // health, so an outage never turns a known outcome into doubt.
                    if healthy_since.elapsed() >= grace {
                        core.on_deadlines(self.store, &mut pending.batch, now)?;
                    }
                    // A backlog (more expired than one chunk) goes on at the
                    // next tick, so purging keeps up with any step rate.
                    if purge_backlog || last_purge.elapsed() >= purge_interval {
                        if !purge_backlog {
                            last_purge = Instant::now();
                        }
                        let parts: Vec<i32> = self.owned.keys().copied().collect();
                        let purged =
                            core.purge(self.store, &mut pending.batch, parts, now, PURGE_CHUNK)?;
                        purge_backlog = purged.more;
                    }
                    if last_size.elapsed() >= STATE_SIZE_EVERY {
                        last_size = Instant::now();
                        self.report_state_size();
                        self.count_open_steps();
                    }
                }
                Step::Input(first) => {
                    let mut next = Some(first);
                    // Take in what is already here before the batch closes.
                    while let Some(msg) = next.take() {
                        match msg {
                            Ok(input) => self.on_input(core, consumer, pending, input).await?,
                            Err(e) => {
                                warn!(error = %e, "consumer error (librdkafka retries by itself)");
                                healthy_since = Instant::now();
                                break;
                            }
                        }
                        if pending.inputs < max_batch {
                            next = consumer
                                .recv()
                                .now_or_never()
                                .map(|m| m.map(|m| kafka::to_input(&m)));
                        }
                    }
                }
            }
            // Fast-path calls start at once: they record nothing first.
            for (p, call) in core.take_immediate() {
                self.invoker.start(p, call);
            }
            self.apply_backpressure(consumer);
            // Group commit: a batch closes when the previous commit returns
            // (and the outcomes worth waiting for are in).
            if in_flight.is_none()
                && (!pending.is_empty() || core.has_outs())
                && self.linger.waiting().is_none()
            {
                let closing = std::mem::replace(pending, Pending::on_top_of(None));
                let f = self.send(core, consumer, producer, closing)?;
                *pending = Pending::on_top_of(Some(f.batch.clone()));
                *in_flight = Some(f);
            }
        }
    }

    /// Backpressure, as Kafka Streams and Vector do it: while the invoker is
    /// full, the `intents` partitions are paused — the consumer keeps polling
    /// (outcomes, commands, the group's heartbeat go on) but fetches no
    /// intents, which wait in Kafka; resumed once it has drained to room
    /// ([`Invoker::has_room`]). Nothing is refused or lost: a paused partition
    /// resumes from the position after its last input read.
    fn apply_backpressure(&mut self, consumer: &Arc<TxnConsumer>) {
        let full = if self.paused.is_empty() {
            self.invoker.is_full()
        } else {
            !self.invoker.has_room()
        };
        let intents = &self.config.kafka.topics.intents;
        let list = |ps: &[i32]| {
            let mut tpl = TopicPartitionList::new();
            for &p in ps {
                tpl.add_partition(intents, p);
            }
            tpl
        };
        if full {
            // Partitions assigned while paused are paused too.
            let more: Vec<i32> = self.assigned.difference(&self.paused).copied().collect();
            if more.is_empty() {
                return;
            }
            match consumer.pause(&list(&more)) {
                Ok(()) => {
                    if self.paused.is_empty() {
                        info!(
                            queued = self.invoker.running(),
                            "the invoker is full: intents paused until it drains (executor.max_queued_calls / max_queued_bytes)"
                        );
                        self.metrics.intents_paused(true);
                    }
                    self.paused.extend(more);
                }
                Err(e) => warn!(error = %e, "could not pause the intents partitions"),
            }
        } else if !self.paused.is_empty() {
            let back: Vec<i32> = self.paused.intersection(&self.assigned).copied().collect();
            if let Err(e) = consumer.resume(&list(&back)) {
                warn!(error = %e, "could not resume the intents partitions; trying again");
                return;
            }
            info!(
                queued = self.invoker.running(),
                "the invoker has room: intents resumed"
            );
            self.paused.clear();
            self.metrics.intents_paused(false);
        }
    }

    /// Every partition is revoked while a batch is open (the range assignor's
    /// eager rebalances revoke all): nothing of the batch is durable, so drop
    /// it and go on from what is committed, as a new owner would — librdkafka
    /// reads a partition assigned again from its committed offset, and the
    /// outcomes the batch held are decided again. The consumer stays: a new
    /// one's static rejoin mid-rebalance would start another rebalance, and
    /// under load two gates could keep each other rebalancing.
    fn discard_open_batch(&mut self, core: &mut GateCore, pending: &mut Pending) {
        let open = std::mem::replace(pending, Pending::on_top_of(None));
        info!(
            inputs = open.inputs,
            "partitions revoked mid-batch: the open batch is dropped, its inputs are read again from the last commit"
        );
        self.backlog.extend(open.outcomes);
        core.reset();
    }

    async fn on_input(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        pending: &mut Pending,
        input: Input,
    ) -> Result<(), GateError> {
        let topics = &self.config.kafka.topics;
        self.ensure_owned(core, consumer, input.partition).await?;
        let now = now_ms();
        let processed = if let Some(error) = self.poison.set_aside(&input) {
            warn!(topic = %input.topic, partition = input.partition, offset = input.offset, %error, "setting aside an input whose processing failed {} times", Poison::SET_ASIDE_AFTER);
            core.set_aside(&input, input.topic == topics.intents, error, now);
            Ok(())
        } else if input.topic == topics.intents {
            core.on_intent(self.store, &mut pending.batch, &input, now)
        } else if input.topic == topics.commands {
            core.on_command(self.store, &mut pending.batch, &input, now)
        } else {
            core.on_progress(self.store, &mut pending.batch, &input, now)
        };
        match processed {
            Ok(()) => self.poison.forget(&input),
            Err(e) => {
                if matches!(e, StateError::Corrupt { .. }) {
                    self.poison.failed(&input, &e);
                }
                return Err(e.into());
            }
        }
        if input.topic == topics.intents {
            pending
                .intents_next
                .insert(input.partition, input.offset + 1);
        } else {
            pending
                .others_next
                .insert((input.topic.clone(), input.partition), input.offset + 1);
        }
        pending.inputs += 1;
        if pending.first_input.is_none() {
            pending.first_input = Some(Poison::key(&input));
        }
        Ok(())
    }

    /// An invocation of this process finished: settle it here if this session
    /// owns its partition, hand it to the owner through `progress` if another
    /// member does, or hold it until the session knows.
    async fn on_finished(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        pending: &mut Pending,
        f: Finished,
    ) -> Result<(), GateError> {
        let p = f.partition;
        self.linger.finished(f.took);
        core.finished(p, &f.progress.step, f.progress.dispatch);
        let fast = f.progress.fast_ref.is_some();
        if self.assigned.contains(&p) {
            self.ensure_owned(core, consumer, p).await?;
            core.on_outcome(
                self.store,
                &mut pending.batch,
                p,
                f.progress.clone(),
                now_ms(),
            )?;
            if !fast {
                pending.outcomes.push(f);
            }
        } else if fast {
            // Its intent is re-read by the partition's owner: nothing to hand over.
        } else if self.ever_assigned {
            self.metrics.outcome_handed_over(p, &f.progress.step);
            pending.orphans.push(f.clone());
            pending.outcomes.push(f);
        } else {
            self.backlog.push(f);
        }
        Ok(())
    }

    async fn on_rebalance(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &Producers,
        ev: RebalanceEvent,
        batch_open: bool,
    ) -> Result<(), GateError> {
        match ev {
            RebalanceEvent::Assigned(parts) => {
                let ps: BTreeSet<i32> = parts.iter().map(|(_, p)| *p).collect();
                info!(partitions = ?ps, "partitions assigned");
                // Partitions added to `intents` trigger a rebalance: re-read
                // the count the partition check uses.
                let t = self.config.kafka.topics.clone();
                let counts = read_layout(&self.config.kafka).await;
                match &counts {
                    Ok(Ok(n)) => check_layout(core, &t, n)?,
                    Ok(Err(e)) => {
                        warn!(error = %e, "could not read the intents topic's partition count; keeping the last one")
                    }
                    Err(e) => warn!(error = %e, "partition count task failed"),
                }
                // Once per session, before the first committed-offset lookup:
                // end what a broker crash may have left hanging for our
                // transactional ids (see `kafka::end_hanging_transactions`).
                if !self.ever_assigned
                    && let (Ok(Ok(n)), Some(&p)) = (&counts, ps.iter().next())
                {
                    // The topics this gate writes: all but intents and commands.
                    let written: Vec<(String, i32)> = [
                        (&t.results, n.results),
                        (&t.dlq, n.dlq),
                        (&t.progress, n.progress),
                        (&t.changelog, n.changelog),
                        (&t.approvals, n.approvals),
                    ]
                    .into_iter()
                    .flat_map(|(name, n)| (0..n as i32).map(move |q| (name.clone(), q)))
                    .collect();
                    let started = Instant::now();
                    let ends = producer.all.iter().map(|pr| {
                        kafka::end_hanging_transactions(pr, consumer, &written, (&t.intents, p))
                    });
                    for r in futures::future::join_all(ends).await {
                        if let Err(e) = r {
                            // Not fatal: if something did hang, the offset
                            // lookup below waits, and a new session tries again.
                            warn!(error = %e, "could not end hanging transactions of this gate's producers");
                        }
                    }
                    info!(
                        partitions = written.len(),
                        ms = started.elapsed().as_millis() as u64,
                        "ended any transaction a broker crash left hanging for this gate's producers"
                    );
                    // Then what a broker may have lost of what it acknowledged.
                    lost::mend(
                        &self.config.kafka,
                        self.config.state.retention.0,
                        self.last_commits,
                        &producer.all[0],
                        consumer,
                        &ps,
                        self.metrics,
                    )
                    .await?;
                }
                self.ever_assigned = true;
                self.assigned.extend(ps.iter().copied());
                self.invoker.ownership().add(ps.iter().copied());
                for p in ps {
                    self.ensure_owned(core, consumer, p).await?;
                }
            }
            RebalanceEvent::Revoked(parts) => {
                let ps: BTreeSet<i32> = parts.iter().map(|(_, p)| *p).collect();
                info!(partitions = ?ps, "partitions revoked");
                if batch_open {
                    // The open batch may hold inputs of revoked partitions, or of
                    // re-assigned ones whose position already moved past them:
                    // drop it (nothing of it is durable yet) and re-read from the
                    // last commit with a fresh consumer.
                    return Err(GateError::Rebalanced);
                }
                // Calls of these partitions still waiting for a slot here are
                // not invoked: they are handed to the new owner.
                self.invoker.ownership().remove(ps.iter().copied());
                for p in ps {
                    self.assigned.remove(&p);
                    self.paused.remove(&p);
                    self.owned.remove(&p);
                    self.progress_ends.remove(&p);
                    core.drop_partition(p);
                }
            }
        }
        self.health.set_gate_ready(
            !self.assigned.is_empty() && self.assigned.iter().all(|p| self.owned.contains_key(p)),
        );
        Ok(())
    }

    /// Export how many steps of the owned partitions wait for a person (the
    /// gauges the alerts watch: a counter's increase would clear while a step
    /// is still unresolved).
    fn count_open_steps(&self) {
        let mut total = crate::state::OpenSteps::default();
        for &p in self.owned.keys() {
            match self.store.open_steps(p) {
                Ok(n) => {
                    total.in_doubt += n.in_doubt;
                    total.awaiting_approval += n.awaiting_approval;
                }
                Err(e) => {
                    warn!(partition = p, error = %e, "could not count the steps waiting for a person");
                    return;
                }
            }
        }
        self.metrics
            .open_steps(total.in_doubt, total.awaiting_approval);
    }

    fn report_state_size(&self) {
        let size = self.store.size();
        self.metrics
            .state_size(size.steps, size.disk_bytes, &size.memory());
    }

    /// Before a partition's first input: bring its local state up to the
    /// changelog's end, and load its pending deadlines.
    async fn ensure_owned(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        p: i32,
    ) -> Result<(), GateError> {
        if self.owned.contains_key(&p) {
            return Ok(());
        }
        // The group's committed offset (with the applied mark in its
        // metadata). A read_committed member's fetch waits while a transaction
        // of the group is unsettled, which after a broker restart can take a
        // while: asked again in place, the member keeps its place in the group
        // (a new session would rejoin, re-init its producers and ask again);
        // only a wait past COMMITTED_PATIENCE fails the session.
        let asking = Instant::now();
        let (committed, meta) = loop {
            let topics = self.config.kafka.topics.clone();
            let c = consumer.clone();
            let fetched = kafka::blocking(move || {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&topics.intents, p);
                let committed = c.committed_offsets(tpl, COMMITTED_ASK)?;
                let i = committed.find_partition(&topics.intents, p);
                // Nothing committed yet: from 0 — with auto.offset.reset=earliest
                // that also covers a log whose start moved. (Not a watermark query:
                // those were seen to time out for minutes after a broker restart.)
                let off = i
                    .as_ref()
                    .and_then(|e| e.offset().to_raw())
                    .filter(|o| *o >= 0)
                    .unwrap_or(0);
                let meta = i.map(|e| e.metadata().to_owned()).unwrap_or_default();
                drop(committed);
                Ok::<_, KafkaError>((off, meta))
            })
            .await;
            match fetched {
                Ok(v) => break v,
                Err(e)
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::OperationTimedOut)
                        && asking.elapsed() < COMMITTED_PATIENCE =>
                {
                    warn!(
                        partition = p,
                        error = %e,
                        waited_s = asking.elapsed().as_secs(),
                        "the group's committed offset of this partition is not available yet: a transaction of the group is still open (the broker settling one after a restart; or, past the transaction timeout, one left hanging by another process — docs/guarantees.md \"Faults and bad input\": kafka-transactions.sh find-hanging): asking again"
                    );
                    self.health.beat();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let (applied, written_with) = parse_applied(&meta);
        let applied = applied.map_or(committed, |a| a.max(committed));
        // The partition count the group's offsets were committed with: a
        // workflow's partition is murmur2 % count, so another count moves
        // workflows away from their recorded steps.
        if let (Some(was), Some(now)) = (written_with, core.intent_partitions())
            && was != now
        {
            return Err(layout_changed(&self.config.kafka.topics.intents, was, now));
        }
        let started = Instant::now();
        info!(
            partition = p,
            committed,
            changelog_from = ?self.store.changelog_next(p).ok().flatten(),
            "restoring the partition's state from the changelog"
        );
        let trust = match self.trust {
            Some(t) => t,
            None => {
                let d = kafka::changelog_delete_retention(&self.config.kafka).await;
                let t = crate::state::Trust::from_delete_retention(d);
                info!(delete_retention = ?d, max_age = ?t.max_age, "a partition's local state is resumed from only if it was in sync with the changelog more recently than max_age");
                *self.trust.insert(t)
            }
        };
        let store = self.store.clone();
        let cfg = self.config.kafka.clone();
        let mut restoring = tokio::task::spawn_blocking(move || {
            crate::state::restore_partition(&cfg, &store, p, &trust)
        });
        // A long restore is progress, not a stall.
        let restored = loop {
            tokio::select! {
                r = &mut restoring => break r??,
                _ = tokio::time::sleep(Duration::from_secs(1)) => self.health.beat(),
            }
        };
        if let Some(reason) = restored.reason {
            self.metrics.full_restore(p, reason.label());
        }
        let n = restored.records;
        info!(
            partition = p,
            records = n,
            full = restored.full,
            ms = started.elapsed().as_millis() as u64,
            "partition restored"
        );
        if n > 0 {
            self.metrics.restored(p, n, started.elapsed());
            self.report_state_size();
        }
        core.load_partition(self.store, p, applied, now_ms())?;
        self.hold_until_progress_read(core, consumer, p).await;
        self.owned.insert(p, Owned { applied, committed });
        self.assigned.insert(p);
        self.invoker.ownership().add([p]);
        self.health
            .set_gate_ready(self.assigned.iter().all(|q| self.owned.contains_key(q)));
        Ok(())
    }

    /// Note where the partition's `progress` ends now: the deadlines of the
    /// partition wait until it has been read that far (outcomes handed over
    /// while it moved are known first). Without the end (the broker did not
    /// say), only the grace period holds them.
    async fn hold_until_progress_read(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        p: i32,
    ) {
        let (c, topic) = (consumer.clone(), self.config.kafka.topics.progress.clone());
        let end = kafka::blocking(move || c.fetch_watermarks(&topic, p, WATERMARK_ASK)).await;
        match end {
            Ok((_, high)) if high > 0 => {
                self.progress_ends.insert(p, high);
            }
            Ok(_) => core.progress_read(p),
            Err(e) => {
                warn!(partition = p, error = %e, "could not read where the partition's progress ends: its deadlines wait the grace period only");
                core.progress_read(p);
            }
        }
    }

    /// Release the deadlines of partitions whose `progress` was read up to
    /// where it ended at their assignment (the consumer's position counts
    /// control records, which a message offset would not).
    fn check_progress_read(&mut self, core: &mut GateCore, consumer: &TxnConsumer) {
        if self.progress_ends.is_empty() {
            return;
        }
        let Ok(positions) = consumer.position() else {
            return;
        };
        let topic = &self.config.kafka.topics.progress;
        self.progress_ends.retain(|&p, &mut end| {
            let at = positions
                .find_partition(topic, p)
                .and_then(|e| e.offset().to_raw())
                .unwrap_or(-1);
            if at >= end {
                core.progress_read(p);
                return false;
            }
            true
        });
        drop(positions);
    }

    /// Close a batch: produce its messages and changelog records, its input
    /// offsets, and commit — in a task, while the next batch is decided.
    fn send(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &mut Producers,
        mut pending: Pending,
    ) -> Result<InFlight, GateError> {
        let started = Instant::now();
        pending.batch.detach();
        let t = &self.config.kafka.topics;
        let mut invokes = Vec::new();
        let mut published = Vec::new();
        let mut records = Vec::new();
        let mut results = Vec::new();
        let mut touched: BTreeSet<i32> = pending.batch.partitions();
        for o in core.take_outs() {
            match o {
                Out::Invoke { partition, call } => {
                    // A pool tool's call goes out in this transaction, with
                    // its `started` record: visible to workers once committed.
                    match pool_call_record(self.config, partition, &call) {
                        Some((pool, record)) => {
                            records.push(record);
                            published.push((partition, call, pool));
                        }
                        None => invokes.push((partition, call)),
                    }
                }
                Out::Result {
                    partition,
                    result,
                    traceparent,
                    since_ms,
                } => {
                    touched.insert(partition);
                    results.push((
                        result.status.as_str().to_owned(),
                        result.deduplicated,
                        since_ms,
                    ));
                    records.push(result_record(
                        &t.results,
                        partition,
                        &result,
                        traceparent.as_deref(),
                    ));
                }
                Out::Approval { partition, event } => records.push(OutRecord::json_for_workflow(
                    &t.approvals,
                    partition,
                    &event.step.workflow_id,
                    &event,
                )),
                Out::Forward {
                    partition,
                    key,
                    payload,
                    headers,
                    timestamp_ms,
                } => records.push(OutRecord {
                    topic: t.intents.clone(),
                    partition: Some(partition),
                    key,
                    payload,
                    headers,
                    timestamp_ms,
                }),
                Out::Dlq {
                    key,
                    headers,
                    record,
                } => records.push(OutRecord {
                    topic: t.dlq.clone(),
                    partition: None,
                    key,
                    payload: Some(record.to_json()),
                    headers,
                    timestamp_ms: None,
                }),
            }
        }
        for f in &pending.orphans {
            records.push(progress_record(&t.progress, f.partition, &f.progress));
        }
        records.extend(pending.batch.changelog().into_iter().map(|e| OutRecord {
            topic: t.changelog.clone(),
            partition: Some(e.partition),
            key: Some(e.key),
            payload: e.value,
            headers: Vec::new(),
            timestamp_ms: None,
        }));
        // Offsets: every intents partition this batch consumed from or writes
        // for (so a fenced member's transaction cannot commit), and any whose
        // committed offset may move now that a fast-path call was answered.
        let mut offsets = BTreeMap::new();
        let mut input_offsets = Vec::new();
        for (p, o) in &self.owned {
            let applied = pending
                .intents_next
                .get(p)
                .map_or(o.applied, |n| (*n).max(o.applied));
            let next = pending.intents_next.get(p).copied().unwrap_or(o.applied);
            let commit = core.first_unanswered(*p).map_or(next, |f| f.min(next));
            if commit == o.committed && applied == o.applied && !touched.contains(p) {
                continue;
            }
            offsets.insert(*p, (applied, commit));
            input_offsets.push(lost::InputOffset {
                topic: t.intents.clone(),
                partition: *p,
                offset: commit,
                metadata: Some(applied_metadata(applied, core.intent_partitions())),
            });
        }
        for ((topic, p), next) in &pending.others_next {
            input_offsets.push(lost::InputOffset {
                topic: topic.clone(),
                partition: *p,
                offset: *next,
                metadata: None,
            });
        }
        let tpl = lost::InputOffset::list(&input_offsets)?;
        let batch = Arc::new(pending.batch);
        let changelog = t.changelog.clone();
        let starts_calls = !invokes.is_empty();
        let answers = !results.is_empty();
        let records = Arc::new(records);
        let (slot, producer) = producer.next();
        let (consumer, sent_records) = (consumer.clone(), records.clone());
        let task = tokio::spawn(async move {
            let records = sent_records;
            let t0 = Instant::now();
            let (mut t1, mut marker_lost) = (t0, false);
            let landed = kafka::transact(&producer, &consumer, &records, tpl, || {
                t1 = Instant::now();
                crash_point::before_commit();
                marker_lost = crash_point::lose_commit_marker(answers);
                Ok::<_, GateError>(if marker_lost {
                    kafka::Ending::Abort
                } else {
                    kafka::Ending::Commit
                })
            })
            .await?;
            crash_point::lose_commit_reply(starts_calls)?;
            tracing::debug!(
                records = records.len(),
                send_us = (t1 - t0).as_micros() as u64,
                commit_us = t1.elapsed().as_micros() as u64,
                "batch committed"
            );
            // Where the changelog records landed: the local state will
            // reflect each partition's changelog up to there.
            let mut next = BTreeMap::new();
            for (r, &(p, o)) in records.iter().zip(&landed) {
                if r.topic == changelog {
                    let n = next.entry(p).or_insert(o + 1);
                    *n = (*n).max(o + 1);
                }
            }
            Ok::<_, GateError>(Landed {
                changelog_next: next,
                landed,
                marker_lost,
            })
        });
        Ok(InFlight {
            task,
            batch,
            records,
            input_offsets,
            slot,
            invokes,
            published,
            results,
            outcomes: pending.outcomes,
            offsets,
            started,
            first_input: pending.first_input,
        })
    }

    /// Wait for a batch's commit and act on it.
    async fn land(&mut self, core: &mut GateCore, mut f: InFlight) -> Result<(), GateError> {
        let r = (&mut f.task).await;
        self.landed(core, f, r.map_err(GateError::from).and_then(|r| r))
    }

    /// A batch's commit returned: on success apply it to the local state, move
    /// the offsets and start its calls; on failure keep its outcomes for the next
    /// session, which re-reads its inputs.
    fn landed(
        &mut self,
        core: &mut GateCore,
        f: InFlight,
        r: Result<Landed, GateError>,
    ) -> Result<(), GateError> {
        let landed = match r {
            Ok(l) => l,
            Err(e) => {
                self.backlog.extend(f.outcomes);
                core.commit_unknown(f.invokes);
                // Published or not with their records, nothing more to do:
                // workers see them only if that commit landed after all.
                for (p, call, _) in &f.published {
                    core.published(*p, call);
                }
                if let (Some(code), Some(first)) = (e.refused_record(), f.first_input) {
                    warn!(topic = %first.0, partition = first.1, offset = first.2, code, "Kafka refused a record of a batch: the next batches take one input each, and an input whose records are refused {} times is set aside", Poison::SET_ASIDE_AFTER);
                    self.poison.refused(first, &e);
                }
                return Err(e);
            }
        };
        self.poison.committed(f.first_input.as_ref());
        let t = Instant::now();
        self.store.apply(&f.batch, &landed.changelog_next)?;
        self.metrics.state_written(t.elapsed());
        self.last_commits.record(
            f.slot,
            lost::Committed {
                records: f.records,
                landed: landed.landed,
                offsets: f.input_offsets,
                at: Instant::now(),
            },
        );
        for (p, (applied, committed)) in f.offsets {
            if let Some(o) = self.owned.get_mut(&p) {
                o.applied = applied;
                o.committed = committed;
            }
        }
        self.linger.landed(f.invokes.len(), f.started.elapsed());
        for (p, call) in f.invokes {
            core.invoked(p, &call);
            self.invoker.start(p, call);
        }
        for (p, call, pool) in &f.published {
            core.published(*p, call);
            self.metrics.pool_call(pool, &call.step);
        }
        let now = now_ms();
        for (status, deduplicated, since_ms) in &f.results {
            let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
            self.metrics
                .result_published(status, *deduplicated, latency);
        }
        self.metrics.committed(f.started.elapsed());
        if landed.marker_lost {
            return Err(crash_point::session_lost());
        }
        Ok(())
    }

    /// SIGTERM: start no more calls; commit what is decided; let running
    /// calls finish within `executor.drain_timeout`, and commit their
    /// outcomes. Calls that had not started (queued for a slot, or decided in
    /// the last batch) are handed back not invoked and recorded so: the next
    /// owner runs them at once, never `in_doubt`. Calls still running at the
    /// drain timeout stay `started`; their deadline settles them.
    async fn shut_down(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &mut Producers,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        pending: Pending,
    ) -> Result<(), GateError> {
        self.invoker.ownership().stop();
        core.set_stopping();
        if !pending.is_empty() || core.has_outs() {
            let f = self.send(core, consumer, producer, pending)?;
            self.land(core, f).await?;
        }
        let until = Instant::now() + self.config.executor.drain_timeout.0;
        let mut pending = Pending::on_top_of(None);
        // Re-checked every 50 ms: the last outcome may be received just
        // before its task counts itself finished.
        while self.invoker.running() > 0 && Instant::now() < until {
            match tokio::time::timeout(Duration::from_millis(50), outcomes.recv()).await {
                Ok(Some(f)) => self.on_finished(core, consumer, &mut pending, f).await?,
                Ok(None) => break,
                Err(_) => {}
            }
        }
        while let Ok(f) = outcomes.try_recv() {
            self.on_finished(core, consumer, &mut pending, f).await?;
        }
        if self.invoker.running() > 0 {
            warn!(
                calls = self.invoker.running(),
                "drain timeout: calls still running stay `started`; their deadline settles them"
            );
        }
        if !pending.is_empty() || core.has_outs() {
            let f = self.send(core, consumer, producer, pending)?;
            self.land(core, f).await?;
        }
        Ok(())
    }
}

/// What woke the gate's loop.
enum Step {
    Rebalance(RebalanceEvent),
    Committed(Result<Landed, GateError>),
    Outcome(Finished),
    /// The wait for the calls a batch started is over.
    Lingered,
    Tick,
    Input(Result<Input, KafkaError>),
}

/// Resolves when the commit in flight returns; never without one.
async fn wait_commit(
    f: &mut Option<InFlight>,
) -> Result<Result<Landed, GateError>, tokio::task::JoinError> {
    match f {
        Some(f) => (&mut f.task).await,
        None => std::future::pending().await,
    }
}

/// How long a failed session waits for its Kafka clients to close.
const CLOSE_LIMIT: Duration = Duration::from_secs(10);
/// The first wait before a failed session restarts (doubling to 5 s while
/// sessions keep failing within [`STABLE_SESSION`]).
const RESTART_BACKOFF: Duration = Duration::from_millis(250);
const STABLE_SESSION: Duration = Duration::from_secs(60);

/// How often deadlines, purges and the state gauges are looked at.
const TICK: Duration = Duration::from_millis(100);

/// One ask for a partition's committed offset, and how long to go on asking
/// before the session is started over.
const COMMITTED_ASK: Duration = Duration::from_secs(10);
const COMMITTED_PATIENCE: Duration = Duration::from_secs(120);
/// How long asking where a partition's `progress` ends may take at its
/// assignment (without an answer, the grace period alone holds its deadlines).
const WATERMARK_ASK: Duration = Duration::from_secs(5);

/// Expired records removed per partition per tick: up to 20 000 a second
/// while a backlog lasts, in batches that stay small.
const PURGE_CHUNK: usize = 2_000;

/// An outcome handed to the owner of its partition.
fn progress_record(topic: &str, partition: i32, p: &Progress) -> OutRecord {
    OutRecord::for_workflow(
        topic,
        partition,
        &p.step.workflow_id,
        crate::contract::codec::encode(p),
    )
}

/// A pool tool's call as Call v1 on its pool's calls topic (keyed by
/// workflow id, partitioned by the producer: independently of `intents`), or
/// None for a tool this process invokes itself. A worker takes it only
/// before `take_by_ms`, the tool's deadline from now: the gate's deadline for
/// the step is that plus `in_doubt_grace` (docs/design.md "Worker pools").
fn pool_call_record(config: &Config, partition: i32, call: &Call) -> Option<(String, OutRecord)> {
    let tool = config.tools.get(&call.step.tool)?;
    let pool = tool.pool.as_ref()?;
    let take_by = now_ms() + tool.deadline().as_millis().min(i64::MAX as u128) as i64;
    let message = crate::contract::PoolCall::new(call, partition, tool.category.as_str(), take_by);
    let mut record = OutRecord {
        topic: config.kafka.topics.calls_for(pool),
        partition: None,
        key: Some(call.step.workflow_id.as_bytes().to_vec()),
        payload: Some(message.to_json()),
        headers: Vec::new(),
        timestamp_ms: None,
    };
    if let Some(tp) = &call.traceparent {
        record.headers.push((
            crate::contract::headers::TRACEPARENT.to_owned(),
            Some(tp.as_bytes().to_vec()),
        ));
    }
    Some((pool.clone(), record))
}

/// How often the state-size gauges are refreshed (a few RocksDB property reads).
const STATE_SIZE_EVERY: Duration = Duration::from_secs(5);

/// A Result v1 record: keyed by workflow id, in the intent's partition number.
pub fn result_record(
    topic: &str,
    partition: i32,
    result: &ToolResult,
    traceparent: Option<&str>,
) -> OutRecord {
    let mut r = OutRecord::for_workflow(topic, partition, &result.workflow_id, result.to_json());
    if let Some(tp) = traceparent {
        r.headers.push((
            crate::contract::headers::TRACEPARENT.to_owned(),
            Some(tp.as_bytes().to_vec()),
        ));
    }
    r
}

/// Fault injection for the liveness test: with `STEPGATE_TEST_STALL_AFTER=N`
/// (seconds), the gate's loop blocks for good that long after it started —
/// a stuck gate, to be seen by `/healthz`. Unset in production.
mod stall_point {
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    pub fn maybe_stall() {
        static AT: OnceLock<Option<Instant>> = OnceLock::new();
        let at = AT.get_or_init(|| {
            crate::test_hook("STEPGATE_TEST_STALL_AFTER")
                .and_then(|s| s.parse().ok())
                .map(|s| Instant::now() + Duration::from_secs(s))
        });
        if at.is_some_and(|t| Instant::now() >= t) {
            tracing::error!("STEPGATE_TEST_STALL_AFTER: the gate's loop stops here for good");
            loop {
                std::thread::park();
            }
        }
    }
}

/// Fault injection for the crash tests: with
/// `STEPGATE_TEST_CRASH_BEFORE_COMMIT=N`, the process aborts when the N-th
/// transaction has sent everything and is about to commit. Unset in production.
mod crash_point {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A test hook's N, read from the environment once (not on every commit).
    fn hook(cell: &'static OnceLock<Option<u64>>, name: &str) -> Option<u64> {
        *cell.get_or_init(|| crate::test_hook(name).and_then(|v| v.parse().ok()))
    }

    pub fn before_commit() {
        static N: OnceLock<Option<u64>> = OnceLock::new();
        static COMMITS: AtomicU64 = AtomicU64::new(0);
        let Some(n) = hook(&N, "STEPGATE_TEST_CRASH_BEFORE_COMMIT") else {
            return;
        };
        if COMMITS.fetch_add(1, Ordering::SeqCst) + 1 == n {
            eprintln!(
                "STEPGATE_TEST_CRASH_BEFORE_COMMIT={n}: aborting before the transaction commits"
            );
            std::process::abort();
        }
    }

    /// With `STEPGATE_TEST_LOSE_COMMIT_REPLY=N`: the N-th transaction that
    /// starts calls commits, and is then reported failed, as when the commit's
    /// reply is lost.
    pub fn lose_commit_reply(starts_calls: bool) -> Result<(), super::GateError> {
        static N: OnceLock<Option<u64>> = OnceLock::new();
        static STARTING: AtomicU64 = AtomicU64::new(0);
        let Some(n) = hook(&N, "STEPGATE_TEST_LOSE_COMMIT_REPLY") else {
            return Ok(());
        };
        if starts_calls && STARTING.fetch_add(1, Ordering::SeqCst) + 1 == n {
            tracing::warn!(
                "STEPGATE_TEST_LOSE_COMMIT_REPLY={n}: a committed transaction is reported failed"
            );
            return Err(super::GateError::Kafka(
                rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::RequestTimedOut,
                ),
            ));
        }
        Ok(())
    }

    /// With `STEPGATE_TEST_LOSE_COMMIT_MARKER=N`: the N-th transaction that
    /// publishes answers is aborted where it would commit, and reported
    /// committed; the session then fails. That is where a broker that lost
    /// an acknowledged transaction's commit marker leaves the gate once the
    /// next session has ended the hanging transaction (by aborting it).
    pub fn lose_commit_marker(answers: bool) -> bool {
        static N: OnceLock<Option<u64>> = OnceLock::new();
        static ANSWERING: AtomicU64 = AtomicU64::new(0);
        let Some(n) = hook(&N, "STEPGATE_TEST_LOSE_COMMIT_MARKER") else {
            return false;
        };
        let hit = answers && ANSWERING.fetch_add(1, Ordering::SeqCst) + 1 == n;
        if hit {
            tracing::warn!(
                "STEPGATE_TEST_LOSE_COMMIT_MARKER={n}: a transaction is aborted and reported committed"
            );
        }
        hit
    }

    /// The error a session fails with after [`lose_commit_marker`], as when
    /// the broker went away.
    pub fn session_lost() -> super::GateError {
        super::GateError::Kafka(rdkafka::error::KafkaError::MessageProduction(
            rdkafka::types::RDKafkaErrorCode::BrokerTransportFailure,
        ))
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Without the `test-hooks` feature, the gate's hooks do nothing even with
/// their variables set (checked by a unit test of a build without it).
#[cfg(all(test, not(feature = "test-hooks")))]
pub(crate) fn test_hooks_inert() {
    for v in [
        "STEPGATE_TEST_LOSE_COMMIT_MARKER",
        "STEPGATE_TEST_LOSE_COMMIT_REPLY",
        "STEPGATE_TEST_CRASH_BEFORE_COMMIT",
    ] {
        // SAFETY: no other test of this binary reads these variables.
        unsafe { std::env::set_var(v, "1") };
    }
    assert!(!crash_point::lose_commit_marker(true));
    assert!(crash_point::lose_commit_reply(true).is_ok());
    crash_point::before_commit(); // would abort the test binary
}
