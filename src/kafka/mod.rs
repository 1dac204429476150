//! Kafka plumbing: client configs, the rebalance context, topic creation and checks,
//! and the transaction helpers shared by gate and executor.

use crate::config::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::util::Timeout;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc;

#[derive(Debug, Error)]
pub enum KafkaSetupError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    /// The brokers could not be reached, or refused the login or the TLS
    /// handshake ([`stepgate_client::connect`]).
    #[error(transparent)]
    Connect(#[from] stepgate_client::ConnectError),
    #[error(
        "topic `{0}` does not exist: create the topics with `stepgate topics create --config <file>`"
    )]
    MissingTopic(String),
    #[error("{0}")]
    Layout(String),
    #[error("{0}")]
    Sizes(String),
}

/// Largest record stepgate's producers write (librdkafka `message.max.bytes`,
/// default 1 000 000) and the `max.message.bytes` of the topics that
/// `stepgate topics create` makes for what stepgate writes. Set explicitly: a
/// record over the limit fails its whole transaction, and the session would
/// meet the same input again.
pub const MESSAGE_MAX_BYTES: usize = 4 * 1024 * 1024;

/// `max.message.bytes` of the intents topic `stepgate topics create` makes:
/// agents can publish up to this (intents over `gate.max_intent_bytes` are
/// then rejected), and a dead-letter copy — the original key and headers plus
/// a bounded value ([`crate::contract::DLQ_RECORD_MAX_BYTES`]) — always fits
/// under [`MESSAGE_MAX_BYTES`].
pub const INTENTS_MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;

/// What stepgate adds around an intent's arguments in the records it writes
/// (step key, call ids, traceparent, timestamps, record framing), generously.
/// A record derived from one intent is at most `gate.max_intent_bytes` plus this.
pub const RECORD_ENVELOPE_BYTES: usize = 64 * 1024;

// A DLQ copy of the largest record `intents` accepts — its key and headers plus
// the bounded value — fits under what stepgate writes.
const _: () =
    assert!(INTENTS_MAX_MESSAGE_BYTES + crate::contract::DLQ_RECORD_MAX_BYTES < MESSAGE_MAX_BYTES);

/// The `[kafka.client]` pass-through, applied last so an operator can override
/// any of stepgate's defaults (TLS, SASL, timeouts, …).
fn with_overrides(mut c: ClientConfig, cfg: &KafkaConfig) -> ClientConfig {
    for (k, v) in &cfg.client {
        c.set(k, v);
    }
    c
}

/// The base config of every client: brokers, then the `[kafka.client]` pass-through.
pub fn base_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers);
    with_overrides(c, cfg)
}

/// Bound what a consumer prefetches ahead of its poll loop. librdkafka's
/// default, 64 MiB per consumer, buys nothing for a loop that commits every
/// 100 ms; a restore or an intents flood would hold that much per consumer.
/// With a smaller queue the queue is full more often, and librdkafka then
/// pauses fetching for `fetch.queue.backoff.ms` (default 1 s: it cut a restore
/// to 40 % of its rate), so that pause is made short too. Keys the
/// `[kafka.client]` pass-through sets are left alone.
pub fn bound_prefetch(c: &mut ClientConfig) {
    for (k, v) in [
        ("queued.max.messages.kbytes", "8192"),
        ("fetch.queue.backoff.ms", "10"),
    ] {
        if c.get(k).is_none() {
            c.set(k, v);
        }
    }
}

/// A consumer that commits only through transactions and reads only committed data.
pub fn txn_consumer_config(cfg: &KafkaConfig, group: &str, instance: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("group.id", group)
        // Static membership: a restarted process gets its partitions back at once.
        .set("group.instance.id", instance)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        // Range keeps partition p of every subscribed topic on one member, which is
        // what co-partitioned intents and progress need.
        .set("partition.assignment.strategy", "range")
        .set(
            "session.timeout.ms",
            cfg.session_timeout.0.as_millis().to_string(),
        )
        .set("max.poll.interval.ms", "600000")
        .set("statistics.interval.ms", "5000")
        .set("fetch.wait.max.ms", "50");
    let mut c = with_overrides(c, cfg);
    bound_prefetch(&mut c);
    c
}

/// The consumer of a pool's worker (docs/design.md "Worker pools"): one group
/// per pool, reading only committed calls, committing its offsets itself (a
/// committed offset is a call taken). Static membership when `instance` is
/// given: a restarted worker gets its partitions back at once.
pub fn worker_consumer_config(
    cfg: &KafkaConfig,
    group: &str,
    instance: Option<&str>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set(
            "session.timeout.ms",
            cfg.session_timeout.0.as_millis().to_string(),
        )
        .set("fetch.wait.max.ms", "50");
    if let Some(i) = instance {
        c.set("group.instance.id", i);
    }
    let mut c = with_overrides(c, cfg);
    bound_prefetch(&mut c);
    c
}

/// The producer of a pool's worker: idempotent, every write acknowledged by
/// all in-sync replicas (an outcome, or a `started` that lets a call be
/// invoked), sent at once.
pub fn worker_producer_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .set("message.max.bytes", MESSAGE_MAX_BYTES.to_string());
    with_overrides(c, cfg)
}

/// A transactional producer config (EOS v2: one producer per process, fenced by
/// the consumer group's metadata).
pub fn txn_producer_config(cfg: &KafkaConfig, transactional_id: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("transactional.id", transactional_id)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("message.max.bytes", MESSAGE_MAX_BYTES.to_string())
        .set(
            "transaction.timeout.ms",
            cfg.transaction_timeout.0.as_millis().to_string(),
        );
    with_overrides(c, cfg)
}

/// The largest record stepgate's producers may write: [`MESSAGE_MAX_BYTES`]
/// unless `[kafka.client]` overrides `message.max.bytes`.
pub fn producer_max_bytes(cfg: &KafkaConfig) -> Result<usize, KafkaSetupError> {
    match cfg.client.get("message.max.bytes") {
        None => Ok(MESSAGE_MAX_BYTES),
        Some(v) => v.trim().parse().map_err(|_| {
            KafkaSetupError::Sizes(format!(
                "`kafka.client.\"message.max.bytes\"` must be a number of bytes, got `{v}`"
            ))
        }),
    }
}

