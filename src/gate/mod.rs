//! The gate: a consumer group over `intents`, the executors' `progress` and the
//! operators' `commands`.
//!
//! Per batch (every `gate.commit_interval` or `gate.max_batch` inputs): decide
//! ([`GateCore`]), write the state durably (one synced RocksDB batch), then commit
//! the forwarded calls, the answers and the input offsets in one Kafka transaction.
//! The gate never calls a tool.

mod core;

pub use self::core::{GateCore, GateSettings, Input, Out};

use crate::config::Config;
use crate::contract::ToolResult;
use crate::kafka::{self, OutRecord, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::state::{Batch, Reconciled, StateError, StateStore};
use crate::telemetry::{Health, Metrics};
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
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
    #[error("restoring partition {partition} from the changelog did not finish within {limit:?}")]
    RestoreTimeout { partition: i32, limit: Duration },
}

/// The offset-metadata tag carrying a partition's last committed batch number.
const SEQ_TAG: &str = "stepgate-seq:";

/// Per-partition bookkeeping of an owned partition.
struct Owned {
    /// Last batch number committed for this partition (None before the first).
    seq: Option<u64>,
    /// Next intents offset to commit.
    intents_next: i64,
}

/// Run the gate until `shutdown`; recoverable failures restart the session from
/// the last committed offsets.
pub async fn run(
    config: Arc<Config>,
    store: Arc<StateStore>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), GateError> {
    let mut core = GateCore::new(&config, metrics.clone());
    let mut backoff = Duration::from_millis(250);
    loop {
        let mut session = Session {
            config: &config,
            store: &store,
            metrics: &metrics,
            health: &health,
            owned: HashMap::new(),
            assigned: BTreeSet::new(),
        };
        let result = session.run(&mut core, &shutdown).await;
        health.set_gate_ready(false);
        core.reset();
        match result {
            Ok(()) => return Ok(()),
            Err(GateError::Rebalanced) => {
                info!("partitions revoked mid-batch: resuming from the last committed transaction");
            }
            Err(e) => {
                error!(error = %crate::telemetry::error_chain(&e), "gate session failed; resuming from the last committed transaction");
                if !kafka::wait_before_restart(&shutdown, &mut backoff).await {
                    return Ok(());
                }
            }
        }
    }
}

struct Session<'a> {
    config: &'a Config,
    store: &'a StateStore,
    metrics: &'a Arc<Metrics>,
    health: &'a Health,
    owned: HashMap<i32, Owned>,
    assigned: BTreeSet<i32>,
}

/// What one batch has gathered.
#[derive(Default)]
struct Pending {
    batch: Batch,
    inputs: usize,
    intents_next: BTreeMap<i32, i64>,
    /// Next offsets of the other inputs (progress, commands).
    others_next: BTreeMap<(String, i32), i64>,
    started: Option<Instant>,
}

