//! The partitions a gate takes over, restored together
//! (`state::restore_partitions`: one reader per core) — after a rebalance or
//! on a new disk the gate waits for the slowest partition, not for their sum.
//! The session fences a departed owner's producers first
//! (`standby::fence_departed`: its open transaction ends at once), and
//! `ownership` waits for the group's committed offsets before this restore,
//! so one restore reads everything committed.

use super::{Env, GateError};
use crate::state::{Applied, Restored, Trust};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::info;

/// Restore `ps` in parallel, off the async threads. Progress is exported
/// every second, and a long restore beats the health check: it is progress,
/// not a stall.
pub(super) async fn restore_assigned(
    env: Env<'_>,
    ps: &BTreeSet<i32>,
    trust: Trust,
) -> Result<BTreeMap<i32, Restored>, GateError> {
    let (health, metrics) = (env.health, env.metrics);
    let started = Instant::now();
    let applied = Arc::new(Applied::default());
    let mut restoring = tokio::task::spawn_blocking({
        let (cfg, store, ps, applied) = (
            env.config.kafka.clone(),
            env.store.clone(),
            ps.clone(),
            applied.clone(),
        );
        move || crate::state::restore_partitions(&cfg, &store, &ps, &trust, &applied)
    });
    let restored = loop {
        tokio::select! {
            r = &mut restoring => break r??,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                health.beat();
                for &p in ps {
                    metrics.partition_restore_progress(p, applied.of(p), started.elapsed());
                }
            }
        }
    };
    let took = started.elapsed();
    for (p, r) in &restored {
        if let Some(reason) = r.reason {
            metrics.full_restore(*p, reason.label());
        }
        if r.records > 0 {
            metrics.restored(*p, r.records, took);
        }
        info!(
            partition = p,
            records = r.records,
            full = r.full,
            ms = took.as_millis() as u64,
            "partition restored"
        );
    }
    Ok(restored)
}