/// Refuse a config whose largest intent could not be written back: every
/// record stepgate derives from an intent (the forwarded call, the step
/// record) is up to `max_intent_bytes` + [`RECORD_ENVELOPE_BYTES`], and must
/// fit under the producer's `message.max.bytes`.
pub fn check_sizes(cfg: &KafkaConfig, max_intent_bytes: usize) -> Result<(), KafkaSetupError> {
    let need = max_intent_bytes.saturating_add(RECORD_ENVELOPE_BYTES);
    let producer = producer_max_bytes(cfg)?;
    if need > producer {
        return Err(KafkaSetupError::Sizes(format!(
            "`gate.max_intent_bytes` is {max_intent_bytes}: the records stepgate writes for such an intent take up to {need} bytes (the intent + {RECORD_ENVELOPE_BYTES} of envelope), over the producer's `message.max.bytes` of {producer}. Lower `gate.max_intent_bytes` to at most {} or raise `kafka.client.\"message.max.bytes\"` (and the topics' `max.message.bytes`) to at least {need}.",
            producer.saturating_sub(RECORD_ENVELOPE_BYTES)
        )));
    }
    Ok(())
}

/// Refuse topics whose `max.message.bytes` is below what stepgate writes to
/// them (`max_intent_bytes` + envelope; for the DLQ, a copy of the largest
/// record the intents topic accepts). Topics that do not exist are left to
/// [`check_layout`]; when the broker does not answer (no DescribeConfigs
/// permission, a mock cluster), the check is skipped with a warning.
pub async fn check_topic_sizes(
    cfg: &KafkaConfig,
    max_intent_bytes: usize,
) -> Result<(), KafkaSetupError> {
    use rdkafka::admin::ResourceSpecifier;
    let t = &cfg.topics;
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let specs: Vec<ResourceSpecifier<'_>> = t
        .all()
        .iter()
        .map(|n| ResourceSpecifier::Topic(n.as_str()))
        .collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let described = match admin.describe_configs(specs.iter(), &opts).await {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the topics' max.message.bytes: not checked");
            return Ok(());
        }
    };
    let mut limits = std::collections::BTreeMap::new();
    for (name, r) in t.all().iter().zip(described) {
        let limit = r.ok().and_then(|c| {
            c.get("max.message.bytes")
                .and_then(|e| e.value.as_deref())
                .and_then(|v| v.parse::<usize>().ok())
        });
        if let Some(l) = limit {
            limits.insert(name.to_string(), l);
        }
    }
    let need = max_intent_bytes.saturating_add(RECORD_ENVELOPE_BYTES);
    let mut problems = Vec::new();
    for (name, limit) in &limits {
        if *name == t.intents {
            continue;
        }
        let need = if *name == t.dlq {
            // A DLQ record keeps the original key and headers.
            limits
                .get(&t.intents)
                .copied()
                .unwrap_or(need)
                .max(need)
                .saturating_add(crate::contract::DLQ_RECORD_MAX_BYTES)
        } else {
            need
        };
        if *limit < need {
            problems.push(format!(
                "`{name}` has max.message.bytes={limit}, stepgate may write {need}"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(KafkaSetupError::Sizes(format!(
            "records stepgate writes would not fit: {}. Raise each with `kafka-configs --alter --entity-type topics --entity-name <topic> --add-config max.message.bytes={MESSAGE_MAX_BYTES}` (what `stepgate topics create` sets), or lower `gate.max_intent_bytes` (now {max_intent_bytes}).",
            problems.join("; ")
        )))
    }
}

/// The changelog topic's `delete.retention.ms` (how long compaction keeps a
/// tombstone readable), as the broker applies it (the topic's own, else the
/// broker's default). None, with a warning, when the broker does not say (no
/// DescribeConfigs permission, a mock cluster).
pub async fn changelog_delete_retention(cfg: &KafkaConfig) -> Option<Duration> {
    use rdkafka::admin::ResourceSpecifier;
    let read = async {
        let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
        let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let spec = ResourceSpecifier::Topic(cfg.topics.changelog.as_str());
        let described = admin.describe_configs([&spec], &opts).await?;
        let value = described
            .into_iter()
            .next()
            .and_then(|r| r.ok())
            .and_then(|c| {
                c.get("delete.retention.ms")
                    .and_then(|e| e.value.as_deref())
                    .and_then(|v| v.parse::<u64>().ok())
            });
        Ok::<_, KafkaError>(value)
    };
    match read.await {
        Ok(Some(ms)) => Some(Duration::from_millis(ms)),
        Ok(None) => {
            tracing::warn!(topic = %cfg.topics.changelog, "the changelog's delete.retention.ms is not known: Kafka's default (24 h) is assumed when judging whether a partition's local state is recent enough to resume from");
            None
        }
        Err(e) => {
            tracing::warn!(topic = %cfg.topics.changelog, error = %e, "cannot read the changelog's delete.retention.ms: Kafka's default (24 h) is assumed when judging whether a partition's local state is recent enough to resume from");
            None
        }
    }
}

/// The context of consumers that read partitions to their end (restore, audit,
/// operator reads): reaching the end is how they know they are done, so
/// librdkafka's partition-EOF events are not logged as errors.
pub struct ReadToEnd;

/// A consumer that reads partitions to their end.
pub type ReadToEndConsumer = BaseConsumer<ReadToEnd>;

impl ClientContext for ReadToEnd {
    fn error(&self, error: KafkaError, reason: &str) {
        match &error {
            KafkaError::PartitionEOF(_)
            | KafkaError::Global(rdkafka::types::RDKafkaErrorCode::PartitionEOF) => {
                tracing::debug!(%reason, "end of partition")
            }
            _ => tracing::error!(error = %error, %reason, "librdkafka"),
        }
    }
}

impl ConsumerContext for ReadToEnd {}

/// A consumer for reading partitions to their end, only what was committed:
/// the caller assigns it and hands it to [`read_to_end`]. A position outside
/// the log starts over from the log's start. Blocking.
pub fn read_to_end_consumer(
    cfg: &KafkaConfig,
    group: &str,
) -> Result<ReadToEndConsumer, KafkaError> {
    reader_config(cfg, group, "earliest").create_with_context(ReadToEnd)
}

/// A [`read_to_end_consumer`] for resuming at a known offset: a position
/// outside the log (past its end: the topic was recreated) ends the read with
/// [`ReadEnd::OutOfRange`] instead of silently starting elsewhere. Blocking.
pub fn resume_consumer(cfg: &KafkaConfig, group: &str) -> Result<ReadToEndConsumer, KafkaError> {
    reader_config(cfg, group, "error").create_with_context(ReadToEnd)
}

fn reader_config(cfg: &KafkaConfig, group: &str, reset: &str) -> ClientConfig {
    let mut c = base_config(cfg);
    c.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", reset);
    bound_prefetch(&mut c);
    c
}

/// How often a [`read_to_end`] that has not ended logs where it stands.
const READ_REPORT_EVERY: Duration = Duration::from_secs(15);

/// How a [`read_to_end`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadEnd {
    /// Every partition reached its end.
    Reached,
    /// The deadline passed first.
    TimedOut,
    /// A [`resume_consumer`]'s position is outside the log.
    OutOfRange,
}

/// Poll an assigned [`read_to_end_consumer`] until each of `open` has reached
/// its end, handing every record to `f`. The end is the broker's partition-EOF:
/// transaction markers take offsets a read_committed reader never sees, so
/// counting to the high watermark would never finish (and no watermark query
/// is needed: those were seen to time out for minutes after a broker restart).
/// Read errors are retried (librdkafka reconnects by itself). Returns the
/// first error `f` returns. Blocking.
pub fn read_to_end<E>(
    consumer: &ReadToEndConsumer,
    mut open: BTreeSet<i32>,
    deadline: Option<Instant>,
    mut f: impl FnMut(&BorrowedMessage<'_>) -> Result<(), E>,
) -> Result<ReadEnd, E> {
    let started = Instant::now();
    let mut next_report = started + READ_REPORT_EVERY;
    while !open.is_empty() {
        // A read that does not end says where it stands: after a broker
        // restart it can wait on a transaction the broker has yet to settle.
        if Instant::now() > next_report {
            next_report += READ_REPORT_EVERY;
            let at = consumer.position().map(|tpl| {
                tpl.elements()
                    .iter()
                    .map(|e| format!("{}/{}@{:?}", e.topic(), e.partition(), e.offset()))
                    .collect::<Vec<_>>()
            });
            tracing::warn!(
                waiting_on = ?open,
                position = ?at,
                waited_s = started.elapsed().as_secs(),
                "still reading to the end (read_committed: an unsettled transaction holds the end back)"
            );
        }
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) => f(&m)?,
            Some(Err(KafkaError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(KafkaError::MessageConsumption(
                rdkafka::types::RDKafkaErrorCode::AutoOffsetReset,
            ))) => return Ok(ReadEnd::OutOfRange),
            Some(Err(e)) => tracing::warn!(error = %e, "read error (retrying)"),
            None => {}
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Ok(ReadEnd::TimedOut);
        }
    }
    Ok(ReadEnd::Reached)
}

/// Replay `partitions` of `topic` to their end as of now (read_committed),
/// from their beginning or from the first record at or after `since_ms`,
/// handing each record to `f`; partitions that are empty are not waited for.
/// The consumer is of `group` and never commits. For the operator's and the
/// audit's reads; a gate's restore resumes at an offset instead
/// ([`resume_consumer`]). Blocking.
pub fn replay<E: From<KafkaError>>(
    cfg: &KafkaConfig,
    group: &str,
    topic: &str,
    partitions: &[i32],
    since_ms: Option<i64>,
    deadline: Option<Instant>,
    f: impl FnMut(&BorrowedMessage<'_>) -> Result<(), E>,
) -> Result<ReadEnd, E> {
    let consumer = read_to_end_consumer(cfg, group)?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    let mut open = BTreeSet::new();
    for &p in partitions {
        let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(30))?;
        if high > 0 {
            open.insert(p);
        }
        let start = since_ms.map_or(rdkafka::Offset::Beginning, rdkafka::Offset::Offset);
        tpl.add_partition_offset(topic, p, start)?;
    }
    if since_ms.is_some() {
        tpl = consumer.offsets_for_times(tpl, Duration::from_secs(30))?;
    }
    consumer.assign(&tpl)?;
    drop(tpl);
    let end = read_to_end(&consumer, open, deadline, f);
    drop(consumer);
    end
}

/// The offsets of the records a read_committed reader sees in each of
/// `starts`' partitions of `topic`, from the given offset to the end as of now;
/// `None` if the deadline passed first. The consumer is of `group` and never
/// commits. Blocking.
pub fn visible_offsets(
    cfg: &KafkaConfig,
    group: &str,
    topic: &str,
    starts: &BTreeMap<i32, i64>,
    deadline: Instant,
) -> Result<Option<BTreeMap<i32, BTreeSet<i64>>>, KafkaError> {
    use rdkafka::message::Message;
    let consumer = read_to_end_consumer(cfg, group)?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for (&p, &o) in starts {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Offset(o))?;
    }
    consumer.assign(&tpl)?;
    drop(tpl);
    let mut seen: BTreeMap<i32, BTreeSet<i64>> =
        starts.keys().map(|&p| (p, BTreeSet::new())).collect();
    let open = starts.keys().copied().collect();
    let end = read_to_end(&consumer, open, Some(deadline), |m| {
        seen.entry(m.partition()).or_default().insert(m.offset());
        Ok::<_, KafkaError>(())
    })?;
    drop(consumer);
    Ok((end == ReadEnd::Reached).then_some(seen))
}

