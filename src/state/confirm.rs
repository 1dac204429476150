//! The batches a local state holds that the changelog may not: what a
//! restart checks instead of restoring from the start (docs/design.md
//! "Restart after a crash").
//!
//! The gate applies a batch once the broker acknowledged its transaction. A
//! broker killed hard can then lose the commit marker of its producer's last
//! transaction, which the next session aborts (`gate::lost`): the local
//! state would hold a batch the changelog never will. So every applied batch
//! leaves, per partition it wrote, its last changelog record's offset and a
//! digest of that record (a [`Tail`], in `meta`, in the same RocksDB write as
//! the batch). A tail is dropped when the same producer's next transaction
//! is applied (a producer's earlier transaction is complete before its next
//! one begins: only its last can lose its marker, as `gate::lost` assumes),
//! or when a reader of the changelog has confirmed it. Whoever next reads the
//! partition's changelog (a restore, a standby) starts at its oldest tail and
//! confirms each one: the record a read_committed reader sees at that offset
//! has that digest. A tail the reader passes without seeing it, or sees with
//! another digest, was aborted (or lost): the partition is restored from the
//! changelog's start.

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// A committed batch's last changelog record in one partition: where it
/// landed and a digest of its key and value as they landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tail {
    pub offset: i64,
    pub digest: u64,
}

impl Tail {
    /// The tail of a record that landed at `offset` with this key and value.
    pub fn of(offset: i64, key: Option<&[u8]>, value: Option<&[u8]>) -> Tail {
        Tail {
            offset,
            digest: digest(key, value),
        }
    }
}

/// A digest of a changelog record: key and value, each length-prefixed (a
/// tombstone differs from an empty value).
pub fn digest(key: Option<&[u8]>, value: Option<&[u8]>) -> u64 {
    let mut h = Sha256::new();
    for part in [key, value] {
        match part {
            Some(b) => {
                h.update([1]);
                h.update((b.len() as u64).to_be_bytes());
                h.update(b);
            }
            None => h.update([0]),
        }
    }
    let d = h.finalize();
    u64::from_be_bytes(d[..8].try_into().expect("a SHA-256 digest has 32 bytes"))
}

/// Which transactional producer committed a batch: one of a session's
/// producers (`slot`), in a session numbered uniquely within the process.
/// Another session's producers are new ones (a new epoch): their
/// predecessors' last transactions are not settled by theirs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Committer {
    pub session: u64,
    pub slot: usize,
}

/// A committed batch, as [`StateStore::apply`](super::StateStore::apply)
/// records it beside its writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Landing {
    pub committer: Committer,
    /// Per partition the batch wrote, its last changelog record there.
    pub tails: BTreeMap<i32, Tail>,
}

/// The tails of the current session's producers' last applied batches, kept
/// in memory so the next batch of the same producer drops them.
#[derive(Debug, Default)]
pub(super) struct Live {
    session: Option<u64>,
    by_slot: HashMap<usize, Vec<(i32, i64)>>,
}

impl Live {
    /// Record `landing`'s tails as its producer's last; returns the tails its
    /// producer's previous batch left, now settled.
    pub(super) fn replace(&mut self, landing: &Landing) -> Vec<(i32, i64)> {
        if self.session != Some(landing.committer.session) {
            // A new session's producers: the last transactions of the old
            // ones stay unconfirmed until a reader confirms them.
            self.session = Some(landing.committer.session);
            self.by_slot.clear();
        }
        let now: Vec<(i32, i64)> = landing.tails.iter().map(|(&p, t)| (p, t.offset)).collect();
        self.by_slot
            .insert(landing.committer.slot, now)
            .unwrap_or_default()
    }
}

/// What reading a partition's changelog showed of its unconfirmed tails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every tail was seen, with its digest.
    Confirmed,
    /// A tail is not what a read_committed reader sees at its offset: its
    /// batch was aborted (or the log lost it).
    Refuted { offset: i64 },
    /// The read stopped before a tail's offset (a transaction still open
    /// below it): not known yet.
    Unknown { offset: i64 },
}

/// Confirms a partition's unconfirmed tails against the records a
/// read_committed reader returns, in offset order.
#[derive(Debug, Clone, Default)]
pub struct Confirming {
    /// Tails not yet seen: offset → digest.
    want: BTreeMap<i64, u64>,
    refuted: Option<i64>,
}

impl Confirming {
    pub fn new(tails: &[Tail]) -> Confirming {
        Confirming {
            want: tails.iter().map(|t| (t.offset, t.digest)).collect(),
            refuted: None,
        }
    }

    /// Where a reader that resumes at `next` must start to see every tail.
    pub fn start(&self, next: i64) -> i64 {
        self.want.keys().next().map_or(next, |&o| o.min(next))
    }

    /// Whether any tail is still to be seen.
    pub fn pending(&self) -> bool {
        !self.want.is_empty() && self.refuted.is_none()
    }

    /// A record the reader returned.
    pub fn record(&mut self, offset: i64, key: Option<&[u8]>, value: Option<&[u8]>) {
        if self.refuted.is_some() {
            return;
        }
        // Records are returned in offset order: a tail below this one that
        // was not returned is not visible.
        if let Some((&o, _)) = self.want.first_key_value()
            && o < offset
        {
            self.refuted = Some(o);
            return;
        }
        if let Some(d) = self.want.remove(&offset)
            && d != digest(key, value)
        {
            self.refuted = Some(offset);
        }
    }

    /// The verdict once the reader stands at `position` (every offset below
    /// it read: records returned, or markers and aborted records skipped).
    pub fn verdict(&self, position: i64) -> Verdict {
        if let Some(offset) = self.refuted {
            return Verdict::Refuted { offset };
        }
        match self.want.first_key_value() {
            None => Verdict::Confirmed,
            Some((&offset, _)) if offset < position => Verdict::Refuted { offset },
            Some((&offset, _)) => Verdict::Unknown { offset },
        }
    }
}
