//! A gate session: one consumer and its transactional producers, the loop
//! that reads inputs into batches, and a graceful end on SIGTERM.

use super::commit::{InFlight, Landed, Producers};
use super::ownership::{Owned, check_layout, read_layout};
use super::{GateCore, GateError, Input, lost, now_ms};
use crate::config::Config;
use crate::executor::{Finished, Invoker};
use crate::hooks;
use crate::kafka::{self, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::state::{Batch, StateError, StateStore};
use crate::telemetry::{Health, Metrics};
use futures::FutureExt;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub(super) struct Session<'a> {
    pub(super) config: &'a Config,
    pub(super) store: &'a Arc<StateStore>,
    pub(super) metrics: &'a Arc<Metrics>,
    pub(super) health: &'a Health,
    pub(super) invoker: &'a Invoker,
    pub(super) owned: HashMap<i32, Owned>,
    pub(super) assigned: BTreeSet<i32>,
    /// Whether this session's consumer has been given its partitions yet: only
    /// then can an outcome's partition be known to belong elsewhere.
    pub(super) ever_assigned: bool,
    /// Outcomes waiting for the session to know its partitions.
    pub(super) backlog: Vec<Finished>,
    /// Per partition taken over, where its `progress` ended then: its
    /// deadlines wait until the consumer has read that far.
    pub(super) progress_ends: HashMap<i32, i64>,
    pub(super) linger: Linger,
    pub(super) poison: &'a mut Poison,
    /// The producers' last acknowledged transactions, checked by the next session.
    pub(super) last_commits: &'a mut lost::LastCommits,
    /// `intents` partitions paused while the invoker is full (backpressure).
    pub(super) paused: BTreeSet<i32>,
    /// How old a partition's local state may be and still be resumed from
    /// (from the changelog's `delete.retention.ms`, read once per session).
    pub(super) trust: Option<crate::state::Trust>,
}

/// Inputs whose processing failed on a record stepgate cannot read, counted
/// across sessions. Such a failure repeats each time the input is re-read, so
/// after [`Poison::SET_ASIDE_AFTER`] of them the input is set aside — dead-lettered
/// with the reason (and answered, when its caller can be told) — and the
/// partition moves on. Failures of the broker or the disk are not counted:
/// they pass, and the input is processed then.
#[derive(Default)]
pub(super) struct Poison {
    pub(super) failures: HashMap<(String, i32, i64), (u32, String)>,
    /// Batches whose records the broker refused for what they are (see
    /// [`GateError::refused_record`]), by their first input. Kept apart from
    /// `failures`: the input itself is processed fine each time.
    pub(super) refused: HashMap<(String, i32, i64), (u32, String)>,
    /// After a refusal, this many batches of one input each follow, so the
    /// input whose records are refused is the first of its batch.
    pub(super) careful: u32,
}

impl Poison {
    pub(super) const SET_ASIDE_AFTER: u32 = 3;

    pub(super) fn key(input: &Input) -> (String, i32, i64) {
        (input.topic.clone(), input.partition, input.offset)
    }

    pub(super) fn failed(&mut self, input: &Input, error: &StateError) {
        let e = self.failures.entry(Self::key(input)).or_default();
        e.0 += 1;
        e.1 = crate::telemetry::error_chain(error);
    }

    /// One-input batches after a refused record.
    const CAREFUL_BATCHES: u32 = 64;

    /// A batch starting with `first` was refused (its session fails).
    pub(super) fn refused(&mut self, first: (String, i32, i64), error: &GateError) {
        let e = self.refused.entry(first).or_default();
        e.0 += 1;
        e.1 = format!(
            "a record it produces is refused by Kafka: {}",
            crate::telemetry::error_chain(error)
        );
        self.careful = Self::CAREFUL_BATCHES;
    }

