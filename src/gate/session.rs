//! A gate session: one consumer, and the loop that reads inputs into
//! batches, until SIGTERM (a graceful end) or a failure (the next session
//! starts from what Kafka committed). It drives parts that do not know it —
//! the open batch ([`OpenBatch`]), its commits ([`Commits`]), the partitions
//! it owns ([`Ownership`]), backpressure ([`Backpressure`]) and its clocks
//! ([`Timers`]) — and the decision core ([`GateCore`]).

use super::backpressure::Backpressure;
use super::batch::OpenBatch;
use super::commit::{Commits, InFlight, Landed};
use super::lost::LastCommits;
use super::ownership::{Ownership, check_layout};
use super::poison::Poison;
use super::timers::Timers;
use super::{Carry, Env, GateCore, GateError, Input, Out, When, gauges, now_ms, records};
use crate::executor::Finished;
use crate::hooks;
use crate::kafka::{self, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::state::StateError;
use futures::FutureExt;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long a failed session waits for its Kafka clients to close.
const CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// Expired records removed per partition per tick: up to 20 000 a second
/// while a backlog lasts, in batches that stay small.
const PURGE_CHUNK: usize = 2_000;

pub(super) struct Session<'a> {
    env: Env<'a>,
    core: &'a mut GateCore,
    poison: &'a mut Poison,
    consumer: Arc<TxnConsumer>,
    /// The consumer's rebalances, as its context reports them.
    events: mpsc::UnboundedReceiver<RebalanceEvent>,
    open: OpenBatch,
    commits: Commits<'a>,
    ownership: Ownership,
    backpressure: Backpressure,
    timers: Timers,
    /// Outcomes waiting for the session to know its partitions.
    backlog: Vec<Finished>,
}

/// What woke the session's loop.
enum Wake {
    Rebalance(RebalanceEvent),
    Committed(InFlight, Result<Landed, GateError>),
    Outcome(Finished),
    /// The open batch's wait is over (for the calls it started, or to fill).
    Lingered,
    Tick,
    Input(Result<Input, KafkaError>),
}

impl<'a> Session<'a> {
    /// Run one session until `shutdown` (Ok, once its last batches are
    /// committed and applied) or a failure. What it leaves undone is in
    /// `carry` for the next.
    pub(super) async fn run(
        env: Env<'a>,
        core: &'a mut GateCore,
        carry: &'a mut Carry,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let Carry {
            outcomes: backlog,
            poison,
            last_commits,
        } = carry;
        let mut session = Session::start(env, core, poison, last_commits).await?;
        session.backlog = std::mem::take(backlog);
        let served = session.serve(outcomes, shutdown).await;
        let result = session.finish(served, outcomes).await;
        session.backpressure.end(env.metrics);
        let Session {
            consumer,
            commits,
            backlog: mut left,
            ..
        } = session;
        backlog.append(&mut left);
        // Off the async threads and bounded: a consumer's close waits for the
        // group to let it go, and rust-rdkafka's drop polls for that without
        // limit — a close that cannot complete (a member fenced mid-rebalance)
        // would otherwise leave the gate silent, never restarting its session.
        let producers = commits.close(CLOSE_LIMIT);
        let close = async move {
            producers.await;
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

    async fn start(
        env: Env<'a>,
        core: &'a mut GateCore,
        poison: &'a mut Poison,
        last_commits: &'a mut LastCommits,
    ) -> Result<Session<'a>, GateError> {
        let k = &env.config.kafka;
        let (ctx, events) = RebalanceContext::new(env.metrics.clone(), &k.gate_group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(k, &k.gate_group, &format!("{}-gate", k.instance_id))
                .create_with_context(ctx)?,
        );
        let commits = Commits::start(env, consumer.clone(), last_commits).await?;
        consumer.subscribe(&[&k.topics.intents, &k.topics.progress, &k.topics.commands])?;
        info!(intents = %k.topics.intents, progress = %k.topics.progress, commands = %k.topics.commands, "gate consuming");
        Ok(Session {
            env,
            core,
            poison,
            consumer,
            events,
            open: OpenBatch::on_top_of(None),
            commits,
            ownership: Ownership::default(),
            backpressure: Backpressure::default(),
            timers: Timers::new(),
            backlog: Vec::new(),
        })
    }

