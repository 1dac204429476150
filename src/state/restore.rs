//! Restore: a partition's local state brought up to its changelog's end, and
//! a whole state rebuilt from the changelog (`stepgate state rebuild`). The
//! changelog is the source of truth; RocksDB reflects it up to an offset kept
//! per partition (`meta`), from which a restore resumes — only while the state
//! is known contiguous with the changelog ([`StateStore::resume_point`]).

use super::{Confirming, FullReason, Resume, StateError, StateStore, Verdict};
use crate::config::KafkaConfig;
use crate::kafka;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;
use tracing::warn;

#[derive(Debug, Error)]
pub enum RestoreError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("state")]
    State(#[from] StateError),
    #[error("restoring partition {partition} from the changelog did not finish within {limit:?}")]
    Timeout { partition: i32, limit: Duration },
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

/// Bring a partition's local state up to its changelog's end (read_committed:
/// only committed batches), from the offset the state last reflected — or
/// from the start, over a wiped partition, when that is unknown, too old to
/// be contiguous with the changelog, not in the changelog, or when the state
/// holds a batch the changelog does not (see [`StateStore::resume_point`]
/// and [`super::confirm`]). Blocking. `applied` is kept at the records
/// applied so far, for a caller watching a long restore.
pub fn restore_partition(
    cfg: &KafkaConfig,
    store: &StateStore,
    p: i32,
    trust: &Trust,
    applied: &AtomicUsize,
) -> Result<Restored, RestoreError> {
    let group = format!("{}-restore", cfg.gate_group);
    let deadline = Instant::now() + RESTORE_LIMIT;
    let now_ms = chrono::Utc::now().timestamp_millis();
    let mut plan = match store.resume_point(p, now_ms, trust)? {
        Resume::From { next, check } => Plan::Resume {
            next,
            confirming: Confirming::new(&check),
            tails: check.len(),
        },
        Resume::Full(why) => {
            if why != FullReason::NoLocalState {
                warn_full(store, p, why)?;
            }
            Plan::Full(why)
        }
    };
    loop {
        let (from, reason) = match &plan {
            Plan::Resume { next, .. } => (Some(*next), None),
            Plan::Full(why) => (None, Some(*why)),
        };
        let full = from.is_none();
        if full {
            store.wipe_partition(p)?;
        }
        applied.store(0, Ordering::Relaxed);
        // Resuming, a position past the changelog's end means the changelog
        // was recreated: what we hold is from another topic.
        let consumer = match from {
            Some(_) => kafka::resume_consumer(cfg, &group)?,
            None => kafka::read_to_end_consumer(cfg, &group)?,
        };
        // From the start: at the log's first offset, asked for explicitly (a
        // logical "beginning" cost about a second per partition here), and
        // not read at all when the log holds nothing, not even an open
        // transaction's records. Resuming: from the oldest tail to confirm.
        let start = match &plan {
            Plan::Resume {
                next, confirming, ..
            } => confirming.start(*next),
            Plan::Full(_) => {
                let (low, high) =
                    consumer.fetch_watermarks(&cfg.topics.changelog, p, Duration::from_secs(30))?;
                if low >= high {
                    store.finish_restore(p, Some(high.max(0)))?;
                    return Ok(Restored {
                        records: 0,
                        full,
                        reason,
                        confirmed: 0,
                    });
                }
                low
            }
        };
        let apply_from = from.unwrap_or(start);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&cfg.topics.changelog, p, Offset::Offset(start))?;
        consumer.assign(&tpl)?;
        drop(tpl);
        let mut buf = Vec::with_capacity(10_000);
        let mut n = 0;
        let mut next = apply_from;
        let end = kafka::read_to_end(&consumer, BTreeSet::from([p]), Some(deadline), |m| {
            if let Plan::Resume { confirming, .. } = &mut plan {
                confirming.record(m.offset(), m.key(), m.payload());
            }
            // Below the local offset: read only to confirm the tails.
            if m.offset() < apply_from {
                return Ok(());
            }
            next = next.max(m.offset() + 1);
            if let Some(k) = m.key() {
                buf.push((k.to_vec(), m.payload().map(<[u8]>::to_vec)));
            }
            if buf.len() >= 10_000 {
                n += store.apply_changelog(&buf)?;
                applied.store(n, Ordering::Relaxed);
                buf.clear();
            }
            Ok::<_, StateError>(())
        })?;
        let position = kafka::position_of(&consumer, &cfg.topics.changelog, p);
        drop(consumer);
        match end {
            kafka::ReadEnd::Reached => {
                if let Plan::Resume {
                    confirming, tails, ..
                } = &plan
                {
                    let why = match confirming.verdict(position.unwrap_or(i64::MIN)) {
                        Verdict::Confirmed => None,
                        Verdict::Refuted { offset } => Some(FullReason::Unconfirmed {
                            offset,
                            settled: true,
                        }),
                        Verdict::Unknown { offset } => Some(FullReason::Unconfirmed {
                            offset,
                            settled: false,
                        }),
                    };
                    if let Some(why) = why {
                        // What was applied above the local offset is
                        // committed, but the state under it is not: start over.
                        warn_full(store, p, why)?;
                        plan = Plan::Full(why);
                        continue;
                    }
                    let confirmed = *tails;
                    n += store.apply_changelog(&buf)?;
                    applied.store(n, Ordering::Relaxed);
                    store.finish_restore(p, Some(next))?;
                    return Ok(Restored {
                        records: n,
                        full,
                        reason,
                        confirmed,
                    });
                }
                n += store.apply_changelog(&buf)?;
                applied.store(n, Ordering::Relaxed);
                store.finish_restore(p, Some(next))?;
                return Ok(Restored {
                    records: n,
                    full,
                    reason,
                    confirmed: 0,
                });
            }
            kafka::ReadEnd::TimedOut => {
                return Err(RestoreError::Timeout {
                    partition: p,
                    limit: RESTORE_LIMIT,
                });
            }
            // Only a resume reads with an out-of-range error: once from the
            // start, the loop ends.
            kafka::ReadEnd::OutOfRange => {
                warn!(
                    partition = p,
                    local = ?from,
                    "the changelog does not hold the offset the local state reflects (recreated?): restoring from its start"
                );
                plan = Plan::Full(FullReason::OutOfRange);
            }
        }
    }
}

