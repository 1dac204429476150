//! Which partitions this gate owns: assignment and revocation, each owned
//! partition's offsets and its applied mark, restoring a partition's state
//! before its first input, and the layout checks.

use super::lost::InputOffset;
use super::mark::AppliedMark;
use super::{Env, GateError, gauges};
use crate::kafka::{self, TxnConsumer};
use crate::state::Trust;
use rdkafka::consumer::Consumer;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How long to go on asking for a partition's committed offset before the
/// session is started over.
const COMMITTED_PATIENCE: Duration = Duration::from_secs(120);

/// How long asking where a partition's `progress` ends may take at its
/// assignment (without an answer, the grace period alone holds its deadlines).
const WATERMARK_ASK: Duration = Duration::from_secs(5);

/// The partitions a session was assigned, and those it owns: restored and
/// loaded, each with its offsets and its applied mark.
#[derive(Default)]
pub(super) struct Ownership {
    owned: HashMap<i32, OwnedPartition>,
    assigned: BTreeSet<i32>,
    /// Whether this session's consumer has been given its partitions yet: only
    /// then can an outcome's partition be known to belong elsewhere.
    ever_assigned: bool,
    /// Per partition taken over, where its `progress` ended then: its
    /// deadlines wait until the consumer has read that far.
    progress_ends: HashMap<i32, i64>,
    /// How old a partition's local state may be and still be resumed from
    /// (from the changelog's `delete.retention.ms`, read once per session).
    trust: Option<Trust>,
}

/// An owned partition's intents offsets.
pub(super) struct OwnedPartition {
    /// The applied mark: the first intents offset not yet applied (consumed
    /// and decided). The one the core reads, and the one the group's
    /// committed offset carries ([`AppliedMark`]).
    pub(super) applied: i64,
    /// The intents offset last committed for this partition.
    pub(super) committed: i64,
    /// The next intents offset this session reads (it starts at the committed
    /// offset, and re-reads up to `applied` what it must decide again):
    /// nothing at or past it has been decided in this session, so the
    /// committed offset never passes it — memory knows nothing of an
    /// unsettled step or unanswered read there until it is read again.
    pub(super) read: i64,
}

impl OwnedPartition {
    /// A closing batch's (applied mark, committed offset) for this partition,
    /// given the next offset after the intents it consumed from it (if any)
    /// and the first intent memory holds unanswered. The committed offset
    /// stops at that intent, and never passes what this session has read:
    /// after a restart, the intents between the committed offset and the
    /// applied mark are read again, and an unsettled step among them is
    /// known only once read. (The next batch closes after this one lands;
    /// if this one fails, the session starts over, `read` at the committed
    /// offset.)
    pub(super) fn batch_offsets(
        &mut self,
        consumed: Option<i64>,
        first_unanswered: Option<i64>,
    ) -> (i64, i64) {
        let applied = consumed.map_or(self.applied, |n| n.max(self.applied));
        let next = consumed.unwrap_or(self.read);
        self.read = self.read.max(next);
        let commit = first_unanswered.map_or(next, |f| f.min(next));
        (applied, commit)
    }
}

/// A partition taken over: where the group stands in it, and its restore.
pub(super) struct Takeover {
    applied: i64,
    committed: i64,
    records: usize,
    took: Duration,
}

/// The intents offsets a closing batch commits.
#[derive(Default)]
pub(super) struct BatchOffsets {
    /// Per intents partition: (applied, committed) once the batch commits.
    pub offsets: BTreeMap<i32, (i64, i64)>,
    /// As the transaction sends them, the applied mark in their metadata.
    pub input_offsets: Vec<InputOffset>,
}

impl Ownership {
    pub(super) fn owns(&self, p: i32) -> bool {
        self.owned.contains_key(&p)
    }

    pub(super) fn is_assigned(&self, p: i32) -> bool {
        self.assigned.contains(&p)
    }

    pub(super) fn assigned(&self) -> &BTreeSet<i32> {
        &self.assigned
    }

    pub(super) fn ever_assigned(&self) -> bool {
        self.ever_assigned
    }

    /// The owned partitions.
    pub(super) fn partitions(&self) -> Vec<i32> {
        self.owned.keys().copied().collect()
    }

    /// A partition's applied mark (0 for one not owned: nothing decided).
    pub(super) fn applied(&self, p: i32) -> i64 {
        self.owned.get(&p).map_or(0, |o| o.applied)
    }

    /// Some partitions are assigned, and every one is owned.
    pub(super) fn ready(&self) -> bool {
        !self.assigned.is_empty() && self.assigned.iter().all(|p| self.owned.contains_key(p))
    }

    /// Whether `revoked` takes every partition assigned here.
    pub(super) fn all_within(&self, revoked: &BTreeSet<i32>) -> bool {
        self.assigned.is_subset(revoked)
    }

    /// Partitions assigned: each is owned once restored (`restore`, `take`).
    pub(super) fn assign(&mut self, env: Env<'_>, ps: &BTreeSet<i32>) {
        self.ever_assigned = true;
        self.assigned.extend(ps.iter().copied());
        env.invoker.ownership().add(ps.iter().copied());
    }