    async fn serve(
        &mut self,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let busy_age = self.env.config.gate.busy_batch_age.0;
        loop {
            let max_batch = self.max_batch();
            self.env.health.beat();
            hooks::maybe_stall();
            // The open batch's one wake-up: the end of a wait for fast
            // outcomes (`Linger`) or of a busy batch's filling.
            let wake_at = match (
                self.commits.linger.waiting(),
                self.open.filling(max_batch, busy_age),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let reading = self.open.inputs < max_batch && !self.backpressure.reading_held();
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(ev) = self.events.recv() => Wake::Rebalance(ev),
                (f, r) = self.commits.returned() => Wake::Committed(f, r),
                Some(f) = outcomes.recv() => Wake::Outcome(f),
                _ = self.timers.tick() => Wake::Tick,
                _ = tokio::time::sleep_until(wake_at.unwrap_or_else(tokio::time::Instant::now)), if wake_at.is_some() => Wake::Lingered,
                msg = self.consumer.recv(), if reading => Wake::Input(msg.map(|m| kafka::to_input(&m))),
            };
            let ticked = matches!(wake, Wake::Tick);
            match wake {
                Wake::Rebalance(ev) => self.on_rebalance(ev).await?,
                Wake::Committed(f, r) => {
                    self.on_committed(f, r)?;
                    self.open.previous_committed(max_batch);
                }
                Wake::Outcome(f) => self.on_finished(f).await?,
                Wake::Lingered => {}
                Wake::Tick => self.on_tick()?,
                Wake::Input(first) => self.on_inputs(first, max_batch).await?,
            }
            self.take_decisions();
            let intents = &self.env.config.kafka.topics.intents;
            self.backpressure.apply(
                &self.consumer,
                self.env.invoker,
                self.ownership.assigned(),
                intents,
                self.env.metrics,
            );
            if self.may_close(ticked, max_batch, busy_age) {
                self.close()?;
            }
        }
    }

    /// One input a batch after a refused record, so the input whose records
    /// are refused is the first of its batch.
    fn max_batch(&self) -> usize {
        if self.poison.careful > 0 {
            1
        } else {
            self.env.config.gate.max_batch
        }
    }

    /// Group commit: a batch closes when the previous commit returns (and
    /// the outcomes worth waiting for are in; under load, once it has
    /// filled). A batch of nothing but calls started at once waits while
    /// calls run, however long they take: it has nothing to commit before
    /// their outcomes. One whose answers all went out at once closes at a
    /// tick.
    fn may_close(&mut self, ticked: bool, max_batch: usize, busy_age: Duration) -> bool {
        !self.commits.in_flight()
            && !self.open.is_empty()
            && self.commits.linger.waiting().is_none()
            && self.open.filling(max_batch, busy_age).is_none()
            && !(self.open.only_calls_started() && self.env.invoker.running() > 0)
            && (ticked || !self.open.answered_at_once_only())
    }

    /// Close the open batch: its records, its offsets (with the applied
    /// marks) and its commit, in a task; the next batch opens on top of it.
    fn close(&mut self) -> Result<(), GateError> {
        let mut closing = std::mem::replace(&mut self.open, OpenBatch::on_top_of(None));
        closing.batch.detach();
        let built = records::batch_records(self.env.config, &mut closing);
        let core = &*self.core;
        let offsets = self.ownership.batch_offsets(
            &closing.intents_next,
            &built.touched,
            |p| core.first_unanswered(p),
            core.intent_partitions(),
            &self.env.config.kafka.topics.intents,
        );
        let batch = self.commits.send(closing, built, offsets)?;
        self.open = OpenBatch::on_top_of(Some(batch));
        Ok(())
    }

