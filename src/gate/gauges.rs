//! The gauges a session refreshes from its state now and then: the steps
//! waiting for a person, and the state's size.

use super::session::Session;
use std::time::Duration;
use tracing::warn;

/// How often the state-size gauges are refreshed (a few RocksDB property reads).
pub(super) const STATE_SIZE_EVERY: Duration = Duration::from_secs(5);

impl Session<'_> {
    /// Export how many steps of the owned partitions wait for a person (the
    /// gauges the alerts watch: a counter's increase would clear while a step
    /// is still unresolved).
    pub(super) fn count_open_steps(&self) {
        let mut total = crate::state::OpenSteps::default();
        for &p in self.owned.keys() {
            match self.store.open_steps(p) {
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
        self.metrics
            .open_steps(total.in_doubt, total.awaiting_approval);
    }

    pub(super) fn report_state_size(&self) {
        let size = self.store.size();
        self.metrics
            .state_size(size.steps, size.disk_bytes, &size.memory());
    }
}
