//! Transactions a broker acknowledged and then lost.
//!
//! A single broker SIGKILLed mid-commit can come back with a transaction it
//! acknowledged but without the commit marker on some of its partitions (seen
//! with librdkafka alone: `deploy/local/repro/hanging-transaction.sh`). The next
//! session ends such a hanging transaction by aborting it
//! ([`kafka::end_hanging_transactions`]: librdkafka cannot ask the coordinator
//! which way it went), so that batch's answers, step records and offsets would
//! be gone while the local state, applied once the commit returned, holds them:
//! answers never delivered, intents read again.
//!
//! So each producer's last acknowledged transaction is kept (its records are
//! the batch's own, shared, not copied), and the next session of the process,
//! after ending hanging transactions and before its first offset lookup, reads
//! back what a read_committed reader sees of it in the partitions it still
//! owns. What is not there is written again, with the offsets, in one
//! transaction; a partition something else was written to since is left alone
//! (and logged): its later records may build on the lost ones.
//!
//! A read_committed reader stops at a partition's last stable offset: another
//! producer's transaction still open there hides every record after it, ours
//! included. A record of ours at or past that offset is not known yet, not
//! lost: such a read-back is inconclusive, is tried again, and when it stays
//! so nothing is written (as when the read-back times out).

use super::GateError;
use super::mark::AppliedMark;
use crate::config::KafkaConfig;
use crate::kafka::{self, OutRecord, TxnConsumer};
use crate::telemetry::Metrics;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How long reading back the last commits may take before the check gives up
/// (the session then goes on as before: nothing is written again).
const READ_BACK_LIMIT: Duration = Duration::from_secs(30);

/// How many times a read-back that stopped below records of ours (another
/// producer's transaction open) is made before the check gives up.
const READ_BACK_TRIES: u32 = 3;

/// The pause before the next read-back, times the tries made.
const READ_BACK_PAUSE: Duration = Duration::from_secs(2);

/// An input offset a transaction committed for the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct InputOffset {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub metadata: Option<String>,
}

impl InputOffset {
    /// The offsets as a transaction sends them.
    pub fn list(offsets: &[InputOffset]) -> Result<TopicPartitionList, KafkaError> {
        let mut tpl = TopicPartitionList::new();
        for o in offsets {
            let mut e = tpl.add_partition(&o.topic, o.partition);
            e.set_offset(Offset::Offset(o.offset))?;
            if let Some(m) = &o.metadata {
                e.set_metadata(m.clone());
            }
        }
        Ok(tpl)
    }
}

/// A transaction the broker reported committed.
pub(super) struct Committed {
    pub records: Arc<Vec<OutRecord>>,
    /// Where each record landed (partition, offset), in order.
    pub landed: Vec<(i32, i64)>,
    pub offsets: Vec<InputOffset>,
    pub at: Instant,
}

/// Each of the gate's producers' last committed transaction, kept across the
/// process's sessions.
#[derive(Default)]
pub(super) struct LastCommits {
    slots: [Option<(u64, Committed)>; 2],
    seq: u64,
}

impl LastCommits {
    pub fn record(&mut self, slot: usize, c: Committed) {
        self.seq += 1;
        self.slots[slot] = Some((self.seq, c));
    }

    /// Oldest first; those older than `max_age` are dropped (their records
    /// may be gone with the topics' retention, which is no loss).
    fn take(&mut self, max_age: Duration) -> Vec<Committed> {
        let mut v: Vec<_> = self.slots.iter_mut().filter_map(Option::take).collect();
        v.sort_by_key(|(seq, _)| *seq);
        v.into_iter()
            .map(|(_, c)| c)
            .filter(|c| c.at.elapsed() <= max_age)
            .collect()
    }

    fn put_back(&mut self, commits: Vec<Committed>) {
        for (slot, c) in commits.into_iter().enumerate().take(2) {
            self.record(slot, c);
        }
    }
}

