//! Reading: consumers that read a topic to its end (restore, audit, replay),
//! a group's committed offset, and records read, owned.

use super::{TxnConsumer, base_config, blocking, bound_prefetch};
use crate::config::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A [`resume_consumer`] that follows partitions for good (a standby
/// replica): at their end, a fetch waits `wait_ms` for new records (a short
/// wait ends reads to the end sooner; a follower needs no such hurry).
pub fn follow_consumer(
    cfg: &KafkaConfig,
    group: &str,
    wait_ms: u32,
) -> Result<ReadToEndConsumer, KafkaError> {
    let mut c = reader_config(cfg, group, "error");
    c.set("fetch.wait.max.ms", wait_ms.to_string());
    c.create_with_context(ReadToEnd)
}

fn reader_config(cfg: &KafkaConfig, group: &str, reset: &str) -> ClientConfig {
    let mut c = base_config(cfg);
    c.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", reset);
    // At a partition's end a fetch waits this long for records before the
    // end is reported (librdkafka's default, 500 ms, is added to every
    // restore and read-back).
    if c.get("fetch.wait.max.ms").is_none() {
        c.set("fetch.wait.max.ms", "10");
    }
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

/// Where a reader stands in a partition: the next offset it would return
/// (past markers and aborted records it skipped); None when unknown.
pub fn position_of<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    let tpl = consumer.position().ok()?;
    let at = tpl
        .find_partition(topic, partition)
        .and_then(|e| e.offset().to_raw())
        .filter(|o| *o >= 0);
    drop(tpl);
    at
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

/// How long one ask for a group's committed offset may take.
const COMMITTED_ASK: Duration = Duration::from_secs(10);

/// The group's committed offset of one partition of `topic`, and its
/// metadata: 0 (no metadata) when nothing is committed yet — with
/// `auto.offset.reset=earliest` that also covers a log whose start moved.
/// (Not a watermark query: those were seen to time out for minutes after a
/// broker restart.) A read_committed member's lookup waits while a
/// transaction of the group is unsettled, which after a broker restart can
/// take a while: a lookup that times out is made again in place, so the
/// member keeps its place in the group, for up to `patience` (`waiting` is
/// told each time, with how long it has been asking).
pub async fn committed_offset(
    consumer: &Arc<TxnConsumer>,
    topic: &str,
    partition: i32,
    patience: Duration,
    mut waiting: impl FnMut(&KafkaError, Duration),
) -> Result<(i64, String), KafkaError> {
    let asking = Instant::now();
    loop {
        let (c, topic) = (consumer.clone(), topic.to_owned());
        let fetched = blocking(move || {
            let mut tpl = rdkafka::TopicPartitionList::new();
            tpl.add_partition(&topic, partition);
            let committed = c.committed_offsets(tpl, COMMITTED_ASK)?;
            let e = committed.find_partition(&topic, partition);
            let offset = e
                .as_ref()
                .and_then(|e| e.offset().to_raw())
                .filter(|o| *o >= 0)
                .unwrap_or(0);
            let meta = e.map(|e| e.metadata().to_owned()).unwrap_or_default();
            drop(committed);
            Ok::<_, KafkaError>((offset, meta))
        })
        .await;
        match fetched {
            Ok(v) => return Ok(v),
            Err(e)
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::OperationTimedOut)
                    && asking.elapsed() < patience =>
            {
                waiting(&e, asking.elapsed());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    }
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

/// The value of a message's header `name` (the first, when it repeats),
/// without the panic rdkafka's own accessors have on a name that is not UTF-8.
pub fn header_value(m: &rdkafka::message::BorrowedMessage<'_>, name: &str) -> Option<Vec<u8>> {
    raw_headers(m)
        .into_iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.unwrap_or_default())
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
