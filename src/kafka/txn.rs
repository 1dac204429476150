//! Transactions: records produced and consumed offsets sent together, then
//! committed or aborted.

use super::{TxnConsumer, blocking};
use crate::config::KafkaConfig;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Commit a transaction, retrying what librdkafka says is retriable. Ok(true)
/// when the commit landed but its producer must not begin another transaction
/// ([`stale_end_possible`]).
pub async fn commit_txn(producer: &FutureProducer, limits: TxnLimits) -> Result<bool, KafkaError> {
    // rust-rdkafka's `commit_transaction` flushes first, and its flush sleeps
    // in 100 ms polls while librdkafka still counts a message whose delivery
    // report the polling thread has handed over but not yet released — a race
    // that added 100 ms to about one commit in ten (measured). The caller has
    // awaited every delivery: wait (briefly) for the count to reach zero.
    let until = Instant::now() + Duration::from_millis(200);
    while producer.in_flight_count() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = Instant::now();
    let mut tries = 0;
    loop {
        let p = producer.clone();
        match blocking(move || p.commit_transaction(Timeout::After(Duration::from_secs(30)))).await
        {
            Err(KafkaError::Transaction(e)) if e.is_retriable() && tries < 5 => {
                tries += 1;
                tracing::warn!(error = %e, "transaction commit will be retried");
            }
            Ok(()) => return Ok(stale_end_possible(tries > 0, started.elapsed(), limits)),
            Err(e) => return Err(e),
        }
    }
}

/// Whether a transaction that ended may have left a copy of its `EndTxn`
/// request on its way to the coordinator: librdkafka sends `EndTxn` again
/// when one times out (after `limits.end_request`), and a call that took that
/// long, or that returned a timeout and was called again, may have done so.
/// librdkafka speaks transaction protocol v1 (no KIP-890 part 2: the
/// producer's epoch is the same for every transaction), so that late copy
/// would end whatever part of the producer's *next* transaction the
/// coordinator holds by then, and the rest would commit on its own — a batch
/// split in two, and an intent's offset committed without its records. A
/// producer after such an end is replaced (a new one with the same
/// transactional id bumps the epoch, which fences every request of the old)
/// before it begins another transaction. confluentinc/librdkafka#5423
/// proposes the same in librdkafka itself.
pub fn stale_end_possible(retried: bool, took: Duration, limits: TxnLimits) -> bool {
    let possible = retried || took >= limits.end_request;
    if possible {
        tracing::warn!(
            ms = took.as_millis() as u64,
            retried,
            request_timeout_ms = limits.end_request.as_millis() as u64,
            "a transaction took long enough to end that its end request may have been sent twice: its producer is replaced before it begins another"
        );
    }
    possible
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
/// `offsets_partition`'s group), by writing to each and aborting. Ok(true)
/// when the producer must be replaced ([`Transacted::renew_producer`]).
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
    limits: TxnLimits,
) -> Result<bool, KafkaError> {
    let probes: Vec<OutRecord> = partitions
        .iter()
        .map(|(topic, p)| OutRecord {
            topic: topic.clone(),
            partition: Some(*p),
            key: Some(HANGING_PROBE_KEY.to_vec()),
            payload: None,
            headers: Vec::new(),
            timestamp_ms: None,
        })
        .collect();
    // The offset is never committed: any value serves to put the group's
    // offsets partition into the transaction.
    let mut offsets = rdkafka::TopicPartitionList::new();
    offsets.add_partition_offset(
        offsets_partition.0,
        offsets_partition.1,
        rdkafka::Offset::Offset(0),
    )?;
    transact(producer, consumer, &probes, offsets, limits, || {
        Ok::<_, KafkaError>(Ending::Abort)
    })
    .await
    .map(|t| t.renew_producer)
}

/// How a transaction whose records and offsets were all sent ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Commit,
    Abort,
}