/// What a read_committed reader sees now.
struct Seen {
    /// Per (topic, partition): offsets of the visible records from the
    /// commits' first offset there to the end.
    records: BTreeMap<(String, i32), BTreeSet<i64>>,
    /// Per (topic, partition): its last stable offset before the read. Every
    /// record below it was settled (committed or aborted) when the read began;
    /// one at or past it may be in a transaction still open. A partition
    /// missing here is not known at all.
    stable: BTreeMap<(String, i32), i64>,
    /// The group's committed offsets, each with the applied mark its
    /// metadata carries.
    offsets: BTreeMap<(String, i32), Position>,
}

/// Where the group stands in an input partition: its offset, and the first
/// offset not yet applied (the applied mark an intents offset's metadata
/// carries, [`AppliedMark`]; the
/// offset itself without one). Ordered by offset, then mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Position {
    offset: i64,
    applied: i64,
}

impl Position {
    fn of(offset: i64, metadata: Option<&str>) -> Position {
        let applied = metadata.and_then(|m| AppliedMark::parse(m).applied);
        Position {
            offset,
            applied: applied.map_or(offset, |a| a.max(offset)),
        }
    }
}

/// What to write again.
#[derive(Debug, Default)]
struct Rewrite {
    records: Vec<OutRecord>,
    offsets: Vec<InputOffset>,
    /// Partitions with lost records that something else was written to since.
    overtaken: BTreeSet<(String, i32)>,
    /// Partitions where the read stopped below a record of ours (another
    /// producer's transaction open): nothing can be told of them yet.
    unknown: BTreeSet<(String, i32)>,
}

impl Rewrite {
    fn is_empty(&self) -> bool {
        self.records.is_empty() && self.offsets.is_empty()
    }
}

/// Whether a (topic, partition) the commits wrote is still this gate's to
/// mend: the partitions of a step's topics are its intent's partition number;
/// dead letters carry no step partition and are mended wherever they went.
fn ours(topic: &str, partition: i32, owned: &BTreeSet<i32>, dlq: &str) -> bool {
    topic == dlq || owned.contains(&partition)
}

/// The first offset the commits wrote in each partition still ours.
fn starts(commits: &[Committed], owned: &BTreeSet<i32>, dlq: &str) -> BTreeMap<(String, i32), i64> {
    let mut starts = BTreeMap::new();
    for c in commits {
        for (r, &(p, o)) in c.records.iter().zip(&c.landed) {
            if ours(&r.topic, p, owned, dlq) {
                let s = starts.entry((r.topic.clone(), p)).or_insert(o);
                *s = (*s).min(o);
            }
        }
    }
    starts
}

/// The records and offsets of `commits` a reader does not see, as they are to
/// be written again (`seen` holds only the partitions still ours). A changelog
/// record a later one of the same key replaces is not written again
/// (compaction keeps the last by offset). A record at or past its partition's
/// last stable offset is not known yet: its partition is `unknown`, and the
/// caller writes nothing while any is.
fn plan(commits: &[Committed], seen: &Seen, owned: &BTreeSet<i32>, changelog: &str) -> Rewrite {
    let settled = |tp: &(String, i32), o: i64| seen.stable.get(tp).is_some_and(|s| o < *s);
    // Ours, among the records every reader can tell about.
    let mut written: BTreeMap<(String, i32), BTreeSet<i64>> = BTreeMap::new();
    let mut last_of_key: HashMap<(i32, &[u8]), (usize, usize)> = HashMap::new();
    for (ci, c) in commits.iter().enumerate() {
        for (ri, (r, &(p, o))) in c.records.iter().zip(&c.landed).enumerate() {
            let tp = (r.topic.clone(), p);
            if settled(&tp, o) {
                written.entry(tp).or_default().insert(o);
            }
            if r.topic == changelog
                && let Some(k) = &r.key
            {
                last_of_key.insert((p, k.as_slice()), (ci, ri));
            }
        }
    }
    let mut rewrite = Rewrite::default();
    for (tp, visible) in &seen.records {
        if let Some(w) = written.get(tp)
            && !w.is_subset(visible)
            && !visible.is_subset(w)
        {
            rewrite.overtaken.insert(tp.clone());
        }
    }
    for (ci, c) in commits.iter().enumerate() {
        for (ri, (r, &(p, o))) in c.records.iter().zip(&c.landed).enumerate() {
            let tp = (r.topic.clone(), p);
            let Some(visible) = seen.records.get(&tp) else {
                continue;
            };
            if visible.contains(&o) || rewrite.overtaken.contains(&tp) {
                continue;
            }
            if !settled(&tp, o) {
                rewrite.unknown.insert(tp);
                continue;
            }
            if r.topic == changelog
                && let Some(k) = &r.key
                && last_of_key.get(&(p, k.as_slice())) != Some(&(ci, ri))
            {
                continue;
            }
            rewrite.records.push(OutRecord {
                partition: Some(p),
                ..r.clone()
            });
        }
    }
    // An offset is behind when the group holds a lower one, or the same one
    // with an earlier applied mark: a batch whose intents all wait on a call
    // still running commits the same offset and moves only the mark. Left
    // behind, the intents between the two marks would be decided again
    // against a state that already holds them (a repeat answered twice).
    let mut last: BTreeMap<(String, i32), &InputOffset> = BTreeMap::new();
    for o in commits.iter().flat_map(|c| &c.offsets) {
        if owned.contains(&o.partition) {
            last.insert((o.topic.clone(), o.partition), o);
        }
    }
    for (tp, o) in last {
        let ours = Position::of(o.offset, o.metadata.as_deref());
        if seen.offsets.get(&tp).is_none_or(|c| *c < ours) {
            rewrite.offsets.push(o.clone());
        }
    }
    rewrite
}