    /// A batch starting with `first` committed.
    pub(super) fn committed(&mut self, first: Option<&(String, i32, i64)>) {
        if let Some(k) = first
            && !self.refused.is_empty()
        {
            self.refused.remove(k);
        }
        self.careful = self.careful.saturating_sub(1);
    }

    /// The error to set this input aside with, once it failed often enough.
    /// (Every input asks: nothing is built while no input has failed.)
    pub(super) fn set_aside(&self, input: &Input) -> Option<&str> {
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

    pub(super) fn forget(&mut self, input: &Input) {
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
pub(super) struct Linger {
    /// Moving averages: hand-over → outcome, and a batch's commit.
    pub(super) call: Duration,
    pub(super) commit: Duration,
    /// Calls started by the last landed batch and not yet finished, and until when to wait for them.
    pub(super) outstanding: usize,
    pub(super) until: Option<tokio::time::Instant>,
}

impl Linger {
    pub(super) fn ewma(avg: &mut Duration, sample: Duration) {
        *avg = if avg.is_zero() {
            sample
        } else {
            (*avg * 7 + sample) / 8
        };
    }

    pub(super) fn landed(&mut self, calls: usize, commit: Duration) {
        Self::ewma(&mut self.commit, commit);
        let wait = self.call * 3 / 2;
        if calls > 0 && !self.call.is_zero() && wait < self.commit / 2 {
            self.outstanding = calls;
            self.until = Some(tokio::time::Instant::now() + wait);
        } else {
            self.until = None;
        }
    }

    pub(super) fn finished(&mut self, took: Duration) {
        Self::ewma(&mut self.call, took);
        self.outstanding = self.outstanding.saturating_sub(1);
        if self.outstanding == 0 {
            self.until = None;
        }
    }

    /// The deadline while the next batch should wait.
    pub(super) fn waiting(&mut self) -> Option<tokio::time::Instant> {
        if self.until.is_some_and(|t| t <= tokio::time::Instant::now()) {
            self.until = None;
        }
        self.until
    }
}

/// What one batch has gathered.
pub(super) struct Pending {
    pub(super) batch: Batch,
    pub(super) inputs: usize,
    /// Per intents partition, the next offset after the last intent consumed.
    pub(super) intents_next: BTreeMap<i32, i64>,
    /// Next offsets of the other inputs (progress, commands).
    pub(super) others_next: BTreeMap<(String, i32), i64>,
    /// Outcomes decided in this batch (carried to the next session if it fails).
    pub(super) outcomes: Vec<Finished>,
    /// Outcomes of partitions owned elsewhere, handed over through `progress`.
    pub(super) orphans: Vec<Finished>,
    /// Its first input (topic, partition, offset): the one set aside if its
    /// records keep being refused.
    pub(super) first_input: Option<(String, i32, i64)>,
}

impl Pending {
    pub(super) fn on_top_of(below: Option<Arc<Batch>>) -> Pending {
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

    pub(super) fn is_empty(&self) -> bool {
        self.inputs == 0 && self.batch.is_empty() && self.outcomes.is_empty()
    }
}

/// What woke the gate's loop.
pub(super) enum Step {
    Rebalance(RebalanceEvent),
    Committed(Result<Landed, GateError>),
    Outcome(Finished),
    /// The wait for the calls a batch started is over.
    Lingered,
    Tick,
    Input(Result<Input, KafkaError>),
}

/// Resolves when the commit in flight returns; never without one.
pub(super) async fn wait_commit(
    f: &mut Option<InFlight>,
) -> Result<Result<Landed, GateError>, tokio::task::JoinError> {
    match f {
        Some(f) => (&mut f.task).await,
        None => std::future::pending().await,
    }
}

/// How long a failed session waits for its Kafka clients to close.
pub(super) const CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// How often deadlines, purges and the state gauges are looked at.
pub(super) const TICK: Duration = Duration::from_millis(100);

/// How often the state-size gauges are refreshed (a few RocksDB property reads).
pub(super) const STATE_SIZE_EVERY: Duration = Duration::from_secs(5);

/// Expired records removed per partition per tick: up to 20 000 a second
/// while a backlog lasts, in batches that stay small.
pub(super) const PURGE_CHUNK: usize = 2_000;

/// How often a running gate reads the topics' partition counts again (a
/// consumer sees new partitions only at its next metadata refresh, minutes later).
pub(super) const LAYOUT_EVERY: Duration = Duration::from_secs(10);

/// A session's Kafka clients.
pub(super) struct Clients {
    pub(super) consumer: Arc<TxnConsumer>,
    pub(super) producer: Producers,
    /// The consumer's rebalances, as its context reports them.
    pub(super) events: mpsc::UnboundedReceiver<RebalanceEvent>,
}

/// The batch being gathered and the one committing.
pub(super) struct Batches {
    pub(super) pending: Pending,
    pub(super) in_flight: Option<InFlight>,
}

impl Session<'_> {
    pub(super) async fn run(
        &mut self,
        core: &mut GateCore,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let k = &self.config.kafka;
        let (ctx, events) = RebalanceContext::new(self.metrics.clone(), &k.gate_group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(k, &k.gate_group, &format!("{}-gate", k.instance_id))
                .create_with_context(ctx)?,
        );
        let producer = Producers::init(k).await?;
        consumer.subscribe(&[&k.topics.intents, &k.topics.progress, &k.topics.commands])?;
        info!(intents = %k.topics.intents, progress = %k.topics.progress, commands = %k.topics.commands, "gate consuming");

        let mut clients = Clients {
            consumer,
            producer,
            events,
        };
        let mut batches = Batches {
            pending: Pending::on_top_of(None),
            in_flight: None,
        };
        let result = self
            .serve(core, &mut clients, outcomes, &mut batches, shutdown)
            .await;
        let Clients {
            consumer,
            mut producer,
            ..
        } = clients;
        let Batches {
            pending,
            mut in_flight,
        } = batches;
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
            // handed back: return at once (the caller gives up ownership, so
            // the queued calls come back not invoked), and let the next
            // session (which publishes the hand-overs) start without waiting
            // on the old clients' close. Its consumer's static member id and
            // producers' transactional ids fence these.
            tokio::spawn(close);
        }
        result
    }

    pub(super) async fn serve(
        &mut self,
        core: &mut GateCore,
        clients: &mut Clients,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        batches: &mut Batches,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let Clients {
            consumer,
            producer,
            events,
        } = clients;
        let Batches { pending, in_flight } = batches;
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
            hooks::maybe_stall();
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
    pub(super) fn apply_backpressure(&mut self, consumer: &Arc<TxnConsumer>) {
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
    pub(super) fn discard_open_batch(&mut self, core: &mut GateCore, pending: &mut Pending) {
        let open = std::mem::replace(pending, Pending::on_top_of(None));
        info!(
            inputs = open.inputs,
            "partitions revoked mid-batch: the open batch is dropped, its inputs are read again from the last commit"
        );
        self.backlog.extend(open.outcomes);
        core.reset();
    }

    pub(super) async fn on_input(
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
    pub(super) async fn on_finished(
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

    /// Export how many steps of the owned partitions wait for a person (the
    /// gauges the alerts watch: a counter's increase would clear while a step
    /// is still unresolved).
    pub(super) fn count_open_steps(&self) {
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

    pub(super) fn report_state_size(&self) {
        let size = self.store.size();
        self.metrics
            .state_size(size.steps, size.disk_bytes, &size.memory());
    }

    /// SIGTERM: start no more calls; commit what is decided; let running
    /// calls finish within `executor.drain_timeout`, and commit their
    /// outcomes. Calls that had not started (queued for a slot, or decided in
    /// the last batch) are handed back not invoked and recorded so: the next
    /// owner runs them at once, never `in_doubt`. Calls still running at the
    /// drain timeout stay `started`; their deadline settles them.
    pub(super) async fn shut_down(
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