    /// Take what the core decided: answers that go at once are sent, calls
    /// that start at once start (the open batch waits a moment for their
    /// outcomes: `Linger`); the rest goes with the open batch.
    fn take_decisions(&mut self) {
        let mut at_once = Vec::new();
        let mut calls = Vec::new();
        for out in self.core.take_outs() {
            match out {
                Out::Invoke {
                    partition,
                    call,
                    when: When::Now,
                } => calls.push((partition, call)),
                Out::Result {
                    when: When::Now, ..
                } => at_once.push(out),
                out => self.open.outs.push(out),
            }
        }
        if !at_once.is_empty() {
            self.commits.answer_at_once(&mut self.open, at_once);
        }
        self.commits.linger.started(calls.len());
        self.open.started_at_once += calls.len();
        for (p, call) in calls {
            self.env.invoker.start(p, call);
        }
    }

    /// Wait for the commit in flight, if any, and act on it.
    async fn land_in_flight(&mut self) -> Result<(), GateError> {
        if !self.commits.in_flight() {
            return Ok(());
        }
        let (f, r) = self.commits.returned().await;
        self.on_committed(f, r)
    }

    /// A batch's commit returned: on success it is applied to the local
    /// state, the offsets move and its calls start; on failure its outcomes
    /// are kept for the next session, which re-reads its inputs.
    fn on_committed(&mut self, f: InFlight, r: Result<Landed, GateError>) -> Result<(), GateError> {
        let landed = match r {
            Ok(l) => l,
            Err(e) => return Err(self.commit_failed(f, e)),
        };
        self.poison.committed(f.first_input.as_ref());
        let done = self.commits.landed(f, landed)?;
        self.ownership.committed(&done.offsets);
        for (p, call) in done.invokes {
            self.core.invoked(p, &call);
            self.env.invoker.start(p, call);
        }
        for (p, call, pool) in &done.published {
            self.core.published(*p, call);
            self.env.metrics.pool_call(pool, &call.step);
        }
        if done.marker_lost {
            return Err(hooks::session_lost().into());
        }
        // Committed and honoured above; the session's producers are then
        // replaced (a new session's, with a new epoch) before another begins.
        if done.renew_producer {
            return Err(GateError::SlowTransactionEnd);
        }
        Ok(())
    }

    /// A batch's commit failed (or its reply was lost: it may have landed).
    fn commit_failed(&mut self, f: InFlight, e: GateError) -> GateError {
        self.backlog.extend(f.outcomes);
        self.core.commit_unknown(f.invokes);
        // Published or not with their records, nothing more to do: workers
        // see them only if that commit landed after all.
        for (p, call, _) in &f.published {
            self.core.published(*p, call);
        }
        if let (Some(code), Some(first)) = (e.refused_record(), f.first_input) {
            warn!(topic = %first.0, partition = first.1, offset = first.2, code, "Kafka refused a record of a batch: the next batches take one input each, and an input whose records are refused {} times is set aside", Poison::SET_ASIDE_AFTER);
            self.poison.refused(first, &e);
        }
        e
    }

    async fn on_rebalance(&mut self, ev: RebalanceEvent) -> Result<(), GateError> {
        let ps = |parts: &[(String, i32)]| parts.iter().map(|(_, p)| *p).collect::<BTreeSet<i32>>();
        match ev {
            RebalanceEvent::Assigned(parts) => self.on_assigned(ps(&parts)).await?,
            RebalanceEvent::Revoked(parts) => self.on_revoked(ps(&parts)).await?,
        }
        self.env.health.set_gate_ready(self.ownership.ready());
        if self.ownership.ever_assigned() {
            for f in std::mem::take(&mut self.backlog) {
                self.on_finished(f).await?;
            }
        }
        Ok(())
    }