    /// Partitions revoked. Calls of theirs still waiting for a slot here are
    /// not invoked: they are handed to the new owner.
    pub(super) fn revoke(&mut self, env: Env<'_>, ps: &BTreeSet<i32>) {
        env.invoker.ownership().remove(ps.iter().copied());
        for p in ps {
            env.metrics.partition_released(*p);
            self.assigned.remove(p);
            self.owned.remove(p);
            self.progress_ends.remove(p);
        }
    }

    /// Before their first input: where the group stands in each partition
    /// of `ps` (its committed offset and applied mark), then their local
    /// states brought up to the changelog's end, together. The committed
    /// offsets come first: one is given only once the group's transaction
    /// holding it has ended, so the restore, read_committed, reads every
    /// batch that transaction wrote.
    pub(super) async fn restore(
        &mut self,
        env: Env<'_>,
        consumer: &Arc<TxnConsumer>,
        ps: &BTreeSet<i32>,
        intent_partitions: Option<i32>,
    ) -> Result<BTreeMap<i32, Takeover>, GateError> {
        let mut stands = BTreeMap::new();
        for &p in ps {
            env.metrics.partition_restoring(p);
            stands.insert(p, stand(env, consumer, p, intent_partitions).await?);
        }
        let trust = self.trust(env).await;
        let started = Instant::now();
        let restored = super::restore::restore_assigned(env, ps, trust).await?;
        let took = started.elapsed();
        if restored.values().any(|r| r.records > 0) {
            gauges::report_state_size(env.store, env.metrics);
        }
        Ok(stands
            .into_iter()
            .map(|(p, (applied, committed))| {
                let records = restored.get(&p).map_or(0, |r| r.records);
                (
                    p,
                    Takeover {
                        applied,
                        committed,
                        records,
                        took,
                    },
                )
            })
            .collect())
    }

    /// How old a partition's local state may be and still be resumed from.
    pub(super) async fn trust(&mut self, env: Env<'_>) -> Trust {
        if let Some(t) = self.trust {
            return t;
        }
        let d = kafka::changelog_delete_retention(&env.config.kafka).await;
        let t = Trust::from_delete_retention(d);
        info!(delete_retention = ?d, max_age = ?t.max_age, "a partition's local state is resumed from only if it was in sync with the changelog more recently than max_age");
        *self.trust.insert(t)
    }

    /// The partition, restored and loaded, owned from now on. Its deadlines
    /// wait until its `progress` is read up to where it ends now (outcomes
    /// handed over while it moved are known first): false. True when there
    /// is nothing to wait for — its `progress` is empty, or the broker did
    /// not say where it ends (only the grace period holds them then).
    pub(super) async fn take(
        &mut self,
        env: Env<'_>,
        consumer: &Arc<TxnConsumer>,
        p: i32,
        t: Takeover,
    ) -> bool {
        let (c, topic) = (consumer.clone(), env.config.kafka.topics.progress.clone());
        let end = kafka::blocking(move || c.fetch_watermarks(&topic, p, WATERMARK_ASK)).await;
        let progress_read = match end {
            Ok((_, high)) if high > 0 => {
                self.progress_ends.insert(p, high);
                false
            }
            Ok(_) => true,
            Err(e) => {
                warn!(partition = p, error = %e, "could not read where the partition's progress ends: its deadlines wait the grace period only");
                true
            }
        };
        self.owned.insert(
            p,
            OwnedPartition {
                applied: t.applied,
                committed: t.committed,
                read: t.committed,
            },
        );
        env.metrics.partition_ready(p, t.records, t.took);
        self.assigned.insert(p);
        env.invoker.ownership().add([p]);
        env.health
            .set_gate_ready(self.assigned.iter().all(|q| self.owned.contains_key(q)));
        progress_read
    }

    /// The partitions whose `progress` has been read up to where it ended at
    /// their assignment (the consumer's position counts control records,
    /// which a message offset would not): their deadlines may fire.
    pub(super) fn progress_caught_up(&mut self, consumer: &TxnConsumer, topic: &str) -> Vec<i32> {
        if self.progress_ends.is_empty() {
            return Vec::new();
        }
        let Ok(positions) = consumer.position() else {
            return Vec::new();
        };
        let mut read = Vec::new();
        self.progress_ends.retain(|&p, &mut end| {
            let at = positions
                .find_partition(topic, p)
                .and_then(|e| e.offset().to_raw())
                .unwrap_or(-1);
            if at >= end {
                read.push(p);
                return false;
            }
            true
        });
        drop(positions);
        read
    }