/// Rebalance events, signalled to the loop that owns the consumer (callbacks
/// never do work themselves and never panic).
#[derive(Debug)]
pub enum RebalanceEvent {
    Assigned(Vec<(String, i32)>),
    Revoked(Vec<(String, i32)>),
}

/// Signals rebalances to the consuming loop, and turns librdkafka's statistics
/// into consumer-lag gauges.
pub struct RebalanceContext {
    tx: mpsc::UnboundedSender<RebalanceEvent>,
    metrics: Arc<crate::telemetry::Metrics>,
    group: String,
}

impl RebalanceContext {
    pub fn new(
        metrics: Arc<crate::telemetry::Metrics>,
        group: &str,
    ) -> (Self, mpsc::UnboundedReceiver<RebalanceEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            RebalanceContext {
                tx,
                metrics,
                group: group.to_owned(),
            },
            rx,
        )
    }
}

impl ClientContext for RebalanceContext {
    // Only the lag is read, from the raw JSON: decoding the whole statistics
    // document into rdkafka's typed struct is slower and breaks on new fields.
    fn stats_raw(&self, statistics: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(statistics) else {
            return;
        };
        let Some(topics) = v.get("topics").and_then(|t| t.as_object()) else {
            return;
        };
        for (topic, t) in topics {
            let Some(parts) = t.get("partitions").and_then(|p| p.as_object()) else {
                continue;
            };
            for (p, part) in parts {
                // Offsets are committed through transactions, which librdkafka's
                // own `consumer_lag` does not see: lag is measured from what
                // the application has consumed to the last stable offset.
                let field = |k: &str| part.get(k).and_then(|v| v.as_i64()).unwrap_or(-1);
                let (Ok(p), end, consumed) =
                    (p.parse::<i32>(), field("ls_offset"), field("app_offset"))
                else {
                    continue;
                };
                // -1 is librdkafka's "internal" partition and an unknown offset.
                if p >= 0 && end >= 0 && consumed >= 0 {
                    self.metrics
                        .consumer_lag(&self.group, topic, p, (end - consumed).max(0));
                }
            }
        }
    }
}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let parts = list(tpl);
            for (topic, p) in &parts {
                self.metrics.forget_consumer_lag(&self.group, topic, *p);
            }
            let _ = self.tx.send(RebalanceEvent::Revoked(parts));
        }
    }

    fn post_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let _ = self.tx.send(RebalanceEvent::Assigned(list(tpl)));
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