    async fn on_assigned(&mut self, ps: BTreeSet<i32>) -> Result<(), GateError> {
        info!(partitions = ?ps, "partitions assigned");
        // Partitions added to `intents` trigger a rebalance: re-read the
        // count the partition check uses.
        let k = self.env.config.kafka.clone();
        let counts = kafka::blocking(move || kafka::layout_counts(&k)).await;
        match &counts {
            Ok(n) => self.check_layout(n)?,
            Err(e) => {
                warn!(error = %e, "could not read the intents topic's partition count; keeping the last one")
            }
        }
        if !self.ownership.ever_assigned()
            && let (Ok(n), Some(&p)) = (&counts, ps.first())
        {
            self.commits.recover(n, p, &ps).await?;
        }
        self.ownership.assign(self.env, &ps);
        let new: BTreeSet<i32> = ps
            .iter()
            .filter(|p| !self.ownership.owns(**p))
            .copied()
            .collect();
        self.take_over(&new).await
    }

    async fn on_revoked(&mut self, ps: BTreeSet<i32>) -> Result<(), GateError> {
        // A revoke waits for the commit in flight: it either landed (and is
        // honoured) or is re-read by the next owner.
        self.land_in_flight().await?;
        if !self.open.is_empty() && self.ownership.all_within(&ps) {
            self.discard_open_batch();
        }
        info!(partitions = ?ps, "partitions revoked");
        if !self.open.is_empty() {
            // The open batch may hold inputs of revoked partitions, or of
            // re-assigned ones whose position already moved past them: drop
            // it (nothing of it is durable yet) and re-read from the last
            // commit with a fresh consumer.
            return Err(GateError::Rebalanced);
        }
        self.ownership.revoke(self.env, &ps);
        for p in ps {
            self.backpressure.release(p);
            self.core.drop_partition(p);
        }
        Ok(())
    }

    /// Every partition is revoked while a batch is open (the range assignor's
    /// eager rebalances revoke all): nothing of the batch is durable, so drop
    /// it and go on from what is committed, as a new owner would — librdkafka
    /// reads a partition assigned again from its committed offset, and the
    /// outcomes the batch held are decided again. The consumer stays: a new
    /// one's static rejoin mid-rebalance would start another rebalance, and
    /// under load two gates could keep each other rebalancing.
    fn discard_open_batch(&mut self) {
        let open = std::mem::replace(&mut self.open, OpenBatch::on_top_of(None));
        info!(
            inputs = open.inputs,
            "partitions revoked mid-batch: the open batch is dropped, its inputs are read again from the last commit"
        );
        self.backlog.extend(open.outcomes);
        self.core.reset();
    }

    /// The topics' partition counts as read now: checked against what the
    /// state was written with (`ownership::check_layout`), and the intents
    /// count the partition check uses.
    fn check_layout(&mut self, n: &kafka::Layout) -> Result<(), GateError> {
        let t = &self.env.config.kafka.topics;
        let intents = check_layout(self.core.intent_partitions(), t, n)?;
        self.core.set_intent_partitions(intents);
        Ok(())
    }

    /// Before a partition's first input: its state restored, its deadlines
    /// loaded into the core, and the partition owned.
    async fn ensure_owned(&mut self, p: i32) -> Result<(), GateError> {
        if self.ownership.owns(p) {
            return Ok(());
        }
        self.take_over(&BTreeSet::from([p])).await
    }

    /// Take `ps` over: a departed owner's producers fenced, their states
    /// restored together (`ownership::restore`), then each loaded and owned.
    async fn take_over(&mut self, ps: &BTreeSet<i32>) -> Result<(), GateError> {
        if ps.is_empty() {
            return Ok(());
        }
        super::standby::fence_departed(&self.env.config.kafka, ps).await;
        let known = self.core.intent_partitions();
        let takeovers = self
            .ownership
            .restore(self.env, &self.consumer, ps, known)
            .await?;
        for (p, takeover) in takeovers {
            self.core.load_partition(self.env.store, p, now_ms())?;
            if self
                .ownership
                .take(self.env, &self.consumer, p, takeover)
                .await
            {
                self.core.progress_read(p);
            }
        }
        Ok(())
    }

