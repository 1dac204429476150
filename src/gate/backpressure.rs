//! Backpressure: reading held, then the `intents` partitions paused, while the
//! invoker is full.

use crate::executor::Invoker;
use crate::kafka::TxnConsumer;
use crate::telemetry::Metrics;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// How long a full invoker only holds the gate's reading before it pauses the
/// `intents` partitions. librdkafka's pause drops every intent it has
/// prefetched, and its resume fetches them all again: in a flood of fast
/// calls, pausing at each full invoker made the broker send each intent about
/// 19 times (issue #34). A hold stops reading instead: the prefetch stays,
/// bounded by `queued.max.messages.kbytes`. It is kept short because while it
/// lasts nothing else on the consumer is read either — `progress` outcomes,
/// `commands`, rebalances — so a slow tool's calls still lead to a pause,
/// which lets those through while intents wait in Kafka.
pub(super) const HOLD_BEFORE_PAUSE: Duration = Duration::from_secs(1);

/// Backpressure, as Kafka Streams and Vector do it: while the invoker is
/// full, the gate first holds its reading ([`HOLD_BEFORE_PAUSE`]); if it is
/// still full then, the `intents` partitions are paused — the consumer keeps
/// polling (outcomes, commands, the group's heartbeat go on) but fetches no
/// intents, which wait in Kafka. Reading goes on, and paused partitions
/// resume, once the invoker has drained to room
/// ([`Invoker::has_room`](crate::executor::Invoker::has_room)). Nothing is
/// refused or lost: a paused partition resumes from the position after its
/// last input read.
#[derive(Default)]
pub(super) struct Backpressure {
    /// `intents` partitions paused while the invoker is full.
    paused: BTreeSet<i32>,
    /// Since when the invoker has been full, reading held.
    held_since: Option<Instant>,
}

impl Backpressure {
    /// Whether the gate's loop leaves the consumer unread now: the invoker
    /// is full and has been for less than [`HOLD_BEFORE_PAUSE`].
    pub(super) fn reading_held(&self) -> bool {
        self.held_since
            .is_some_and(|t| t.elapsed() < HOLD_BEFORE_PAUSE)
    }

    /// Hold, pause or resume the reading of `intents` (of the `assigned`
    /// partitions) as the invoker's fill says.
    pub(super) fn apply(
        &mut self,
        consumer: &TxnConsumer,
        invoker: &Invoker,
        assigned: &BTreeSet<i32>,
        intents: &str,
        metrics: &Metrics,
    ) {
        let was_held = self.held_since.is_some();
        let (held_since, reading) = decide(
            self.held_since,
            !self.paused.is_empty(),
            invoker.is_full(),
            invoker.has_room(),
            Instant::now(),
        );
        self.held_since = held_since;
        if reading == Reading::Hold && !was_held {
            debug!(
                queued = invoker.running(),
                "the invoker is full: reading held"
            );
        }
        let list = |ps: &[i32]| {
            let mut tpl = TopicPartitionList::new();
            for &p in ps {
                tpl.add_partition(intents, p);
            }
            tpl
        };
        match reading {
            Reading::Read | Reading::Hold => {}
            Reading::Pause => {
                // Partitions assigned while paused are paused too.
                let more: Vec<i32> = assigned.difference(&self.paused).copied().collect();
                if more.is_empty() {
                    return;
                }
                match consumer.pause(&list(&more)) {
                    Ok(()) => {
                        if self.paused.is_empty() {
                            info!(
                                queued = invoker.running(),
                                "the invoker is full: intents paused until it drains (executor.max_queued_calls / max_queued_bytes)"
                            );
                            metrics.intents_paused(true);
                        }
                        self.paused.extend(more);
                    }
                    Err(e) => warn!(error = %e, "could not pause the intents partitions"),
                }
            }
            Reading::Resume => {
                let back: Vec<i32> = self.paused.intersection(assigned).copied().collect();
                if let Err(e) = consumer.resume(&list(&back)) {
                    warn!(error = %e, "could not resume the intents partitions; trying again");
                    return;
                }
                info!(
                    queued = invoker.running(),
                    "the invoker has room: intents resumed"
                );
                self.paused.clear();
                metrics.intents_paused(false);
            }
        }
    }

