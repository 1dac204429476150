//! Group commit's one wait: the next batch held a moment for the outcomes of
//! fast calls just started (after a commit, or at once: a keyed step's).

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
        // A new batch opens: its wait starts now.
        self.until = None;
        let wait = self.call * 3 / 2;
        if calls > 0 && !self.call.is_zero() && wait < self.commit / 2 {
            self.wait_for(calls, wait);
        }
    }

    /// Calls started at once — a fast path's, or a keyed step's — before the
    /// batch that decided them closes. Closing it without their outcomes
    /// commits nothing they need (their intents' offsets stay held), and
    /// their answers then wait for that commit and one more; waiting for
    /// them instead costs their run and saves a commit, as long as they
    /// come back within about a commit: so the wait is 1.5× their recent
    /// duration, at most one commit.
    pub(super) fn started(&mut self, calls: usize) {
        if calls > 0 && !self.call.is_zero() && self.call < self.commit {
            self.wait_for(calls, (self.call * 3 / 2).min(self.commit));
        }
    }

    /// The first calls of a batch set its wait; later ones never lengthen
    /// it (a steady stream of calls must not hold a batch open).
    fn wait_for(&mut self, calls: usize, wait: Duration) {
        self.outstanding += calls;
        if self.until.is_none() {
            self.until = Some(tokio::time::Instant::now() + wait);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn warm() -> Linger {
        Linger {
            call: Duration::from_millis(1),
            commit: Duration::from_millis(10),
            ..Linger::default()
        }
    }

    /// Calls started while a batch waits never lengthen its wait: a steady
    /// stream of calls must not hold the batch open.
    #[tokio::test]
    async fn a_batch_waits_once_for_the_calls_it_started() {
        let mut l = warm();
        l.started(1);
        let first = l.until.expect("waits for a fast call");
        l.started(3);
        assert_eq!(l.until, Some(first), "not lengthened");
        assert_eq!(l.outstanding, 4);
        for _ in 0..4 {
            l.finished(Duration::from_millis(1));
        }
        assert_eq!(l.until, None, "every outcome is in");
    }

    /// Calls slower than a commit (or none measured yet) are not waited for;
    /// after a commit, calls over a third of one are not.
    #[tokio::test]
    async fn slow_calls_are_not_waited_for() {
        let mut l = Linger::default();
        l.started(1);
        assert_eq!(l.until, None, "nothing measured yet");
        let mut l = warm();
        l.call = Duration::from_millis(12);
        l.started(1);
        assert_eq!(l.until, None, "slower than a commit");
        l.call = Duration::from_millis(8);
        l.started(1);
        let waited = l
            .until
            .expect("started at once: waited for, at most a commit");
        assert!(waited <= tokio::time::Instant::now() + Duration::from_millis(10));
        l.landed(1, Duration::from_millis(10));
        assert_eq!(
            l.until, None,
            "after a commit: 1.5x the call is over half a commit"
        );
    }
}