/// Read back this process's last commits and write again what a broker lost
/// of them in the partitions `owned` (see the module's text). Errors end the
/// session; the commits are then checked again by the next.
pub(super) async fn mend(
    cfg: &KafkaConfig,
    retention: Duration,
    last: &mut LastCommits,
    producer: &FutureProducer,
    consumer: &Arc<TxnConsumer>,
    owned: &BTreeSet<i32>,
    metrics: &Metrics,
) -> Result<(), GateError> {
    let commits = last.take(retention / 2);
    if commits.is_empty() {
        return Ok(());
    }
    crate::hooks::crash_before_mend();
    let started = Instant::now();
    let rewrite = match settled_plan(cfg, &commits, consumer, owned).await {
        Ok(Some(rewrite)) => rewrite,
        Ok(None) => return Ok(()),
        Err(e) => {
            last.put_back(commits);
            return Err(e);
        }
    };
    for (topic, partition) in &rewrite.overtaken {
        warn!(
            topic,
            partition,
            "records of a transaction the broker acknowledged are missing, and other records were written after them: not written again (docs/guarantees.md \"Faults and bad input\")"
        );
    }
    if rewrite.is_empty() {
        info!(
            ms = started.elapsed().as_millis() as u64,
            "this gate's last commits read back whole"
        );
        return Ok(());
    }
    warn!(
        records = rewrite.records.len(),
        offsets = rewrite.offsets.len(),
        "a transaction the broker acknowledged lost its commit marker: writing its records again"
    );
    match write_again(producer, consumer, &rewrite, kafka::TxnLimits::of(cfg)).await {
        Ok(kafka::Transacted {
            landed,
            renew_producer,
        }) => {
            metrics.lost_commit_rewritten(rewrite.records.len());
            info!(
                records = rewrite.records.len(),
                ms = started.elapsed().as_millis() as u64,
                "wrote again what the broker lost"
            );
            last.record(
                0,
                Committed {
                    records: Arc::new(rewrite.records),
                    landed,
                    offsets: rewrite.offsets,
                    at: Instant::now(),
                },
            );
            if renew_producer {
                return Err(GateError::SlowTransactionEnd);
            }
            Ok(())
        }
        Err(e) => {
            last.put_back(commits);
            Err(e)
        }
    }
}