fn list(tpl: &rdkafka::TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

pub type TxnConsumer = StreamConsumer<RebalanceContext>;

/// Create a transactional producer and initialise its transactions (fencing any
/// earlier incarnation with the same id and aborting its open transaction).
pub async fn init_txn_producer(
    cfg: &KafkaConfig,
    transactional_id: &str,
) -> Result<FutureProducer, KafkaError> {
    let producer: FutureProducer = txn_producer_config(cfg, transactional_id).create()?;
    let p = producer.clone();
    tokio::task::spawn_blocking(move || {
        p.init_transactions(Timeout::After(Duration::from_secs(60)))
    })
    .await
    .map_err(|_| KafkaError::Canceled)??;
    Ok(producer)
}

/// Wait before restarting a failed session, doubling the wait each time (capped
/// at 5 s). Returns false when shutdown came first.
pub async fn wait_before_restart(
    shutdown: &tokio_util::sync::CancellationToken,
    backoff: &mut Duration,
) -> bool {
    let wait = *backoff;
    *backoff = (wait * 2).min(Duration::from_secs(5));
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// Drop a Kafka client off the async threads, waiting at most `limit` for it
/// to close; past that it is left to finish on its own thread (a successor
/// with the same static member id fences it).
pub async fn close_within<T: Send + 'static>(what: &str, client: T, limit: Duration) {
    let closing = tokio::task::spawn_blocking(move || drop(client));
    if tokio::time::timeout(limit, closing).await.is_err() {
        tracing::warn!(
            client = what,
            ?limit,
            "a Kafka client did not close in time: going on without waiting for it"
        );
    }
}

/// Run a blocking client call off the async threads.
pub async fn blocking<T: Send + 'static, E: From<KafkaError> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| E::from(KafkaError::Canceled))?
}

/// Commit a transaction, retrying what librdkafka says is retriable.
pub async fn commit_txn(producer: &FutureProducer) -> Result<(), KafkaError> {
    // rust-rdkafka's `commit_transaction` flushes first, and its flush sleeps
    // in 100 ms polls while librdkafka still counts a message whose delivery
    // report the polling thread has handed over but not yet released — a race
    // that added 100 ms to about one commit in ten (measured). The caller has
    // awaited every delivery: wait (briefly) for the count to reach zero.
    let until = Instant::now() + Duration::from_millis(200);
    while producer.in_flight_count() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut tries = 0;
    loop {
        let p = producer.clone();
        match blocking(move || p.commit_transaction(Timeout::After(Duration::from_secs(30)))).await
        {
            Err(KafkaError::Transaction(e)) if e.is_retriable() && tries < 5 => {
                tries += 1;
                tracing::warn!(error = %e, "transaction commit will be retried");
            }
            other => return other,
        }
    }
}

/// Abort the open transaction, if any; errors are logged (the caller is already
/// on an error path and recreates the producer, whose `init_transactions` aborts
/// whatever is still open). Bounded to a few seconds: the session waits for it
/// before it restarts, and outcomes wait for the session.
pub async fn abort_txn(producer: &FutureProducer) {
    let p = producer.clone();
    if let Err(e) =
        blocking(move || p.abort_transaction(Timeout::After(Duration::from_secs(5)))).await
    {
        tracing::warn!(error = %e, "transaction abort failed");
    }
}

/// The key of the records [`end_hanging_transactions`] writes (and aborts).
pub const HANGING_PROBE_KEY: &[u8] = b"stepgate:end-hanging-transaction";

