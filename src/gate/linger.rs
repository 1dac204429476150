//! Group commit's one wait: the next batch held a moment for the outcomes of
//! fast calls just started.

use std::time::Duration;

/// Whether the next batch waits a little for the outcomes of calls just started.
///
/// A batch closes when the previous commit returns — which is also when the
/// calls it recorded start. A fast tool's outcome then arrives a moment after
/// the next batch closed and waits out that whole commit before its own. When
/// calls have lately taken well under half a commit, the next batch waits (at
/// most 1.5× their recent duration) for the calls just started, and their
/// outcomes ride in it: one commit less of latency for the cost of a short wait.
/// Slow tools (or a flood, where calls queue for the pool) make it wait for nothing.
#[derive(Default)]
pub(super) struct Linger {
    /// Moving averages: hand-over → outcome, and a batch's commit.
    pub(super) call: Duration,
    pub(super) commit: Duration,
    /// Calls started by the last landed batch and not yet finished, and until when to wait for them.
    pub(super) outstanding: usize,
    pub(super) until: Option<tokio::time::Instant>,
}

impl Linger {
    pub(super) fn ewma(avg: &mut Duration, sample: Duration) {
        *avg = if avg.is_zero() {
            sample
        } else {
            (*avg * 7 + sample) / 8
        };
    }

    pub(super) fn landed(&mut self, calls: usize, commit: Duration) {
        Self::ewma(&mut self.commit, commit);
        let wait = self.call * 3 / 2;
        if calls > 0 && !self.call.is_zero() && wait < self.commit / 2 {
            self.outstanding = calls;
            self.until = Some(tokio::time::Instant::now() + wait);
        } else {
            self.until = None;
        }
    }

    pub(super) fn finished(&mut self, took: Duration) {
        Self::ewma(&mut self.call, took);
        self.outstanding = self.outstanding.saturating_sub(1);
        if self.outstanding == 0 {
            self.until = None;
        }
    }

    /// The deadline while the next batch should wait.
    pub(super) fn waiting(&mut self) -> Option<tokio::time::Instant> {
        if self.until.is_some_and(|t| t <= tokio::time::Instant::now()) {
            self.until = None;
        }
        self.until
    }
}
