//! The gate consumer's context: rebalances reported to the session loop.

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance, StreamConsumer};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Rebalance events, signalled to the loop that owns the consumer (callbacks
/// never do work themselves and never panic).
#[derive(Debug)]
pub enum RebalanceEvent {
    Assigned(Vec<(String, i32)>),
    Revoked(Vec<(String, i32)>),
}

/// Signals rebalances to the consuming loop, and turns librdkafka's statistics
/// into consumer-lag gauges.
pub struct RebalanceContext {
    tx: mpsc::UnboundedSender<RebalanceEvent>,
    metrics: Arc<crate::telemetry::Metrics>,
    group: String,
}

impl RebalanceContext {
    pub fn new(
        metrics: Arc<crate::telemetry::Metrics>,
        group: &str,
    ) -> (Self, mpsc::UnboundedReceiver<RebalanceEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            RebalanceContext {
                tx,
                metrics,
                group: group.to_owned(),
            },
            rx,
        )
    }
}

impl ClientContext for RebalanceContext {
    // Only the lag is read, from the raw JSON: decoding the whole statistics
    // document into rdkafka's typed struct is slower and breaks on new fields.
    fn stats_raw(&self, statistics: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(statistics) else {
            return;
        };
        let Some(topics) = v.get("topics").and_then(|t| t.as_object()) else {
            return;
        };
        for (topic, t) in topics {
            let Some(parts) = t.get("partitions").and_then(|p| p.as_object()) else {
                continue;
            };
            for (p, part) in parts {
                // Offsets are committed through transactions, which librdkafka's
                // own `consumer_lag` does not see: lag is measured from what
                // the application has consumed to the last stable offset.
                let field = |k: &str| part.get(k).and_then(|v| v.as_i64()).unwrap_or(-1);
                let (Ok(p), end, consumed) =
                    (p.parse::<i32>(), field("ls_offset"), field("app_offset"))
                else {
                    continue;
                };
                // -1 is librdkafka's "internal" partition and an unknown offset.
                if p >= 0 && end >= 0 && consumed >= 0 {
                    self.metrics
                        .consumer_lag(&self.group, topic, p, (end - consumed).max(0));
                }
            }
        }
    }
}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let parts = list(tpl);
            for (topic, p) in &parts {
                self.metrics.forget_consumer_lag(&self.group, topic, *p);
            }
            let _ = self.tx.send(RebalanceEvent::Revoked(parts));
        }
    }

    fn post_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let _ = self.tx.send(RebalanceEvent::Assigned(list(tpl)));
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

fn list(tpl: &rdkafka::TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

pub type TxnConsumer = StreamConsumer<RebalanceContext>;
