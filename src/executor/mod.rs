//! Executors: a consumer group over the gate's `calls`.
//!
//! For each batch of calls, one Kafka transaction records `started` for every
//! recorded call together with the calls' offsets; only after it commits are the
//! tools invoked. So a crash before the commit leaves the calls to be redelivered
//! (nothing was invoked), and a crash after it leaves `started` with no outcome,
//! which the gate settles at the tool's deadline: re-run where that is safe,
//! `in_doubt` where it is not. Outcomes are published in later transactions.
//! The executor never reads gate state.

use crate::config::Config;
use crate::contract::{Call, Progress, ProgressEvent};
use crate::kafka::{self, OutRecord, RebalanceContext, RebalanceEvent, TxnConsumer};
use crate::telemetry::{Health, Metrics};
use crate::tools::ToolRegistry;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[derive(Debug, Error)]
pub enum ExecutorError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("partitions were revoked while calls were buffered; they are re-read")]
    Rebalanced,
    #[error("no partitions assigned for {0:?}: rejoining with a fresh consumer")]
    Unassigned(Duration),
}

/// An outcome waiting to be published, in the call's partition.
type Finished = (i32, Progress);

/// Run executors until `shutdown`, then drain in-flight calls within
/// `executor.drain_timeout` and publish their outcomes.
pub async fn run(
    config: Arc<Config>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), ExecutorError> {
    let tools = Arc::new(ToolRegistry::new(&config));
    let (tx, mut rx) = mpsc::unbounded_channel::<Finished>();
    let mut ex = Executor {
        config: &config,
        metrics: &metrics,
        tools,
        tx,
        in_flight: 0,
        finished: Vec::new(),
    };
    let mut backoff = Duration::from_millis(250);
    loop {
        let r = ex.session(&mut rx, &health, &shutdown).await;
        health.set_executor_ready(false);
        match r {
            Ok(()) => return Ok(()),
            Err(ExecutorError::Rebalanced) => {
                info!("partitions revoked with calls buffered: re-reading from the last commit");
            }
            Err(e) => {
                error!(error = %crate::telemetry::error_chain(&e), "executor session failed; restarting");
                if !kafka::wait_before_restart(&shutdown, &mut backoff).await {
                    return Ok(());
                }
            }
        }
    }
}

struct Executor<'a> {
    config: &'a Config,
    metrics: &'a Arc<Metrics>,
    tools: Arc<ToolRegistry>,
    tx: mpsc::UnboundedSender<Finished>,
    /// Invocations running now.
    in_flight: usize,
    /// Outcomes not yet committed (kept across sessions).
    finished: Vec<Finished>,
}