/// How [`restore_partition`] reads.
enum Plan {
    /// From the local offset `next`, confirming the tails first.
    Resume {
        next: i64,
        confirming: Confirming,
        tails: usize,
    },
    /// From the start, over a wiped partition.
    Full(FullReason),
}

fn warn_full(store: &StateStore, p: i32, why: FullReason) -> Result<(), StateError> {
    match why {
        FullReason::Unconfirmed { offset, settled } => warn!(
            partition = p,
            reason = why.label(),
            offset,
            settled,
            "the local state of this partition holds a batch the changelog does not show committed (a commit the broker acknowledged and then lost, or one still unsettled): restoring it from the changelog's start"
        ),
        _ => warn!(
            partition = p,
            reason = why.label(),
            detail = ?why,
            local = ?store.changelog_next(p)?,
            "the local state of this partition is not known to be contiguous with its changelog: restoring it from the changelog's start"
        ),
    }
    Ok(())
}

/// What [`restore_partition`] did.
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
    let mut records = 0;
    for p in 0..partitions as i32 {
        // A new directory: nothing local to trust or not.
        let n = restore_partition(
            cfg,
            &store,
            p,
            &Trust::from_delete_retention(None),
            &AtomicUsize::new(0),
        )?
        .records;
        records += n;
        progress(p, partitions, n);
    }
    Ok(Rebuilt {
        path: path.to_owned(),
        partitions,
        records,
    })
}
