//! `stepgate worker --pool <name>`: runs the calls of a pool's tools where
//! those tools can be reached (docs/design.md "Worker pools").
//!
//! The gate publishes a pool tool's call (Call v1) on the pool's calls topic
//! in the transaction that records its step `started`; workers are one
//! consumer group per pool, reading `read_committed`, with no state of their
//! own: a committed consumer offset is a call taken. Each call:
//! - `unkeyed`: its offset is committed (synchronously) first, then Outcome v1
//!   `started` is published and acknowledged, then the tool is invoked — a
//!   crash mid-call leaves the step to the gate's deadline (`in_doubt`); no
//!   worker is given the call again;
//! - other categories: `started`, invoke, outcome, then the offset — a crash
//!   mid-call gives the call to the next member, which runs it again with the
//!   same `Idempotency-Key`.
//!
//! The outcome (Outcome v1 `finished`) goes to `progress`, in the step's
//! partition, where its owner settles it once. The tools are invoked by
//! [`crate::tools::ToolRegistry`] (HTTP and MCP, as the gate's own invoker
//! does), with the URLs, headers and secrets of this process's config only.
//!
//! Trust: a worker runs only calls signed with its pool's key
//! (`[pools.<name>] key`, shared with the gates; `contract::sign`), so a
//! record on the calls topic not written by a gate is never run — it is
//! logged, counted (`stepgate_worker_calls_refused_total`) and its offset
//! committed past, so it cannot wedge the partition. Each Outcome v1 is
//! signed with the same key and echoes the call's `token`: the gate takes a
//! report only from a holder of that dispatch's call. With `http.listen` set,
//! the worker serves `/metrics` there (`/healthz` always ok, `/readyz` once
//! consuming).

use crate::config::Config;
use crate::contract::headers::SIGNATURE;
use crate::contract::sign::{Signed, sign, verify};
use crate::contract::{PoolCall, Progress, ProgressEvent};
use crate::kafka::{self, KafkaSetupError};
use crate::telemetry::{Health, Metrics};
use crate::tools::ToolRegistry;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use rdkafka::ClientContext;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Setup(#[from] KafkaSetupError),
    #[error(
        "`--pool {0}` is not a pool name: 1 to 100 of [A-Za-z0-9_-], as the gate's tools declare it"
    )]
    Pool(String),
    #[error(
        "tools.{0} declares `pool`: a worker runs its tools by their `url` or `mcp` (the pool is `--pool`)"
    )]
    PoolTool(String),
    #[error("the worker's config declares no tools: give the pool's tools their `url` or `mcp`")]
    NoTools,
    #[error(
        "`--rate {0}`: give `<tool>=<calls per second>` for a tool of this worker's config, at least 1"
    )]
    Rate(String),
    #[error(
        "pool `{0}` has no key: give the worker's config `[pools.{0}] key = \"env:<VARIABLE>\"`, the key the gates sign the pool's calls with, and start it with that variable set"
    )]
    PoolKey(String),
}

/// What `stepgate worker` is told on its command line.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub pool: String,
    /// Calls invoked at once by this process.
    pub concurrency: usize,
    /// Static group membership (a restarted worker gets its partitions back
    /// at once); none: a dynamic member.
    pub instance_id: Option<String>,
    /// Per tool, at most this many calls started per second (`--rate
    /// tool=N`): a provider's rate limit met before it answers 429. A call
    /// waits for its turn before it is taken.
    pub rates: Vec<String>,
}

/// The consumer group of a pool's workers.
pub fn group_of(config: &Config, pool: &str) -> String {
    format!("{}.pool.{pool}", config.kafka.gate_group)
}

