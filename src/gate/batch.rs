//! What a batch gathers while the one before it commits: its state writes,
//! input offsets and outcomes.

use super::commit::InFlight;
use crate::executor::Finished;
use crate::state::Batch;
use rdkafka::error::KafkaError;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// What one batch has gathered.
pub(super) struct Pending {
    pub(super) batch: Batch,
    pub(super) inputs: usize,
    /// Per intents partition, the next offset after the last intent consumed.
    pub(super) intents_next: BTreeMap<i32, i64>,
    /// Next offsets of the other inputs (progress, commands).
    pub(super) others_next: BTreeMap<(String, i32), i64>,
    /// Outcomes decided in this batch (carried to the next session if it fails).
    pub(super) outcomes: Vec<Finished>,
    /// Outcomes of partitions owned elsewhere, handed over through `progress`.
    pub(super) orphans: Vec<Finished>,
    /// Its first input (topic, partition, offset): the one set aside if its
    /// records keep being refused.
    pub(super) first_input: Option<(String, i32, i64)>,
    /// Answers sent at once, outside the transaction
    /// (`gate.answer_repeats_at_once`): the batch commits their intents'
    /// offsets only once they are acknowledged.
    pub(super) sent_at_once: Vec<JoinHandle<Result<(), KafkaError>>>,
}

impl Pending {
    pub(super) fn on_top_of(below: Option<Arc<Batch>>) -> Pending {
        Pending {
            batch: Batch::on_top_of(below),
            inputs: 0,
            intents_next: BTreeMap::new(),
            others_next: BTreeMap::new(),
            outcomes: Vec::new(),
            orphans: Vec::new(),
            first_input: None,
            sent_at_once: Vec::new(),
        }
    }

    /// Whether all it would commit is input offsets, its answers having gone
    /// out at once (`gate.answer_repeats_at_once`): nobody waits on that
    /// commit, so it closes at the next tick rather than at once — one
    /// transaction per tick for a run of repeats, not one per repeat.
    pub(super) fn answered_at_once_only(&self, core: &super::GateCore) -> bool {
        !self.sent_at_once.is_empty()
            && self.batch.is_empty()
            && self.outcomes.is_empty()
            && self.orphans.is_empty()
            && !core.has_outs()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.inputs == 0 && self.batch.is_empty() && self.outcomes.is_empty()
    }
}

/// The batch being gathered and the one committing.
pub(super) struct Batches {
    pub(super) pending: Pending,
    pub(super) in_flight: Option<InFlight>,
}
