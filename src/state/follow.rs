//! Reading changelog partitions into the local state with one consumer:
//! restores (each partition read to its end, in parallel) and standby
//! replicas (followed for as long as this process keeps them warm).
//!
//! Each partition resumes from the offset its local state reflects, after
//! confirming the tails of the batches it applied last ([`super::confirm`]);
//! or starts over from the changelog's start over a wiped partition
//! ([`StateStore::resume_point`] says which). The read is read_committed: a
//! follower never applies a record of a transaction that did not commit.

use super::{
    BulkLoad, Confirming, FullReason, RestoreError, Resume, Staged, StateError, StateStore, Trust,
    Verdict, bulk,
};
use crate::config::KafkaConfig;
use crate::kafka::{self, ReadToEndConsumer};
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tracing::warn;

/// The partitions this process's gate owns: a standby never writes to one
/// of them. [`Owners::hold`] locks the set: while the guard lives the gate
/// cannot take a partition, so a standby checks and writes under it, and
/// once the gate has taken a partition (before it restores it) no standby
/// write of it is under way or to come.
pub trait Owners: Send + Sync {
    fn hold(&self) -> Box<dyn Held + '_>;
}

/// The gate's partitions, locked ([`Owners::hold`]).
pub trait Held {
    fn owns(&self, p: i32) -> bool;
}

/// [`Owners`] kept in a set of its own (tests, tools).
#[derive(Debug, Default)]
pub struct Claims {
    owned: Mutex<BTreeSet<i32>>,
}

impl Claims {
    fn lock(&self) -> MutexGuard<'_, BTreeSet<i32>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gate takes `p`.
    pub fn claim(&self, p: i32) {
        self.lock().insert(p);
    }

    /// The gate let `ps` go.
    pub fn release(&self, ps: impl IntoIterator<Item = i32>) {
        let mut owned = self.lock();
        for p in ps {
            owned.remove(&p);
        }
    }
}

impl Held for MutexGuard<'_, BTreeSet<i32>> {
    fn owns(&self, p: i32) -> bool {
        self.contains(&p)
    }
}

impl Owners for Claims {
    fn hold(&self) -> Box<dyn Held + '_> {
        Box::new(self.lock())
    }
}

/// Records staged before they are written (one RocksDB write).
const WRITE_EVERY: usize = 20_000;

/// Records read between two readings of the clock in [`Follower::poll`].
const CLOCK_EVERY: u32 = 256;

/// How long asking a partition's watermarks may take.
const WATERMARKS: Duration = Duration::from_secs(30);

/// How a [`Follower`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A restore, before the gate serves the partitions: records go in
    /// without RocksDB's WAL, or over a wiped partition into a bulk load
    /// (flushed or ingested once each partition is done, then marked), and
    /// a partition whose tails cannot be confirmed yet starts over rather
    /// than waiting.
    Restore,
    /// A standby: every write carries the offsets it brings its partitions
    /// to, with the WAL; a tail not settled yet is waited for.
    Standby,
}

/// One partition being read.
#[derive(Debug)]
struct Track {
    /// Records at or past this offset are applied; below it they are only
    /// read to confirm tails.
    apply_from: i64,
    /// The offset after the last record read (what the state reflects once
    /// written).
    next: i64,
    /// Tails still to confirm (None once confirmed, or over a wiped partition).
    confirming: Option<Confirming>,
    confirmed: usize,
    /// Why it started over from the changelog's start.
    full: Option<FullReason>,
    /// Records applied.
    records: usize,
    /// At the end of the partition (as a read_committed reader sees it),
    /// nothing read since.
    at_end: bool,
    /// When the reader last stood at the end (wall clock, ms).
    at_end_since: Option<i64>,
    /// Offsets written but not yet marked (a standby marks with each write).
    unmarked: bool,
}

/// What became of a partition in one [`Follower::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// It reached its end, tails confirmed: it reflects its changelog.
    CaughtUp(i32),
    /// A tail was not on the changelog: it starts over from the start.
    StartedOver(i32, FullReason),
}

/// A partition read to its end ([`Follower`], [`super::restore_partitions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub records: usize,
    pub full: Option<FullReason>,
    pub confirmed: usize,
    /// The offset after the last record applied.
    pub next: i64,
    pub caught_up: bool,
}