/// Run the pool's worker until `shutdown`: calls taken then are finished
/// (within `executor.drain_timeout`); calls not taken stay for another worker.
pub async fn run(
    config: Arc<Config>,
    opts: WorkerOptions,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    if !crate::tools::tool::valid_pool_name(&opts.pool) {
        return Err(WorkerError::Pool(opts.pool));
    }
    if let Some((name, _)) = config.tools.iter().find(|(_, t)| t.pool.is_some()) {
        return Err(WorkerError::PoolTool(name.clone()));
    }
    if config.tools.is_empty() {
        return Err(WorkerError::NoTools);
    }
    // Resolved at start (`Config::resolve_pool_keys`): without it nothing
    // could be verified, nor signed.
    let Some(key) = config
        .pools
        .get(&opts.pool)
        .and_then(crate::config::PoolConfig::key_bytes)
        .map(<[u8]>::to_vec)
    else {
        return Err(WorkerError::PoolKey(opts.pool));
    };
    let mut rates = HashMap::new();
    for r in &opts.rates {
        let per_second = r
            .split_once('=')
            .filter(|(tool, _)| config.tools.contains_key(*tool))
            .and_then(|(tool, n)| Some((tool, n.parse::<u32>().ok().and_then(NonZeroU32::new)?)));
        let Some((tool, n)) = per_second else {
            return Err(WorkerError::Rate(r.clone()));
        };
        rates.insert(tool.to_owned(), RateLimiter::direct(Quota::per_second(n)));
    }
    let k = &config.kafka;
    kafka::check_connection(k).await?;
    kafka::create_pool_topics(k, &config.state, std::slice::from_ref(&opts.pool)).await?;
    let topic = k.topics.calls_for(&opts.pool);
    let group = group_of(&config, &opts.pool);
    let owned = Arc::new(Mutex::new(Owned::default()));
    let consumer: Arc<PoolConsumer> = Arc::new(
        kafka::worker_consumer_config(k, &group, opts.instance_id.as_deref())
            .create_with_context(PoolContext(owned.clone()))?,
    );
    consumer.subscribe(&[&topic])?;
    let producer: FutureProducer = kafka::direct_producer_config(k).create()?;
    let concurrency = opts.concurrency.max(1);
    let metrics = Arc::new(Metrics::with_tools(config.tool_names()));
    let health = Arc::new(Health::new(Duration::MAX));
    serve_metrics(&config, &metrics, &health, &shutdown).await;
    let worker = Arc::new(Worker {
        tools: ToolRegistry::new(&config.tools, concurrency),
        consumer: consumer.clone(),
        producer,
        progress: k.topics.progress.clone(),
        topic: topic.clone(),
        pool: opts.pool.clone(),
        key,
        metrics,
        rates,
        owned,
    });
    info!(pool = %opts.pool, %topic, %group, tools = ?config.tools.keys().collect::<Vec<_>>(), concurrency, "worker consuming");
    health.set_gate_ready(true);
    let slots = Arc::new(Semaphore::new(concurrency));
    loop {
        let slot = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            s = slots.clone().acquire_owned() => s.expect("the slots are never closed"),
        };
        let msg = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            m = consumer.recv() => m,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "consumer error (librdkafka retries by itself)");
                continue;
            }
        };
        let partition = msg.partition();
        // Read while the partition is this member's: its calls may be taken
        // only as long as it stays so (see `Owned`).
        let Some(epoch) = worker.owned().epochs.get(&partition).copied() else {
            continue;
        };
        // Headers read as `kafka::to_input` does: a name that is not UTF-8
        // (anyone who can write the topic can send one) never panics.
        let input = kafka::to_input(&msg);
        let signature = input
            .headers
            .into_iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(SIGNATURE))
            .and_then(|(_, v)| v);
        let taken = Taken {
            partition,
            epoch,
            offset: input.offset,
            payload: input.payload.unwrap_or_default(),
            signature,
        };
        let w = worker.clone();
        tokio::spawn(async move {
            w.handle(taken).await;
            drop(slot);
        });
    }
    // Calls taken finish and report; the rest stay on the topic for another
    // member (their offsets are not committed).
    let drain = config.executor.drain_timeout.0;
    if tokio::time::timeout(drain, slots.acquire_many(concurrency as u32))
        .await
        .is_err()
    {
        warn!(
            "drain timeout: calls still running are left to the gate's deadline (unkeyed: in_doubt; others: run again)"
        );
    }
    drop(worker);
    kafka::close_within("the worker's consumer", consumer, Duration::from_secs(10)).await;
    info!("worker stopped");
    Ok(())
}

