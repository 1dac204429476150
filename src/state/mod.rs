//! The gate's state: the only owner of RocksDB.
//!
//! Column families:
//! - `steps`: one [`StepRecord`] per step key (recorded tools only);
//! - `deadlines`: started steps awaiting an outcome → their deadline;
//! - `expiry`: `(partition, expires_at, step)` index for retention purges;
//! - `workflows`: workflows ended by a `last_step` tool;
//! - `meta`: per partition, the next changelog offset the local state reflects,
//!   when it was last known in sync with the changelog, and the tails of the
//!   applied batches not yet confirmed on the changelog ([`confirm`]); whether
//!   a gate process runs on the state (see [`StateStore::begin_gate`]).
//!
//! Every key starts with the input partition (4 bytes, big endian), so a
//! partition's state can be listed and restored on its own.
//!
//! **The changelog topic is the source of truth; RocksDB is its cache.** A batch's
//! writes are applied here only after the Kafka transaction carrying them (and
//! their changelog records) has committed, unsynced, together with the changelog
//! offset they bring the partition to ([`StateStore::apply`]). On assignment the
//! partition's changelog is replayed from that offset (or from its start when the
//! offset is missing), so the local state can lag Kafka but never be ahead of it,
//! nor hold a history Kafka aborted.
//!
//! **A stale cache is never trusted** ([`StateStore::resume_point`]): the offset
//! is resumed from only while the state is younger than the changelog's
//! `delete.retention.ms` (past it, compaction may have removed tombstones the
//! state never read), and only once the batches it may hold that the changelog
//! does not (a commit marker the broker lost, which Kafka then aborted) are
//! confirmed there ([`confirm`]).

mod bulk;
mod confirm;
mod follow;
mod record;
mod restore;

pub use bulk::BulkLoad;
pub use confirm::{Committer, Confirming, Landing, Tail, Verdict, digest};
pub use follow::{
    Claims, Event as FollowEvent, Follower, Held, Mode as FollowMode, Owners,
    Progress as FollowProgress,
};

pub use record::{
    DispatchToken, Evidence, FastEntry, Hold, MAX_EVIDENCE_KEPT, MAX_LOOKUPS_KEPT, MAX_TOKENS_KEPT,
    MAX_WAITERS, NotWaiting, OperatorEntry, Phase, REPHRASED_BUDGET_BYTES, Reconciling,
    RephrasedCall, StepRecord, Tokens, WAITERS_BUDGET_BYTES, Waiter, WorkflowEnd,
    check_record_sizes, token_digest,
};
pub use restore::{
    Applied, RebuildError, Rebuilt, RestoreError, Restored, Trust, rebuild_state,
    restore_partitions,
};

