//! Which partitions this gate owns: assignment and revocation, restoring a
//! partition's state before its first input, and the layout checks.

use super::commit::Producers;
use super::session::Session;
use super::{GateCore, GateError, lost, now_ms};
use crate::kafka::{self, RebalanceEvent, TxnConsumer};
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// The offset-metadata tag carrying, per intents partition, the first offset
/// not yet applied: the committed offset may lag it (held at an unanswered
/// fast-path call), and intents re-read below it are not applied twice.
pub(super) const APPLIED_TAG: &str = "stepgate-applied:";

/// The committed offset's metadata: the applied mark and the intents topic's
/// partition count it was written with (`stepgate-applied:<n> partitions:<m>`).
pub(super) fn applied_metadata(applied: i64, partitions: Option<i32>) -> String {
    match partitions {
        Some(n) => format!("{APPLIED_TAG}{applied} partitions:{n}"),
        None => format!("{APPLIED_TAG}{applied}"),
    }
}

/// [`applied_metadata`] read back (either part may be missing: the partition
/// count is written once known, and another tool may commit the group's
/// offsets).
pub(super) fn parse_applied(meta: &str) -> (Option<i64>, Option<i32>) {
    let Some(rest) = meta.strip_prefix(APPLIED_TAG) else {
        return (None, None);
    };
    let mut parts = rest.split_whitespace();
    let applied = parts.next().and_then(|s| s.parse().ok());
    let partitions = parts
        .find_map(|p| p.strip_prefix("partitions:"))
        .and_then(|s| s.parse().ok());
    (applied, partitions)
}

/// The topics' partition counts ([`kafka::layout_counts`]), as read now,
/// against what the state was written with: a changed layout, or one the
/// start-up check refuses, stops the gate.
pub(super) fn check_layout(
    core: &mut GateCore,
    t: &crate::config::TopicsConfig,
    n: &kafka::Layout,
) -> Result<(), GateError> {
    let intents = n.intents as i32;
    if let Some(was) = core.intent_partitions()
        && was != intents
    {
        return Err(layout_changed(&t.intents, was, intents));
    }
    kafka::check_counts(t, n).map_err(|e| {
        GateError::Layout(format!(
            "{e} The running gate stops rather than answer in the wrong partition (docs/runbook.md \"Growing partitions\")."
        ))
    })?;
    core.set_intent_partitions(intents);
    Ok(())
}

/// [`kafka::layout_counts`] in a task (a broker outage must not hold the loop).
pub(super) fn read_layout(
    k: &crate::config::KafkaConfig,
) -> JoinHandle<Result<kafka::Layout, kafka::KafkaSetupError>> {
    let k = k.clone();
    tokio::task::spawn_blocking(move || kafka::layout_counts(&k))
}

pub(super) fn layout_changed(intents: &str, was: i32, now: i32) -> GateError {
    GateError::Layout(format!(
        "`{intents}` has {now} partitions, but this deployment's state was written with {was}: a workflow lives in partition murmur2(workflow_id) % partitions, so workflows have moved away from their recorded steps, and a retry of a recorded step would run again. stepgate stops rather than deduplicate in the wrong partition. Never change the partition count in place: create a new topic set with the count you want and cut agents over to it (docs/runbook.md \"Growing partitions\"); to go back, restore the old count."
    ))
}

