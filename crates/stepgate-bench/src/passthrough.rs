//! The limit: a stateless consume → produce passthrough with the same client
//! library and client settings as stepgate's gate, and its commit cadence (a
//! batch commits `commit_interval` after its first input or at `max_batch`
//! inputs). Each record is produced at once to the same partition number of the
//! next topic; at the commit, deliveries are awaited, then the input offsets are
//! committed: in the batch's transaction (EOS, read_committed) or after it
//! (at-least-once). Run by the bench as a child process.
//!
//! With `--tool-url`, the floor of any system that calls the tool: one hop whose
//! records are intents, parsed by stepgate's own parser, the tool called through
//! stepgate's own HTTP client (`ToolRegistry`, the same key, headers and pool) once
//! per step key this process has seen (an in-memory set: no state, no
//! changelog, no step log), every intent echoed once its step's call returned (a
//! repeat at once). Calls run while a batch commits, as a keyed step's do in
//! the gate; each partition's committed offset stops at its
//! first call still running. It is no dedup to rely on: after a crash it calls
//! and echoes again from that offset, and it forgets every key. The bench does
//! not crash it.

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use stepgate::config::KafkaConfig;
use stepgate::contract::{self, Call, Outcome, StepKey};
use stepgate::kafka::{self, RebalanceContext, RebalanceEvent, TxnConsumer};
use stepgate::telemetry::Metrics;
use stepgate::tools::{ToolConfig, ToolRegistry};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
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
    /// Call this HTTP tool (the workload's, `keyed`) once per new step key
    /// before echoing (one hop only): see the module's comment.
    #[arg(long)]
    tool_url: Option<String>,
    /// Calls in flight at most, with `--tool-url` (stepgate's `executor.concurrency`).
    #[arg(long, default_value_t = 1024)]
    concurrency: usize,
    /// With `--tool-url`: `stepgate` calls through stepgate's `ToolRegistry`
    /// (reqwest, its retries and outcome classification); `reqwest`, a bare
    /// reqwest client with stepgate's client settings, and `hyper`, a bare
    /// hyper-util client, each sending the same request (a 2xx or the hop
    /// stops): what each layer above hyper costs (docs/performance.md).
    #[arg(
        long,
        env = "PASSTHROUGH_HTTP_CLIENT",
        value_parser = ["stepgate", "hyper", "reqwest"],
        default_value = "stepgate"
    )]
    http_client: String,
    /// With `--http-client reqwest`: client settings changed from stepgate's,
    /// comma-separated (`noproxy`, `h1`: HTTP/1.1 only, `noretry`: no
    /// protocol-NACK retries, `nodelayoff`: Nagle's algorithm on).
    #[arg(long, env = "PASSTHROUGH_REQWEST_TWEAKS", value_delimiter = ',')]
    reqwest_tweaks: Vec<String>,
    /// With `--http-client hyper`: `TCP_NODELAY` on, as reqwest (and so
    /// stepgate) sets it; hyper-util's own default is off.
    #[arg(long, env = "PASSTHROUGH_HYPER_NODELAY")]
    hyper_nodelay: bool,
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
    if args.tool_url.is_some() && args.hops.len() != 1 {
        anyhow::bail!("--tool-url runs one hop, got {}", args.hops.len());
    }
    let tools = match &args.tool_url {
        Some(url) => {
            let tool: ToolConfig =
                serde_json::from_value(serde_json::json!({ "category": "keyed", "url": url }))?;
            let tools = BTreeMap::from([(crate::workload::TOOL.to_owned(), tool)]);
            let via = match args.http_client.as_str() {
                "hyper" => Via::Hyper(Box::new(Bare::new(
                    url,
                    args.concurrency,
                    args.hyper_nodelay,
                ))),
                "reqwest" => Via::Reqwest(Plain::new(url, args.concurrency, &args.reqwest_tweaks)),
                _ => Via::Registry,
            };
            Some(Caller {
                registry: ToolRegistry::new(&tools, args.concurrency),
                via,
            })
        }
        None => None,
    };
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
        match tools.clone() {
            Some(tools) => {
                let calls = Arc::new(Semaphore::new(args.concurrency));
                tasks.push(tokio::spawn(async move {
                    hop.run_http(tools, calls, a, s).await
                }));
            }
            None => tasks.push(tokio::spawn(async move { hop.run(a, s).await })),
        }
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

