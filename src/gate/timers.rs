//! The session loop's clocks: its tick, and when each of the tick's chores
//! is due — deadlines (after a spell of health), purges, the gauges, the
//! layout read again, and how long the session has gone without partitions.

use crate::config::KafkaConfig;
use crate::kafka::{self, KafkaSetupError, Layout};
use futures::FutureExt;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio::time::{Interval, MissedTickBehavior};
use tracing::warn;

/// How often deadlines, purges and the state gauges are looked at.
const TICK: Duration = Duration::from_millis(100);

/// How often the state-size gauges are refreshed (a few RocksDB property reads).
const GAUGES_EVERY: Duration = Duration::from_secs(5);

/// How often a running gate reads the topics' partition counts again (a
/// consumer sees new partitions only at its next metadata refresh, minutes later).
const LAYOUT_EVERY: Duration = Duration::from_secs(10);

pub(super) struct Timers {
    tick: Interval,
    last_purge: Instant,
    /// The last purge found more expired records than one chunk: the next
    /// goes on at the next tick, so purging keeps up with any step rate.
    purge_backlog: bool,
    last_gauges: Instant,
    /// Since when the consumer has read without an error.
    healthy_since: Instant,
    /// Since when the session has had partitions assigned, or started.
    assigned_since: Instant,
    last_layout: Instant,
    /// The layout being read again, in a task (a broker outage must not
    /// hold the loop).
    layout: Option<JoinHandle<Result<Layout, KafkaSetupError>>>,
}

impl Timers {
    pub(super) fn new() -> Timers {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let now = Instant::now();
        Timers {
            tick,
            last_purge: now,
            purge_backlog: false,
            last_gauges: now,
            healthy_since: now,
            assigned_since: now,
            last_layout: now,
            layout: None,
        }
    }

    /// The loop's next tick.
    pub(super) async fn tick(&mut self) {
        self.tick.tick().await;
    }

    /// The consumer reported an error (librdkafka retries by itself).
    pub(super) fn unhealthy(&mut self) {
        self.healthy_since = Instant::now();
    }

    /// Outcomes may be queued behind an outage (ours or the broker's): only
    /// settle deadlines after `grace` of health, so an outage never turns a
    /// known outcome into doubt.
    pub(super) fn deadlines_due(&self, grace: Duration) -> bool {
        self.healthy_since.elapsed() >= grace
    }

    /// Whether a purge is due: every `interval`, or at once while a backlog
    /// lasts.
    pub(super) fn purge_due(&mut self, interval: Duration) -> bool {
        if self.purge_backlog {
            return true;
        }
        let due = self.last_purge.elapsed() >= interval;
        if due {
            self.last_purge = Instant::now();
        }
        due
    }

    /// A purge found more expired records than one chunk (`more`).
    pub(super) fn purged(&mut self, more: bool) {
        self.purge_backlog = more;
    }

    pub(super) fn gauges_due(&mut self) -> bool {
        let due = self.last_gauges.elapsed() >= GAUGES_EVERY;
        if due {
            self.last_gauges = Instant::now();
        }
        due
    }

    /// Whether the session has been without partitions for longer than
    /// `after` (`assigned`: it has some now).
    pub(super) fn unassigned_for(&mut self, assigned: bool, after: Duration) -> bool {
        if assigned {
            self.assigned_since = Instant::now();
            return false;
        }
        self.assigned_since.elapsed() > after
    }

    /// The topics' partition counts, read again every [`LAYOUT_EVERY`] in a
    /// task: what a read found, once it is in.
    pub(super) fn layout(&mut self, k: &KafkaConfig) -> Option<Result<Layout, KafkaSetupError>> {
        if self.layout.as_ref().is_some_and(JoinHandle::is_finished) {
            return match self.layout.take()?.now_or_never()? {
                Ok(read) => Some(read),
                Err(e) => {
                    warn!(error = %e, "partition count task failed");
                    None
                }
            };
        }
        if self.layout.is_none() && self.last_layout.elapsed() >= LAYOUT_EVERY {
            self.last_layout = Instant::now();
            let k = k.clone();
            self.layout = Some(tokio::task::spawn_blocking(move || {
                kafka::layout_counts(&k)
            }));
        }
        None
    }
}