/// Reads changelog partitions into the local state with one consumer.
pub struct Follower {
    consumer: ReadToEndConsumer,
    topic: String,
    mode: Mode,
    parts: BTreeMap<i32, Track>,
    /// Records read and not yet written, by partition.
    staged: BTreeMap<i32, Staged>,
    /// Staged records, every partition.
    pending: usize,
    /// A standby's: the gate's partitions, never written to.
    owners: Option<Arc<dyn Owners>>,
}

impl Follower {
    /// A follower of `cfg`'s changelog, as a member of no group (`group`
    /// names it; it never commits). Blocking.
    pub fn new(cfg: &KafkaConfig, group: &str, mode: Mode) -> Result<Follower, KafkaError> {
        Ok(Follower {
            consumer: kafka::resume_consumer(cfg, group)?,
            topic: cfg.topics.changelog.clone(),
            mode,
            parts: BTreeMap::new(),
            staged: BTreeMap::new(),
            pending: 0,
            owners: None,
        })
    }

    /// A standby that never writes to a partition the gate owns.
    pub fn standby(
        cfg: &KafkaConfig,
        group: &str,
        owners: Arc<dyn Owners>,
    ) -> Result<Follower, KafkaError> {
        Ok(Follower {
            consumer: kafka::follow_consumer(cfg, group, 100)?,
            topic: cfg.topics.changelog.clone(),
            mode: Mode::Standby,
            parts: BTreeMap::new(),
            staged: BTreeMap::new(),
            pending: 0,
            owners: Some(owners),
        })
    }

    /// The consumer (for other questions to the brokers).
    pub fn consumer(&self) -> &ReadToEndConsumer {
        &self.consumer
    }

    /// Whether the gate owns `p`, and the owners' lock that keeps it so
    /// (a standby changes the local state only under it).
    fn guard(&self, p: i32) -> (bool, Option<Box<dyn Held + '_>>) {
        match &self.owners {
            Some(o) => {
                let held = o.hold();
                (held.owns(p), Some(held))
            }
            None => (false, None),
        }
    }

