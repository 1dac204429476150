//! Time: started steps past their deadline (re-run where safe, in doubt
//! otherwise), and retention's purge.

use super::{Apply, GateCore, HOLD_LIMIT_MS, KEPT_UNTIL_RESOLVED, ms};
use crate::contract::{ErrorBody, Outcome, Texts};
use crate::state::{Phase, StateError};

/// What one purge round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// Step records removed.
    pub removed: usize,
    /// Unresolved step records past their retention, kept until resolved.
    pub kept: usize,
    /// Some partition had more expired records than the round's limit: the
    /// gate goes on at its next tick instead of waiting `purge_interval`.
    pub more: bool,
}

impl GateCore {
    /// Act on every deadline that has passed: a call still running here gets
    /// more time (its outcome will come); otherwise re-run where that is safe,
    /// and declare the rest in doubt.
    pub(super) fn apply_deadlines(&mut self, ax: &mut Apply<'_>) -> Result<(), StateError> {
        self.held.retain(|p, h| {
            let waiting = !h.progress_read || h.until_ms > ax.now_ms;
            if waiting && ax.now_ms > h.until_ms + HOLD_LIMIT_MS {
                tracing::warn!(partition = p, "the partition's progress was not read to its end within 5 minutes of its assignment: its deadlines are settled from now on");
                return false;
            }
            waiting
        });
        let mut waiting = Vec::new();
        while let Some((deadline, p, step)) = self.due.first().cloned() {
            if deadline > ax.now_ms {
                break;
            }
            self.due.pop_first();
            if self.held.contains_key(&p) {
                waiting.push((deadline, p, step));
                continue;
            }
            let Some(mut record) = ax.step(p, &step)? else {
                continue;
            };
            // A held call's lifecycle, an in-doubt step's next lookup.
            if matches!(record.phase, Phase::AwaitingApproval | Phase::InDoubt) {
                if record.deadline_ms == Some(deadline) {
                    self.lifecycle_due(ax, p, record)?;
                }
                continue;
            }
            if record.phase != Phase::Started || record.deadline_ms.is_some_and(|d| d != deadline) {
                continue; // settled or re-run since
            }
            // Handed back never invoked by a process that was stopping.
            if record.not_invoked == Some(record.dispatch) {
                self.rerun_not_invoked(p, &mut record, ax.now_ms);
                ax.put_step(p, &record)?;
                continue;
            }
            let key = (p, step.clone());
            if self.running.get(&key) == Some(&record.dispatch)
                || self.awaiting_commit.get(&key) == Some(&record.dispatch)
            {
                // Running here (queued for a slot, retrying) or waiting for the
                // commit that starts it: the invocation reports itself.
                let later = ax.now_ms + ms(self.tool_deadline(&step.tool));
                record.deadline_ms = Some(later);
                self.due.insert((later, p, step));
                ax.put_step(p, &record)?;
                continue;
            }
            // A pool's dispatch no worker took was never invoked: said so,
            // unless an earlier dispatch may have acted.
            if let Some(pool) = self.tools.get(&step.tool).and_then(|t| t.pool.clone())
                && record.taken != Some(record.dispatch)
            {
                let dispatch = record.dispatch;
                record.open_dispatches.retain(|d| *d != dispatch);
                self.metrics.pool_unclaimed(&pool, &step);
                let outcome = Outcome::Error {
                    error: ErrorBody {
                        kind: "no_worker".into(),
                        message: Texts::no_worker(&step.tool, &pool),
                    },
                };
                let outcome = self.unless_earlier_may_have_run(&record, outcome);
                let phase = Phase::settled_by(&outcome);
                self.settle(ax, p, record, outcome, phase)?;
                continue;
            }
            if record.category.rerun_is_safe() {
                record.dispatch += 1;
                self.metrics.reforwarded(&step, record.dispatch);
                self.start(p, &mut record, ax.now_ms, None);
                ax.put_step(p, &record)?;
            } else {
                let outcome = Outcome::InDoubt {
                    error: ErrorBody {
                        kind: "executor_lost".into(),
                        message: Texts::in_doubt_lost(&step.tool),
                    },
                };
                let phase = Phase::settled_by(&outcome);
                self.settle(ax, p, record, outcome, phase)?;
            }
        }
        self.due.extend(waiting);
        Ok(())
    }

    /// Remove up to `limit` expired records of each partition (records this
    /// batch or the one committing already removed are not counted twice).
    pub(super) fn apply_purge(
        &mut self,
        ax: &mut Apply<'_>,
        partitions: impl IntoIterator<Item = i32>,
        limit: usize,
    ) -> Result<Purged, StateError> {
        let mut out = Purged::default();
        for p in partitions {
            let expired = ax.expired(p, limit)?;
            out.more |= expired.len() >= limit;
            for (expires_at, step) in expired {
                match ax.step(p, &step)? {
                    // Unresolved (in doubt, held for approval, started): kept
                    // until someone settles it, whatever the retention — its
                    // next retry must not find it gone and run it again. Its
                    // settlement sets a retention from then (`settle`).
                    Some(mut r) if r.expires_at_ms == expires_at && r.phase.unresolved() => {
                        r.expires_at_ms = KEPT_UNTIL_RESOLVED;
                        ax.put_step(p, &r)?;
                        out.kept += 1;
                    }
                    Some(r) if r.expires_at_ms == expires_at => {
                        ax.delete_step(p, &step)?;
                        if ax
                            .workflow_end(p, &step.workflow_id)?
                            .is_some_and(|e| e.step == step)
                        {
                            ax.batch.delete_workflow_end(p, &step.workflow_id);
                        }
                        out.removed += 1;
                    }
                    _ => ax.batch.delete_expiry(p, &step, expires_at),
                }
            }
        }
        self.metrics.purged(out.removed);
        if out.kept > 0 {
            tracing::info!(
                kept = out.kept,
                "unresolved steps past their retention kept until resolved (`stepgate steps list --unresolved`)"
            );
        }
        Ok(out)
    }
}