impl Hop {
    /// The hop's consumer (subscribed), its producer and its rebalance events.
    async fn clients(
        &self,
    ) -> anyhow::Result<(
        Arc<TxnConsumer>,
        FutureProducer,
        mpsc::UnboundedReceiver<RebalanceEvent>,
    )> {
        let (ctx, events) = RebalanceContext::new(Arc::new(Metrics::new()), &self.group);
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
        Ok((consumer, producer, events))
    }

    async fn run(
        self,
        assigned: Arc<AtomicUsize>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (consumer, producer, mut events) = self.clients().await?;
        let mut batch = Batch::default();
        // This batch's input only: nothing else is committed with it.
        let mut progress = Progress::default();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(ev) = events.recv() => {
                    if let RebalanceEvent::Assigned(parts) = ev {
                        assigned.fetch_add(parts.len(), Ordering::Relaxed);
                    }
                }
                _ = closes(batch.started, self.interval) => {
                    let progress = std::mem::take(&mut progress);
                    self.commit(&consumer, &producer, std::mem::take(&mut batch), &progress).await?;
                }
                msg = consumer.recv() => {
                    let m = match msg {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("passthrough: consumer error (librdkafka retries by itself): {e}");
                            continue;
                        }
                    };
                    batch.begin(&producer, self.eos)?;
                    // Produced at once, unlike the gate, which must decide first:
                    // the limit is the best a stateless hop can do.
                    let d = send(&producer, &self.output, m.partition(), m.key(), m.payload()).await?;
                    batch.deliveries.push(d);
                    progress.consumed.insert(m.partition(), m.offset() + 1);
                    if batch.deliveries.len() >= self.max_batch {
                        let progress = std::mem::take(&mut progress);
                        self.commit(&consumer, &producer, std::mem::take(&mut batch), &progress).await?;
                    }
                }
            }
        }
        self.commit(&consumer, &producer, batch, &progress).await?;
        drop(producer);
        drop(consumer);
        Ok(())
    }

    /// Wait for the batch's deliveries, then commit `progress`'s offsets (in
    /// the transaction, for EOS).
    async fn commit(
        &self,
        consumer: &Arc<TxnConsumer>,
        producer: &FutureProducer,
        batch: Batch,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        if batch.started.is_none() {
            return Ok(());
        }
        for d in batch.deliveries {
            if let Ok(Err((e, _))) = d.await {
                return Err(e.into());
            }
        }
        let tpl = progress.offsets(&self.input)?;
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

/// Produce one record to `partition` of `topic`, waiting while librdkafka's
/// queue is full.
async fn send(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
) -> anyhow::Result<DeliveryFuture> {
    let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).partition(partition);
    if let Some(k) = key {
        rec = rec.key(k);
    }
    if let Some(v) = payload {
        rec = rec.payload(v);
    }
    loop {
        match producer.send_result(rec) {
            Ok(f) => return Ok(f),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                rec = r;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err((e, _)) => return Err(e.into()),
        }
    }
}

/// How the HTTP hop calls the tool.
#[derive(Clone)]
struct Caller {
    /// stepgate's registry: the tool's name for the intent parser, and the
    /// calls themselves with `Via::Registry`.
    registry: ToolRegistry,
    via: Via,
}

/// The client of `--http-client`.
#[derive(Clone)]
enum Via {
    Registry,
    Reqwest(Plain),
    Hyper(Box<Bare>),
}

/// A bare reqwest client with stepgate's client settings: the tool
/// protocol's request, nothing else.
#[derive(Clone)]
struct Plain {
    client: reqwest::Client,
    url: reqwest::Url,
}

impl Plain {
    fn new(url: &str, concurrency: usize, tweaks: &[String]) -> Plain {
        let mut b = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(concurrency)
            .pool_idle_timeout(Duration::from_secs(4))
            .tcp_keepalive(Duration::from_secs(30));
        for t in tweaks {
            b = match t.as_str() {
                "noproxy" => b.no_proxy(),
                "h1" => b.http1_only(),
                "noretry" => b.retry(reqwest::retry::never()),
                "nodelayoff" => b.tcp_nodelay(false),
                "" => b,
                other => panic!("--reqwest-tweaks: unknown {other:?}"),
            };
        }
        let client = b.build().expect("static settings");
        Plain {
            client,
            url: url.parse().expect("the bench's tool URL parses"),
        }
    }