    /// The partitions being read.
    pub fn partitions(&self) -> impl Iterator<Item = i32> + '_ {
        self.parts.keys().copied()
    }

    /// How far partition `p` has got.
    pub fn progress(&self, p: i32) -> Option<Progress> {
        self.parts.get(&p).map(|t| Progress {
            records: t.records,
            full: t.full,
            confirmed: t.confirmed,
            next: t.next,
            caught_up: t.at_end && t.confirming.is_none(),
        })
    }

    /// Records applied so far, every partition.
    pub fn records(&self) -> usize {
        self.parts.values().map(|t| t.records).sum()
    }

    /// Start reading `p`: from its local offset, confirming its tails first,
    /// or from the changelog's start over a wiped partition. Blocking
    /// (asks the partition's watermarks).
    pub fn start(&mut self, store: &StateStore, p: i32, trust: &Trust) -> Result<(), RestoreError> {
        self.stop(store, p)?;
        let now = chrono::Utc::now().timestamp_millis();
        match store.resume_point(p, now, trust)? {
            Resume::From { next, check } => {
                let confirming = Confirming::new(&check);
                let start = confirming.start(next);
                let (low, high) = self.consumer.fetch_watermarks(&self.topic, p, WATERMARKS)?;
                // Past the end: the changelog was recreated; below its start:
                // records the state never read were deleted.
                if next > high || start < low {
                    warn!(
                        partition = p,
                        local = next,
                        low,
                        high,
                        "the changelog does not hold the offset the local state reflects (recreated?): restoring from its start"
                    );
                    return self.start_over(store, p, FullReason::OutOfRange, false);
                }
                let track = Track {
                    apply_from: next,
                    next,
                    confirmed: check.len(),
                    confirming: (!check.is_empty()).then_some(confirming),
                    full: None,
                    records: 0,
                    at_end: false,
                    at_end_since: None,
                    unmarked: false,
                };
                if self.guard(p).0 {
                    return Ok(());
                }
                self.staged.entry(p).or_default().resumed(p);
                self.assign(p, start)?;
                self.parts.insert(p, track);
                Ok(())
            }
            Resume::Full(why) => {
                if why != FullReason::NoLocalState {
                    warn!(
                        partition = p,
                        reason = why.label(),
                        detail = ?why,
                        local = ?store.changelog_next(p)?,
                        "the local state of this partition is not known to be contiguous with its changelog: restoring it from the changelog's start"
                    );
                }
                self.start_over(store, p, why, false)
            }
        }
    }

    /// Wipe `p` and read it from the changelog's start (or mark it at the
    /// end at once when the changelog holds nothing).
    fn start_over(
        &mut self,
        store: &StateStore,
        p: i32,
        why: FullReason,
        assigned: bool,
    ) -> Result<(), RestoreError> {
        if assigned {
            self.unassign(p)?;
        }
        self.parts.remove(&p);
        if let Some(s) = self.staged.remove(&p) {
            self.pending -= s.records;
        }
        // At the log's first offset, asked for explicitly (a logical
        // "beginning" cost about a second per partition here).
        let (low, high) = self.consumer.fetch_watermarks(&self.topic, p, WATERMARKS)?;
        let (owned, guard) = self.guard(p);
        if owned {
            return Ok(());
        }
        store.wipe_partition(p)?;
        let mut staged = Staged::default();
        staged.wiped(p);
        if self.mode == Mode::Restore {
            // Nothing is read from a partition being restored: its records
            // can wait to be sorted and ingested at once.
            staged.bulk = Some(store.bulk_load(p));
        }
        let mut track = Track {
            apply_from: low,
            next: low,
            confirming: None,
            confirmed: 0,
            full: Some(why),
            records: 0,
            at_end: false,
            at_end_since: None,
            unmarked: false,
        };
        if low >= high {
            // Nothing in it, not even an open transaction's records: in sync
            // now, and followed from its end.
            track.next = high.max(0);
            track.apply_from = track.next;
            track.at_end = true;
            track.at_end_since = Some(chrono::Utc::now().timestamp_millis());
            store.finish_restore(p, Some(track.next))?;
        }
        drop(guard);
        self.staged.insert(p, staged);
        self.assign(p, track.next)?;
        self.parts.insert(p, track);
        Ok(())
    }

    /// Stop reading `p` (what it applied stays; a standby's is marked).
    pub fn stop(&mut self, store: &StateStore, p: i32) -> Result<(), RestoreError> {
        if self.parts.contains_key(&p) {
            self.write(store)?;
            self.drop_partition(p)?;
        }
        Ok(())
    }

    fn drop_partition(&mut self, p: i32) -> Result<(), KafkaError> {
        self.parts.remove(&p);
        if let Some(s) = self.staged.remove(&p) {
            self.pending -= s.records;
        }
        self.unassign(p)
    }

    fn assign(&self, p: i32, at: i64) -> Result<(), KafkaError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, p, Offset::Offset(at))?;
        self.consumer.incremental_assign(&tpl)
    }

    fn unassign(&self, p: i32) -> Result<(), KafkaError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.topic, p);
        self.consumer.incremental_unassign(&tpl)
    }

    /// Read for at most `budget`, apply what was read, and say which
    /// partitions caught up or started over. Blocking.
    pub fn poll(
        &mut self,
        store: &StateStore,
        budget: Duration,
    ) -> Result<Vec<Event>, RestoreError> {
        let until = Instant::now() + budget;
        let mut ends = Vec::new();
        // The clock is read once per CLOCK_EVERY records while they flow (a
        // read per record was a few % of a restore), and after every wait.
        let (mut left, mut unclocked) = (budget, 0);
        loop {
            if unclocked == 0 {
                left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
            }
            unclocked = (unclocked + 1) % CLOCK_EVERY;
            match self.consumer.poll(left.min(Duration::from_millis(100))) {
                Some(Ok(m)) => {
                    let p = m.partition();
                    let Some(t) = self.parts.get_mut(&p) else {
                        continue;
                    };
                    let o = m.offset();
                    t.at_end = false;
                    if let Some(c) = &mut t.confirming {
                        c.record(o, m.key(), m.payload());
                    }
                    if o < t.apply_from {
                        continue;
                    }
                    t.next = t.next.max(o + 1);
                    t.unmarked = true;
                    if let Some(k) = m.key() {
                        store.stage(self.staged.entry(p).or_default(), k, m.payload())?;
                        t.records += 1;
                        self.pending += 1;
                    }
                    if self.pending >= WRITE_EVERY {
                        self.write(store)?;
                    }
                }
                Some(Err(KafkaError::PartitionEOF(p))) => {
                    if let Some(t) = self.parts.get_mut(&p) {
                        t.at_end = true;
                        t.at_end_since = Some(chrono::Utc::now().timestamp_millis());
                        ends.push(p);
                    }
                }
                Some(Err(KafkaError::MessageConsumption(
                    rdkafka::types::RDKafkaErrorCode::AutoOffsetReset,
                ))) => {
                    // Checked against the watermarks at the start: the log's
                    // start moved since. Which partition is not said: every
                    // one not yet at its end starts over.
                    self.write(store)?;
                    let open: Vec<i32> = self
                        .parts
                        .iter()
                        .filter(|(_, t)| !t.at_end && t.full.is_none())
                        .map(|(p, _)| *p)
                        .collect();
                    for p in open {
                        self.start_over(store, p, FullReason::OutOfRange, true)?;
                    }
                }
                Some(Err(e)) => warn!(error = %e, "changelog read error (retrying)"),
                None => {
                    unclocked = 0;
                    if !ends.is_empty() {
                        break;
                    }
                }
            }
        }
        self.write(store)?;
        let mut events = Vec::new();
        ends.sort_unstable();
        ends.dedup();
        for p in ends {
            let Some(t) = self.parts.get_mut(&p) else {
                continue;
            };
            if !t.at_end {
                continue;
            }
            if let Some(c) = &t.confirming {
                let position = kafka::position_of(&self.consumer, &self.topic, p);
                let why = match c.verdict(position.unwrap_or(i64::MIN)) {
                    Verdict::Confirmed => None,
                    Verdict::Refuted { offset } => Some(FullReason::Unconfirmed {
                        offset,
                        settled: true,
                    }),
                    // A standby waits for the transaction below it to end; a
                    // restore does not keep its partition waiting.
                    Verdict::Unknown { .. } if self.mode == Mode::Standby => continue,
                    Verdict::Unknown { offset } => Some(FullReason::Unconfirmed {
                        offset,
                        settled: false,
                    }),
                };
                match why {
                    None => {
                        t.confirming = None;
                        t.unmarked = true;
                        if self.mode == Mode::Standby {
                            let owners = self.owners.clone();
                            let held = owners.as_ref().map(|o| o.hold());
                            if !held.as_ref().is_some_and(|h| h.owns(p)) {
                                store.tails_confirmed(p)?;
                            }
                        }
                    }
                    Some(why) => {
                        warn!(
                            partition = p,
                            reason = why.label(),
                            detail = ?why,
                            "the local state of this partition holds a batch the changelog does not show committed (a commit the broker acknowledged and then lost, or one still unsettled): restoring it from the changelog's start"
                        );
                        self.start_over(store, p, why, true)?;
                        events.push(Event::StartedOver(p, why));
                        continue;
                    }
                }
            }
            events.push(Event::CaughtUp(p));
        }
        Ok(events)
    }

    /// Write what is staged. A standby marks each partition it wrote at the
    /// offset it reached, in the same write (never ahead of its data), and
    /// drops what it read of a partition the gate claimed meanwhile; a
    /// restore marks a partition only once it is done ([`Follower::finish`]).
    fn write(&mut self, store: &StateStore) -> Result<(), StateError> {
        if self.pending == 0
            && self
                .parts
                .values()
                .all(|t| !t.unmarked || t.confirming.is_some())
        {
            return Ok(());
        }
        self.pending = 0;
        let staged = std::mem::take(&mut self.staged);
        match self.mode {
            Mode::Restore => {
                for (p, mut s) in staged {
                    store.write_staged(&mut s, false)?;
                    self.staged.insert(p, s);
                }
                // The bulk loads of this reader's partitions stay within
                // one budget: the largest spills a run past it.
                loop {
                    let loads = || self.staged.values().filter_map(|s| s.bulk.as_ref());
                    if loads().map(BulkLoad::bytes).sum::<usize>() <= bulk::BUDGET {
                        return Ok(());
                    }
                    let largest = self
                        .staged
                        .values_mut()
                        .filter_map(|s| s.bulk.as_mut())
                        .max_by_key(|l| l.bytes());
                    match largest {
                        Some(l) => l.spill()?,
                        None => return Ok(()),
                    }
                }
            }
            Mode::Standby => {
                let owners = self.owners.clone();
                let guard = owners.as_ref().map(|o| o.hold());
                let mut claimed = Vec::new();
                for (p, mut s) in staged {
                    if guard.as_ref().is_some_and(|g| g.owns(p)) {
                        claimed.push(p);
                        continue;
                    }
                    let mark = self
                        .parts
                        .get_mut(&p)
                        .filter(|t| t.unmarked && t.confirming.is_none())
                        .map(|t| {
                            t.unmarked = false;
                            t.next
                        });
                    store.write_followed(&mut s, p, mark)?;
                    self.staged.insert(p, s);
                }
                drop(guard);
                for p in claimed {
                    self.parts.remove(&p);
                    let _ = self.unassign(p);
                }
                Ok(())
            }
        }
    }

    /// Mark `p` as reflecting its changelog up to where it was read, in sync
    /// now, its tails confirmed. A restore flushes what it wrote without the
    /// WAL first (once for all of `ps`). Synced.
    pub fn finish(&mut self, store: &StateStore, ps: &[i32]) -> Result<(), StateError> {
        self.write(store)?;
        if self.mode == Mode::Restore {
            for p in ps {
                if let Some(load) = self.staged.get_mut(p).and_then(|s| s.bulk.take()) {
                    store.ingest(load)?;
                }
            }
            store.flush()?;
        }
        for p in ps {
            if let Some(t) = self.parts.get_mut(p) {
                store.finish_restore(*p, Some(t.next))?;
                t.unmarked = false;
            }
        }
        Ok(())
    }

    /// A standby stood at `p`'s end at `at_ms`: in sync then (unless the
    /// gate claimed it meanwhile).
    pub fn mark_in_sync(&self, store: &StateStore, p: i32, at_ms: i64) -> Result<(), StateError> {
        let (owned, _held) = self.guard(p);
        if owned || !self.parts.contains_key(&p) {
            return Ok(());
        }
        store.mark_in_sync(p, at_ms)
    }

    /// A standby's partitions that stood at their end since `since_ms`
    /// (tails confirmed), with when: in sync with the changelog then.
    pub fn in_sync_since(&self, since_ms: i64) -> Vec<(i32, i64)> {
        self.parts
            .iter()
            .filter(|(_, t)| t.at_end && t.confirming.is_none())
            .filter_map(|(p, t)| {
                t.at_end_since
                    .filter(|&at| at >= since_ms)
                    .map(|at| (*p, at))
            })
            .collect()
    }

    /// Ask where each partition at its end now ends: those whose reader
    /// still stands there are in sync as of the question (a standby's idle
    /// partitions get no new end-of-partition event). Blocking.
    pub fn check_at_end(&mut self) {
        let parts: Vec<i32> = self
            .parts
            .iter()
            .filter(|(_, t)| t.at_end && t.confirming.is_none())
            .map(|(p, _)| *p)
            .collect();
        for p in parts {
            let asked = chrono::Utc::now().timestamp_millis();
            let Ok((_, high)) =
                self.consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(5))
            else {
                continue;
            };
            let at = kafka::position_of(&self.consumer, &self.topic, p);
            if let Some(t) = self.parts.get_mut(&p)
                && t.at_end
                && at.is_some_and(|a| a >= high)
            {
                t.at_end_since = Some(asked);
            }
        }
    }

    /// How far behind its changelog's end each partition is (records and
    /// markers), as of a watermark query. Blocking.
    pub fn lag(&self, p: i32) -> Option<i64> {
        let (_, high) = self
            .consumer
            .fetch_watermarks(&self.topic, p, Duration::from_secs(5))
            .ok()?;
        let at = kafka::position_of(&self.consumer, &self.topic, p)
            .or_else(|| self.parts.get(&p).map(|t| t.next))?;
        Some((high - at).max(0))
    }
}