    /// A closing batch's intents offsets: every owned partition this batch
    /// consumed from (`consumed`: the next offset after its last intent) or
    /// writes for (`touched`: so a fenced member's transaction cannot
    /// commit), and any whose committed offset or mark moves now (a call
    /// answered: `first_unanswered` no longer holds it).
    pub(super) fn batch_offsets(
        &mut self,
        consumed: &BTreeMap<i32, i64>,
        touched: &BTreeSet<i32>,
        first_unanswered: impl Fn(i32) -> Option<i64>,
        partitions: Option<i32>,
        intents: &str,
    ) -> BatchOffsets {
        let mut out = BatchOffsets::default();
        for (p, o) in self.owned.iter_mut() {
            let (applied, commit) = o.batch_offsets(consumed.get(p).copied(), first_unanswered(*p));
            if commit == o.committed && applied == o.applied && !touched.contains(p) {
                continue;
            }
            out.offsets.insert(*p, (applied, commit));
            out.input_offsets.push(InputOffset {
                topic: intents.to_owned(),
                partition: *p,
                offset: commit,
                metadata: Some(AppliedMark::encode(applied, partitions)),
            });
        }
        out
    }

    /// A batch committed these (applied, committed) offsets.
    pub(super) fn committed(&mut self, offsets: &BTreeMap<i32, (i64, i64)>) {
        for (p, (applied, committed)) in offsets {
            if let Some(o) = self.owned.get_mut(p) {
                o.applied = *applied;
                o.committed = *committed;
            }
        }
    }
}

/// Where the group stands in partition `p`: (applied mark, committed
/// offset), once the group's committed offset is given.
async fn stand(
    env: Env<'_>,
    consumer: &Arc<TxnConsumer>,
    p: i32,
    intent_partitions: Option<i32>,
) -> Result<(i64, i64), GateError> {
    let topic = &env.config.kafka.topics.intents;
    let (committed, meta) =
        kafka::committed_offset(consumer, topic, p, COMMITTED_PATIENCE, |e, waited| {
            warn!(
                partition = p,
                error = %e,
                waited_s = waited.as_secs(),
                "the group's committed offset of this partition is not available yet: a transaction of the group is still open (the broker settling one after a restart; or, past the transaction timeout, one left hanging by another process — docs/guarantees.md \"Faults and bad input\": kafka-transactions.sh find-hanging): asking again"
            );
            env.health.beat();
        })
        .await?;
    let mark = AppliedMark::parse(&meta);
    // The partition count the group's offsets were committed with: a
    // workflow's partition is murmur2 % count, so another count moves
    // workflows away from their recorded steps.
    if let (Some(was), Some(now)) = (mark.partitions, intent_partitions)
        && was != now
    {
        return Err(layout_changed(topic, was, now));
    }
    let applied = mark.applied.map_or(committed, |a| a.max(committed));
    info!(
        partition = p,
        committed,
        changelog_from = ?env.store.changelog_next(p).ok().flatten(),
        "taking the partition over: restoring its state from the changelog"
    );
    Ok((applied, committed))
}

/// The topics' partition counts ([`kafka::layout_counts`]), as read now,
/// against the intents count the state was written with (`was`): a changed
/// layout, or one the start-up check refuses, stops the gate. The intents
/// count to go on with.
pub(super) fn check_layout(
    was: Option<i32>,
    t: &crate::config::TopicsConfig,
    n: &kafka::Layout,
) -> Result<i32, GateError> {
    let intents = n.intents as i32;
    if let Some(was) = was
        && was != intents
    {
        return Err(layout_changed(&t.intents, was, intents));
    }
    kafka::check_counts(t, n).map_err(|e| {
        GateError::Layout(format!(
            "{e} The running gate stops rather than answer in the wrong partition (docs/runbook.md \"Growing partitions\")."
        ))
    })?;
    Ok(intents)
}

fn layout_changed(intents: &str, was: i32, now: i32) -> GateError {
    GateError::Layout(format!(
        "`{intents}` has {now} partitions, but this deployment's state was written with {was}: a workflow lives in partition murmur2(workflow_id) % partitions, so workflows have moved away from their recorded steps, and a retry of a recorded step would run again. stepgate stops rather than deduplicate in the wrong partition. Never change the partition count in place: create a new topic set with the count you want and cut agents over to it (docs/runbook.md \"Growing partitions\"); to go back, restore the old count."
    ))
}

#[cfg(test)]
mod tests {
    use super::OwnedPartition;

    /// Restarted with the committed offset held at an unsettled step (5)
    /// and the applied mark past it (9): until the session has read that
    /// intent again, a batch that consumed nothing from the partition keeps
    /// the committed offset where it is. (Committing the mark, as the gate
    /// did, skipped the step for good: its call was never answered.)
    #[test]
    fn a_restarted_session_commits_no_further_than_it_has_read() {
        let mut o = OwnedPartition {
            applied: 9,
            committed: 5,
            read: 5,
        };
        assert_eq!(o.batch_offsets(None, None), (9, 5));
        // It reads the step again (5) and the rest: held at the step.
        assert_eq!(o.batch_offsets(Some(9), Some(5)), (9, 5));
        // Settled in a batch that read nothing more: past everything read.
        assert_eq!(o.batch_offsets(None, None), (9, 9));
        // New intents read past the mark.
        assert_eq!(o.batch_offsets(Some(12), None), (12, 12));
    }
}
