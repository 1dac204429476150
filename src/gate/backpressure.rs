//! Backpressure: reading held, then the `intents` partitions paused, while the
//! invoker is full.

use super::session::Session;
use crate::kafka::TxnConsumer;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use std::sync::Arc;
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

impl Session<'_> {
    /// Whether the gate's loop leaves the consumer unread now: the invoker
    /// is full and has been for less than [`HOLD_BEFORE_PAUSE`].
    pub(super) fn reading_held(&self) -> bool {
        self.held_since
            .is_some_and(|t| t.elapsed() < HOLD_BEFORE_PAUSE)
    }

    /// Backpressure, as Kafka Streams and Vector do it: while the invoker is
    /// full, the gate first holds its reading ([`HOLD_BEFORE_PAUSE`]); if it
    /// is still full then, the `intents` partitions are paused — the consumer
    /// keeps polling (outcomes, commands, the group's heartbeat go on) but
    /// fetches no intents, which wait in Kafka. Reading goes on, and paused
    /// partitions resume, once the invoker has drained to room
    /// ([`Invoker::has_room`](crate::executor::Invoker::has_room)). Nothing is
    /// refused or lost: a paused partition resumes from the position after its
    /// last input read.
    pub(super) fn apply_backpressure(&mut self, consumer: &Arc<TxnConsumer>) {
        let full = if self.paused.is_empty() && self.held_since.is_none() {
            self.invoker.is_full()
        } else {
            !self.invoker.has_room()
        };
        if full {
            let since = *self.held_since.get_or_insert_with(|| {
                debug!(
                    queued = self.invoker.running(),
                    "the invoker is full: reading held"
                );
                Instant::now()
            });
            if since.elapsed() < HOLD_BEFORE_PAUSE {
                return;
            }
        } else {
            self.held_since = None;
        }
        let intents = &self.config.kafka.topics.intents;
        let list = |ps: &[i32]| {
            let mut tpl = TopicPartitionList::new();
            for &p in ps {
                tpl.add_partition(intents, p);
            }
            tpl
        };
        if full {
            // Partitions assigned while paused are paused too.
            let more: Vec<i32> = self.assigned.difference(&self.paused).copied().collect();
            if more.is_empty() {
                return;
            }
            match consumer.pause(&list(&more)) {
                Ok(()) => {
                    if self.paused.is_empty() {
                        info!(
                            queued = self.invoker.running(),
                            "the invoker is full: intents paused until it drains (executor.max_queued_calls / max_queued_bytes)"
                        );
                        self.metrics.intents_paused(true);
                    }
                    self.paused.extend(more);
                }
                Err(e) => warn!(error = %e, "could not pause the intents partitions"),
            }
        } else if !self.paused.is_empty() {
            let back: Vec<i32> = self.paused.intersection(&self.assigned).copied().collect();
            if let Err(e) = consumer.resume(&list(&back)) {
                warn!(error = %e, "could not resume the intents partitions; trying again");
                return;
            }
            info!(
                queued = self.invoker.running(),
                "the invoker has room: intents resumed"
            );
            self.paused.clear();
            self.metrics.intents_paused(false);
        }
    }
}