/// End any transaction the broker still holds open for this producer's
/// transactional id in `partitions` and in the group's offsets (those of
/// `offsets_partition`'s group), by writing to each and aborting.
///
/// Why: after a broker is SIGKILLed mid-transaction, the transaction
/// coordinator can come back without the transaction (its id `Empty`), while
/// the partitions it touched still hold it open — a *hanging* transaction
/// (seen here: a changelog partition and `__consumer_offsets`). The partition's
/// last stable offset then never moves (read_committed readers, agents
/// included, see nothing past it) and the group's committed offsets are
/// "unstable" forever, so the gate cannot even learn where to resume.
/// `init_transactions` does not help (the coordinator thinks nothing is open);
/// the abort marker of a transaction of the same producer id does: the
/// partition ends every open transaction of that id. The records written are
/// aborted, so no read_committed reader ever sees them.
pub async fn end_hanging_transactions(
    producer: &FutureProducer,
    consumer: &Arc<TxnConsumer>,
    partitions: &[(String, i32)],
    offsets_partition: (&str, i32),
) -> Result<(), KafkaError> {
    use rdkafka::producer::FutureRecord;
    producer.begin_transaction()?;
    let wrote = async {
        let mut deliveries = Vec::with_capacity(partitions.len());
        for (topic, p) in partitions {
            let rec: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(topic).partition(*p).key(HANGING_PROBE_KEY);
            deliveries.push(producer.send_result(rec).map_err(|(e, _)| e)?);
        }
        for d in deliveries {
            check_delivery(d.await)?;
        }
        // The offset is never committed: any value serves to put the group's
        // offsets partition into the transaction.
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(
            offsets_partition.0,
            offsets_partition.1,
            rdkafka::Offset::Offset(0),
        )?;
        send_offsets(producer, consumer, tpl).await
    }
    .await;
    let p = producer.clone();
    let aborted =
        blocking(move || p.abort_transaction(Timeout::After(Duration::from_secs(30)))).await;
    wrote.and(aborted)
}

/// Partition counts of the topics, or an error naming the missing one.
/// A refused login or TLS handshake fails at once, naming its cause.
pub fn partition_counts(cfg: &KafkaConfig, topics: &[&str]) -> Result<Vec<usize>, KafkaSetupError> {
    let md = stepgate_client::connect::topic_partitions(
        &base_config(cfg),
        None,
        Duration::from_secs(15),
    )?;
    topics
        .iter()
        .map(|t| {
            md.iter()
                .find(|mt| mt.name == *t && mt.ok)
                .map(|mt| mt.partitions)
                .filter(|n| *n > 0)
                .ok_or_else(|| KafkaSetupError::MissingTopic((*t).to_owned()))
        })
        .collect()
}

/// Reach the brokers once, before anything else asks them: a refused login,
/// a failed TLS handshake or no broker at all is an error naming its cause
/// within 15 s, where a later request would only time out.
pub async fn check_connection(cfg: &KafkaConfig) -> Result<(), KafkaSetupError> {
    let c = base_config(cfg);
    tokio::task::spawn_blocking(move || {
        stepgate_client::connect::topic_partitions(&c, None, Duration::from_secs(15))
    })
    .await
    .map_err(|_| KafkaError::Canceled)??;
    Ok(())
}

/// Refuse to start on a topic layout that would misroute answers.
pub fn check_layout(cfg: &KafkaConfig) -> Result<usize, KafkaSetupError> {
    check_counts(&cfg.topics, &layout_counts(cfg)?)
}

/// The partition counts of every topic, in the order of
/// [`TopicsConfig::all`](crate::config::TopicsConfig::all). Blocking.
pub fn layout_counts(cfg: &KafkaConfig) -> Result<Vec<usize>, KafkaSetupError> {
    let names: Vec<&str> = cfg.topics.all().iter().map(|s| s.as_str()).collect();
    partition_counts(cfg, &names)
}

/// [`layout_counts`] that would misroute answers are refused; the intents
/// topic's count otherwise.
pub fn check_counts(
    t: &crate::config::TopicsConfig,
    counts: &[usize],
) -> Result<usize, KafkaSetupError> {
    let (intents, results, progress, changelog, commands) =
        (counts[0], counts[1], counts[3], counts[4], counts[5]);
    if results < intents {
        return Err(KafkaSetupError::Layout(format!(
            "`{}` has {results} partitions but `{}` has {intents}: results are written to the intent's partition number, so results needs at least as many. Add partitions to `{}` (kafka-topics --alter --partitions {intents}) or recreate both with `stepgate topics create`.",
            t.results, t.intents, t.results
        )));
    }
    if progress != intents || changelog != intents || commands != intents {
        return Err(KafkaSetupError::Layout(format!(
            "the internal topics `{}` ({progress}), `{}` ({changelog}) and `{}` ({commands}) must have as many partitions as `{}` ({intents}); `stepgate topics create` makes them equal.",
            t.progress, t.changelog, t.commands, t.intents
        )));
    }
    Ok(intents)
}

/// Create every topic stepgate uses (existing ones are left as they are).
/// Returns (topic, created?) pairs.
pub async fn create_topics(
    cfg: &KafkaConfig,
    state: &crate::config::StateConfig,
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    check_connection(cfg).await?;
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let t = &cfg.topics;
    let retention_ms = state.retention.0.as_millis().max(1).to_string();
    // Operators' decisions outlive the steps they settled: the audit shows them.
    let decisions_ms = state
        .decisions_retention
        .as_ref()
        .map_or_else(|| "-1".to_owned(), |d| d.0.as_millis().max(1).to_string());
    let (intents_max, others_max) = (
        INTENTS_MAX_MESSAGE_BYTES.to_string(),
        MESSAGE_MAX_BYTES.to_string(),
    );
    let (intents_max, others_max) = (intents_max.as_str(), others_max.as_str());
    let names = t.all();
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| {
            let topic = NewTopic::new(
                n,
                cfg.partitions,
                TopicReplication::Fixed(cfg.replication_factor),
            );
            // Explicit record size limits (see MESSAGE_MAX_BYTES): the
            // broker's default (1 MiB) is below what stepgate may write.
            let topic = topic.set(
                "max.message.bytes",
                if *n == &t.intents {
                    intents_max
                } else {
                    others_max
                },
            );
            if *n == &t.changelog {
                // Latest value per key; tombstones remove purged records.
                topic.set("cleanup.policy", "compact")
            } else if *n == &t.commands {
                topic.set("retention.ms", &decisions_ms)
            } else {
                // Kept at least as long as steps are remembered, so a late repeat
                // and an audit can still be traced through them.
                topic.set("retention.ms", &retention_ms)
            }
        })
        .collect();
    let out = create_each(&admin, &topics).await?;
    // Creation returns before every broker's metadata shows the topics: wait for
    // them, so that what runs next (a layout check, stepgate itself) sees them.
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    wait_for_topics(cfg, names).await?;
    Ok(out)
}

