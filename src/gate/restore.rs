//! The partitions a gate is assigned, taken over before each is loaded: the
//! producers of a gate that left holding them fenced (`standby::fence_departed`:
//! its open transaction ends at once), then all of them restored at once
//! (`state::restore_partitions`: one reader per core) — after a rebalance or
//! on a new disk the gate waits for the slowest partition, not for their sum.
//! Each is then loaded as before (`ownership::ensure_owned`), its restore
//! resuming from the end reached here.

use crate::config::KafkaConfig;
use crate::state::{Applied, StateStore, Trust};
use crate::telemetry::{Health, Metrics};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::info;

/// Take over `ps` (those of them not yet owned): fence a departed owner,
/// then restore them in parallel. Progress is exported every second, and a
/// long restore beats the health check.
pub(super) async fn restore_assigned(
    cfg: &KafkaConfig,
    store: &Arc<StateStore>,
    ps: &BTreeSet<i32>,
    trust: Trust,
    health: &Health,
    metrics: &Metrics,
) -> Result<(), super::GateError> {
    super::standby::fence_departed(cfg, ps).await;
    // One partition: its own restore (`ensure_owned`) is all there is.
    if ps.len() < 2 {
        return Ok(());
    }
    let started = Instant::now();
    for &p in ps {
        metrics.partition_restoring(p);
    }
    let applied = Arc::new(Applied::default());
    let mut restoring = tokio::task::spawn_blocking({
        let (cfg, store, ps, applied) = (cfg.clone(), store.clone(), ps.clone(), applied.clone());
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
    let records: usize = restored.values().map(|r| r.records).sum();
    for (p, r) in &restored {
        if let Some(reason) = r.reason {
            metrics.full_restore(*p, reason.label());
        }
        if r.records > 0 {
            metrics.restored(*p, r.records, started.elapsed());
        }
    }
    info!(
        partitions = ?ps,
        records,
        ms = started.elapsed().as_millis() as u64,
        "assigned partitions restored together"
    );
    Ok(())
}
