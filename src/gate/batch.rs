//! The open batch: what the gate gathers while the batch before it commits —
//! its state writes, what the core decided for it, input offsets and
//! outcomes.

use super::{Input, Out};
use crate::executor::Finished;
use crate::state::Batch;
use rdkafka::error::KafkaError;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What one batch has gathered.
pub(super) struct OpenBatch {
    /// Its state writes, read through to the batch committing below it.
    pub(super) batch: Batch,
    /// What the core decided that goes with it: records for its transaction,
    /// calls to start once it has committed.
    pub(super) outs: Vec<Out>,
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
    /// Answers sent at once, outside the transaction (repeats of committed
    /// outcomes): the batch commits their intents' offsets only once they
    /// are acknowledged.
    pub(super) sent_at_once: Vec<JoinHandle<Result<(), KafkaError>>>,
    /// When it opened (the one before it was sent): under load it fills
    /// until `gate.busy_batch_age` from here.
    pub(super) opened: Instant,
    /// Calls started at once while it was open (a keyed step's, a fast
    /// path's).
    pub(super) started_at_once: usize,
    /// The commit before it returned with an eighth of `max_batch` inputs and
    /// outcomes or more already in it: they arrive faster than one commit
    /// takes them.
    pub(super) busy: bool,
}

impl OpenBatch {
    pub(super) fn on_top_of(below: Option<Arc<Batch>>) -> OpenBatch {
        OpenBatch {
            batch: Batch::on_top_of(below),
            outs: Vec::new(),
            inputs: 0,
            intents_next: BTreeMap::new(),
            others_next: BTreeMap::new(),
            outcomes: Vec::new(),
            orphans: Vec::new(),
            first_input: None,
            sent_at_once: Vec::new(),
            opened: Instant::now(),
            busy: false,
            started_at_once: 0,
        }
    }

    /// An input decided in it: its offset is committed with it.
    pub(super) fn took(&mut self, input: &Input, intents: &str) {
        if input.topic == intents {
            self.intents_next.insert(input.partition, input.offset + 1);
        } else {
            self.others_next
                .insert((input.topic.clone(), input.partition), input.offset + 1);
        }
        self.inputs += 1;
        if self.first_input.is_none() {
            self.first_input = Some((input.topic.clone(), input.partition, input.offset));
        }
    }

    /// The commit before it returned: under load it fills before it closes.
    /// Outcomes count too: behind a full invoker, whose reading is held, a
    /// batch gathers only outcomes, and the next inputs can ride with them.
    pub(super) fn previous_committed(&mut self, max_batch: usize) {
        self.busy = self.inputs + self.outcomes.len() >= (max_batch / 8).max(2);
    }

    /// Until when it stays open to fill (`gate.busy_batch_age`): while it is
    /// busy and holds fewer than `max_batch` inputs.
    pub(super) fn filling(&self, max_batch: usize, age: Duration) -> Option<Instant> {
        let until = self.opened + age;
        (self.busy && self.inputs < max_batch && until > Instant::now()).then_some(until)
    }

    /// Whether all it holds is intents whose calls were started at once (a
    /// keyed step's, a fast path's): it would commit no record and no
    /// answer, and no offset past those calls, only the mark that they were
    /// read. Closing it while they run would cost a transaction now and
    /// their outcomes another.
    pub(super) fn only_calls_started(&self) -> bool {
        self.started_at_once > 0
            && self.sent_at_once.is_empty()
            && self.others_next.is_empty()
            && self.writes_nothing()
    }

    /// Whether all it would commit is input offsets, its answers having gone
    /// out at once: nobody waits on that commit, so it closes at the next
    /// tick rather than at once — one transaction per tick for a run of
    /// repeats, not one per repeat.
    pub(super) fn answered_at_once_only(&self) -> bool {
        !self.sent_at_once.is_empty() && self.writes_nothing()
    }

    /// No state write, outcome, hand-over or record to publish: its
    /// transaction would carry input offsets alone.
    fn writes_nothing(&self) -> bool {
        self.batch.is_empty()
            && self.outcomes.is_empty()
            && self.orphans.is_empty()
            && self.outs.is_empty()
    }

    /// Nothing read, written, decided or settled in it: nothing to commit.
    pub(super) fn is_empty(&self) -> bool {
        self.inputs == 0
            && self.batch.is_empty()
            && self.outcomes.is_empty()
            && self.outs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished() -> Finished {
        use crate::contract::{Outcome, Progress, ProgressEvent, StepKey};
        Finished {
            partition: 0,
            progress: Progress {
                step: StepKey {
                    workflow_id: "w".into(),
                    step_index: 0,
                    tool: "t".into(),
                    attempt: 0,
                },
                dispatch: 1,
                fast_ref: None,
                at_ms: 0,
                token: None,
                event: ProgressEvent::Finished {
                    outcome: Outcome::Ok {
                        output: serde_json::Value::Null,
                    },
                },
            },
            took: Duration::ZERO,
        }
    }

    fn with_inputs(n: usize) -> OpenBatch {
        let mut p = OpenBatch::on_top_of(None);
        p.inputs = n;
        p
    }

    /// Under a light load a batch closes as soon as the commit before it
    /// returns: fewer than an eighth of `max_batch` arrived during it.
    #[test]
    fn a_batch_fills_only_when_the_last_commit_left_it_busy() {
        let age = Duration::from_millis(100);
        let mut light = with_inputs(249);
        light.previous_committed(2000);
        assert_eq!(light.filling(2000, age), None);
        // Inputs taken after the commit returned do not make it busy.
        light.inputs = 1999;
        assert_eq!(light.filling(2000, age), None);

        let mut busy = with_inputs(250);
        busy.previous_committed(2000);
        assert_eq!(busy.filling(2000, age), Some(busy.opened + age));
        assert_eq!(busy.filling(2000, Duration::ZERO), None, "0s: never");

        // Behind a full invoker a batch gathers outcomes, not inputs: busy too.
        let mut outcomes_only = with_inputs(0);
        outcomes_only.outcomes = (0..250).map(|_| finished()).collect();
        outcomes_only.previous_committed(2000);
        assert!(outcomes_only.filling(2000, age).is_some());
    }

    /// A busy batch fills until it holds `max_batch` inputs or is
    /// `gate.busy_batch_age` old, whichever comes first.
    #[test]
    fn a_busy_batch_fills_until_full_or_old() {
        let age = Duration::from_millis(100);
        let mut p = with_inputs(900);
        p.previous_committed(2000);
        assert!(p.filling(2000, age).is_some());
        p.inputs = 2000;
        assert_eq!(p.filling(2000, age), None, "full");
        p.inputs = 1500;
        p.opened = Instant::now() - Duration::from_millis(90);
        assert!(p.filling(2000, age).is_some());
        p.opened = Instant::now() - age;
        assert_eq!(p.filling(2000, age), None, "old enough");
        // A gate taking one input a batch (after a refused record) never waits.
        let mut careful = with_inputs(1);
        careful.previous_committed(1);
        assert_eq!(careful.filling(1, age), None);
    }
}