    /// The tick's chores: the consumer's health, the layout, deadlines,
    /// purges and the gauges.
    fn on_tick(&mut self) -> Result<(), GateError> {
        let (config, k) = (self.env.config, &self.env.config.kafka);
        if let Some((code, reason)) = self.consumer.client().fatal_error() {
            if code == rdkafka::types::RDKafkaErrorCode::FencedInstanceId {
                return Err(GateError::InstanceIdTaken {
                    instance: k.instance_id.clone(),
                    group: k.gate_group.clone(),
                });
            }
            return Err(GateError::FatalConsumer(format!("{code:?}: {reason}")));
        }
        // A member left without partitions for this long (e.g. fenced while
        // the broker restarted) starts over.
        let stuck_after = k.session_timeout.0 * 3;
        let assigned = !self.ownership.assigned().is_empty();
        if self.timers.unassigned_for(assigned, stuck_after) {
            return Err(GateError::Unassigned(stuck_after));
        }
        for p in self
            .ownership
            .progress_caught_up(&self.consumer, &k.topics.progress)
        {
            self.core.progress_read(p);
        }
        self.commits.log_if_slow();
        match self.timers.layout(k) {
            Some(Ok(n)) => self.check_layout(&n)?,
            Some(Err(e)) => warn!(error = %e, "could not read the topics' partition counts"),
            None => {}
        }
        let (store, batch, now) = (self.env.store, &mut self.open.batch, now_ms());
        if self.timers.deadlines_due(config.gate.in_doubt_grace.0) {
            self.core.on_deadlines(store, batch, now)?;
        }
        if self.timers.purge_due(config.state.purge_interval.0) {
            let parts = self.ownership.partitions();
            let purged = self.core.purge(store, batch, parts, now, PURGE_CHUNK)?;
            self.timers.purged(purged.more);
        }
        if self.timers.gauges_due() {
            gauges::report_state_size(store, self.env.metrics);
            gauges::count_open_steps(store, self.env.metrics, self.ownership.partitions());
        }
        Ok(())
    }