/// `/metrics` at `http.listen`, when set; a port already taken (a gate on
/// the same host, say) only loses the endpoint, never the worker.
async fn serve_metrics(
    config: &Config,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
) {
    if config.http.listen.is_empty() {
        return;
    }
    let served = match config.http.listen.parse::<std::net::SocketAddr>() {
        Ok(addr) => std::net::TcpListener::bind(addr)
            .and_then(|l| {
                crate::telemetry::serve(l, metrics.clone(), health.clone(), shutdown.clone())
            })
            .map_err(|e| e.to_string()),
        Err(e) => Err(format!("{e}")),
    };
    match served {
        Ok(addr) => info!(%addr, "serving /metrics"),
        Err(error) => {
            warn!(listen = %config.http.listen, %error, "cannot serve /metrics (set `http.listen` to a free address, or empty): going on without it")
        }
    }
}

/// A call as read from the calls topic.
struct Taken {
    partition: i32,
    /// The partition's assignment it was read in.
    epoch: u64,
    offset: i64,
    payload: Vec<u8>,
    /// Its `stepgate-signature` header.
    signature: Option<Vec<u8>>,
}

struct Worker {
    tools: ToolRegistry,
    consumer: Arc<PoolConsumer>,
    producer: FutureProducer,
    progress: String,
    topic: String,
    pool: String,
    /// The pool's key: calls are run only signed with it; outcomes are signed.
    key: Vec<u8>,
    metrics: Arc<Metrics>,
    /// `--rate`: per tool, the calls it may start per second.
    rates: HashMap<String, DefaultDirectRateLimiter>,
    owned: Arc<Mutex<Owned>>,
}

/// The calls partitions this member owns, each with the assignment (epoch)
/// it came in, and the offset committed last in each. A commit is made only
/// in the assignment its call was read in, with the lock held; a revoke takes
/// the lock too, so it waits for a commit in flight. So once a partition is
/// revoked, no commit of this member for it can land: its next owner, which
/// reads the committed offset only after the revoke, never runs an `unkeyed`
/// call this member took (the group protocol itself does not check which
/// member owns the partition of an offset commit).
#[derive(Default)]
struct Owned {
    epochs: HashMap<i32, u64>,
    next_epoch: u64,
    /// Commits only move forward (an `unkeyed` call's commit may already
    /// cover an earlier call still running; that one is re-run by the gate's
    /// deadline if lost).
    committed: HashMap<i32, i64>,
}

/// Keeps [`Owned`] in step with the group's assignments.
struct PoolContext(Arc<Mutex<Owned>>);

type PoolConsumer = StreamConsumer<PoolContext>;

