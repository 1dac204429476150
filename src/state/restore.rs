//! Restore: a partition's local state brought up to its changelog's end, and
//! a whole state rebuilt from the changelog (`stepgate state rebuild`). The
//! changelog is the source of truth; RocksDB reflects it up to an offset kept
//! per partition (`meta`), from which a restore resumes — only while the state
//! is known contiguous with the changelog ([`StateStore::resume_point`]).

use super::{FollowMode, Follower, FullReason, StateError, StateStore};
use crate::config::KafkaConfig;
use crate::kafka;
use rdkafka::error::KafkaError;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RestoreError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("state")]
    State(#[from] StateError),
    #[error("restoring partition {partition} from the changelog did not finish within {limit:?}")]
    Timeout { partition: i32, limit: Duration },
    #[error("a restore's reader thread panicked")]
    Panicked,
}

/// How long a restore may take before the session gives up and retries.
const RESTORE_LIMIT: Duration = Duration::from_secs(600);

/// What a local state's age is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trust {
    /// A partition's local state last in sync with its changelog at least
    /// this long ago is not resumed from (see [`Trust::from_delete_retention`]).
    pub max_age: Duration,
}

impl Trust {
    /// Kafka's default `delete.retention.ms` (24 h), assumed when the
    /// changelog's cannot be read.
    pub const DEFAULT_DELETE_RETENTION: Duration = Duration::from_secs(24 * 3600);

    /// From the changelog topic's `delete.retention.ms` (None: unreadable,
    /// Kafka's default assumed), less a margin: a tenth of it (clock skew
    /// between the gate's host and the broker) and the longest a restore may
    /// read ([`RESTORE_LIMIT`]: a tombstone must still be there when the read
    /// reaches it). A retention under ~11 minutes leaves no local state
    /// trusted: every restore is full.
    pub fn from_delete_retention(delete_retention: Option<Duration>) -> Trust {
        let d = delete_retention.unwrap_or(Self::DEFAULT_DELETE_RETENTION);
        Trust {
            max_age: d.saturating_sub(d / 10).saturating_sub(RESTORE_LIMIT),
        }
    }
}

/// Records applied so far by a running restore, per partition: for a caller
/// watching a long one.
#[derive(Debug, Default)]
pub struct Applied(std::sync::Mutex<BTreeMap<i32, usize>>);

impl Applied {
    fn set(&self, p: i32, n: usize) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p, n);
    }

    /// Records applied to `p` so far.
    pub fn of(&self, p: i32) -> usize {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&p).copied().unwrap_or(0)
    }

    /// Records applied so far, every partition.
    pub fn total(&self) -> usize {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.values().sum()
    }
}

/// Most readers a restore runs at once (each a consumer and a thread that
/// applies what it reads).
const MAX_READERS: usize = 4;

/// Bring partitions' local state up to their changelog's end (read_committed:
/// only committed batches), each from the offset its state last reflected —
/// or from the start, over a wiped partition, when that is unknown, too old
/// to be contiguous with the changelog, not in the changelog, or when the
/// state holds a batch the changelog does not (see
/// [`StateStore::resume_point`] and [`super::confirm`]). The partitions are
/// read in parallel, by one reader per core (at most [`MAX_READERS`]), each
/// reading its share with one consumer. A wiped partition's records are
/// bulk loaded (`super::bulk`); a resumed one's go in without RocksDB's WAL.
/// Either is durable before the partition is marked restored. Blocking.
pub fn restore_partitions(
    cfg: &KafkaConfig,
    store: &StateStore,
    ps: &BTreeSet<i32>,
    trust: &Trust,
    applied: &Applied,
) -> Result<BTreeMap<i32, Restored>, RestoreError> {
    let readers = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, MAX_READERS)
        .min(ps.len().max(1));
    if readers <= 1 {
        return restore_with_one_reader(cfg, store, ps, trust, applied);
    }
    let mut shares = vec![BTreeSet::new(); readers];
    for (i, p) in ps.iter().enumerate() {
        shares[i % readers].insert(*p);
    }
    std::thread::scope(|scope| {
        let running: Vec<_> = shares
            .iter()
            .map(|share| {
                scope.spawn(move || restore_with_one_reader(cfg, store, share, trust, applied))
            })
            .collect();
        let mut done = BTreeMap::new();
        for r in running {
            done.extend(r.join().map_err(|_| RestoreError::Panicked)??);
        }
        Ok(done)
    })
}

fn restore_with_one_reader(
    cfg: &KafkaConfig,
    store: &StateStore,
    ps: &BTreeSet<i32>,
    trust: &Trust,
    applied: &Applied,
) -> Result<BTreeMap<i32, Restored>, RestoreError> {
    let group = format!("{}-restore", cfg.gate_group);
    let deadline = Instant::now() + RESTORE_LIMIT;
    let mut f = Follower::new(cfg, &group, FollowMode::Restore)?;
    for &p in ps {
        f.start(store, p, trust)?;
    }
    let mut done = BTreeMap::new();
    loop {
        let ready: Vec<i32> = f
            .partitions()
            .filter(|p| f.progress(*p).is_some_and(|g| g.caught_up))
            .collect();
        if !ready.is_empty() {
            f.finish(store, &ready)?;
            for p in ready {
                let g = f.progress(p).expect("a partition being read");
                f.stop(store, p)?;
                done.insert(
                    p,
                    Restored {
                        records: g.records,
                        full: g.full.is_some(),
                        reason: g.full,
                        confirmed: if g.full.is_some() { 0 } else { g.confirmed },
                    },
                );
            }
        }
        for p in f.partitions() {
            if let Some(g) = f.progress(p) {
                applied.set(p, g.records);
            }
        }
        for (p, r) in &done {
            applied.set(*p, r.records);
        }
        if done.len() == ps.len() {
            return Ok(done);
        }
        if Instant::now() > deadline {
            return Err(RestoreError::Timeout {
                partition: f.partitions().next().unwrap_or(-1),
                limit: RESTORE_LIMIT,
            });
        }
        f.poll(store, Duration::from_millis(500))?;
    }
}

/// What [`restore_partitions`] did for a partition.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    /// Changelog records applied.
    pub records: usize,
    /// Whether it started from the changelog's start (over a wiped partition).
    pub full: bool,
    /// Why it did (None when it resumed).
    pub reason: Option<FullReason>,
    /// Tails of applied batches confirmed on the changelog before resuming.
    pub confirmed: usize,
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
    #[error("restore")]
    Restore(#[from] RestoreError),
    #[error("state")]
    State(#[from] StateError),
}

/// Rebuild a whole gate state from the changelog into a new directory, each
/// partition marked with the changelog offset it reflects, so a gate started on
/// it only reads what was written since. Blocking; `progress` is told
/// (partition, partitions, records) as each partition finishes.
pub fn rebuild_state(
    cfg: &KafkaConfig,
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
    // A new directory: nothing local to trust or not. All at once, as a gate
    // restores what it is assigned.
    let all = (0..partitions as i32).collect();
    let done = restore_partitions(
        cfg,
        &store,
        &all,
        &Trust::from_delete_retention(None),
        &Applied::default(),
    )?;
    let mut records = 0;
    for (p, r) in done {
        records += r.records;
        progress(p, partitions, r.records);
    }
    Ok(Rebuilt {
        path: path.to_owned(),
        partitions,
        records,
    })
}