    async fn call(&self, call: &Call) -> anyhow::Result<()> {
        use contract::headers;
        let step = &call.step;
        let resp = self
            .client
            .post(self.url.clone())
            .header(headers::IDEMPOTENCY_KEY, step.idempotency_key())
            .header(headers::STEP_INDEX, step.step_index.to_string())
            .header(headers::ATTEMPT, step.attempt.to_string())
            .header(headers::WORKFLOW_ID, step.workflow_id.as_str())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(call.arguments.as_str().to_owned())
            .send()
            .await?;
        let status = resp.status();
        resp.bytes().await?;
        anyhow::ensure!(status.is_success(), "the tool answered {status}");
        Ok(())
    }
}

impl Caller {
    async fn call(&self, call: &Call) -> anyhow::Result<()> {
        match &self.via {
            Via::Reqwest(plain) => plain.call(call).await,
            Via::Hyper(bare) => bare.call(call).await,
            Via::Registry => match self.registry.invoke(call).await {
                Outcome::Ok { .. } => Ok(()),
                other => anyhow::bail!("the call of {:?} ended {}", call.step, other.label()),
            },
        }
    }
}

/// A bare hyper-util client: the tool protocol's request, nothing else.
#[derive(Clone)]
struct Bare {
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    url: hyper::Uri,
}

impl Bare {
    fn new(url: &str, concurrency: usize, nodelay: bool) -> Bare {
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_nodelay(nodelay);
        connector.set_keepalive(Some(Duration::from_secs(30)));
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(concurrency)
                .pool_idle_timeout(Duration::from_secs(4))
                .build(connector);
        Bare {
            client,
            url: url.parse().expect("the bench's tool URL parses"),
        }
    }

    async fn call(&self, call: &Call) -> anyhow::Result<()> {
        use contract::headers;
        use http_body_util::BodyExt;
        let step = &call.step;
        let req = hyper::Request::post(self.url.clone())
            .header(headers::IDEMPOTENCY_KEY, step.idempotency_key())
            .header(headers::STEP_INDEX, step.step_index.to_string())
            .header(headers::ATTEMPT, step.attempt.to_string())
            .header(headers::WORKFLOW_ID, step.workflow_id.as_str())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::copy_from_slice(
                call.arguments.as_str().as_bytes(),
            )))?;
        let resp = self.client.request(req).await?;
        let status = resp.status();
        resp.into_body().collect().await?;
        anyhow::ensure!(status.is_success(), "the tool answered {status}");
        Ok(())
    }
}

/// An intent to echo, once its step's call (if any) returned.
struct Echo {
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
}

/// A hop's open transaction (EOS) or batch (at-least-once).
#[derive(Default)]
struct Batch {
    deliveries: Vec<DeliveryFuture>,
    started: Option<Instant>,
}

impl Batch {
    /// Open the batch (its transaction, for EOS) unless it is open.
    fn begin(&mut self, producer: &FutureProducer, eos: bool) -> anyhow::Result<()> {
        if self.started.is_none() {
            if eos {
                producer.begin_transaction()?;
            }
            self.started = Some(Instant::now());
        }
        Ok(())
    }
}

/// Where a hop's input stands, per partition: what a commit commits.
#[derive(Default)]
struct Progress {
    /// The offset after the last record consumed.
    consumed: BTreeMap<i32, i64>,
    /// The HTTP hop's offsets whose call is still running: the committed
    /// offset stops at the first of them.
    running: BTreeMap<i32, BTreeSet<i64>>,
}

impl Progress {
    /// A call returned: its offset no longer holds the commit back.
    fn returned(&mut self, echo: &Echo) {
        if let Some(r) = self.running.get_mut(&echo.partition) {
            r.remove(&echo.offset);
        }
    }

    fn offsets(&self, topic: &str) -> anyhow::Result<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        for (p, next) in &self.consumed {
            let first_running = self.running.get(p).and_then(|r| r.first().copied());
            tpl.add_partition_offset(topic, *p, Offset::Offset(first_running.unwrap_or(*next)))?;
        }
        Ok(tpl)
    }
}