use crate::contract::{StepKey, codec};
use rocksdb::{
    ColumnFamilyDescriptor, DB, Direction, IteratorMode, Options, WriteBatch, WriteOptions,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateError {
    #[error("RocksDB")]
    Rocks(#[from] rocksdb::Error),
    #[error("a bulk load's files")]
    Io(#[from] std::io::Error),
    #[error("corrupt state record under {cf}")]
    Corrupt {
        cf: &'static str,
        source: crate::contract::codec::DecodeError,
    },
}

/// A column family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cf {
    Steps,
    Deadlines,
    Expiry,
    Workflows,
    /// Steps waiting for a person (in doubt, awaiting approval): what the
    /// open-steps gauges count.
    Attention,
}

impl Cf {
    const ALL: [Cf; 5] = [
        Cf::Steps,
        Cf::Deadlines,
        Cf::Expiry,
        Cf::Workflows,
        Cf::Attention,
    ];

    /// The first byte of a changelog key.
    fn tag(self) -> u8 {
        match self {
            Cf::Steps => 1,
            Cf::Deadlines => 2,
            Cf::Expiry => 4,
            Cf::Workflows => 5,
            Cf::Attention => 6,
        }
    }

    /// Indexes derived from the step records: not on the changelog, rebuilt
    /// from the restored records instead (a step's every change would
    /// otherwise write two or three index records beside it).
    fn derived(self) -> bool {
        matches!(self, Cf::Deadlines | Cf::Expiry | Cf::Attention)
    }

    /// Its place in [`Cf::ALL`].
    fn index(self) -> usize {
        Cf::ALL
            .iter()
            .position(|c| *c == self)
            .expect("every column family is in ALL")
    }

    fn from_tag(tag: u8) -> Option<Cf> {
        Cf::ALL.into_iter().find(|c| c.tag() == tag)
    }

    fn name(self) -> &'static str {
        match self {
            Cf::Steps => "steps",
            Cf::Deadlines => "deadlines",
            Cf::Expiry => "expiry",
            Cf::Workflows => "workflows",
            Cf::Attention => "attention",
        }
    }
}

const META: &str = "meta";
/// Set in `meta` (synced) while a gate process runs on the state; removed
/// (synced) when it stops gracefully.
const RUNNING: &[u8] = b"running";

/// A raw key-value pair.
type Raw = (Vec<u8>, Vec<u8>);

/// The RocksDB-backed state of one gate process.
pub struct StateStore {
    db: DB,
    /// The current session's producers' last applied batches (their tails).
    live: std::sync::Mutex<confirm::Live>,
    /// Each column family's options, by [`Cf::index`]: a bulk load's files
    /// are written with them ([`bulk`]).
    cf_opts: Vec<Options>,
    bulk_dir: std::path::PathBuf,
}

impl StateStore {
    pub fn open(path: &Path) -> Result<StateStore, StateError> {
        StateStore::open_with_cache(path, crate::config::DEFAULT_BLOCK_CACHE_BYTES)
    }

    /// Open with a block cache of `cache_bytes`, shared by every column family.
    ///
    /// Memory stays bounded however many records the state holds: one block
    /// cache holds data blocks *and* the index and filter blocks (which grow
    /// with the records: ~75 MiB at 10 M steps), and one budget caps all
    /// memtables. Index and filters are partitioned, so a lookup needs one small
    /// partition of each in the cache rather than a whole file's; they are
    /// cached at high priority, ahead of data blocks, and the top level of each
    /// file stays pinned.
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> Result<StateStore, StateError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.set_write_buffer_size(32 * 1024 * 1024);
        opts.set_db_write_buffer_size(128 * 1024 * 1024);
        let cache = rocksdb::Cache::new_lru_cache(cache_bytes);
        let cf_opts = |bloom: bool| {
            let mut table = rocksdb::BlockBasedOptions::default();
            table.set_block_cache(&cache);
            if bloom {
                table.set_bloom_filter(10.0, false);
                table.set_partition_filters(true);
            }
            table.set_index_type(rocksdb::BlockBasedIndexType::TwoLevelIndexSearch);
            table.set_metadata_block_size(4096);
            table.set_cache_index_and_filter_blocks(true);
            table.set_cache_index_and_filter_blocks_with_high_priority(true);
            table.set_pin_top_level_index_and_filter(true);
            let mut o = opts.clone();
            o.set_block_based_table_factory(&table);
            o
        };
        // Point lookups of keys that mostly do not exist yet (every new step)
        // are answered by a bloom filter without reading data blocks; the
        // expiry index is only ever scanned in order, and needs none.
        let meta_opts = cf_opts(true);
        let cf_opts: Vec<Options> = Cf::ALL.iter().map(|c| cf_opts(*c != Cf::Expiry)).collect();
        let cfs = Cf::ALL
            .iter()
            .zip(&cf_opts)
            .map(|(c, o)| ColumnFamilyDescriptor::new(c.name(), o.clone()))
            .chain([ColumnFamilyDescriptor::new(META, meta_opts)]);
        let db = DB::open_cf_descriptors(&opts, path, cfs)?;
        // Emptied of what a bulk load left when the process stopped (never
        // ingested).
        let bulk_dir = bulk::dir_of(path);
        match std::fs::remove_dir_all(&bulk_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => std::fs::create_dir(&bulk_dir)?,
        }
        Ok(StateStore {
            db,
            live: Default::default(),
            cf_opts,
            bulk_dir,
        })
    }

    fn cf(&self, cf: Cf) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(cf.name())
            .expect("column families are created at open")
    }

    fn meta(&self) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(META)
            .expect("column families are created at open")
    }

    fn get_raw(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        Ok(self.db.get_cf(self.cf(cf), key)?)
    }

    /// A step's record, as committed.
    pub fn step(&self, partition: i32, step: &StepKey) -> Result<Option<StepRecord>, StateError> {
        self.get_raw(Cf::Steps, &step_key_bytes(partition, step))?
            .map(|b| decode(Cf::Steps, &b))
            .transpose()
    }

    /// The next changelog offset of `partition` that the local state does not
    /// reflect yet (None: nothing known; restore from the start).
    pub fn changelog_next(&self, partition: i32) -> Result<Option<i64>, StateError> {
        Ok(self
            .db
            .get_cf(self.meta(), clog_key(partition))?
            .and_then(|b| b.try_into().ok().map(i64::from_be_bytes)))
    }

    /// When (wall clock, ms) the local state of `partition` was last known in
    /// sync with its changelog: its last restore, or the last committed batch
    /// this process applied to it (None: unknown — left by a process that did
    /// not stop cleanly).
    pub fn synced_at(&self, partition: i32) -> Result<Option<i64>, StateError> {
        Ok(self
            .db
            .get_cf(self.meta(), sync_key(partition))?
            .and_then(|b| b.try_into().ok().map(i64::from_be_bytes)))
    }

    /// Whether a restore of `partition` may resume from the offset its local
    /// state reflects, or must start over from the changelog's start.
    ///
    /// Resuming is only sound while the state is contiguous with the
    /// changelog: nothing after the offset may have been removed before it is
    /// read. Compaction removes a tombstone `delete.retention.ms` after it
    /// cleaned its segment — at the earliest that long after it was written —
    /// so a state last in sync less than that ago (less a margin:
    /// [`Trust::max_age`]) cannot have missed one; an older one can (a step it
    /// holds `started` may have been settled and purged elsewhere since). A
    /// state of unknown age (left by an older version after an unclean stop)
    /// is not resumed from either. Whether the offset is still in the log is
    /// checked by the read itself (an out-of-range position starts over), and
    /// so are the tails the resume must confirm ([`Resume::From::check`]).
    pub fn resume_point(
        &self,
        partition: i32,
        now_ms: i64,
        trust: &Trust,
    ) -> Result<Resume, StateError> {
        let Some(next) = self.changelog_next(partition)? else {
            return Ok(Resume::Full(FullReason::NoLocalState));
        };
        let Some(at) = self.synced_at(partition)? else {
            return Ok(Resume::Full(FullReason::UnknownAge));
        };
        let age = Duration::from_millis(now_ms.saturating_sub(at).max(0) as u64);
        if age >= trust.max_age {
            return Ok(Resume::Full(FullReason::Stale {
                age,
                max_age: trust.max_age,
            }));
        }
        Ok(Resume::From {
            next,
            check: self.unconfirmed(partition)?,
        })
    }

    /// The tails of the batches applied to `partition` that are not yet
    /// confirmed on its changelog, oldest first ([`confirm`]).
    pub fn unconfirmed(&self, partition: i32) -> Result<Vec<Tail>, StateError> {
        let mut out = Vec::new();
        for (k, v) in self.meta_prefix(&tail_prefix(partition))? {
            let (Some(o), Ok(d)) = (
                k.get(k.len().saturating_sub(8)..)
                    .and_then(|b| b.try_into().ok())
                    .map(i64::from_be_bytes),
                <[u8; 8]>::try_from(v.as_slice()),
            ) else {
                return Err(StateError::Corrupt {
                    cf: META,
                    source: codec::DecodeError::Length {
                        len: v.len(),
                        expected: 8,
                    },
                });
            };
            out.push(Tail {
                offset: o,
                digest: u64::from_be_bytes(d),
            });
        }
        Ok(out)
    }

    /// A gate process starts on this state; returns whether the last one did
    /// not stop gracefully ([`StateStore::end_gate`] never ran: killed,
    /// crashed, power lost). Nothing is discarded for it: the batches such a
    /// process may have left that the changelog does not hold are known by
    /// their tails, and each partition's next reader confirms them
    /// ([`confirm`]). Synced.
    pub fn begin_gate(&self) -> Result<bool, StateError> {
        let unclean = self.db.get_cf(self.meta(), RUNNING)?.is_some();
        let mut wb = WriteBatch::default();
        wb.put_cf(self.meta(), RUNNING, now_ms().to_be_bytes());
        self.write_synced(wb)?;
        Ok(unclean)
    }

    /// The gate process stopped gracefully: every batch it applied had
    /// committed. Synced (with every unsynced write before it).
    pub fn end_gate(&self) -> Result<(), StateError> {
        let mut wb = WriteBatch::default();
        wb.delete_cf(self.meta(), RUNNING);
        self.write_synced(wb)
    }

    fn meta_prefix(&self, prefix: &[u8]) -> Result<Vec<Raw>, StateError> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator_cf(self.meta(), IteratorMode::From(prefix, Direction::Forward))
        {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    /// Apply a committed batch (not synced: a crash loses at most what the
    /// changelog holds and the next assignment replays). `landing` gives, per
    /// partition, the batch's last changelog record there: the state reflects
    /// the changelog up to it, and keeps it as a tail to confirm until its
    /// producer's next batch is applied ([`confirm`]) — in this same write, so
    /// no crash leaves the batch without its tails.
    pub fn apply(&self, batch: &Batch, landing: &Landing) -> Result<(), StateError> {
        let mut wb = WriteBatch::default();
        for ((cf, key), value) in &batch.writes {
            match value {
                Some(v) => wb.put_cf(self.cf(*cf), key, v),
                None => wb.delete_cf(self.cf(*cf), key),
            }
        }
        // The batch committed, so this process owned its partitions (its
        // transaction was fenced by the group's generation): what it applied
        // is all the changelog holds up to its tail there.
        let now = now_ms();
        for (p, t) in &landing.tails {
            wb.put_cf(self.meta(), clog_key(*p), (t.offset + 1).to_be_bytes());
            wb.put_cf(self.meta(), sync_key(*p), now.to_be_bytes());
            wb.put_cf(self.meta(), tail_key(*p, t.offset), t.digest.to_be_bytes());
        }
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for (p, o) in live.replace(landing) {
            if landing.tails.get(&p).is_none_or(|t| t.offset != o) {
                wb.delete_cf(self.meta(), tail_key(p, o));
            }
        }
        self.db.write(wb)?;
        Ok(())
    }

    fn write_synced(&self, wb: WriteBatch) -> Result<(), StateError> {
        let mut wo = WriteOptions::default();
        wo.set_sync(true);
        self.db.write_opt(wb, &wo)?;
        Ok(())
    }

    /// How many steps of `partition` wait for a person, from the attention
    /// index (small: only such steps are in it).
    pub fn open_steps(&self, partition: i32) -> Result<OpenSteps, StateError> {
        let mut n = OpenSteps::default();
        for (_, v) in self.scan_prefix(Cf::Attention, &partition.to_be_bytes())? {
            match v.first() {
                Some(&ATTENTION_IN_DOUBT) => n.in_doubt += 1,
                Some(&ATTENTION_AWAITING_APPROVAL) => n.awaiting_approval += 1,
                _ => {}
            }
        }
        Ok(n)
    }

    /// Started steps of a partition with their deadlines (ms since the epoch).
    pub fn deadlines(&self, partition: i32) -> Result<Vec<(StepKey, i64)>, StateError> {
        let mut out = Vec::new();
        for (key, value) in self.scan_prefix(Cf::Deadlines, &partition.to_be_bytes())? {
            let step = decode_step_key(&key).ok_or(StateError::Corrupt {
                cf: "deadlines",
                source: crate::contract::codec::DecodeError::Empty,
            })?;
            out.push((step, decode_deadline(&value)?));
        }
        Ok(out)
    }

    /// Up to `limit` step records of `partition` whose retention ended before
    /// `now_ms`, oldest first, leaving out the index entries `skip` names.
    /// Reads the index only as far as it needs: at millions of steps it is
    /// never collected whole.
    fn expired_where(
        &self,
        partition: i32,
        now_ms: i64,
        limit: usize,
        skip: impl Fn(&[u8]) -> bool,
    ) -> Result<Vec<(i64, StepKey)>, StateError> {
        let mut out = Vec::new();
        let prefix = partition.to_be_bytes();
        let iter = self.db.iterator_cf(
            self.cf(Cf::Expiry),
            IteratorMode::From(&prefix, Direction::Forward),
        );
        for item in iter {
            let (key, _) = item?;
            if !key.starts_with(&prefix) || out.len() >= limit || key.len() < 12 {
                break;
            }
            let at = i64::from_be_bytes(key[4..12].try_into().unwrap_or_default());
            if at > now_ms {
                break;
            }
            if skip(&key) {
                continue;
            }
            if let Some(step) = decode_step_key(&key[12..]) {
                out.push((at, step));
            }
        }
        Ok(out)
    }

    /// Up to `limit` step records of `partition` whose retention ended before `now_ms`.
    pub fn expired(
        &self,
        partition: i32,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<(i64, StepKey)>, StateError> {
        self.expired_where(partition, now_ms, limit, |_| false)
    }

    /// Every step record of a workflow in a partition, in step order.
    pub fn workflow_steps(
        &self,
        partition: i32,
        workflow_id: &str,
    ) -> Result<Vec<StepRecord>, StateError> {
        let mut prefix = partition.to_be_bytes().to_vec();
        push_workflow(&mut prefix, workflow_id);
        self.scan_prefix(Cf::Steps, &prefix)?
            .into_iter()
            .map(|(_, v)| decode(Cf::Steps, &v))
            .collect()
    }

    fn scan_prefix(&self, cf: Cf, prefix: &[u8]) -> Result<Vec<Raw>, StateError> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator_cf(self.cf(cf), IteratorMode::From(prefix, Direction::Forward))
        {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    /// What the state holds, on disk and in memory (for metrics).
    pub fn size(&self) -> StateSize {
        let sum = |prop: &str| -> u64 {
            Cf::ALL
                .iter()
                .filter_map(|c| {
                    self.db
                        .property_int_value_cf(self.cf(*c), prop)
                        .ok()
                        .flatten()
                })
                .sum()
        };
        // The block cache is shared: any column family reports all of it.
        let cache = |prop: &str| {
            self.db
                .property_int_value_cf(self.cf(Cf::Steps), prop)
                .ok()
                .flatten()
                .unwrap_or(0)
        };
        StateSize {
            steps: cache("rocksdb.estimate-num-keys"),
            disk_bytes: sum("rocksdb.live-sst-files-size"),
            memtable_bytes: sum("rocksdb.cur-size-all-mem-tables"),
            table_reader_bytes: sum("rocksdb.estimate-table-readers-mem"),
            block_cache_bytes: cache("rocksdb.block-cache-usage"),
            block_cache_pinned_bytes: cache("rocksdb.block-cache-pinned-usage"),
        }
    }
}

/// The size of the state, from RocksDB's own estimates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StateSize {
    /// Step records (estimate).
    pub steps: u64,
    /// Live SST files.
    pub disk_bytes: u64,
    /// Memtables not yet flushed, every column family.
    pub memtable_bytes: u64,
    /// Index and filter blocks held outside the block cache by open SST files.
    pub table_reader_bytes: u64,
    /// The shared block cache's contents, pinned entries included.
    pub block_cache_bytes: u64,
    /// Block cache entries in use and so not evictable.
    pub block_cache_pinned_bytes: u64,
}

impl StateSize {
    /// Memory by where it is held, as the metrics label it.
    pub fn memory(&self) -> [(&'static str, u64); 4] {
        [
            ("memtables", self.memtable_bytes),
            ("table_readers", self.table_reader_bytes),
            ("block_cache", self.block_cache_bytes),
            ("block_cache_pinned", self.block_cache_pinned_bytes),
        ]
    }
}

/// One state change as written to the changelog topic: the key is the column
/// family's tag byte followed by the state key; `None` is a tombstone.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangelogEntry {
    pub partition: i32,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

impl StateStore {
    /// Forget everything local about a partition, before restoring it.
    pub fn wipe_partition(&self, partition: i32) -> Result<(), StateError> {
        let from = partition.to_be_bytes();
        let to = partition.saturating_add(1).to_be_bytes();
        let mut wb = WriteBatch::default();
        for cf in Cf::ALL {
            // Not over a range that holds nothing: the deletion would overlap
            // a bulk load's files, and keep them out of the bottom level.
            if self.holds_any(cf, &from, &to) {
                wb.delete_range_cf(self.cf(cf), from, to);
            }
        }
        wb.delete_cf(self.meta(), clog_key(partition));
        wb.delete_cf(self.meta(), sync_key(partition));
        let (from, to) = tail_range(partition);
        wb.delete_range_cf(self.meta(), from, to);
        self.write_synced(wb)
    }

    /// Whether `cf` holds a key in `[from, to)`.
    fn holds_any(&self, cf: Cf, from: &[u8], to: &[u8]) -> bool {
        let mut ro = rocksdb::ReadOptions::default();
        ro.set_iterate_upper_bound(to.to_vec());
        let mut it = self.db.raw_iterator_cf_opt(self.cf(cf), ro);
        it.seek(from);
        // An error reading says nothing: the range is deleted as if it held.
        it.valid() || it.status().is_err()
    }

    /// What the local state holds of `partition` that the changelog carries
    /// (step records and workflow ends, not the derived indexes), keyed as
    /// on the changelog: for checks that the state equals its changelog.
    #[cfg(test)]
    pub(crate) fn logged_records(&self, partition: i32) -> Result<Vec<Raw>, StateError> {
        let mut out = Vec::new();
        for cf in Cf::ALL.into_iter().filter(|c| !c.derived()) {
            for (k, v) in self.scan_prefix(cf, &partition.to_be_bytes())? {
                out.push(([&[cf.tag()][..], &k].concat(), v));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Apply changelog records in order (later ones win); returns how many were
    /// applied. Not synced: [`StateStore::finish_restore`] syncs once at the end.
    pub fn apply_changelog(
        &self,
        records: &[(Vec<u8>, Option<Vec<u8>>)],
    ) -> Result<usize, StateError> {
        let mut staged = Staged::default();
        for (key, value) in records {
            self.stage(&mut staged, key, value.as_deref())?;
        }
        let n = staged.records;
        self.write_staged(&mut staged, true)?;
        Ok(n)
    }

    /// Add one changelog record to `staged` (see [`Staged`]).
    pub fn stage(
        &self,
        staged: &mut Staged,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), StateError> {
        let Some((tag, state_key)) = key.split_first() else {
            return Ok(());
        };
        // Only what is logged is applied: the indexes are derived from the
        // step records as they are applied.
        let Some(cf) = Cf::from_tag(*tag).filter(|c| !c.derived()) else {
            return Ok(());
        };
        if state_key.len() < 4 {
            return Ok(());
        }
        staged.records += 1;
        if let Some(load) = &mut staged.bulk {
            load.push(key, value);
            return Ok(());
        }
        // Kept as it came, compact: half the bytes of the named form the gate
        // writes, so a restore writes and compacts half as much (reads decode
        // either form). One that cannot be read is refused when read.
        match value {
            Some(v) => staged.wb.put_cf(self.cf(cf), state_key, v),
            None => staged.wb.delete_cf(self.cf(cf), state_key),
        }
        if cf == Cf::Steps {
            self.index_restored(staged, state_key, value)?;
        }
        Ok(())
    }

    /// Write what `staged` holds, and empty it; without RocksDB's WAL when
    /// `wal` is false (then nothing of it is durable until the memtables are
    /// flushed: [`StateStore::flush`]).
    pub fn write_staged(&self, staged: &mut Staged, wal: bool) -> Result<(), StateError> {
        let wb = std::mem::take(&mut staged.wb);
        staged.records = 0;
        if wb.is_empty() {
            return Ok(());
        }
        let mut wo = WriteOptions::default();
        wo.disable_wal(!wal);
        self.db.write_opt(wb, &wo)?;
        Ok(())
    }

    /// A standby's write: what `staged` holds of `partition`, with the WAL,
    /// and in the same write the partition marked as reflecting its
    /// changelog up to `next` (never ahead of its data). Not synced.
    pub fn write_followed(
        &self,
        staged: &mut Staged,
        partition: i32,
        next: Option<i64>,
    ) -> Result<(), StateError> {
        if let Some(n) = next {
            staged
                .wb
                .put_cf(self.meta(), clog_key(partition), n.to_be_bytes());
        }
        self.write_staged(staged, true)
    }

    /// A standby stood at `partition`'s end at `at_ms` (its tails confirmed):
    /// the state was in sync with the changelog then. Moves forward only.
    pub fn mark_in_sync(&self, partition: i32, at_ms: i64) -> Result<(), StateError> {
        if self.synced_at(partition)?.is_some_and(|s| s >= at_ms) {
            return Ok(());
        }
        let mut wb = WriteBatch::default();
        wb.put_cf(self.meta(), sync_key(partition), at_ms.to_be_bytes());
        self.db.write(wb)?;
        Ok(())
    }

    /// A reader confirmed `partition`'s tails on the changelog.
    pub fn tails_confirmed(&self, partition: i32) -> Result<(), StateError> {
        let mut wb = WriteBatch::default();
        let (from, to) = tail_range(partition);
        wb.delete_range_cf(self.meta(), from, to);
        self.db.write(wb)?;
        Ok(())
    }

    /// Flush every memtable to disk (waiting): what was written without the
    /// WAL is durable from here.
    pub fn flush(&self) -> Result<(), StateError> {
        let cfs: Vec<_> = Cf::ALL.iter().map(|c| self.cf(*c)).collect();
        let mut fo = rocksdb::FlushOptions::default();
        fo.set_wait(true);
        self.db.flush_cfs_opt(&cfs, &fo)?;
        Ok(())
    }

    /// The index entries of a restored step record (or of its tombstone).
    fn index_restored(
        &self,
        staged: &mut Staged,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), StateError> {
        let r: Option<Indexed> = match value.map(Indexed::decode).transpose() {
            Ok(r) => r,
            // Kept as it is, unindexed: the restore goes on, and an input of
            // this step fails on it until the gate sets that input aside.
            Err(e) => {
                tracing::error!(error = %e, "a step record on the changelog cannot be read; restored without its indexes");
                None
            }
        };
        let wb = &mut staged.wb;
        if let Some(r) = &r {
            wb.put_cf(self.cf(Cf::Expiry), expiry_key(key, r.expires_at_ms), []);
        }
        // Over a wiped partition, a key has an index entry only if a record
        // of this restore put one: the deletes of every other key are skipped.
        let fresh = staged.fresh.contains(&partition_of(key));
        let indexed = fresh && staged.indexed.contains(key);
        let mut any = false;
        match r.as_ref().and_then(|r| deadline_of(r.phase, r.deadline_ms)) {
            Some(d) => {
                wb.put_cf(self.cf(Cf::Deadlines), key, encode_deadline(d));
                any = true;
            }
            None if !fresh || indexed => wb.delete_cf(self.cf(Cf::Deadlines), key),
            None => {}
        }
        match r.and_then(|r| attention_of(r.phase)) {
            Some(a) => {
                wb.put_cf(self.cf(Cf::Attention), key, [a]);
                any = true;
            }
            None if !fresh || indexed => wb.delete_cf(self.cf(Cf::Attention), key),
            None => {}
        }
        if fresh && any && !indexed {
            staged.indexed.insert(key.to_vec());
        }
        Ok(())
    }

    /// Mark a restored partition as reflecting its changelog up to `next`,
    /// in sync with it now, its tails confirmed (synced: the restore's
    /// unsynced writes become durable with it).
    pub fn finish_restore(&self, partition: i32, next: Option<i64>) -> Result<(), StateError> {
        let mut wb = WriteBatch::default();
        let (from, to) = tail_range(partition);
        wb.delete_range_cf(self.meta(), from, to);
        match next {
            Some(n) => {
                wb.put_cf(self.meta(), clog_key(partition), n.to_be_bytes());
                wb.put_cf(self.meta(), sync_key(partition), now_ms().to_be_bytes());
            }
            None => {
                wb.delete_cf(self.meta(), clog_key(partition));
                wb.delete_cf(self.meta(), sync_key(partition));
            }
        }
        self.write_synced(wb)
    }
}

/// Changelog records being applied to the local state, in one write batch.
#[derive(Default)]
pub struct Staged {
    wb: WriteBatch,
    /// Records staged since the last write.
    pub records: usize,
    /// Partitions wiped before this restore: none of their keys has index
    /// entries but those `indexed` holds.
    fresh: std::collections::HashSet<i32>,
    indexed: std::collections::HashSet<Vec<u8>>,
    /// Records gathered for a bulk load instead ([`StateStore::ingest`]).
    pub bulk: Option<BulkLoad>,
}

impl Staged {
    /// `partition` was wiped before its records are staged here.
    pub fn wiped(&mut self, partition: i32) {
        self.fresh.insert(partition);
        let p = partition.to_be_bytes();
        self.indexed.retain(|k| !k.starts_with(&p));
    }

    /// `partition`'s records are staged over what it holds (a resume).
    pub fn resumed(&mut self, partition: i32) {
        self.fresh.remove(&partition);
    }

    /// Bytes staged (RocksDB's own count).
    pub fn bytes(&self) -> usize {
        self.wb.size_in_bytes()
    }
}

type Writes = HashMap<(Cf, Vec<u8>), Option<Vec<u8>>>;

/// Pending writes of one batch, read-through to the batch being committed (if
/// any) and then to the local state, so inputs see the effects of every input
/// decided before them, committed or not.
#[derive(Default)]
pub struct Batch {
    writes: Writes,
    /// The step records among `writes`, decoded (None: deleted): a step written
    /// in this batch or the one below is read without decoding it again.
    steps: HashMap<Vec<u8>, Option<StepRecord>>,
    /// The writes of the batch committing while this one gathers.
    below: Option<std::sync::Arc<Batch>>,
}

impl Batch {
    /// A batch decided while `below` commits.
    pub fn on_top_of(below: Option<std::sync::Arc<Batch>>) -> Batch {
        // Sized like the batch below: a busy gate's batches are alike, and a
        // map grown to thousands of entries by doubling hashes each key again
        // at every growth (about 1 % of a flood's CPU).
        let (writes, steps) = below
            .as_ref()
            .map_or((0, 0), |b| (b.writes.len(), b.steps.len()));
        Batch {
            writes: Writes::with_capacity(writes),
            steps: HashMap::with_capacity(steps),
            below,
        }
    }

    /// Forget the batch below, once it is applied to the local state (so
    /// batches never chain).
    pub fn detach(&mut self) {
        self.below = None;
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    fn get(&self, store: &StateStore, cf: Cf, key: Vec<u8>) -> Result<Option<Vec<u8>>, StateError> {
        let k = (cf, key);
        if let Some(v) = self.writes.get(&k) {
            return Ok(v.clone());
        }
        if let Some(v) = self.below.as_ref().and_then(|b| b.writes.get(&k)) {
            return Ok(v.clone());
        }
        store.get_raw(cf, &k.1)
    }

    pub fn step(
        &self,
        store: &StateStore,
        partition: i32,
        step: &StepKey,
    ) -> Result<Option<StepRecord>, StateError> {
        let key = step_key_bytes(partition, step);
        if let Some(r) = self.written_step(&key) {
            return Ok(r.clone());
        }
        store
            .get_raw(Cf::Steps, &key)?
            .map(|b| decode(Cf::Steps, &b))
            .transpose()
    }

    /// A step record this batch or the one below wrote (Some(None): deleted).
    fn written_step(&self, key: &[u8]) -> Option<&Option<StepRecord>> {
        self.steps
            .get(key)
            .or_else(|| self.below.as_ref().and_then(|b| b.steps.get(key)))
    }

    /// The index fields of a step's current record (None: no record).
    fn current_index(&self, store: &StateStore, key: &[u8]) -> Result<Option<Indexed>, StateError> {
        if let Some(r) = self.written_step(key) {
            return Ok(r.as_ref().map(Indexed::of));
        }
        store
            .get_raw(Cf::Steps, key)?
            .map(|b| in_cf(Cf::Steps, Indexed::decode(&b)))
            .transpose()
    }

    /// Write a step record, keeping the deadline and expiry indexes in line
    /// (an index entry that does not change is not written again).
    pub fn put_step(
        &mut self,
        store: &StateStore,
        partition: i32,
        record: &StepRecord,
    ) -> Result<(), StateError> {
        let key = step_key_bytes(partition, &record.step);
        let old = self.current_index(store, &key)?;
        self.put_step_over(key, old, record);
        Ok(())
    }

    /// [`Batch::put_step`] over a record the caller read from this batch
    /// ([`Batch::step`]) and knows to be current still: `old` is its
    /// [`Indexed`] (None: there was none). Saves reading the step again — in
    /// a flood most outcomes settle a step only RocksDB still holds.
    pub fn put_step_known(&mut self, partition: i32, old: Option<Indexed>, record: &StepRecord) {
        self.put_step_over(step_key_bytes(partition, &record.step), old, record);
    }

    /// [`Batch::put_step`] of a step that has no record yet, here, below
    /// or in `store` (a deferred step's first write, `gate/core/deferred.rs`):
    /// nothing to read. Checked in debug builds, which the simulation and
    /// the test suites run.
    pub fn put_first_step(&mut self, store: &StateStore, partition: i32, record: &StepRecord) {
        let key = step_key_bytes(partition, &record.step);
        debug_assert!(
            matches!(self.current_index(store, &key), Ok(None)),
            "step {} written as new has a record",
            record.step
        );
        self.put_step_over(key, None, record);
    }

    fn put_step_over(&mut self, key: Vec<u8>, old: Option<Indexed>, record: &StepRecord) {
        let old_expiry = old.as_ref().map(|o| o.expires_at_ms);
        if old_expiry != Some(record.expires_at_ms) {
            if let Some(e) = old_expiry {
                self.writes.insert((Cf::Expiry, expiry_key(&key, e)), None);
            }
            self.writes.insert(
                (Cf::Expiry, expiry_key(&key, record.expires_at_ms)),
                Some(Vec::new()),
            );
        }
        let attention = attention_of(record.phase);
        if old.as_ref().and_then(|o| attention_of(o.phase)) != attention {
            self.writes
                .insert((Cf::Attention, key.clone()), attention.map(|a| vec![a]));
        }
        let deadline = deadline_of(record.phase, record.deadline_ms);
        if old.and_then(|o| deadline_of(o.phase, o.deadline_ms)) != deadline {
            self.writes
                .insert((Cf::Deadlines, key.clone()), deadline.map(encode_deadline));
        }
        self.writes
            .insert((Cf::Steps, key.clone()), Some(codec::encode(record)));
        self.steps.insert(key, Some(record.clone()));
    }

    /// Remove a step record and its index entries (retention).
    pub fn delete_step(
        &mut self,
        store: &StateStore,
        partition: i32,
        step: &StepKey,
    ) -> Result<(), StateError> {
        let key = step_key_bytes(partition, step);
        if let Some(old) = self.current_index(store, &key)? {
            self.writes
                .insert((Cf::Expiry, expiry_key(&key, old.expires_at_ms)), None);
        }
        self.writes.insert((Cf::Deadlines, key.clone()), None);
        self.writes.insert((Cf::Attention, key.clone()), None);
        self.writes.insert((Cf::Steps, key.clone()), None);
        self.steps.insert(key, None);
        Ok(())
    }

    /// Up to `limit` expired step records of `partition` that neither this
    /// batch nor the one below has already removed: a purge that goes on
    /// before its last chunk is applied takes the next records, not the same.
    pub fn expired(
        &self,
        store: &StateStore,
        partition: i32,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<(i64, StepKey)>, StateError> {
        store.expired_where(partition, now_ms, limit, |key| {
            let k = (Cf::Expiry, key.to_vec());
            matches!(self.writes.get(&k), Some(None))
                || self
                    .below
                    .as_ref()
                    .is_some_and(|b| matches!(b.writes.get(&k), Some(None)))
        })
    }

    /// Drop a dangling expiry index entry.
    pub fn delete_expiry(&mut self, partition: i32, step: &StepKey, at_ms: i64) {
        let key = step_key_bytes(partition, step);
        self.writes
            .insert((Cf::Expiry, expiry_key(&key, at_ms)), None);
    }

    /// Whether (and by which step) a workflow was ended by a `last_step` tool.
    pub fn workflow_end(
        &self,
        store: &StateStore,
        partition: i32,
        workflow_id: &str,
    ) -> Result<Option<WorkflowEnd>, StateError> {
        self.get(store, Cf::Workflows, workflow_key(partition, workflow_id))?
            .map(|b| decode(Cf::Workflows, &b))
            .transpose()
    }

    pub fn put_workflow_end(&mut self, partition: i32, end: &WorkflowEnd) {
        self.writes.insert(
            (
                Cf::Workflows,
                workflow_key(partition, &end.step.workflow_id),
            ),
            Some(codec::encode(end)),
        );
    }

    pub fn delete_workflow_end(&mut self, partition: i32, workflow_id: &str) {
        self.writes
            .insert((Cf::Workflows, workflow_key(partition, workflow_id)), None);
    }

    /// The batch's writes as changelog records, in a stable order; the derived
    /// indexes stay local.
    pub fn changelog(&self) -> Vec<ChangelogEntry> {
        let mut out: Vec<ChangelogEntry> = self
            .writes
            .iter()
            .filter(|((cf, _), _)| !cf.derived())
            .map(|((cf, key), value)| {
                let mut k = Vec::with_capacity(key.len() + 1);
                k.push(cf.tag());
                k.extend_from_slice(key);
                ChangelogEntry {
                    partition: partition_of(key),
                    key: k,
                    value: value.clone(),
                }
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// The partitions this batch writes to.
    pub fn partitions(&self) -> std::collections::BTreeSet<i32> {
        self.writes.keys().map(|(_, k)| partition_of(k)).collect()
    }
}

/// A changelog record of a step: its partition and record (None for a
/// tombstone); None for every other kind of changelog record.
pub fn changelog_step(
    key: &[u8],
    value: Option<&[u8]>,
) -> Option<(i32, StepKey, Option<StepRecord>)> {
    let (tag, state_key) = key.split_first()?;
    if Cf::from_tag(*tag)? != Cf::Steps || state_key.len() < 4 {
        return None;
    }
    let step = decode_step_key(state_key)?;
    let record = match value {
        Some(v) => Some(decode(Cf::Steps, v).ok()?),
        None => None,
    };
    Some((partition_of(state_key), step, record))
}

/// The fields of a step record its indexes derive from (decoding only these
/// skips the rest of the record).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Indexed {
    phase: Phase,
    #[serde(default)]
    deadline_ms: Option<i64>,
    expires_at_ms: i64,
}

impl Indexed {
    const FIELDS: &[&str] = &["phase", "deadline_ms", "expires_at_ms"];

    /// From a step record's bytes, reading only these fields.
    fn decode(bytes: &[u8]) -> Result<Indexed, codec::DecodeError> {
        codec::decode_fields(bytes, Self::FIELDS)
    }

    pub fn of(record: &StepRecord) -> Self {
        Indexed {
            phase: record.phase,
            deadline_ms: record.deadline_ms,
            expires_at_ms: record.expires_at_ms,
        }
    }
}

/// A step's entry in the attention index: the phases a person must act on.
fn attention_of(phase: Phase) -> Option<u8> {
    match phase {
        Phase::InDoubt => Some(ATTENTION_IN_DOUBT),
        Phase::AwaitingApproval => Some(ATTENTION_AWAITING_APPROVAL),
        _ => None,
    }
}

const ATTENTION_IN_DOUBT: u8 = 0;
const ATTENTION_AWAITING_APPROVAL: u8 = 1;

/// Steps of a partition waiting for a person (see [`StateStore::open_steps`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenSteps {
    pub in_doubt: u64,
    pub awaiting_approval: u64,
}

/// A step's entry in the deadlines index: a started call awaits an
/// outcome; a held call's lifecycle and an in-doubt step's reconcile lookups
/// have times too (`gate/core/approvals.rs`, `reconcile.rs`).
fn deadline_of(phase: Phase, deadline_ms: Option<i64>) -> Option<i64> {
    match phase {
        Phase::Started | Phase::AwaitingApproval | Phase::InDoubt => deadline_ms,
        _ => None,
    }
}

/// A deadline in the (local-only) deadlines index: 8 bytes, big endian.
fn encode_deadline(d: i64) -> Vec<u8> {
    d.to_be_bytes().to_vec()
}

fn decode_deadline(bytes: &[u8]) -> Result<i64, StateError> {
    <[u8; 8]>::try_from(bytes)
        .map(i64::from_be_bytes)
        .map_err(|_| StateError::Corrupt {
            cf: Cf::Deadlines.name(),
            source: codec::DecodeError::Length {
                len: bytes.len(),
                expected: 8,
            },
        })
}

fn decode<T: serde::de::DeserializeOwned>(cf: Cf, bytes: &[u8]) -> Result<T, StateError> {
    in_cf(cf, codec::decode(bytes))
}

/// A record of `cf` that could not be decoded is a corrupt state record.
fn in_cf<T>(cf: Cf, decoded: Result<T, codec::DecodeError>) -> Result<T, StateError> {
    decoded.map_err(|source| StateError::Corrupt {
        cf: cf.name(),
        source,
    })
}

fn partition_of(key: &[u8]) -> i32 {
    i32::from_be_bytes(
        key[..4]
            .try_into()
            .expect("every key starts with its partition"),
    )
}

fn clog_key(partition: i32) -> Vec<u8> {
    [b"clog/".as_slice(), &partition.to_be_bytes()].concat()
}

const SYNC_PREFIX: &[u8] = b"sync/";

/// `tail/<partition><offset>` → digest: an applied batch's last changelog
/// record in the partition, not yet confirmed there ([`confirm`]).
fn tail_prefix(partition: i32) -> Vec<u8> {
    [b"tail/".as_slice(), &partition.to_be_bytes()].concat()
}

fn tail_key(partition: i32, offset: i64) -> Vec<u8> {
    [tail_prefix(partition).as_slice(), &offset.to_be_bytes()].concat()
}

/// Every tail key of `partition`: `[from, to)`.
fn tail_range(partition: i32) -> (Vec<u8>, Vec<u8>) {
    let mut to = tail_prefix(partition);
    to.push(0xff);
    (tail_prefix(partition), to)
}

fn sync_key(partition: i32) -> Vec<u8> {
    [SYNC_PREFIX, &partition.to_be_bytes()].concat()
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Whether a partition's restore resumes from its local offset ([`StateStore::resume_point`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// From changelog offset `next`: the local state is contiguous with the
    /// changelog, once the reader has confirmed each of `check`, the tails of
    /// the applied batches not yet confirmed there (oldest first).
    From { next: i64, check: Vec<Tail> },
    /// From the changelog's start, over a wiped partition.
    Full(FullReason),
}

/// Why a partition is restored from the changelog's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullReason {
    /// Nothing local (a new owner, a new or lost disk).
    NoLocalState,
    /// When the local state was last in sync is not known: the last process
    /// on it did not stop cleanly.
    UnknownAge,
    /// Last in sync longer ago than the changelog's tombstones are kept.
    Stale { age: Duration, max_age: Duration },
    /// The changelog does not hold the local offset (recreated, or its start
    /// moved past it).
    OutOfRange,
    /// The local state holds a batch the changelog does not show committed
    /// at `offset`: a commit the broker acknowledged and then lost (aborted
    /// since), or one it cannot tell yet (a transaction still open below it).
    Unconfirmed { offset: i64, settled: bool },
}

impl FullReason {
    /// A short machine-readable name (logs).
    pub fn label(self) -> &'static str {
        match self {
            FullReason::NoLocalState => "no_local_state",
            FullReason::UnknownAge => "unknown_age",
            FullReason::Stale { .. } => "stale",
            FullReason::OutOfRange => "out_of_range",
            FullReason::Unconfirmed { settled: true, .. } => "batch_not_on_changelog",
            FullReason::Unconfirmed { settled: false, .. } => "batch_not_settled",
        }
    }
}

fn push_workflow(buf: &mut Vec<u8>, workflow_id: &str) {
    // Length-prefixed so that one workflow id is never a prefix of another's keys.
    buf.extend_from_slice(&(workflow_id.len() as u16).to_be_bytes());
    buf.extend_from_slice(workflow_id.as_bytes());
}

fn workflow_key(partition: i32, workflow_id: &str) -> Vec<u8> {
    let mut k = partition.to_be_bytes().to_vec();
    push_workflow(&mut k, workflow_id);
    k
}

/// `partition | len(workflow) | workflow | step_index | attempt | tool`, ordered so a
/// workflow's steps sort together by index.
fn step_key_bytes(partition: i32, step: &StepKey) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + 2 + step.workflow_id.len() + 16 + step.tool.len());
    k.extend_from_slice(&partition.to_be_bytes());
    push_workflow(&mut k, &step.workflow_id);
    k.extend_from_slice(&step.step_index.to_be_bytes());
    k.extend_from_slice(&step.attempt.to_be_bytes());
    k.extend_from_slice(step.tool.as_bytes());
    k
}

fn decode_step_key(k: &[u8]) -> Option<StepKey> {
    let len = u16::from_be_bytes(k.get(4..6)?.try_into().ok()?) as usize;
    let wf = std::str::from_utf8(k.get(6..6 + len)?).ok()?;
    let rest = k.get(6 + len..)?;
    let step_index = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    let attempt = u64::from_be_bytes(rest.get(8..16)?.try_into().ok()?);
    let tool = std::str::from_utf8(rest.get(16..)?).ok()?;
    Some(StepKey {
        workflow_id: wf.to_owned(),
        step_index,
        tool: tool.to_owned(),
        attempt,
    })
}

fn expiry_key(step_key: &[u8], at_ms: i64) -> Vec<u8> {
    let mut k = step_key[..4].to_vec();
    k.extend_from_slice(&at_ms.max(0).to_be_bytes());
    k.extend_from_slice(step_key);
    k
}

#[cfg(test)]
mod tests;