/// How long a transaction's records and offsets may take to be acknowledged,
/// for a producer whose `transaction.timeout.ms` is `transaction_timeout`:
/// past it the coordinator has aborted the transaction anyway. Each delivery
/// is bounded by the transaction timeout (librdkafka caps `message.timeout.ms`
/// at it) and the offsets by [`OFFSETS_TIMEOUT`]; yet after a partition
/// leader's SIGKILL a send was seen never to return (issue #34's cluster
/// test: a gate answering nothing for minutes), so the stage as a whole is
/// bounded here too.
pub fn send_limit(transaction_timeout: Duration) -> Duration {
    transaction_timeout.max(OFFSETS_TIMEOUT) + Duration::from_secs(10)
}

/// The time bounds of a transactional producer's transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnLimits {
    /// How long its records and offsets may take ([`send_limit`]).
    pub send: Duration,
    /// When librdkafka gives up waiting for the reply to one request to the
    /// transaction coordinator, and sends it again: `socket.timeout.ms`,
    /// which librdkafka sets 100 ms under `transaction.timeout.ms` unless it
    /// is set. (A value librdkafka would refuse counts as zero: every end is
    /// then taken as slow.)
    pub end_request: Duration,
}

impl TxnLimits {
    pub fn of(cfg: &KafkaConfig) -> TxnLimits {
        let txn = cfg.transaction_timeout.0;
        // As librdkafka's config check sets it for a transactional producer.
        let end_request = match cfg.client.get("socket.timeout.ms") {
            Some(v) => v
                .trim()
                .parse()
                .map_or(Duration::ZERO, Duration::from_millis),
            None => txn
                .saturating_sub(Duration::from_millis(100))
                .max(Duration::from_millis(900)),
        };
        TxnLimits {
            send: send_limit(txn),
            end_request,
        }
    }
}

/// How long `send_offsets_to_transaction` may block.
const OFFSETS_TIMEOUT: Duration = Duration::from_secs(30);

/// One transaction: `records` produced and `offsets` (consumed by
/// `consumer`'s group) sent together — neither waits for the other — then
/// ended as `ending` decides once both are acknowledged; aborted on any error,
/// or when sending takes longer than `limits.send`.
pub async fn transact<E: From<KafkaError>>(
    producer: &FutureProducer,
    consumer: &Arc<TxnConsumer>,
    records: &[OutRecord],
    offsets: rdkafka::TopicPartitionList,
    limits: TxnLimits,
    ending: impl FnOnce() -> Result<Ending, E>,
) -> Result<Transacted, E> {
    producer.begin_transaction()?;
    let sent = async {
        let sending = async {
            crate::hooks::hang_send().await;
            tokio::join!(send_all(producer, records), async {
                if offsets.count() > 0 {
                    send_offsets(producer, consumer, offsets).await
                } else {
                    Ok(())
                }
            })
        };
        let (landed, offsets) = match tokio::time::timeout(limits.send, sending).await {
            Ok(sent) => sent,
            Err(_) => {
                tracing::warn!(
                    secs = limits.send.as_secs(),
                    records = records.len(),
                    "a transaction's records and offsets were not all acknowledged in time: aborted"
                );
                return Err(
                    KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut).into(),
                );
            }
        };
        let (landed, ()) = (landed?, offsets?);
        let renew_producer = match ending()? {
            Ending::Commit => commit_txn(producer, limits).await?,
            // A late `EndTxn(abort)` would abort part of the next transaction
            // and let the rest commit: the same hazard.
            Ending::Abort => {
                let (p, started) = (producer.clone(), Instant::now());
                blocking(move || p.abort_transaction(Timeout::After(Duration::from_secs(30))))
                    .await?;
                stale_end_possible(false, started.elapsed(), limits)
            }
        };
        Ok(Transacted {
            landed,
            renew_producer,
        })
    }
    .await;
    if sent.is_err() {
        abort_txn(producer).await;
    }
    sent
}

/// A transaction that ended as its caller decided.
#[derive(Debug)]
pub struct Transacted {
    /// Where each record landed (partition, offset), in order.
    pub landed: Vec<(i32, i64)>,
    /// The producer must not begin another transaction: it committed this one
    /// in a way that may leave a late copy of its commit request on its way
    /// ([`stale_end_possible`]). The caller replaces it.
    pub renew_producer: bool,
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
        p.send_offsets_to_transaction(&offsets, &meta, Timeout::After(OFFSETS_TIMEOUT))
    })
    .await
}