/// Per-partition bookkeeping of an owned partition.
pub(super) struct Owned {
    /// First intents offset not yet applied (consumed and decided).
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

impl Owned {
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

/// One ask for a partition's committed offset, and how long to go on asking
/// before the session is started over.
pub(super) const COMMITTED_ASK: Duration = Duration::from_secs(10);

pub(super) const COMMITTED_PATIENCE: Duration = Duration::from_secs(120);

/// How long asking where a partition's `progress` ends may take at its
/// assignment (without an answer, the grace period alone holds its deadlines).
pub(super) const WATERMARK_ASK: Duration = Duration::from_secs(5);

impl Session<'_> {
    pub(super) async fn on_rebalance(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &Producers,
        ev: RebalanceEvent,
        batch_open: bool,
    ) -> Result<(), GateError> {
        match ev {
            RebalanceEvent::Assigned(parts) => {
                let ps: BTreeSet<i32> = parts.iter().map(|(_, p)| *p).collect();
                info!(partitions = ?ps, "partitions assigned");
                // Partitions added to `intents` trigger a rebalance: re-read
                // the count the partition check uses.
                let t = self.config.kafka.topics.clone();
                let counts = read_layout(&self.config.kafka).await;
                match &counts {
                    Ok(Ok(n)) => check_layout(core, &t, n)?,
                    Ok(Err(e)) => {
                        warn!(error = %e, "could not read the intents topic's partition count; keeping the last one")
                    }
                    Err(e) => warn!(error = %e, "partition count task failed"),
                }
                // Once per session, before the first committed-offset lookup:
                // end what a broker crash may have left hanging for our
                // transactional ids (see `kafka::end_hanging_transactions`).
                if !self.ever_assigned
                    && let (Ok(Ok(n)), Some(&p)) = (&counts, ps.iter().next())
                {
                    // The topics this gate writes: all but intents and commands.
                    let written: Vec<(String, i32)> = [
                        (&t.results, n.results),
                        (&t.dlq, n.dlq),
                        (&t.progress, n.progress),
                        (&t.changelog, n.changelog),
                        (&t.approvals, n.approvals),
                    ]
                    .into_iter()
                    .flat_map(|(name, n)| (0..n as i32).map(move |q| (name.clone(), q)))
                    .collect();
                    let started = Instant::now();
                    let limits = kafka::TxnLimits::of(&self.config.kafka);
                    let ends = producer.all.iter().map(|pr| {
                        kafka::end_hanging_transactions(
                            pr,
                            consumer,
                            &written,
                            (&t.intents, p),
                            limits,
                        )
                    });
                    let mut renew = false;
                    for r in futures::future::join_all(ends).await {
                        match r {
                            Ok(r) => renew |= r,
                            // Not fatal: if something did hang, the offset
                            // lookup below waits, and a new session tries again.
                            Err(e) => {
                                warn!(error = %e, "could not end hanging transactions of this gate's producers")
                            }
                        }
                    }
                    if renew {
                        return Err(GateError::SlowTransactionEnd);
                    }
                    info!(
                        partitions = written.len(),
                        ms = started.elapsed().as_millis() as u64,
                        "ended any transaction a broker crash left hanging for this gate's producers"
                    );
                    // Then what a broker may have lost of what it acknowledged.
                    lost::mend(
                        &self.config.kafka,
                        self.config.state.retention.0,
                        self.last_commits,
                        &producer.all[0],
                        consumer,
                        &ps,
                        self.metrics,
                    )
                    .await?;
                }
                self.ever_assigned = true;
                self.assigned.extend(ps.iter().copied());
                self.invoker.ownership().add(ps.iter().copied());
                // All at once; each is then loaded, resuming from there.
                let new: BTreeSet<i32> = ps
                    .iter()
                    .filter(|p| !self.owned.contains_key(p))
                    .copied()
                    .collect();
                super::restore::restore_assigned(
                    &self.config.kafka,
                    self.store,
                    &new,
                    self.health,
                    self.metrics,
                )
                .await?;
                for p in ps {
                    self.ensure_owned(core, consumer, p).await?;
                }
            }
            RebalanceEvent::Revoked(parts) => {
                let ps: BTreeSet<i32> = parts.iter().map(|(_, p)| *p).collect();
                info!(partitions = ?ps, "partitions revoked");
                if batch_open {
                    // The open batch may hold inputs of revoked partitions, or of
                    // re-assigned ones whose position already moved past them:
                    // drop it (nothing of it is durable yet) and re-read from the
                    // last commit with a fresh consumer.
                    return Err(GateError::Rebalanced);
                }
                // Calls of these partitions still waiting for a slot here are
                // not invoked: they are handed to the new owner.
                self.invoker.ownership().remove(ps.iter().copied());
                for p in ps {
                    self.metrics.partition_released(p);
                    self.assigned.remove(&p);
                    self.paused.remove(&p);
                    self.owned.remove(&p);
                    self.progress_ends.remove(&p);
                    core.drop_partition(p);
                }
            }
        }
        self.health.set_gate_ready(
            !self.assigned.is_empty() && self.assigned.iter().all(|p| self.owned.contains_key(p)),
        );
        Ok(())
    }