/// What to write again, once no record of ours is hidden behind another
/// producer's open transaction: None when the read-back does not settle in
/// time (nothing is written then).
async fn settled_plan(
    cfg: &KafkaConfig,
    commits: &[Committed],
    consumer: &Arc<TxnConsumer>,
    owned: &BTreeSet<i32>,
) -> Result<Option<Rewrite>, GateError> {
    let mut tries = 0;
    loop {
        tries += 1;
        let Some(seen) = read_back(cfg, commits, consumer, owned).await? else {
            warn!(
                limit_s = READ_BACK_LIMIT.as_secs(),
                "could not read back this gate's last commits in time: not checked for what a broker may have lost of them"
            );
            return Ok(None);
        };
        let rewrite = plan(commits, &seen, owned, &cfg.topics.changelog);
        if rewrite.unknown.is_empty() {
            return Ok(Some(rewrite));
        }
        // Another producer's transaction is open below records of ours:
        // whether they are there cannot be told until it ends.
        if tries >= READ_BACK_TRIES {
            warn!(
                partitions = ?rewrite.unknown,
                tries,
                "reading back this gate's last commits stopped each time at another producer's open transaction, below records of ours: not checked for what a broker may have lost of them (nothing written again)"
            );
            return Ok(None);
        }
        info!(
            partitions = ?rewrite.unknown,
            "reading back this gate's last commits stopped at another producer's open transaction, below records of ours: reading again"
        );
        tokio::time::sleep(READ_BACK_PAUSE * tries).await;
    }
}

async fn read_back(
    cfg: &KafkaConfig,
    commits: &[Committed],
    consumer: &Arc<TxnConsumer>,
    owned: &BTreeSet<i32>,
) -> Result<Option<Seen>, GateError> {
    let mut ours: BTreeMap<(String, i32), BTreeSet<i64>> = BTreeMap::new();
    for c in commits {
        for (r, &(p, o)) in c.records.iter().zip(&c.landed) {
            ours.entry((r.topic.clone(), p)).or_default().insert(o);
        }
    }
    let mut by_topic: BTreeMap<String, BTreeMap<i32, i64>> = BTreeMap::new();
    for ((topic, p), o) in starts(commits, owned, &cfg.topics.dlq) {
        by_topic.entry(topic).or_default().insert(p, o);
    }
    let mut tpl = TopicPartitionList::new();
    for o in commits.iter().flat_map(|c| &c.offsets) {
        if owned.contains(&o.partition) && tpl.find_partition(&o.topic, o.partition).is_none() {
            tpl.add_partition(&o.topic, o.partition);
        }
    }
    let (cfg, consumer) = (cfg.clone(), consumer.clone());
    let seen = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + READ_BACK_LIMIT;
        let group = format!("{}-read-back", cfg.gate_group);
        let mut records = BTreeMap::new();
        let mut stable = BTreeMap::new();
        for (topic, starts) in &by_topic {
            let read = ReadBack {
                cfg: &cfg,
                group: &group,
                topic,
                deadline,
            };
            let Some(seen) = read.topic(starts, &ours)? else {
                return Ok(None);
            };
            records.extend(
                seen.visible
                    .into_iter()
                    .map(|(p, s)| ((topic.clone(), p), s)),
            );
            stable.extend(
                seen.stable
                    .into_iter()
                    .map(|(p, e)| ((topic.clone(), p), e)),
            );
        }
        // Without the group's offsets nothing is written: records written
        // again with their offsets left behind would be decided again.
        let Some(offsets) = group_offsets(&consumer, tpl, deadline) else {
            return Ok(None);
        };
        Ok::<_, KafkaError>(Some(Seen {
            records,
            stable,
            offsets,
        }))
    })
    .await??;
    Ok(seen)
}

/// What a reader sees of one topic: per partition, the offsets of the
/// records visible, and its last stable offset where it matters.
struct TopicSeen {
    visible: BTreeMap<i32, BTreeSet<i64>>,
    stable: BTreeMap<i32, i64>,
}

/// One topic's read-back, until `deadline`. Blocking.
struct ReadBack<'a> {
    cfg: &'a KafkaConfig,
    group: &'a str,
    topic: &'a str,
    deadline: Instant,
}

