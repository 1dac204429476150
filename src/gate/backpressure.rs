//! Backpressure: the `intents` partitions paused while the invoker is full.

use super::session::Session;
use crate::kafka::TxnConsumer;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer;
use std::sync::Arc;
use tracing::{info, warn};

impl Session<'_> {
    /// Backpressure, as Kafka Streams and Vector do it: while the invoker is
    /// full, the `intents` partitions are paused — the consumer keeps polling
    /// (outcomes, commands, the group's heartbeat go on) but fetches no
    /// intents, which wait in Kafka; resumed once it has drained to room
    /// ([`Invoker::has_room`](crate::executor::Invoker::has_room)). Nothing is
    /// refused or lost: a paused partition resumes from the position after its
    /// last input read.
    pub(super) fn apply_backpressure(&mut self, consumer: &Arc<TxnConsumer>) {
        let full = if self.paused.is_empty() {
            self.invoker.is_full()
        } else {
            !self.invoker.has_room()
        };
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