    /// Before a partition's first input: bring its local state up to the
    /// changelog's end, and load its pending deadlines.
    pub(super) async fn ensure_owned(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        p: i32,
    ) -> Result<(), GateError> {
        if self.owned.contains_key(&p) {
            return Ok(());
        }
        self.metrics.partition_restoring(p);
        // The group's committed offset (with the applied mark in its
        // metadata). A read_committed member's fetch waits while a transaction
        // of the group is unsettled, which after a broker restart can take a
        // while: asked again in place, the member keeps its place in the group
        // (a new session would rejoin, re-init its producers and ask again);
        // only a wait past COMMITTED_PATIENCE fails the session.
        let asking = Instant::now();
        let (committed, meta) = loop {
            let topics = self.config.kafka.topics.clone();
            let c = consumer.clone();
            let fetched = kafka::blocking(move || {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&topics.intents, p);
                let committed = c.committed_offsets(tpl, COMMITTED_ASK)?;
                let i = committed.find_partition(&topics.intents, p);
                // Nothing committed yet: from 0 — with auto.offset.reset=earliest
                // that also covers a log whose start moved. (Not a watermark query:
                // those were seen to time out for minutes after a broker restart.)
                let off = i
                    .as_ref()
                    .and_then(|e| e.offset().to_raw())
                    .filter(|o| *o >= 0)
                    .unwrap_or(0);
                let meta = i.map(|e| e.metadata().to_owned()).unwrap_or_default();
                drop(committed);
                Ok::<_, KafkaError>((off, meta))
            })
            .await;
            match fetched {
                Ok(v) => break v,
                Err(e)
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::OperationTimedOut)
                        && asking.elapsed() < COMMITTED_PATIENCE =>
                {
                    warn!(
                        partition = p,
                        error = %e,
                        waited_s = asking.elapsed().as_secs(),
                        "the group's committed offset of this partition is not available yet: a transaction of the group is still open (the broker settling one after a restart; or, past the transaction timeout, one left hanging by another process — docs/guarantees.md \"Faults and bad input\": kafka-transactions.sh find-hanging): asking again"
                    );
                    self.health.beat();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let (applied, written_with) = parse_applied(&meta);
        let applied = applied.map_or(committed, |a| a.max(committed));
        // The partition count the group's offsets were committed with: a
        // workflow's partition is murmur2 % count, so another count moves
        // workflows away from their recorded steps.
        if let (Some(was), Some(now)) = (written_with, core.intent_partitions())
            && was != now
        {
            return Err(layout_changed(&self.config.kafka.topics.intents, was, now));
        }
        let started = Instant::now();
        info!(
            partition = p,
            committed,
            changelog_from = ?self.store.changelog_next(p).ok().flatten(),
            "restoring the partition's state from the changelog"
        );
        let trust = match self.trust {
            Some(t) => t,
            None => {
                let d = kafka::changelog_delete_retention(&self.config.kafka).await;
                let t = crate::state::Trust::from_delete_retention(d);
                info!(delete_retention = ?d, max_age = ?t.max_age, "a partition's local state is resumed from only if it was in sync with the changelog more recently than max_age");
                *self.trust.insert(t)
            }
        };
        let store = self.store.clone();
        let cfg = self.config.kafka.clone();
        // Records applied so far, exported while a long restore runs.
        let so_far = Arc::new(crate::state::Applied::default());
        let mut restoring = tokio::task::spawn_blocking({
            let so_far = so_far.clone();
            move || crate::state::restore_partition(&cfg, &store, p, &trust, &so_far)
        });
        // A long restore is progress, not a stall.
        let restored = loop {
            tokio::select! {
                r = &mut restoring => break r??,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    self.health.beat();
                    let n = so_far.total();
                    self.metrics.partition_restore_progress(p, n, started.elapsed());
                }
            }
        };
        if let Some(reason) = restored.reason {
            self.metrics.full_restore(p, reason.label());
        }
        let n = restored.records;
        let took = started.elapsed();
        info!(
            partition = p,
            records = n,
            full = restored.full,
            ms = took.as_millis() as u64,
            "partition restored"
        );
        if n > 0 {
            self.metrics.restored(p, n, took);
            self.report_state_size();
        }
        core.load_partition(self.store, p, applied, now_ms())?;
        self.hold_until_progress_read(core, consumer, p).await;
        self.owned.insert(
            p,
            Owned {
                applied,
                committed,
                read: committed,
            },
        );
        self.metrics.partition_ready(p, n, took);
        self.assigned.insert(p);
        self.invoker.ownership().add([p]);
        self.health
            .set_gate_ready(self.assigned.iter().all(|q| self.owned.contains_key(q)));
        Ok(())
    }

    /// Note where the partition's `progress` ends now: the deadlines of the
    /// partition wait until it has been read that far (outcomes handed over
    /// while it moved are known first). Without the end (the broker did not
    /// say), only the grace period holds them.
    pub(super) async fn hold_until_progress_read(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        p: i32,
    ) {
        let (c, topic) = (consumer.clone(), self.config.kafka.topics.progress.clone());
        let end = kafka::blocking(move || c.fetch_watermarks(&topic, p, WATERMARK_ASK)).await;
        match end {
            Ok((_, high)) if high > 0 => {
                self.progress_ends.insert(p, high);
            }
            Ok(_) => core.progress_read(p),
            Err(e) => {
                warn!(partition = p, error = %e, "could not read where the partition's progress ends: its deadlines wait the grace period only");
                core.progress_read(p);
            }
        }
    }

    /// Release the deadlines of partitions whose `progress` was read up to
    /// where it ended at their assignment (the consumer's position counts
    /// control records, which a message offset would not).
    pub(super) fn check_progress_read(&mut self, core: &mut GateCore, consumer: &TxnConsumer) {
        if self.progress_ends.is_empty() {
            return;
        }
        let Ok(positions) = consumer.position() else {
            return;
        };
        let topic = &self.config.kafka.topics.progress;
        self.progress_ends.retain(|&p, &mut end| {
            let at = positions
                .find_partition(topic, p)
                .and_then(|e| e.offset().to_raw())
                .unwrap_or(-1);
            if at >= end {
                core.progress_read(p);
                return false;
            }
            true
        });
        drop(positions);
    }
}

#[cfg(test)]
mod tests {
    use super::Owned;

    /// Restarted with the committed offset held at an unsettled step (5)
    /// and the applied mark past it (9): until the session has read that
    /// intent again, a batch that consumed nothing from the partition keeps
    /// the committed offset where it is. (Committing the mark, as the gate
    /// did, skipped the step for good: its call was never answered.)
    #[test]
    fn a_restarted_session_commits_no_further_than_it_has_read() {
        let mut o = Owned {
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