    /// Inputs, starting with `first`: what is already here is taken in
    /// before the batch closes.
    async fn on_inputs(
        &mut self,
        first: Result<Input, KafkaError>,
        max_batch: usize,
    ) -> Result<(), GateError> {
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Ok(input) => self.on_input(input).await?,
                Err(e) => {
                    warn!(error = %e, "consumer error (librdkafka retries by itself)");
                    self.timers.unhealthy();
                    break;
                }
            }
            if self.open.inputs < max_batch {
                next = self
                    .consumer
                    .recv()
                    .now_or_never()
                    .map(|m| m.map(|m| kafka::to_input(&m)));
            }
        }
        Ok(())
    }

    async fn on_input(&mut self, input: Input) -> Result<(), GateError> {
        self.ensure_owned(input.partition).await?;
        let topics = &self.env.config.kafka.topics;
        let (store, batch, now) = (self.env.store, &mut self.open.batch, now_ms());
        let processed = if let Some(error) = self.poison.set_aside(&input) {
            warn!(topic = %input.topic, partition = input.partition, offset = input.offset, %error, "setting aside an input whose processing failed {} times", Poison::SET_ASIDE_AFTER);
            self.core
                .set_aside(&input, input.topic == topics.intents, error, now);
            Ok(())
        } else if input.topic == topics.intents {
            let applied = self.ownership.applied(input.partition);
            self.core.on_intent(store, batch, &input, applied, now)
        } else if input.topic == topics.commands {
            self.core.on_command(store, batch, &input, now)
        } else {
            self.core.on_progress(store, batch, &input, now)
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
        self.open.took(&input, &topics.intents);
        Ok(())
    }

    /// An invocation of this process finished: settle it here if this session
    /// owns its partition, hand it to the owner through `progress` if another
    /// member does, or hold it until the session knows.
    async fn on_finished(&mut self, f: Finished) -> Result<(), GateError> {
        let p = f.partition;
        self.commits.linger.finished(f.took);
        self.core.finished(p, &f.progress.step, f.progress.dispatch);
        // A reconcile lookup's answer, like a read's, is never handed over:
        // the partition's owner asks again at its next time.
        let fast = f.progress.fast_ref.is_some() || f.progress.lookup_ask().is_some();
        if self.ownership.is_assigned(p) {
            self.ensure_owned(p).await?;
            let (store, batch) = (self.env.store, &mut self.open.batch);
            self.core
                .on_outcome(store, batch, p, f.progress.clone(), now_ms())?;
            if !fast {
                self.open.outcomes.push(f);
            }
        } else if fast {
            // Its intent is re-read by the partition's owner: nothing to hand over.
        } else if self.ownership.ever_assigned() {
            self.env.metrics.outcome_handed_over(p, &f.progress.step);
            self.open.orphans.push(f.clone());
            self.open.outcomes.push(f);
        } else {
            self.backlog.push(f);
        }
        Ok(())
    }

    /// The loop ended: a commit in flight ends either way — what committed
    /// is honoured (applied, its calls started); what did not is re-read. A
    /// graceful end then shuts down; a failed one keeps its open batch's
    /// outcomes for the next session.
    async fn finish(
        &mut self,
        served: Result<(), GateError>,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
    ) -> Result<(), GateError> {
        let landed = self.land_in_flight().await;
        match (served, landed) {
            (Ok(()), Ok(())) => self.shut_down(outcomes).await,
            (Err(e), _) | (Ok(()), Err(e)) => {
                let open = std::mem::replace(&mut self.open, OpenBatch::on_top_of(None));
                self.backlog.extend(open.outcomes);
                Err(e)
            }
        }
    }

    /// SIGTERM: start no more calls; commit what is decided; let running
    /// calls finish within `executor.drain_timeout`, and commit their
    /// outcomes. Calls that had not started (queued for a slot, or decided in
    /// the last batch) are handed back not invoked and recorded so: the next
    /// owner runs them at once, never `in_doubt`. Calls still running at the
    /// drain timeout stay `started`; their deadline settles them.
    async fn shut_down(
        &mut self,
        outcomes: &mut mpsc::UnboundedReceiver<Finished>,
    ) -> Result<(), GateError> {
        self.env.invoker.ownership().stop();
        self.core.set_stopping();
        self.commit_open().await?;
        let until = Instant::now() + self.env.config.executor.drain_timeout.0;
        // Re-checked every 50 ms: the last outcome may be received just
        // before its task counts itself finished.
        while self.env.invoker.running() > 0 && Instant::now() < until {
            match tokio::time::timeout(Duration::from_millis(50), outcomes.recv()).await {
                Ok(Some(f)) => self.on_finished(f).await?,
                Ok(None) => break,
                Err(_) => {}
            }
        }
        while let Ok(f) = outcomes.try_recv() {
            self.on_finished(f).await?;
        }
        if self.env.invoker.running() > 0 {
            warn!(
                calls = self.env.invoker.running(),
                "drain timeout: calls still running stay `started`; their deadline settles them"
            );
        }
        self.commit_open().await
    }

    /// Commit the open batch now, if it holds anything, and wait for it.
    async fn commit_open(&mut self) -> Result<(), GateError> {
        self.take_decisions();
        if self.open.is_empty() {
            return Ok(());
        }
        self.close()?;
        self.land_in_flight().await
    }
}
