//! The gauges a session refreshes from its state now and then: the steps
//! waiting for a person, and the state's size.

use crate::state::{OpenSteps, StateStore};
use crate::telemetry::Metrics;
use tracing::warn;

/// Export how many steps of the owned partitions wait for a person (the
/// gauges the alerts watch: a counter's increase would clear while a step
/// is still unresolved).
pub(super) fn count_open_steps(
    store: &StateStore,
    metrics: &Metrics,
    partitions: impl IntoIterator<Item = i32>,
) {
    let mut total = OpenSteps::default();
    for p in partitions {
        match store.open_steps(p) {
            Ok(n) => {
                total.in_doubt += n.in_doubt;
                total.awaiting_approval += n.awaiting_approval;
            }
            Err(e) => {
                warn!(partition = p, error = %e, "could not count the steps waiting for a person");
                return;
            }
        }
    }
    metrics.open_steps(total.in_doubt, total.awaiting_approval);
}

pub(super) fn report_state_size(store: &StateStore, metrics: &Metrics) {
    let size = store.size();
    metrics.state_size(size.steps, size.disk_bytes, &size.memory());
}