    /// A partition revoked: no longer paused here.
    pub(super) fn release(&mut self, p: i32) {
        self.paused.remove(&p);
    }

    /// The session ended: its consumer (and its pause) is gone with it.
    pub(super) fn end(&self, metrics: &Metrics) {
        if !self.paused.is_empty() {
            metrics.intents_paused(false);
        }
    }
}

/// What backpressure does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// The invoker has room and nothing is paused: read on.
    Read,
    /// The invoker is full, for less than [`HOLD_BEFORE_PAUSE`]: leave the
    /// consumer unread, keeping librdkafka's prefetch.
    Hold,
    /// Full for [`HOLD_BEFORE_PAUSE`] or more: pause the `intents`
    /// partitions (those not paused yet).
    Pause,
    /// Held or paused, and the invoker has drained to room: resume.
    Resume,
}

/// The backpressure decision, apart from the consumer so it can be tested:
/// given when the hold began (if it did), whether any partition is paused,
/// the invoker's `is_full` and `has_room`, and now, the new hold start and
/// the step to take. Once held or paused, the gate waits for room
/// (`has_room`, below full), not just for "not full", so it does not flap at
/// the limit.
pub(super) fn decide(
    held_since: Option<Instant>,
    any_paused: bool,
    is_full: bool,
    has_room: bool,
    now: Instant,
) -> (Option<Instant>, Reading) {
    let full = if !any_paused && held_since.is_none() {
        is_full
    } else {
        !has_room
    };
    if !full {
        let step = if any_paused {
            Reading::Resume
        } else {
            Reading::Read
        };
        return (None, step);
    }
    let since = held_since.unwrap_or(now);
    let step = if now.saturating_duration_since(since) < HOLD_BEFORE_PAUSE {
        Reading::Hold
    } else {
        Reading::Pause
    };
    (Some(since), step)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn an_invoker_with_room_reads_on() {
        let now = Instant::now();
        assert_eq!(decide(None, false, false, true, now), (None, Reading::Read));
        // Not full yet, but short of room: nothing was held, so read on.
        assert_eq!(
            decide(None, false, false, false, now),
            (None, Reading::Read)
        );
    }

    #[test]
    fn a_full_invoker_holds_the_reading_before_it_pauses() {
        let t0 = Instant::now();
        assert_eq!(
            decide(None, false, true, false, t0),
            (Some(t0), Reading::Hold)
        );
        let t = t0 + HOLD_BEFORE_PAUSE - MS;
        assert_eq!(
            decide(Some(t0), false, true, false, t),
            (Some(t0), Reading::Hold)
        );
        // Below full but without room yet: the hold goes on, measured from t0.
        assert_eq!(
            decide(Some(t0), false, false, false, t),
            (Some(t0), Reading::Hold)
        );
    }

    #[test]
    fn an_invoker_full_for_the_whole_hold_pauses_the_intents() {
        let t0 = Instant::now();
        let t = t0 + HOLD_BEFORE_PAUSE;
        assert_eq!(
            decide(Some(t0), false, true, false, t),
            (Some(t0), Reading::Pause)
        );
        // Still paused and still short of room: stay paused (partitions
        // assigned meanwhile are paused too).
        let later = t + HOLD_BEFORE_PAUSE;
        assert_eq!(
            decide(Some(t0), true, false, false, later),
            (Some(t0), Reading::Pause)
        );
    }

    #[test]
    fn room_ends_a_hold_without_a_pause_and_resumes_a_pause() {
        let t0 = Instant::now();
        let t = t0 + 10 * MS;
        // A brief full spell ends in a read, never a pause: no refetch.
        assert_eq!(
            decide(Some(t0), false, false, true, t),
            (None, Reading::Read)
        );
        let t = t0 + 5 * HOLD_BEFORE_PAUSE;
        assert_eq!(
            decide(Some(t0), true, false, true, t),
            (None, Reading::Resume)
        );
    }
}
