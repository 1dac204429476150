//! A gate session: one consumer and its transactional producers, the loop
//! that reads inputs into batches, and a graceful end on SIGTERM.

use super::batch::{Batches, Pending};
use super::commit::{Landed, Producers, wait_commit};
use super::gauges::STATE_SIZE_EVERY;
use super::linger::Linger;
use super::ownership::{Owned, check_layout, read_layout};
use super::poison::Poison;
use super::{GateCore, GateError, Input, lost, now_ms};
use crate::config::Config;
use crate::executor::{Finished, Invoker};
use crate::hooks;
use crate::kafka::{self, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::state::{StateError, StateStore};
use crate::telemetry::{Health, Metrics};
use futures::FutureExt;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use std::collections::{BTreeSet, HashMap};
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
    /// Since when the invoker has been full, reading held (backpressure).
    pub(super) held_since: Option<std::time::Instant>,
    /// How old a partition's local state may be and still be resumed from
    /// (from the changelog's `delete.retention.ms`, read once per session).
    pub(super) trust: Option<crate::state::Trust>,
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

/// How long a failed session waits for its Kafka clients to close.
pub(super) const CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// How often deadlines, purges and the state gauges are looked at.
pub(super) const TICK: Duration = Duration::from_millis(100);

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
    /// The idempotent producer of answers sent outside the transactions
    /// (repeats of committed outcomes).
    pub(super) answers: FutureProducer,
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

        let answers = kafka::direct_producer_config(k).create()?;
        let mut clients = Clients {
            consumer,
            producer,
            events,
            answers,
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
            answers,
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
            kafka::close_within("the gate's answers producer", answers, CLOSE_LIMIT).await;
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
            answers,
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
        let busy_age = self.config.gate.busy_batch_age.0;
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
            // The open batch's one wake-up: the end of a wait for fast
            // outcomes (`Linger`) or of a busy batch's filling.
            let wake = match (self.linger.waiting(), pending.filling(max_batch, busy_age)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let step = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(ev) = events.recv() => Step::Rebalance(ev),
                done = wait_commit(in_flight) => Step::Committed(done.map_err(GateError::from).and_then(|r| r)),
                Some(f) = outcomes.recv() => Step::Outcome(f),
                _ = tick.tick() => Step::Tick,
                _ = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => Step::Lingered,
                msg = consumer.recv(), if pending.inputs < max_batch && !self.reading_held() => {
                    Step::Input(msg.map(|m| kafka::to_input(&m)))
                }
            };
            let step_is_tick = matches!(step, Step::Tick);
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
                    pending.previous_committed(max_batch);
                }
                Step::Outcome(f) => self.on_finished(core, consumer, pending, f).await?,
                Step::Lingered => {}
                Step::Tick => {
                    if let Some((code, reason)) = consumer.client().fatal_error() {
                        if code == rdkafka::types::RDKafkaErrorCode::FencedInstanceId {
                            return Err(GateError::InstanceIdTaken {
                                instance: k.instance_id.clone(),
                                group: k.gate_group.clone(),
                            });
                        }
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
                    if let Some(f) = in_flight.as_mut() {
                        f.log_if_slow();
                    }
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
            // Repeats of committed outcomes are answered at once, outside
            // the transaction (docs/design.md "Repeats answered at once").
            let outs = core.take_at_once();
            if !outs.is_empty() {
                self.send_at_once(answers, pending, outs);
            }
            // Fast-path calls start at once: they record nothing first; so
            // does a keyed step's. The open batch waits a moment for their
            // outcomes (`Linger`).
            let immediate = core.take_immediate();
            self.linger.started(immediate.len());
            pending.started_at_once += immediate.len();
            for (p, call) in immediate {
                self.invoker.start(p, call);
            }
            self.apply_backpressure(consumer);
            // Group commit: a batch closes when the previous commit returns
            // (and the outcomes worth waiting for are in; under load, once
            // it has filled). A batch of nothing but calls started at once
            // waits while calls run, however long they take: it has nothing
            // to commit before their outcomes.
            if in_flight.is_none()
                && (!pending.is_empty() || core.has_outs())
                && self.linger.waiting().is_none()
                && pending.filling(max_batch, busy_age).is_none()
                && !(pending.only_calls_started(core) && self.invoker.running() > 0)
                && (step_is_tick || !pending.answered_at_once_only(core))
            {
                let closing = std::mem::replace(pending, Pending::on_top_of(None));
                let f = self.send(core, consumer, producer, closing)?;
                *pending = Pending::on_top_of(Some(f.batch.clone()));
                *in_flight = Some(f);
            }
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
        // A reconcile lookup's answer, like a read's, is never handed over:
        // the partition's owner asks again at its next time.
        let fast = f.progress.fast_ref.is_some() || f.progress.lookup_ask().is_some();
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