impl Session<'_> {
    async fn run(
        &mut self,
        core: &mut GateCore,
        shutdown: &CancellationToken,
    ) -> Result<(), GateError> {
        let k = &self.config.kafka;
        let (ctx, mut events) = RebalanceContext::new(self.metrics.clone(), &k.gate_group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(k, &k.gate_group, &format!("{}-gate", k.instance_id))
                .create_with_context(ctx)?,
        );
        let producer =
            kafka::init_txn_producer(k, &format!("{}-gate-{}", k.gate_group, k.instance_id))
                .await?;
        consumer.subscribe(&[&k.topics.intents, &k.topics.progress, &k.topics.commands])?;
        info!(intents = %k.topics.intents, progress = %k.topics.progress, commands = %k.topics.commands, "gate consuming");

        let commit_interval = self.config.gate.commit_interval.0;
        let purge_interval = self.config.state.purge_interval.0;
        let mut last_purge = Instant::now();
        let mut last_size = Instant::now();
        let grace = self.config.gate.in_doubt_grace.0;
        let mut healthy_since = Instant::now();
        let stuck_after = k.session_timeout.0 * 3;
        let mut unassigned_since = Instant::now();
        let mut tick = tokio::time::interval(commit_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pending = Pending::default();
        let result = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some(ev) = events.recv() => {
                    let open = pending.inputs > 0 || !pending.batch.is_empty() || core.has_outs();
                    self.on_rebalance(core, &consumer, ev, open).await?
                }
                _ = tick.tick() => {
                    // A member left without partitions for this long (e.g.
                    // fenced while the broker restarted) starts over.
                    if self.assigned.is_empty() && unassigned_since.elapsed() > stuck_after {
                        return Err(GateError::Unassigned(stuck_after));
                    }
                    if !self.assigned.is_empty() {
                        unassigned_since = Instant::now();
                    }
                    let now = now_ms();
                    // Outcomes may be queued behind an outage (ours or the
                    // broker's): only settle deadlines after a grace period of
                    // health, so an outage never turns a known outcome into doubt.
                    if healthy_since.elapsed() >= grace {
                        core.on_deadlines(self.store, &mut pending.batch, now)?;
                    }
                    if last_purge.elapsed() >= purge_interval {
                        last_purge = Instant::now();
                        let parts: Vec<i32> = self.owned.keys().copied().collect();
                        core.purge(self.store, &mut pending.batch, parts, now, 10_000)?;
                    }
                    if last_size.elapsed() >= STATE_SIZE_EVERY {
                        last_size = Instant::now();
                        self.metrics.state_size(&self.store.size());
                    }
                    // Work from deadlines and purges alone is committed at once;
                    // with inputs it joins their batch.
                    if pending.inputs == 0 && (core.has_outs() || !pending.batch.is_empty()) {
                        self.flush(core, &consumer, &producer, std::mem::take(&mut pending)).await?;
                    }
                }
                // A batch closes `commit_interval` after its first input.
                _ = batch_closes(pending.started, commit_interval) => {
                    self.flush(core, &consumer, &producer, std::mem::take(&mut pending)).await?;
                }
                msg = consumer.recv() => {
                    let input = match msg {
                        Ok(m) => kafka::to_input(&m),
                        Err(e) => {
                            warn!(error = %e, "consumer error (librdkafka retries by itself)");
                            healthy_since = Instant::now();
                            continue;
                        }
                    };
                    self.ensure_owned(core, &consumer, input.partition).await?;
                    let now = now_ms();
                    if input.topic == k.topics.intents {
                        core.on_intent(self.store, &mut pending.batch, &input, now)?;
                        pending.intents_next.insert(input.partition, input.offset + 1);
                    } else {
                        if input.topic == k.topics.commands {
                            core.on_command(self.store, &mut pending.batch, &input, now)?;
                        } else {
                            core.on_progress(self.store, &mut pending.batch, &input, now)?;
                        }
                        pending.others_next.insert((input.topic.clone(), input.partition), input.offset + 1);
                    }
                    pending.inputs += 1;
                    pending.started.get_or_insert_with(Instant::now);
                    if pending.inputs >= self.config.gate.max_batch {
                        self.flush(core, &consumer, &producer, std::mem::take(&mut pending)).await?;
                    }
                }
            }
        };
        // Commit what is done before leaving; what was not committed is re-read
        // by the next owner (and undone here at the next start).
        if result.is_ok()
            && (pending.started.is_some() || !pending.batch.is_empty() || core.has_outs())
        {
            self.flush(core, &consumer, &producer, pending).await?;
        }
        drop(producer);
        drop(consumer);
        result
    }

    async fn on_rebalance(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        ev: RebalanceEvent,
        batch_open: bool,
    ) -> Result<(), GateError> {
        match ev {
            RebalanceEvent::Assigned(parts) => {
                let ps: BTreeSet<i32> = parts.iter().map(|(_, p)| *p).collect();
                info!(partitions = ?ps, "partitions assigned");
                self.assigned.extend(ps.iter().copied());
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
                for p in ps {
                    self.assigned.remove(&p);
                    self.owned.remove(&p);
                    core.drop_partition(p);
                }
            }
        }
        self.health.set_gate_ready(
            !self.assigned.is_empty() && self.assigned.iter().all(|p| self.owned.contains_key(p)),
        );
        Ok(())
    }

    /// Before a partition's first input: reconcile its state with what Kafka
    /// committed, and load its pending deadlines.
    async fn ensure_owned(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        p: i32,
    ) -> Result<(), GateError> {
        if self.owned.contains_key(&p) {
            return Ok(());
        }
        let topics = self.config.kafka.topics.clone();
        let c = consumer.clone();
        let (intents_off, seq_meta) = kafka::blocking(move || {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&topics.intents, p);
            let committed = c.committed_offsets(tpl, Duration::from_secs(30))?;
            let i = committed.find_partition(&topics.intents, p);
            let intents = i
                .as_ref()
                .and_then(|e| e.offset().to_raw())
                .filter(|o| *o >= 0);
            let meta = i.map(|e| e.metadata().to_owned()).unwrap_or_default();
            // Nothing committed yet: commit from 0 when needed — with
            // auto.offset.reset=earliest that also covers a log whose start moved.
            // (Not a watermark query: those were seen to time out for minutes
            // after a broker restart.)
            let intents = intents.unwrap_or(0);
            drop(committed);
            Ok((intents, meta))
        })
        .await?;
        let committed_seq = seq_meta
            .strip_prefix(SEQ_TAG)
            .and_then(|s| s.parse::<u64>().ok());
        let nothing_local = self.store.applied_seq(p)?.is_none();
        let restore = match self.store.reconcile(p, committed_seq)? {
            // Nothing here and nothing committed: a new deployment, or the
            // group's offsets are gone (expired, a new group id) while the
            // changelog still holds the truth. Reading the changelog tells
            // (an empty partition ends at once).
            Reconciled::InSync if committed_seq.is_none() && nothing_local => {
                let (c, topic) = (consumer.clone(), self.config.kafka.topics.changelog.clone());
                match kafka::blocking(move || {
                    c.fetch_watermarks(&topic, p, Duration::from_secs(10))
                })
                .await
                {
                    Ok((low, high)) => high > low,
                    // Unknown: reading the changelog will tell.
                    Err(_) => true,
                }
            }
            Reconciled::InSync => false,
            Reconciled::RolledBack { seq } => {
                self.metrics.rolled_back(p, seq);
                false
            }
            Reconciled::Diverged {
                state_seq,
                committed_seq,
            } => {
                // New owner, lost disk, or state from another history: the
                // changelog is the truth up to the last committed batch.
                self.metrics.divergence(p, state_seq, committed_seq);
                true
            }
        };
        if restore {
            let started = Instant::now();
            let n = tokio::task::block_in_place(|| {
                restore_partition(&self.config.kafka, self.store, p)
            })?;
            self.store.finish_restore(p, committed_seq)?;
            if n > 0 {
                self.metrics.restored(p, n, started.elapsed());
            }
            self.metrics.state_size(&self.store.size());
        }
        let seq = committed_seq;
        core.load_partition(self.store, p)?;
        self.owned.insert(
            p,
            Owned {
                seq,
                intents_next: intents_off,
            },
        );
        self.assigned.insert(p);
        self.health
            .set_gate_ready(self.assigned.iter().all(|q| self.owned.contains_key(q)));
        Ok(())
    }

    /// Commit one batch: state first (synced), then the transaction with its
    /// messages and input offsets.
    async fn flush(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &FutureProducer,
        pending: Pending,
    ) -> Result<(), GateError> {
        let outs = core.take_outs();
        if pending.batch.is_empty() && outs.is_empty() && pending.inputs == 0 {
            return Ok(());
        }
        let started = Instant::now();
        let touched = pending.batch.partitions();
        let mut seqs = BTreeMap::new();
        for p in &touched {
            let o = self.owned.get(p).map(|o| o.seq).unwrap_or_default();
            seqs.insert(*p, o.map_or(1, |s| s + 1));
        }
        producer.begin_transaction()?;
        let mut records: Vec<OutRecord> = outs.iter().map(|o| self.record(o)).collect();
        let changelog_topic = &self.config.kafka.topics.changelog;
        records.extend(pending.batch.changelog().into_iter().map(|e| OutRecord {
            topic: changelog_topic.clone(),
            partition: Some(e.partition),
            key: Some(e.key),
            payload: e.value,
            headers: Vec::new(),
        }));
        let sent = async {
            // Produce first (it needs no state), then make the state durable while
            // deliveries are in flight, then commit.
            let send = kafka::send_all(producer, &records);
            let state = async {
                let t = Instant::now();
                let written = self.store.commit(pending.batch, &seqs);
                self.metrics.state_written(t.elapsed());
                written.map_err(GateError::from)
            };
            let (s, st) = tokio::join!(send, state);
            st?;
            s?;
            if !touched.is_empty() {
                crash_point::state_written();
            }
            let mut tpl = TopicPartitionList::new();
            let topics = &self.config.kafka.topics;
            let intent_parts: BTreeSet<i32> = pending
                .intents_next
                .keys()
                .chain(touched.iter())
                .copied()
                .collect();
            for p in intent_parts {
                let owned = self.owned.get(&p);
                let next = pending
                    .intents_next
                    .get(&p)
                    .copied()
                    .or(owned.map(|o| o.intents_next))
                    .unwrap_or(0);
                let seq = seqs.get(&p).copied().or(owned.and_then(|o| o.seq));
                let mut e = tpl.add_partition(&topics.intents, p);
                e.set_offset(Offset::Offset(next))?;
                e.set_metadata(seq.map(|s| format!("{SEQ_TAG}{s}")).unwrap_or_default());
            }
            for ((topic, p), next) in &pending.others_next {
                tpl.add_partition_offset(topic, *p, Offset::Offset(*next))?;
            }
            if tpl.count() > 0 {
                kafka::send_offsets(producer, consumer, tpl).await?;
            }
            kafka::commit_txn(producer).await?;
            Ok::<(), GateError>(())
        }
        .await;
        if let Err(e) = sent {
            kafka::abort_txn(producer).await;
            // The next session reconciles these partitions against Kafka and undoes
            // the state of this batch.
            return Err(e);
        }
        for (p, s) in seqs {
            if let Some(o) = self.owned.get_mut(&p) {
                o.seq = Some(s);
            }
        }
        for (p, next) in pending.intents_next {
            if let Some(o) = self.owned.get_mut(&p) {
                o.intents_next = next;
            }
        }
        let now = now_ms();
        for o in &outs {
            if let Out::Result {
                result, since_ms, ..
            } = o
            {
                let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
                self.metrics
                    .result_published(result.status.as_str(), result.deduplicated, latency);
            }
        }
        self.metrics.committed(started.elapsed());
        Ok(())
    }

    fn record(&self, out: &Out) -> OutRecord {
        let t = &self.config.kafka.topics;
        match out {
            Out::Call { partition, call } => OutRecord {
                topic: t.calls.clone(),
                partition: Some(*partition),
                key: Some(call.step.workflow_id.as_bytes().to_vec()),
                payload: Some(serde_json::to_vec(call).expect("calls serialise")),
                headers: Vec::new(),
            },
            Out::Result {
                partition,
                result,
                traceparent,
                ..
            } => result_record(&t.results, *partition, result, traceparent.as_deref()),
            Out::Approval { partition, event } => OutRecord {
                topic: t.approvals.clone(),
                partition: Some(*partition),
                key: Some(event.step.workflow_id.as_bytes().to_vec()),
                payload: Some(serde_json::to_vec(event).expect("approval events serialise")),
                headers: Vec::new(),
            },
            Out::Dlq {
                key,
                headers,
                record,
            } => OutRecord {
                topic: t.dlq.clone(),
                partition: None,
                key: key.clone(),
                payload: Some(serde_json::to_vec(record).expect("DLQ records serialise")),
                headers: headers.clone(),
            },
        }
    }
}

