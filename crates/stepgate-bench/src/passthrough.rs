//! The limit: a stateless consume → produce passthrough with the same client
//! library and client settings as stepgate's gate, and its commit cadence (a
//! batch commits `commit_interval` after its first input or at `max_batch`
//! inputs). Each record is produced at once to the same partition number of the
//! next topic; at the commit, deliveries are awaited, then the input offsets are
//! committed: in the batch's transaction (EOS, read_committed) or after it
//! (at-least-once). Run by the bench as a child process.

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use stepgate::config::KafkaConfig;
use stepgate::kafka::{self, RebalanceContext, RebalanceEvent, TxnConsumer};
use stepgate::telemetry::Metrics;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[arg(long)]
    brokers: String,
    /// A hop `INPUT:OUTPUT`; several run side by side in this process.
    #[arg(long = "hop", required = true)]
    hops: Vec<String>,
    /// Consumer group prefix (hop n uses `<group>-<n>`).
    #[arg(long)]
    group: String,
    #[arg(long, value_parser = ["eos", "alos"])]
    mode: String,
    #[arg(long, default_value = "100ms")]
    commit_interval: humantime::Duration,
    #[arg(long, default_value_t = 2000)]
    max_batch: usize,
    /// Partitions of every input topic (READY is printed once all are assigned).
    #[arg(long)]
    partitions: usize,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        if let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            term.recv().await;
        }
        s.cancel();
    });
    let assigned = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (n, hop) in args.hops.iter().enumerate() {
        let (input, output) = hop
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("--hop wants INPUT:OUTPUT, got {hop}"))?;
        let hop = Hop {
            cfg: KafkaConfig {
                brokers: args.brokers.clone(),
                ..KafkaConfig::default()
            },
            group: format!("{}-{n}", args.group),
            input: input.to_owned(),
            output: output.to_owned(),
            eos: args.mode == "eos",
            interval: args.commit_interval.into(),
            max_batch: args.max_batch,
        };
        let (a, s) = (assigned.clone(), shutdown.clone());
        tasks.push(tokio::spawn(async move { hop.run(a, s).await }));
    }
    let want = args.partitions * args.hops.len();
    while assigned.load(Ordering::Relaxed) < want && !shutdown.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("READY");
    for t in tasks {
        t.await??;
    }
    Ok(())
}

struct Hop {
    cfg: KafkaConfig,
    group: String,
    input: String,
    output: String,
    eos: bool,
    interval: Duration,
    max_batch: usize,
}

#[derive(Default)]
struct Pending {
    deliveries: Vec<DeliveryFuture>,
    next: BTreeMap<i32, i64>,
    started: Option<Instant>,
}

impl Hop {
    async fn run(
        self,
        assigned: Arc<AtomicUsize>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (ctx, mut events) = RebalanceContext::new(Arc::new(Metrics::new()), &self.group);
        let consumer: Arc<TxnConsumer> = Arc::new(
            kafka::txn_consumer_config(&self.cfg, &self.group, &format!("{}-0", self.group))
                .create_with_context(ctx)?,
        );
        let producer: FutureProducer = if self.eos {
            kafka::init_txn_producer(&self.cfg, &format!("{}-txn", self.group)).await?
        } else {
            // The same producer settings, without the transactional id.
            let mut c = kafka::txn_producer_config(&self.cfg, "unused");
            c.remove("transactional.id");
            c.create()?
        };
        consumer.subscribe(&[&self.input])?;
        let mut pending = Pending::default();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(ev) = events.recv() => {
                    if let RebalanceEvent::Assigned(parts) = ev {
                        assigned.fetch_add(parts.len(), Ordering::Relaxed);
                    }
                }
                _ = closes(pending.started, self.interval) => {
                    self.commit(&consumer, &producer, std::mem::take(&mut pending)).await?;
                }
                msg = consumer.recv() => {
                    let m = match msg {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("passthrough: consumer error (librdkafka retries by itself): {e}");
                            continue;
                        }
                    };
                    if pending.started.is_none() && self.eos {
                        producer.begin_transaction()?;
                    }
                    pending.started.get_or_insert_with(Instant::now);
                    // Produced at once, unlike the gate, which must decide first:
                    // the limit is the best a stateless hop can do.
                    let mut rec: FutureRecord<'_, [u8], [u8]> =
                        FutureRecord::to(&self.output).partition(m.partition());
                    if let Some(k) = m.key() {
                        rec = rec.key(k);
                    }
                    if let Some(v) = m.payload() {
                        rec = rec.payload(v);
                    }
                    loop {
                        match producer.send_result(rec) {
                            Ok(f) => break pending.deliveries.push(f),
                            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                                rec = r;
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                            Err((e, _)) => return Err(e.into()),
                        }
                    }
                    pending.next.insert(m.partition(), m.offset() + 1);
                    if pending.deliveries.len() >= self.max_batch {
                        self.commit(&consumer, &producer, std::mem::take(&mut pending)).await?;
                    }
                }
            }
        }
        self.commit(&consumer, &producer, pending).await?;
        drop(producer);
        drop(consumer);
        Ok(())
    }

    /// Wait for the batch's deliveries, then commit its input offsets (in the
    /// transaction, for EOS).
    async fn commit(
        &self,
        consumer: &Arc<TxnConsumer>,
        producer: &FutureProducer,
        pending: Pending,
    ) -> anyhow::Result<()> {
        if pending.started.is_none() {
            return Ok(());
        }
        for d in pending.deliveries {
            if let Ok(Err((e, _))) = d.await {
                return Err(e.into());
            }
        }
        let mut tpl = TopicPartitionList::new();
        for (p, next) in &pending.next {
            tpl.add_partition_offset(&self.input, *p, Offset::Offset(*next))?;
        }
        if self.eos {
            kafka::send_offsets(producer, consumer, tpl).await?;
            // The passthrough has no session to restart with new producers.
            if kafka::commit_txn(producer, kafka::TxnLimits::of(&self.cfg)).await? {
                anyhow::bail!(
                    "a commit ended slowly enough that its end request may have been sent twice: the passthrough stops rather than risk a split transaction"
                );
            }
        } else {
            consumer.commit(&tpl, CommitMode::Async)?;
        }
        Ok(())
    }
}

async fn closes(started: Option<Instant>, interval: Duration) {
    match started {
        Some(t) => tokio::time::sleep_until((t + interval).into()).await,
        None => std::future::pending().await,
    }
}