impl ReadBack<'_> {
    /// The offsets a read_committed reader sees from `starts` (per partition)
    /// to the end, and each partition's last stable offset where it matters
    /// (`i64::MAX` elsewhere); None if the deadline passed first.
    fn topic(
        &self,
        starts: &BTreeMap<i32, i64>,
        ours: &BTreeMap<(String, i32), BTreeSet<i64>>,
    ) -> Result<Option<TopicSeen>, KafkaError> {
        let (cfg, group, topic, deadline) = (self.cfg, self.group, self.topic, self.deadline);
        let Some(mut seen) = kafka::visible_offsets(cfg, group, topic, starts, deadline)? else {
            return Ok(None);
        };
        // Records of ours the read did not see are lost, or past where it
        // stopped: another producer's transaction still open below them.
        // Those partitions are read again after their last stable offset
        // is taken: below it, every record was settled when the read began.
        let missing: BTreeSet<i32> = seen
            .iter()
            .filter(|(p, visible)| {
                ours.get(&(topic.to_owned(), **p))
                    .is_some_and(|o| !o.is_subset(visible))
            })
            .map(|(p, _)| *p)
            .collect();
        let mut ends: BTreeMap<i32, i64> = seen.keys().map(|&p| (p, i64::MAX)).collect();
        if !missing.is_empty() {
            let Some(lso) = stable_offsets(cfg, group, topic, &missing, deadline)? else {
                return Ok(None);
            };
            let again: BTreeMap<i32, i64> = starts
                .iter()
                .filter(|(p, _)| missing.contains(p))
                .map(|(p, o)| (*p, *o))
                .collect();
            let Some(read) = kafka::visible_offsets(cfg, group, topic, &again, deadline)? else {
                return Ok(None);
            };
            seen.extend(read);
            ends.extend(lso);
        }
        Ok(Some(TopicSeen {
            visible: seen,
            stable: ends,
        }))
    }
}

/// The group's committed offsets of `tpl`'s partitions, each with the
/// applied mark its metadata carries; None if `deadline` passed first.
/// Blocking.
fn group_offsets(
    consumer: &TxnConsumer,
    tpl: TopicPartitionList,
    deadline: Instant,
) -> Option<BTreeMap<(String, i32), Position>> {
    let mut offsets = BTreeMap::new();
    while tpl.count() > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match consumer.committed_offsets(tpl.clone(), left.min(Duration::from_secs(10))) {
            Ok(c) => {
                for e in c.elements() {
                    if let Offset::Offset(o) = e.offset() {
                        offsets.insert(
                            (e.topic().to_owned(), e.partition()),
                            Position::of(o, Some(e.metadata())),
                        );
                    }
                }
                break;
            }
            Err(e) => {
                warn!(error = %e, "could not look up the group's committed offsets (retrying)");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
    Some(offsets)
}

/// Each of `partitions`' last stable offset, as a read_committed reader's
/// watermark query gives it (librdkafka lists offsets at the consumer's
/// isolation level: its "high" watermark is where its read stops). Queries
/// that fail are made again until `deadline` (`None` then). Blocking.
fn stable_offsets(
    cfg: &KafkaConfig,
    group: &str,
    topic: &str,
    partitions: &BTreeSet<i32>,
    deadline: Instant,
) -> Result<Option<BTreeMap<i32, i64>>, KafkaError> {
    let consumer = kafka::read_to_end_consumer(cfg, group)?;
    let mut stable = BTreeMap::new();
    for &p in partitions {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            match consumer.fetch_watermarks(topic, p, left.min(Duration::from_secs(5))) {
                Ok((_, lso)) => {
                    stable.insert(p, lso);
                    break;
                }
                Err(e) => {
                    warn!(topic, partition = p, error = %e, "could not look up the last stable offset (retrying)")
                }
            }
        }
    }
    Ok(Some(stable))
}

async fn write_again(
    producer: &FutureProducer,
    consumer: &Arc<TxnConsumer>,
    rewrite: &Rewrite,
    limits: kafka::TxnLimits,
) -> Result<kafka::Transacted, GateError> {
    let offsets = InputOffset::list(&rewrite.offsets)?;
    kafka::transact(
        producer,
        consumer,
        &rewrite.records,
        offsets,
        limits,
        || Ok::<_, GateError>(kafka::Ending::Commit),
    )
    .await
}

#[cfg(test)]
mod tests;