/// Resolves when a batch opened at `started` is due; never without one.
async fn batch_closes(started: Option<Instant>, interval: Duration) {
    match started {
        Some(t) => tokio::time::sleep_until((t + interval).into()).await,
        None => std::future::pending().await,
    }
}

/// How often the state-size gauges are refreshed (a few RocksDB property reads).
const STATE_SIZE_EVERY: Duration = Duration::from_secs(5);

/// How long a restore may take before the session gives up and retries.
const RESTORE_LIMIT: Duration = Duration::from_secs(600);

/// Rebuild a partition's local state from its changelog partition, read to its
/// end (read_committed: only committed batches). Blocking.
pub fn restore_partition(
    cfg: &crate::config::KafkaConfig,
    store: &StateStore,
    p: i32,
) -> Result<usize, GateError> {
    let consumer = kafka::read_to_end_consumer(cfg, &format!("{}-restore", cfg.gate_group))?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&cfg.topics.changelog, p, Offset::Beginning)?;
    consumer.assign(&tpl)?;
    drop(tpl);
    store.wipe_partition(p)?;
    let deadline = Instant::now() + RESTORE_LIMIT;
    let mut buf = Vec::with_capacity(10_000);
    let mut n = 0;
    let done = kafka::read_to_end(&consumer, BTreeSet::from([p]), Some(deadline), |m| {
        if let Some(k) = m.key() {
            buf.push((k.to_vec(), m.payload().map(<[u8]>::to_vec)));
        }
        if buf.len() >= 10_000 {
            n += store.apply_changelog(&buf)?;
            buf.clear();
        }
        Ok::<_, StateError>(())
    })?;
    if !done {
        return Err(GateError::RestoreTimeout {
            partition: p,
            limit: RESTORE_LIMIT,
        });
    }
    n += store.apply_changelog(&buf)?;
    drop(consumer);
    Ok(n)
}