impl Hop {
    /// The `--tool-url` hop: see the module's comment.
    async fn run_http(
        self,
        tools: Caller,
        calls: Arc<Semaphore>,
        assigned: Arc<AtomicUsize>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (consumer, producer, mut events) = self.clients().await?;
        let tools = Arc::new(tools);
        let mut seen: HashSet<StepKey> = HashSet::new();
        let mut progress = Progress::default();
        let mut inflight: JoinSet<anyhow::Result<Echo>> = JoinSet::new();
        let mut open = Batch::default();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(ev) = events.recv() => {
                    if let RebalanceEvent::Assigned(parts) = ev {
                        assigned.fetch_add(parts.len(), Ordering::Relaxed);
                    }
                }
                _ = closes(open.started, self.interval) => {
                    self.commit(&consumer, &producer, std::mem::take(&mut open), &progress).await?;
                }
                Some(done) = inflight.join_next() => {
                    let echo = done??;
                    progress.returned(&echo);
                    self.echo(&consumer, &producer, &mut open, &progress, echo).await?;
                }
                (permit, msg) = async {
                    let permit = calls.clone().acquire_owned().await;
                    (permit, consumer.recv().await)
                } => {
                    let m = match msg {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("passthrough: consumer error (librdkafka retries by itself): {e}");
                            continue;
                        }
                    };
                    let echo = Echo {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().map(<[u8]>::to_vec),
                    };
                    progress.consumed.insert(echo.partition, echo.offset + 1);
                    let intent = echo.payload.as_deref().and_then(|p| {
                        contract::parse_intent(p, 1 << 20, tools.registry.names()).ok()
                    });
                    let Some(intent) = intent.filter(|i| seen.insert(i.step_key())) else {
                        // A repeat (or no intent at all): echoed at once.
                        self.echo(&consumer, &producer, &mut open, &progress, echo).await?;
                        continue;
                    };
                    progress.running.entry(echo.partition).or_default().insert(echo.offset);
                    let call = Call {
                        step: intent.step_key(),
                        arguments: intent.arguments,
                        dispatch: 1,
                        fast_ref: None,
                        traceparent: None,
                        call_id: intent.call_id,
                        token: None,
                    };
                    let tools = tools.clone();
                    inflight.spawn(async move {
                        let _slot = permit;
                        tools.call(&call).await?;
                        Ok(echo)
                    });
                }
            }
        }
        while let Some(done) = inflight.join_next().await {
            let echo = done??;
            progress.returned(&echo);
            self.echo(&consumer, &producer, &mut open, &progress, echo)
                .await?;
        }
        self.commit(&consumer, &producer, open, &progress).await?;
        drop(producer);
        drop(consumer);
        Ok(())
    }

    /// Produce `echo` in the open transaction (begun if none is), and commit
    /// at `max_batch` records.
    async fn echo(
        &self,
        consumer: &Arc<TxnConsumer>,
        producer: &FutureProducer,
        open: &mut Batch,
        progress: &Progress,
        echo: Echo,
    ) -> anyhow::Result<()> {
        open.begin(producer, self.eos)?;
        let d = send(
            producer,
            &self.output,
            echo.partition,
            echo.key.as_deref(),
            echo.payload.as_deref(),
        )
        .await?;
        open.deliveries.push(d);
        if open.deliveries.len() >= self.max_batch {
            self.commit(consumer, producer, std::mem::take(open), progress)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offset_of(tpl: &TopicPartitionList, p: i32) -> Offset {
        tpl.find_partition("in", p)
            .expect("partition listed")
            .offset()
    }

    fn returned(partition: i32, offset: i64) -> Echo {
        Echo {
            partition,
            offset,
            key: None,
            payload: None,
        }
    }

    #[test]
    fn the_committed_offset_stops_at_the_first_call_still_running() {
        let mut progress = Progress::default();
        progress.consumed.insert(0, 10);
        progress.consumed.insert(1, 7);
        progress.running.entry(0).or_default().extend([4, 8]);
        // Partition 1's calls all returned: the whole of it is done.
        progress.running.entry(1).or_default().insert(5);
        progress.returned(&returned(1, 5));
        let tpl = progress.offsets("in").unwrap();
        assert_eq!(offset_of(&tpl, 0), Offset::Offset(4));
        assert_eq!(offset_of(&tpl, 1), Offset::Offset(7));
        // The first call returns: up to the second.
        progress.returned(&returned(0, 4));
        assert_eq!(
            offset_of(&progress.offsets("in").unwrap(), 0),
            Offset::Offset(8)
        );
    }
}
