//! Client configs (the `[kafka.client]` pass-through applied last), creating
//! transactional producers, and closing clients without hanging the caller.

use super::{KafkaSetupError, MESSAGE_MAX_BYTES};
use crate::config::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::util::Timeout;
use std::time::Duration;

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
        // A gate learns that a dead one's partitions move at its next
        // heartbeat: librdkafka's 3 s would add up to 3 s to every takeover.
        .set("heartbeat.interval.ms", heartbeat_ms(cfg).to_string())
        .set("max.poll.interval.ms", "600000")
        .set("statistics.interval.ms", "5000")
        .set("fetch.wait.max.ms", "50");
    let mut c = with_overrides(c, cfg);
    bound_prefetch(&mut c);
    // Named after its instance (unless `[kafka.client]` names every client):
    // another gate that takes its partitions after it died can tell which
    // transactional producers to fence (`gate::standby`).
    if c.get("client.id").is_none() {
        c.set("client.id", gate_client_id(&cfg.instance_id));
    }
    c
}

/// A gate consumer's heartbeat: a thirtieth of the session timeout, between
/// 100 ms and librdkafka's 3 s.
fn heartbeat_ms(cfg: &KafkaConfig) -> u128 {
    (cfg.session_timeout.0.as_millis() / 30).clamp(100, 3000)
}

/// The `client.id` of a gate's consumer: its instance, after a prefix.
pub fn gate_client_id(instance_id: &str) -> String {
    format!("{GATE_CLIENT_PREFIX}{instance_id}")
}

/// The instance a gate consumer's `client.id` names ([`gate_client_id`]).
pub fn instance_of_client(client_id: &str) -> Option<&str> {
    client_id
        .strip_prefix(GATE_CLIENT_PREFIX)
        .filter(|i| !i.is_empty())
}

const GATE_CLIENT_PREFIX: &str = "stepgate-gate:";

/// The transactional ids of a gate instance's two producers.
pub fn gate_transactional_ids(cfg: &KafkaConfig, instance_id: &str) -> [String; 2] {
    let id = format!("{}-gate-{}", cfg.gate_group, instance_id);
    let b = format!("{id}-b");
    [id, b]
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

/// A producer outside transactions: idempotent, every write acknowledged by
/// all in-sync replicas, sent at once. A pool's worker sends its outcomes
/// (and the `started` that lets a call be invoked) with it, and the gate its
/// answers at once (repeats of committed outcomes).
pub fn direct_producer_config(cfg: &KafkaConfig) -> ClientConfig {
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
/// with the same static member id fences it). A thread of its own, not the
/// runtime's blocking pool: the runtime waits for its blocking tasks when it
/// is dropped, so a client that never closed kept a stopped process from
/// exiting.
pub async fn close_within<T: Send + 'static>(what: &str, client: T, limit: Duration) {
    let (closed, closing) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("kafka-close".into())
        .spawn(move || {
            drop(client);
            let _ = closed.send(());
        });
    if let Err(e) = spawned {
        // The client was dropped with the closure, here.
        tracing::warn!(client = what, error = %e, "no thread to close a Kafka client on: closed in place");
        return;
    }
    if tokio::time::timeout(limit, closing).await.is_err() {
        tracing::warn!(
            client = what,
            ?limit,
            "a Kafka client did not close in time: going on without waiting for it"
        );
    }
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