/// What [`rebuild_state`] did.
#[derive(Debug)]
pub struct Rebuilt {
    pub path: std::path::PathBuf,
    pub partitions: usize,
    pub records: usize,
}

#[derive(Debug, Error)]
pub enum RebuildError {
    #[error("`{0}` exists and is not empty: rebuild into a new directory")]
    NotEmpty(std::path::PathBuf),
    #[error("Kafka")]
    Setup(#[from] kafka::KafkaSetupError),
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("restore")]
    Gate(#[from] GateError),
    #[error("state")]
    State(#[from] StateError),
}

/// Rebuild a whole gate state from the changelog into a new directory, each
/// partition marked with the batch number its group last committed, so a gate
/// started on it finds every partition in sync. Blocking; `progress` is told
/// (partition, partitions, records) as each partition finishes.
pub fn rebuild_state(
    cfg: &crate::config::KafkaConfig,
    path: &std::path::Path,
    mut progress: impl FnMut(i32, usize, usize),
) -> Result<Rebuilt, RebuildError> {
    if path.exists()
        && std::fs::read_dir(path)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(RebuildError::NotEmpty(path.to_owned()));
    }
    let partitions = kafka::check_layout(cfg)?;
    let store = StateStore::open(path)?;
    // The committed batch numbers, read as the gate group (without joining it).
    let consumer: rdkafka::consumer::BaseConsumer = kafka::base_config(cfg)
        .set("group.id", &cfg.gate_group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition(&cfg.topics.intents, p);
    }
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(30))?;
    let seqs: Vec<Option<u64>> = (0..partitions as i32)
        .map(|p| {
            committed
                .find_partition(&cfg.topics.intents, p)
                .and_then(|e| {
                    e.metadata()
                        .strip_prefix(SEQ_TAG)
                        .and_then(|s| s.parse().ok())
                })
        })
        .collect();
    drop(committed);
    drop(consumer);
    let mut records = 0;
    for p in 0..partitions as i32 {
        let n = restore_partition(cfg, &store, p)?;
        store.finish_restore(p, seqs[p as usize])?;
        records += n;
        progress(p, partitions, n);
    }
    Ok(Rebuilt {
        path: path.to_owned(),
        partitions,
        records,
    })
}