impl PoolContext {
    fn owned(&self) -> std::sync::MutexGuard<'_, Owned> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl ClientContext for PoolContext {}

impl ConsumerContext for PoolContext {
    fn pre_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let mut o = self.owned();
            for e in tpl.elements() {
                o.epochs.remove(&e.partition());
                o.committed.remove(&e.partition());
            }
        }
    }

    fn post_rebalance(&self, _c: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let mut o = self.owned();
                for e in tpl.elements() {
                    o.next_epoch += 1;
                    let epoch = o.next_epoch;
                    o.epochs.insert(e.partition(), epoch);
                }
                let mut owned: Vec<i32> = o.epochs.keys().copied().collect();
                owned.sort_unstable();
                info!(partitions = ?owned, "calls partitions assigned");
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

impl Worker {
    async fn handle(&self, taken: Taken) {
        let Taken {
            partition,
            epoch,
            offset,
            payload,
            signature,
        } = taken;
        // Only a gate holds the key: anything else on the topic is never run
        // (and committed past, so it cannot hold the partition up).
        let signed = signature
            .as_deref()
            .is_some_and(|s| verify(&self.key, Signed::Call, &payload, s));
        if !signed {
            self.metrics
                .worker_call_refused(&self.pool, "signature", partition, offset);
            let _ = self.commit(partition, epoch, offset).await;
            return;
        }
        let call: PoolCall = match serde_json::from_slice(&payload) {
            Ok(c) => c,
            Err(e) => {
                warn!(partition, offset, error = %e, "an unreadable call on the calls topic: skipped");
                self.metrics
                    .worker_call_refused(&self.pool, "unreadable", partition, offset);
                let _ = self.commit(partition, epoch, offset).await;
                return;
            }
        };
        // Its turn under the tool's rate first: a call that waits past its
        // take_by time is not taken (the gate answers it no_worker).
        if let Some(limit) = self.rates.get(&call.step.tool) {
            limit.until_ready().await;
        }
        let now = chrono::Utc::now().timestamp_millis();
        if now > call.take_by_ms {
            // The gate answers it `no_worker` at its deadline: never taken.
            warn!(step = %call.step, dispatch = call.dispatch, late_ms = now - call.take_by_ms, "a call past its take_by time: not taken (the gate answers it no_worker)");
            let _ = self.commit(partition, epoch, offset).await;
            return;
        }
        let unkeyed = call.category == "unkeyed";
        // Unkeyed: taken for good before anything is sent to the tool.
        if unkeyed && let Err(e) = self.commit(partition, epoch, offset).await {
            warn!(step = %call.step, error = %e, "could not commit taking an unkeyed call: not invoked (another member takes it, or the gate answers it)");
            return;
        }
        if let Err(e) = self.report(&call, ProgressEvent::Started).await {
            // Not said taken: not invoked. A keyed call stays uncommitted for
            // another member; an unkeyed one is answered `no_worker`.
            warn!(step = %call.step, error = %e, "could not publish that the call was taken: not invoked");
            return;
        }
        info!(step = %call.step, dispatch = call.dispatch, category = %call.category, "call taken");
        let outcome = self.tools.invoke(&call.to_call()).await;
        info!(step = %call.step, dispatch = call.dispatch, outcome = outcome.label(), "call finished");
        if let Err(e) = self
            .report(&call, ProgressEvent::Finished { outcome })
            .await
        {
            // Unkeyed: the gate's deadline says in_doubt. Keyed: left
            // uncommitted, run again with the same key.
            warn!(step = %call.step, error = %e, "could not publish the call's outcome");
            return;
        }
        if !unkeyed && let Err(e) = self.commit(partition, epoch, offset).await {
            warn!(step = %call.step, error = %e, "could not commit a finished call (it may run again, with the same key)");
        }
    }

    /// Outcome v1 to the step's owner: `progress`, in the step's partition,
    /// with the call's token and signed with the pool's key, acknowledged by
    /// the brokers before this returns.
    async fn report(&self, call: &PoolCall, event: ProgressEvent) -> Result<(), KafkaError> {
        let progress = Progress {
            step: call.step.clone(),
            dispatch: call.dispatch,
            fast_ref: None,
            at_ms: chrono::Utc::now().timestamp_millis(),
            token: Some(call.token.clone()),
            event,
        };
        let payload = serde_json::to_vec(&progress).expect("a progress record serialises");
        let signature = sign(&self.key, Signed::Outcome, &payload);
        let mut headers = OwnedHeaders::new().insert(Header {
            key: SIGNATURE,
            value: Some(signature.as_bytes()),
        });
        if let Some(tp) = &call.traceparent {
            headers = headers.insert(Header {
                key: crate::contract::headers::TRACEPARENT,
                value: Some(tp.as_bytes()),
            });
        }
        let record = FutureRecord::to(&self.progress)
            .partition(call.partition)
            .key(call.step.workflow_id.as_bytes())
            .payload(&payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map(|_| ())
            .map_err(|(e, _)| e)
    }

    fn owned(&self) -> std::sync::MutexGuard<'_, Owned> {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Commit that the call at `offset` (and everything before it in its
    /// partition) is taken, synchronously; never backwards; and only while
    /// the partition is still owned in the assignment `epoch` it was read in
    /// (an error otherwise: not taken).
    async fn commit(&self, partition: i32, epoch: u64, offset: i64) -> Result<(), KafkaError> {
        let next = offset + 1;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(next))?;
        let (consumer, owned) = (self.consumer.clone(), self.owned.clone());
        tokio::task::spawn_blocking(move || {
            // Held over the commit: see `Owned`.
            let mut o = owned
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if o.epochs.get(&partition) != Some(&epoch) {
                return Err(KafkaError::ConsumerCommit(
                    rdkafka::types::RDKafkaErrorCode::AssignmentLost,
                ));
            }
            if o.committed.get(&partition).is_some_and(|&c| c >= next) {
                return Ok(());
            }
            consumer.commit(&tpl, CommitMode::Sync)?;
            o.committed.insert(partition, next);
            Ok(())
        })
        .await
        .map_err(|_| KafkaError::Canceled)?
    }
}
