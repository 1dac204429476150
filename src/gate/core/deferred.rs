//! Steps of re-runnable tools recorded once, settled (docs/design.md "One
//! record for a re-runnable step"): while the call runs, the step's record
//! lives here, in memory, and the intent's offset is the durable intent — the
//! partition's committed offset is held at it until the settled record, the
//! answers and the offset commit in one transaction. A crash or a partition
//! moving re-reads the intent and runs the step again, with the same key.

use crate::contract::StepKey;
use crate::state::{Phase, StepRecord};
use std::collections::{BTreeMap, HashMap};

/// The run a step re-created from a re-read intent assumes before its own: it
/// may have been invoked (by a process that then crashed, or lost the
/// partition) and was never heard from. Its own run is numbered above it, so
/// a "not performed" of that run alone is never taken as the whole truth
/// (`unless_earlier_may_have_run`).
pub(super) const RUN_BEFORE_REREAD: u32 = 1;

/// What [`Deferred::update`] did with a step's record.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Update {
    /// Still running: kept in memory, nothing to write.
    Kept,
    /// It left: the caller writes it, as the step's first record. A step is
    /// deferred only when its intent found no record, and every write of it
    /// since ends its deferral (here, or `remove`), so none exists.
    Left,
    /// Not a deferred step: the caller writes it as any other.
    NotDeferred,
}

/// Records of deferred steps by partition and step (nested, so that a
/// lookup, made for every input, borrows the step key instead of cloning it),
/// and by intent offset (the lowest holds the partition's committed offset
/// back).
#[derive(Debug, Default)]
pub(super) struct Deferred {
    records: HashMap<i32, HashMap<StepKey, (StepRecord, i64)>>,
    by_offset: BTreeMap<(i32, i64), StepKey>,
}

impl Deferred {
    pub(super) fn get(&self, p: i32, step: &StepKey) -> Option<&StepRecord> {
        self.records.get(&p)?.get(step).map(|(r, _)| r)
    }

    pub(super) fn contains(&self, p: i32, step: &StepKey) -> bool {
        self.get(p, step).is_some()
    }

    /// A new deferred step, from the intent at `offset`.
    pub(super) fn insert(&mut self, p: i32, record: StepRecord, offset: i64) {
        self.by_offset.insert((p, offset), record.step.clone());
        self.records
            .entry(p)
            .or_default()
            .insert(record.step.clone(), (record, offset));
    }

    /// Keep `record` here while its call runs; otherwise (settled, or in any
    /// other phase) it leaves, and the caller writes it durably.
    pub(super) fn update(&mut self, p: i32, record: &StepRecord) -> Update {
        match self
            .records
            .get_mut(&p)
            .and_then(|steps| steps.get_mut(&record.step))
        {
            Some((kept, _)) if record.phase == Phase::Started => {
                *kept = record.clone();
                Update::Kept
            }
            Some(_) => {
                self.remove(p, &record.step);
                Update::Left
            }
            None => Update::NotDeferred,
        }
    }

    pub(super) fn remove(&mut self, p: i32, step: &StepKey) -> Option<StepRecord> {
        let (record, offset) = self.records.get_mut(&p)?.remove(step)?;
        self.by_offset.remove(&(p, offset));
        Some(record)
    }

    /// The lowest intent offset of `p` whose step is deferred.
    pub(super) fn first_offset(&self, p: i32) -> Option<i64> {
        self.by_offset
            .range((p, i64::MIN)..=(p, i64::MAX))
            .next()
            .map(|((_, o), _)| *o)
    }

    /// The deferred steps of one workflow in `p`.
    pub(super) fn of_workflow(&self, p: i32, workflow_id: &str) -> Vec<StepKey> {
        self.records
            .get(&p)
            .into_iter()
            .flat_map(|steps| steps.keys())
            .filter(|s| s.workflow_id == workflow_id)
            .cloned()
            .collect()
    }

    pub(super) fn drop_partition(&mut self, p: i32) {
        self.records.remove(&p);
        self.by_offset.retain(|(q, _), _| *q != p);
    }

    pub(super) fn clear(&mut self) {
        self.records.clear();
        self.by_offset.clear();
    }

    pub(super) fn len(&self) -> usize {
        self.records.values().map(HashMap::len).sum()
    }
}