/// A Result v1 record: keyed by workflow id, in the intent's partition number.
pub fn result_record(
    topic: &str,
    partition: i32,
    result: &ToolResult,
    traceparent: Option<&str>,
) -> OutRecord {
    OutRecord {
        topic: topic.to_owned(),
        partition: Some(partition),
        key: Some(result.workflow_id.as_bytes().to_vec()),
        payload: Some(result.to_json()),
        headers: traceparent
            .map(|tp| vec![("traceparent".to_owned(), Some(tp.as_bytes().to_vec()))])
            .unwrap_or_default(),
    }
}

/// Fault injection for the crash-consistency tests: with
/// `STEPGATE_TEST_CRASH_AFTER_STATE_WRITE=N`, the process aborts right after the
/// N-th durable state write, before its Kafka transaction commits — the window
/// where state is ahead of Kafka. Unset in production.
mod crash_point {
    use std::sync::atomic::{AtomicU64, Ordering};
    static WRITES: AtomicU64 = AtomicU64::new(0);

    pub fn state_written() {
        let Some(n) = std::env::var("STEPGATE_TEST_CRASH_AFTER_STATE_WRITE")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return;
        };
        if WRITES.fetch_add(1, Ordering::SeqCst) + 1 == n {
            eprintln!(
                "STEPGATE_TEST_CRASH_AFTER_STATE_WRITE={n}: aborting before the transaction commits"
            );
            std::process::abort();
        }
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