/// Create the calls topic of each worker pool (docs/design.md "Worker
/// pools"): `kafka.partitions` partitions (independent of `intents`: workers
/// scale apart from the gates), kept as long as steps. Existing ones are left
/// as they are. Returns (topic, created?) pairs.
pub async fn create_pool_topics(
    cfg: &KafkaConfig,
    state: &crate::config::StateConfig,
    pools: &[String],
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    if pools.is_empty() {
        return Ok(Vec::new());
    }
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let retention_ms = state.retention.0.as_millis().max(1).to_string();
    let max_bytes = MESSAGE_MAX_BYTES.to_string();
    let names: Vec<String> = pools.iter().map(|p| cfg.topics.calls_for(p)).collect();
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| {
            NewTopic::new(
                n,
                cfg.partitions,
                TopicReplication::Fixed(cfg.replication_factor),
            )
            .set("max.message.bytes", &max_bytes)
            .set("retention.ms", &retention_ms)
        })
        .collect();
    let out = create_each(&admin, &topics).await?;
    // Seen in the metadata before anyone produces to or subscribes to them.
    wait_for_topics(cfg, names).await?;
    Ok(out)
}

/// Create `topics`: each name, and whether it was made now (false: it existed).
async fn create_each(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[NewTopic<'_>],
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let mut out = Vec::new();
    for r in admin.create_topics(topics.iter(), &opts).await? {
        match r {
            Ok(name) => out.push((name, true)),
            Err((name, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {
                out.push((name, false))
            }
            Err((name, code)) => {
                return Err(KafkaSetupError::Layout(format!(
                    "could not create topic `{name}`: {code}"
                )));
            }
        }
    }
    Ok(out)
}

/// Wait (up to 30 s) until the brokers' metadata shows every topic of `names`.
async fn wait_for_topics(cfg: &KafkaConfig, names: Vec<String>) -> Result<(), KafkaSetupError> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match partition_counts(&cfg, &refs) {
                Err(KafkaSetupError::MissingTopic(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

/// A record to produce.
#[derive(Debug, Clone)]
pub struct OutRecord {
    pub topic: String,
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    /// None for a tombstone.
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's timestamp (ms since the epoch); None: the producer's clock.
    pub timestamp_ms: Option<i64>,
}

impl OutRecord {
    /// A record about a workflow's step: keyed by the workflow, to a given
    /// partition (its intent's), no headers.
    pub fn for_workflow(
        topic: &str,
        partition: i32,
        workflow_id: &str,
        payload: Vec<u8>,
    ) -> OutRecord {
        OutRecord {
            topic: topic.to_owned(),
            partition: Some(partition),
            key: Some(workflow_id.as_bytes().to_vec()),
            payload: Some(payload),
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// [`OutRecord::for_workflow`] with a JSON payload. stepgate's messages
    /// (string-keyed maps, no non-finite numbers) always serialise.
    pub fn json_for_workflow(
        topic: &str,
        partition: i32,
        workflow_id: &str,
        value: &impl serde::Serialize,
    ) -> OutRecord {
        let payload = serde_json::to_vec(value).expect("stepgate's messages serialise to JSON");
        OutRecord::for_workflow(topic, partition, workflow_id, payload)
    }
}

/// Produce every record and wait for all deliveries (inside the caller's
/// transaction, when there is one).
/// Produce `records` and wait for every delivery; returns where each landed
/// (partition, offset), in order.
pub async fn send_all(
    producer: &FutureProducer,
    records: &[OutRecord],
) -> Result<Vec<(i32, i64)>, KafkaError> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::FutureRecord;
    use rdkafka::types::RDKafkaErrorCode;
    let mut pending = std::collections::VecDeque::new();
    let mut landed = vec![(-1, -1); records.len()];
    for (i, r) in records.iter().enumerate() {
        loop {
            let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&r.topic);
            if let Some(p) = &r.payload {
                rec = rec.payload(p.as_slice());
            }
            if let Some(p) = r.partition {
                rec = rec.partition(p);
            }
            if let Some(k) = &r.key {
                rec = rec.key(k.as_slice());
            }
            if let Some(ts) = r.timestamp_ms {
                rec = rec.timestamp(ts);
            }
            if !r.headers.is_empty() {
                let mut h = OwnedHeaders::new_with_capacity(r.headers.len());
                for (k, v) in &r.headers {
                    h = h.insert(Header {
                        key: k,
                        value: v.as_deref(),
                    });
                }
                rec = rec.headers(h);
            }
            match producer.send_result(rec) {
                Ok(f) => {
                    pending.push_back((i, f));
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    // The local queue is full: wait for the oldest delivery, then retry.
                    match pending.pop_front() {
                        Some((j, f)) => landed[j] = check_delivery(f.await)?,
                        None => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
                Err((e, _)) => return Err(e),
            }
        }
    }
    for (j, f) in pending {
        landed[j] = check_delivery(f.await)?;
    }
    Ok(landed)
}

fn check_delivery(
    r: Result<
        rdkafka::producer::future_producer::OwnedDeliveryResult,
        futures::channel::oneshot::Canceled,
    >,
) -> Result<(i32, i64), KafkaError> {
    match r {
        Ok(Ok(d)) => Ok((d.partition, d.offset)),
        Ok(Err((e, _))) => Err(e),
        Err(_) => Err(KafkaError::Canceled),
    }
}

/// Send the consumed offsets into the producer's open transaction.
pub async fn send_offsets(
    producer: &FutureProducer,
    consumer: &Arc<TxnConsumer>,
    offsets: rdkafka::TopicPartitionList,
) -> Result<(), KafkaError> {
    let meta = consumer.group_metadata().ok_or(KafkaError::ConsumerCommit(
        rdkafka::types::RDKafkaErrorCode::InvalidGroupId,
    ))?;
    let p = producer.clone();
    blocking(move || {
        p.send_offsets_to_transaction(&offsets, &meta, Timeout::After(Duration::from_secs(30)))
    })
    .await
}

/// A record read from Kafka, owned.
#[derive(Debug, Clone)]
pub struct Input {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// Header names are bytes on the wire; a name that is not UTF-8 is kept
    /// with its invalid bytes replaced by U+FFFD (so a DLQ copy still shows it).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's Kafka timestamp, ms since the epoch.
    pub timestamp_ms: Option<i64>,
}

impl Input {
    /// The W3C `traceparent` header, when present and valid
    /// ([`crate::contract::headers::is_valid_traceparent`]). An invalid one is ignored
    /// here, where it enters: it is neither stored, nor sent to a tool (where
    /// it could fail the request), nor copied onto the result.
    pub fn traceparent(&self) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(crate::contract::headers::TRACEPARENT))
            .and_then(|(_, v)| v.as_ref())
            .and_then(|v| String::from_utf8(v.clone()).ok())
            .filter(|tp| crate::contract::headers::is_valid_traceparent(tp))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// An intent the gate re-routed from the partition the agent published to.
    pub fn forwarded(&self) -> bool {
        self.header(crate::contract::headers::FORWARDED_FROM)
            .is_some()
    }

    /// Where this input's answer goes: the partition the agent published to
    /// (for a re-routed intent, the one its header names; `partitions` bounds it).
    pub fn reply_partition(&self, partitions: Option<i32>) -> i32 {
        self.header(crate::contract::headers::REPLY_PARTITION)
            .and_then(|v| v.parse::<i32>().ok())
            .filter(|r| *r >= 0 && partitions.is_none_or(|n| *r < n))
            .unwrap_or(self.partition)
    }
}

/// Copy a consumed message out of librdkafka's buffers. Never panics, whatever
/// the record holds.
pub fn to_input(m: &rdkafka::message::BorrowedMessage<'_>) -> Input {
    use rdkafka::message::Message;
    Input {
        topic: m.topic().to_owned(),
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().map(<[u8]>::to_vec),
        headers: raw_headers(m),
        timestamp_ms: m.timestamp().to_millis(),
    }
}

/// Whether a consumed message has a header of this name (case-insensitive).
pub fn has_header(m: &rdkafka::message::BorrowedMessage<'_>, name: &str) -> bool {
    raw_headers(m)
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case(name))
}

/// A message's headers, names read as bytes. rdkafka's own `Headers::iter`,
/// `get` and `try_get` unwrap `to_str()` on every name, so one header whose
/// name is not UTF-8 — which any producer can write — panicked the process,
/// and again on every restart (the record is read again). So the names are
/// read through librdkafka's C API instead.
fn raw_headers(m: &rdkafka::message::BorrowedMessage<'_>) -> Vec<(String, Option<Vec<u8>>)> {
    use rdkafka::bindings as rd;
    use std::ffi::{CStr, c_void};
    let mut hdrs: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `m.ptr()` is a live message for the borrow of `m`; the headers
    // it returns are owned by the message and only read while `m` is borrowed.
    let err = unsafe { rd::rd_kafka_message_headers(m.ptr(), &mut hdrs) };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
        return Vec::new();
    }
    // SAFETY: `hdrs` is non-null and valid while `m` is.
    let count = unsafe { rd::rd_kafka_header_cnt(hdrs) };
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `idx` < count; librdkafka writes pointers into the headers'
        // own storage, valid while `m` is.
        let err =
            unsafe { rd::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: librdkafka stores names NUL-terminated.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        let value = (!value.is_null()).then(|| {
            // SAFETY: `value` points to `size` bytes owned by the headers.
            unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec()
        });
        out.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::consumer::BaseConsumer;
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, Producer};
    use std::ffi::c_void;

    /// Production Kafkas ask for logins this build must speak: Kerberos
    /// (GSSAPI) and OAUTHBEARER with OIDC token fetching. librdkafka refuses
    /// to create a client configured for a mechanism it was built without.
    #[test]
    fn the_built_in_librdkafka_speaks_gssapi_and_oidc() {
        let gssapi: Result<BaseProducer, _> = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("security.protocol", "SASL_PLAINTEXT")
            .set("sasl.mechanism", "GSSAPI")
            // No Kerberos ticket is fetched in a test.
            .set("sasl.kerberos.kinit.cmd", "true")
            .create();
        assert!(gssapi.is_ok(), "GSSAPI: {:?}", gssapi.err());
        let oidc: Result<BaseProducer, _> = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", "OAUTHBEARER")
            .set("sasl.oauthbearer.method", "oidc")
            .set("sasl.oauthbearer.client.id", "stepgate")
            .set("sasl.oauthbearer.client.secret", "s")
            .set(
                "sasl.oauthbearer.token.endpoint.url",
                "https://127.0.0.1:1/token",
            )
            .create();
        assert!(oidc.is_ok(), "OIDC: {:?}", oidc.err());
    }

    /// A client whose close never finishes (as a consumer whose group will not
    /// let it go) holds the session at most `limit`: it is dropped on a
    /// blocking thread and left there.
    #[tokio::test(flavor = "current_thread")]
    async fn a_client_that_never_closes_holds_the_caller_at_most_the_limit() {
        struct NeverCloses(std::sync::mpsc::Receiver<()>);
        impl Drop for NeverCloses {
            fn drop(&mut self) {
                let _ = self.0.recv();
            }
        }
        let (release, stuck) = std::sync::mpsc::channel();
        let started = std::time::Instant::now();
        close_within("stuck", NeverCloses(stuck), Duration::from_millis(200)).await;
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        drop(release);
    }

    /// Produce one record with raw header names through librdkafka's C API:
    /// rdkafka's own `OwnedHeaders` only takes `&str` names.
    fn produce_raw(
        producer: &BaseProducer,
        topic: &std::ffi::CStr,
        headers: &[(&[u8], &[u8])],
        value: &[u8],
    ) {
        use rd::rd_kafka_vtype_t as V;
        use rdkafka::bindings as rd;
        // Names NUL-terminated, for librdkafka's `strlen`.
        let names: Vec<Vec<u8>> = headers
            .iter()
            .map(|(n, _)| n.iter().copied().chain([0]).collect())
            .collect();
        // SAFETY: plain-old-data unions, every field written before use.
        let mut vus: Vec<rd::rd_kafka_vu_t> = Vec::new();
        let mut vu =
            |vtype: V, u: rd::rd_kafka_vu_s__bindgen_ty_1| vus.push(rd::rd_kafka_vu_t { vtype, u });
        vu(
            V::RD_KAFKA_VTYPE_TOPIC,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                cstr: topic.as_ptr(),
            },
        );
        vu(
            V::RD_KAFKA_VTYPE_PARTITION,
            rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: 0 },
        );
        vu(
            V::RD_KAFKA_VTYPE_VALUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: value.as_ptr() as *mut c_void,
                    size: value.len(),
                },
            },
        );
        // RD_KAFKA_MSG_F_COPY: librdkafka copies the value.
        vu(
            V::RD_KAFKA_VTYPE_MSGFLAGS,
            rd::rd_kafka_vu_s__bindgen_ty_1 { i: 0x2 },
        );
        for (name, (_, v)) in names.iter().zip(headers) {
            vu(
                V::RD_KAFKA_VTYPE_HEADER,
                rd::rd_kafka_vu_s__bindgen_ty_1 {
                    header: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                        name: name.as_ptr().cast(),
                        val: v.as_ptr().cast(),
                        size: v.len() as isize,
                    },
                },
            );
        }
        // SAFETY: every pointer in `vus` outlives the call (librdkafka copies).
        let err = unsafe {
            rd::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len())
        };
        assert!(err.is_null(), "rd_kafka_produceva failed");
        producer.flush(Duration::from_secs(10)).unwrap();
    }

    const TRACEPARENT: &[u8] = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn an_invalid_traceparent_is_ignored_where_it_enters() {
        let input = |tp: &[u8]| Input {
            topic: "in".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: None,
            headers: vec![("Traceparent".to_owned(), Some(tp.to_vec()))],
            timestamp_ms: None,
        };
        assert_eq!(
            input(TRACEPARENT)
                .traceparent()
                .as_deref()
                .map(str::as_bytes),
            Some(TRACEPARENT)
        );
        for bad in [
            b"00-abc-01".as_slice(),
            b"",
            b"\xff\xfe",
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
            b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
        ] {
            assert_eq!(
                input(bad).traceparent(),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn a_header_name_that_is_not_utf8_is_read_without_panicking() {
        let mock = MockCluster::new(1).unwrap();
        mock.create_topic("in", 1, 1).unwrap();
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .create()
            .unwrap();
        produce_raw(
            &producer,
            c"in",
            &[(b"\xff\xfe", b"x"), (b"traceparent", TRACEPARENT)],
            br#"{"workflow_id":"w"}"#,
        );
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .set("group.id", "g")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset("in", 0, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&tpl).unwrap();
        drop(tpl);
        let deadline = Instant::now() + Duration::from_secs(20);
        let input = loop {
            assert!(Instant::now() < deadline, "no record within 20 s");
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => break to_input(&m),
                Some(Err(e)) => panic!("{e}"),
                None => {}
            }
        };
        assert_eq!(
            input.headers,
            vec![
                ("\u{fffd}\u{fffd}".to_owned(), Some(b"x".to_vec())),
                ("traceparent".to_owned(), Some(TRACEPARENT.to_vec())),
            ]
        );
        assert_eq!(
            input.traceparent().as_deref().map(str::as_bytes),
            Some(TRACEPARENT)
        );
        assert_eq!(
            input.payload.as_deref(),
            Some(br#"{"workflow_id":"w"}"#.as_slice())
        );
    }

    #[test]
    fn producers_set_message_max_bytes_and_sizes_are_checked() {
        let mut cfg = KafkaConfig::default();
        let p = txn_producer_config(&cfg, "t");
        assert_eq!(
            p.get("message.max.bytes"),
            Some(MESSAGE_MAX_BYTES.to_string().as_str())
        );
        check_sizes(&cfg, 1024 * 1024).unwrap();
        check_sizes(&cfg, MESSAGE_MAX_BYTES - RECORD_ENVELOPE_BYTES).unwrap();
        let e = check_sizes(&cfg, MESSAGE_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`gate.max_intent_bytes` is 4194304"), "{e}");
        assert!(
            e.contains("Lower `gate.max_intent_bytes` to at most 4128768"),
            "{e}"
        );
        // An operator's override is what counts.
        cfg.client
            .insert("message.max.bytes".into(), "1000000".into());
        assert_eq!(
            txn_producer_config(&cfg, "t").get("message.max.bytes"),
            Some("1000000")
        );
        assert!(check_sizes(&cfg, 1024 * 1024).is_err());
        cfg.client.insert("message.max.bytes".into(), "lots".into());
        let e = check_sizes(&cfg, 1).unwrap_err().to_string();
        assert!(e.contains("must be a number of bytes, got `lots`"), "{e}");
    }

    #[test]
    fn the_default_largest_intent_fits() {
        assert!(
            crate::config::GateConfig::default().max_intent_bytes + RECORD_ENVELOPE_BYTES
                <= MESSAGE_MAX_BYTES
        );
    }
}