impl Executor<'_> {
    async fn session(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<Finished>,
        health: &Health,
        shutdown: &CancellationToken,
    ) -> Result<(), ExecutorError> {
        let k = &self.config.kafka;
        let (ctx, mut events) = RebalanceContext::new(self.metrics.clone(), &k.executor_group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(k, &k.executor_group, &format!("{}-exec", k.instance_id))
                .create_with_context(ctx)?,
        );
        let producer =
            kafka::init_txn_producer(k, &format!("{}-exec-{}", k.executor_group, k.instance_id))
                .await?;
        consumer.subscribe(&[&k.topics.calls])?;
        health.set_executor_ready(true);
        info!(calls = %k.topics.calls, "executor consuming");

        let concurrency = self.config.executor.concurrency;
        let mut tick = tokio::time::interval(self.config.executor.commit_interval.0);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Calls consumed but not yet committed as started (not yet invoked).
        let mut calls: Vec<(i32, Call)> = Vec::new();
        let mut offsets: BTreeMap<i32, i64> = BTreeMap::new();
        // A member left without partitions for this long (e.g. fenced while the
        // broker restarted) starts over with a fresh consumer.
        let stuck_after = k.session_timeout.0 * 3;
        let mut unassigned_since = Some(Instant::now());
        loop {
            let can_take = self.in_flight + calls.len() < concurrency;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(ev) = events.recv() => {
                    match &ev {
                        RebalanceEvent::Assigned(parts) if !parts.is_empty() => unassigned_since = None,
                        RebalanceEvent::Assigned(_) => {}
                        RebalanceEvent::Revoked(_) => unassigned_since = Some(Instant::now()),
                    }
                    if matches!(ev, RebalanceEvent::Revoked(_)) && !offsets.is_empty() {
                        // Calls consumed but not committed may belong to revoked
                        // partitions, or to re-assigned ones whose position moved
                        // past them: drop them (none was started) and re-read from
                        // the last commit with a fresh consumer.
                        return Err(ExecutorError::Rebalanced);
                    }
                }
                Some(done) = rx.recv() => {
                    self.in_flight -= 1;
                    self.finished.push(done);
                }
                msg = consumer.recv(), if can_take => {
                    let m = match msg {
                        Ok(m) => kafka::to_input(&m),
                        Err(e) => {
                            warn!(error = %e, "consumer error (librdkafka retries by itself)");
                            continue;
                        }
                    };
                    offsets.insert(m.partition, m.offset + 1);
                    match serde_json::from_slice::<Call>(m.payload.as_deref().unwrap_or_default()) {
                        Ok(call) => calls.push((m.partition, call)),
                        Err(e) => error!(partition = m.partition, offset = m.offset, error = %e, "unreadable call record skipped"),
                    }
                }
                _ = tick.tick() => {
                    if unassigned_since.is_some_and(|t| t.elapsed() > stuck_after) {
                        return Err(ExecutorError::Unassigned(stuck_after));
                    }
                    if !calls.is_empty() || !self.finished.is_empty() || !offsets.is_empty() {
                        let batch = std::mem::take(&mut calls);
                        let offs = std::mem::take(&mut offsets);
                        self.commit_and_start(&consumer, &producer, batch, offs).await?;
                    }
                }
            }
        }
        // Shutdown: calls not yet started are left for redelivery; running ones may
        // finish within the drain timeout, and their outcomes are committed.
        drop(calls);
        let drain_until = Instant::now() + self.config.executor.drain_timeout.0;
        while self.in_flight > 0 {
            match tokio::time::timeout_at(drain_until.into(), rx.recv()).await {
                Ok(Some(done)) => {
                    self.in_flight -= 1;
                    self.finished.push(done);
                }
                _ => break,
            }
        }
        if self.in_flight > 0 {
            warn!(
                calls = self.in_flight,
                "drain timeout: calls still running stay `started`; the gate settles them at their deadline"
            );
        }
        if !self.finished.is_empty() {
            self.commit_and_start(&consumer, &producer, Vec::new(), BTreeMap::new())
                .await?;
        }
        drop(producer);
        drop(consumer);
        Ok(())
    }

    /// One transaction: `started` for the new calls, outcomes of finished ones,
    /// and the consumed offsets. Invocations begin only once it has committed.
    async fn commit_and_start(
        &mut self,
        consumer: &Arc<TxnConsumer>,
        producer: &FutureProducer,
        calls: Vec<(i32, Call)>,
        offsets: BTreeMap<i32, i64>,
    ) -> Result<(), ExecutorError> {
        let progress_topic = &self.config.kafka.topics.progress;
        let now = chrono::Utc::now().timestamp_millis();
        let mut records: Vec<OutRecord> = calls
            .iter()
            .filter(|(_, c)| c.fast_ref.is_none())
            .map(|(p, c)| {
                progress_record(
                    progress_topic,
                    *p,
                    &Progress {
                        step: c.step.clone(),
                        dispatch: c.dispatch,
                        fast_ref: None,
                        at_ms: now,
                        event: ProgressEvent::Started,
                    },
                )
            })
            .collect();
        let n_finished = self.finished.len();
        records.extend(
            self.finished
                .iter()
                .map(|(p, pr)| progress_record(progress_topic, *p, pr)),
        );
        producer.begin_transaction()?;
        let committed = async {
            kafka::send_all(producer, &records).await?;
            if !offsets.is_empty() {
                let mut tpl = TopicPartitionList::new();
                for (p, next) in &offsets {
                    tpl.add_partition_offset(
                        &self.config.kafka.topics.calls,
                        *p,
                        Offset::Offset(*next),
                    )?;
                }
                kafka::send_offsets(producer, consumer, tpl).await?;
            }
            kafka::commit_txn(producer).await
        }
        .await;
        if let Err(e) = committed {
            kafka::abort_txn(producer).await;
            // Outcomes stay queued for the next session; the calls are redelivered.
            return Err(e.into());
        }
        self.finished.drain(..n_finished);
        for (p, call) in calls {
            self.start(p, call);
        }
        Ok(())
    }

    fn start(&mut self, partition: i32, call: Call) {
        self.in_flight += 1;
        let tools = self.tools.clone();
        let metrics = self.metrics.clone();
        let tx = self.tx.clone();
        // The step key (and the caller's trace) on every event of the invocation.
        let span = tracing::info_span!(
            "invoke",
            step = %call.step,
            dispatch = call.dispatch,
            traceparent = call.traceparent.as_deref().unwrap_or("")
        );
        let task = async move {
            let t = Instant::now();
            let outcome = tools.invoke(&call).await;
            metrics.invoked(&call.step, outcome.label(), t.elapsed());
            let progress = Progress {
                step: call.step,
                dispatch: call.dispatch,
                fast_ref: call.fast_ref,
                at_ms: chrono::Utc::now().timestamp_millis(),
                event: ProgressEvent::Finished { outcome },
            };
            // The receiver lives as long as the executor; after it, nothing to do.
            let _ = tx.send((partition, progress));
        };
        tokio::spawn(tracing::Instrument::instrument(task, span));
    }
}

fn progress_record(topic: &str, partition: i32, p: &Progress) -> OutRecord {
    OutRecord {
        topic: topic.to_owned(),
        partition: Some(partition),
        key: Some(p.step.workflow_id.as_bytes().to_vec()),
        payload: Some(serde_json::to_vec(p).expect("progress records serialise")),
        headers: Vec::new(),
    }
}
