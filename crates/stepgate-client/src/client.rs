//! The agent side: publish an intent for a step and await its final answer.
//!
//! The step key is born here, not in the model: a [`Workflow`] numbers its steps,
//! and a timed-out call is re-published as *the same step* (a new `call_id`,
//! the same `(workflow_id, step_index, tool, attempt)`), which stepgate answers
//! with the original result instead of running the tool again. Only
//! [`Workflow::retry_step`] asks for a deliberate re-execution (`attempt` + 1).
//!
//! A call's answer is matched by the step key *and* the `call_id` of the
//! intent it answers, never the `call_id` alone: another workflow's call may
//! carry the same `call_id` (models number their calls alike), and its answer
//! must never reach this caller. An answer that matches no waiting call is
//! dropped.
//!
//! Every intent is published to the partition that owns its workflow,
//! [`crate::contract::partition_for`] (murmur2, as Kafka's Java clients do), so a
//! retry from this client and one from any Java or murmur2 client of the same
//! step meet in one partition. The intents topic's partition count is read
//! once, when the client connects.

use crate::contract::{Arguments, Intent, RejectionReason, StepKey, ToolResult};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Connect(#[from] crate::connect::ConnectError),
    #[error("no answer for step {step} within {waited:?} ({publishes} publishes)")]
    Timeout {
        step: StepKey,
        waited: Duration,
        publishes: u32,
    },
    #[error("`arguments` must be a JSON object, got {0}")]
    ArgumentsNotAnObject(Value),
    #[error("the results topic `{0}` does not exist")]
    NoResultsTopic(String),
    #[error("the intents topic `{0}` does not exist")]
    NoIntentsTopic(String),
}

/// Where and how the client talks to stepgate. Its `Debug` redacts secret
/// client properties (`sasl.password`, …).
#[derive(Clone)]
pub struct ClientOptions {
    pub brokers: String,
    pub intents_topic: String,
    pub results_topic: String,
    /// Give up on a call after this long.
    pub timeout: Duration,
    /// Re-publish the same step when no answer came within this long (an answer
    /// to any of the call's publishes ends the wait).
    pub republish_after: Duration,
    /// librdkafka properties for both clients (TLS, SASL, …).
    pub kafka: BTreeMap<String, String>,
}

impl ClientOptions {
    pub fn new(brokers: &str) -> Self {
        ClientOptions {
            brokers: brokers.to_owned(),
            intents_topic: "stepgate.intents".into(),
            results_topic: "stepgate.results".into(),
            timeout: Duration::from_secs(120),
            republish_after: Duration::from_secs(15),
            kafka: BTreeMap::new(),
        }
    }

    fn kafka_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        for (k, v) in &self.kafka {
            c.set(k, v);
        }
        c
    }
}

impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOptions")
            .field("brokers", &self.brokers)
            .field("intents_topic", &self.intents_topic)
            .field("results_topic", &self.results_topic)
            .field("timeout", &self.timeout)
            .field("republish_after", &self.republish_after)
            .field(
                "kafka",
                &crate::redact::redact_client_properties(&self.kafka),
            )
            .finish()
    }
}

/// One tool call at one step of a workflow.
#[derive(Debug, Clone)]
pub struct StepCall {
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    pub arguments: Arguments,
    pub attempt: u64,
    /// The wire `call_id` of the call's first intent: it names this call for
    /// its answer, and is not the step's identity. Generated when `None`
    /// (and for every re-publish). Set one only if it is unique to this call:
    /// never a model's `tool_call_id`, which repeats across conversations —
    /// put that in `metadata` to correlate.
    pub call_id: Option<String>,
    /// Stored with the step, never interpreted (e.g. the model's `tool_call_id`).
    pub metadata: Option<Map<String, Value>>,
    /// How long this call waits for its answer, instead of
    /// [`ClientOptions::timeout`].
    pub timeout: Option<Duration>,
}

impl StepCall {
    /// `arguments` must be a JSON object.
    pub fn new(
        workflow_id: &str,
        step_index: u64,
        tool: &str,
        arguments: Value,
    ) -> Result<Self, ClientError> {
        let arguments =
            Arguments::try_from(arguments).map_err(ClientError::ArgumentsNotAnObject)?;
        Ok(StepCall {
            workflow_id: workflow_id.to_owned(),
            step_index,
            tool: tool.to_owned(),
            arguments,
            attempt: 0,
            call_id: None,
            metadata: None,
            timeout: None,
        })
    }

    /// Wait up to `timeout` for this call's answer (instead of the client's).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn attempt(mut self, attempt: u64) -> Self {
        self.attempt = attempt;
        self
    }

    /// See [`StepCall::call_id`](field@StepCall::call_id): unique to this call.
    pub fn call_id(mut self, call_id: &str) -> Self {
        self.call_id = Some(call_id.to_owned());
        self
    }

    /// Metadata stored with the step (never interpreted), e.g. the model's
    /// `tool_call_id` for correlation.
    pub fn metadata(mut self, metadata: Map<String, Value>) -> Self {
        self.metadata = Some(metadata);
        self
    }

    pub fn step_key(&self) -> StepKey {
        StepKey {
            workflow_id: self.workflow_id.clone(),
            step_index: self.step_index,
            tool: self.tool.clone(),
            attempt: self.attempt,
        }
    }
}

/// What an answer is delivered by: the step key and the `call_id` of the
/// intent it answers.
type CallKey = (StepKey, String);

/// The calls waiting for answers. Each call registers under the key of every
/// intent it publishes, with a number of its own, so that two calls with the
/// same key (the same step, the same `call_id`) both hear its answer.
#[derive(Default)]
struct Waiters {
    by_call: HashMap<CallKey, Vec<(u64, mpsc::UnboundedSender<ToolResult>)>>,
}

impl Waiters {
    fn add(&mut self, key: CallKey, waiter: u64, tx: mpsc::UnboundedSender<ToolResult>) {
        self.by_call.entry(key).or_default().push((waiter, tx));
    }

    fn remove(&mut self, key: &CallKey, waiter: u64) {
        if let Some(waiting) = self.by_call.get_mut(key) {
            waiting.retain(|(w, _)| *w != waiter);
            if waiting.is_empty() {
                self.by_call.remove(key);
            }
        }
    }

    /// The calls an answer is for: those of its step key and `call_id`.
    fn of(&self, answer: &ToolResult) -> Vec<mpsc::UnboundedSender<ToolResult>> {
        let Some(call_id) = answer.call_id.clone() else {
            return Vec::new();
        };
        let key = (
            StepKey {
                workflow_id: answer.workflow_id.clone(),
                step_index: answer.step_index,
                tool: answer.tool.clone(),
                attempt: answer.attempt,
            },
            call_id,
        );
        self.by_call
            .get(&key)
            .map(|w| w.iter().map(|(_, tx)| tx.clone()).collect())
            .unwrap_or_default()
    }
}

/// A connection to stepgate for one agent process; cheap to share (`&Client`)
/// across many concurrent calls.
pub struct Client {
    options: ClientOptions,
    producer: FutureProducer,
    /// Partitions of the intents topic, read at connect.
    intent_partitions: i32,
    waiters: Arc<Mutex<Waiters>>,
    next_id: AtomicU64,
    id_prefix: String,
    stop: CancellationToken,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Client {
    /// Connect, and start reading answers from the current end of the results
    /// topic (so no answer to a call made from now on can be missed).
    pub async fn new(options: ClientOptions) -> Result<Client, ClientError> {
        let producer: FutureProducer = options
            .kafka_config()
            .set("linger.ms", "0")
            .set("enable.idempotence", "true")
            .create()?;
        let id_prefix = format!(
            "sg-{:x}-{:x}",
            std::process::id(),
            chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default() & 0xffff_ffff_ffff
        );
        let waiters: Arc<Mutex<Waiters>> = Arc::default();
        let stop = CancellationToken::new();
        let opts = options.clone();
        let group = format!("{id_prefix}-reader");
        let (consumer, intent_partitions) = tokio::task::spawn_blocking(move || {
            let partitions = partition_count(&opts, &opts.intents_topic)?
                .ok_or_else(|| ClientError::NoIntentsTopic(opts.intents_topic.clone()))?;
            Ok::<_, ClientError>((answers_consumer(&opts, &group)?, partitions))
        })
        .await
        .map_err(|_| KafkaError::Canceled)??;
        let (w, s) = (waiters.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = s.cancelled() => break,
                    m = consumer.recv() => m,
                };
                let Ok(m) = msg else { continue };
                let Some(result) = m
                    .payload()
                    .and_then(|p| serde_json::from_slice::<ToolResult>(p).ok())
                else {
                    continue;
                };
                let txs = w.lock().expect("waiters lock").of(&result);
                for tx in txs {
                    let _ = tx.send(result.clone());
                }
            }
        });
        Ok(Client {
            options,
            producer,
            intent_partitions,
            waiters,
            next_id: AtomicU64::new(0),
            id_prefix,
            stop,
        })
    }

    fn new_call_id(&self) -> String {
        format!(
            "{}-{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Publish the step and await its final answer; on silence, re-publish the
    /// same step every `republish_after`, until `timeout`.
    pub async fn call(&self, call: StepCall) -> Result<ToolResult, ClientError> {
        self.call_published(call, None).await
    }

    /// [`Self::call`], telling `published` once the step's first intent is on
    /// the intents topic (acknowledged by the broker): from then on the step
    /// is stepgate's, whatever becomes of this wait. If the first publish
    /// fails, `published` is dropped unsent.
    pub async fn call_published(
        &self,
        call: StepCall,
        mut published: Option<oneshot::Sender<()>>,
    ) -> Result<ToolResult, ClientError> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let waiter = self.next_id.fetch_add(1, Ordering::Relaxed);
        let step = call.step_key();
        let mut ids = Vec::new();
        let started = tokio::time::Instant::now();
        let deadline = started + call.timeout.unwrap_or(self.options.timeout);
        let result = loop {
            let id = match (&call.call_id, ids.is_empty()) {
                (Some(id), true) => id.clone(),
                _ => self.new_call_id(),
            };
            self.waiters.lock().expect("waiters lock").add(
                (step.clone(), id.clone()),
                waiter,
                tx.clone(),
            );
            ids.push(id.clone());
            if let Err(e) = self.publish(&call, &id).await {
                break Err(e);
            }
            if let Some(published) = published.take() {
                let _ = published.send(());
            }
            let wait_until =
                (tokio::time::Instant::now() + self.options.republish_after).min(deadline);
            match tokio::time::timeout_at(wait_until, rx.recv()).await {
                Ok(Some(answer)) => break Ok(answer),
                Ok(None) => unreachable!("the sender lives in this function"),
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    break Err(ClientError::Timeout {
                        step: step.clone(),
                        waited: started.elapsed(),
                        publishes: ids.len() as u32,
                    });
                }
                Err(_) => {
                    tracing::info!(step = %call.step_key(), "no answer yet: publishing the same step again")
                }
            }
        };
        let mut w = self.waiters.lock().expect("waiters lock");
        for id in ids {
            w.remove(&(step.clone(), id), waiter);
        }
        result
    }

    async fn publish(&self, call: &StepCall, call_id: &str) -> Result<(), ClientError> {
        let intent = Intent {
            workflow_id: call.workflow_id.clone(),
            step_index: call.step_index,
            tool: call.tool.clone(),
            attempt: call.attempt,
            arguments: call.arguments.clone(),
            call_id: Some(call_id.to_owned()),
            metadata: call.metadata.clone(),
        };
        let payload = serde_json::to_vec(&intent).expect("intents serialise");
        self.producer
            .send(
                FutureRecord::to(&self.options.intents_topic)
                    .partition(self.partition_of(&call.workflow_id))
                    .key(&call.workflow_id)
                    .payload(&payload),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| ClientError::Kafka(e))?;
        Ok(())
    }

    /// The partition of the intents topic that owns `workflow_id`, where every
    /// intent of it is published.
    pub fn partition_of(&self, workflow_id: &str) -> i32 {
        crate::contract::partition_for(workflow_id, self.intent_partitions)
    }

    /// A workflow whose steps this client numbers, from 0.
    pub fn workflow(&self, workflow_id: &str) -> Workflow<'_> {
        Workflow {
            client: self,
            id: workflow_id.to_owned(),
            next: AtomicU64::new(0),
            attempts: Mutex::default(),
        }
    }
}

/// Assigned to every results partition at its current end, with the offsets
/// resolved now (not lazily), so answers published after this returns are read.
fn answers_consumer(options: &ClientOptions, group: &str) -> Result<StreamConsumer, ClientError> {
    let consumer: StreamConsumer = options
        .kafka_config()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "10")
        .create()?;
    let meta: BaseConsumer = options.kafka_config().create()?;
    let Some(partitions) = partition_count(options, &options.results_topic)? else {
        return Err(ClientError::NoResultsTopic(options.results_topic.clone()));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        let (_, high) =
            meta.fetch_watermarks(&options.results_topic, p, Duration::from_secs(15))?;
        tpl.add_partition_offset(&options.results_topic, p, Offset::Offset(high))?;
    }
    consumer.assign(&tpl)?;
    drop(tpl);
    drop(meta);
    Ok(consumer)
}

/// The number of partitions of `topic`, or None when it does not exist.
/// A refused login or TLS handshake is reported as such, at once
/// ([`crate::connect`]).
fn partition_count(options: &ClientOptions, topic: &str) -> Result<Option<i32>, ClientError> {
    let topics = crate::connect::topic_partitions(
        &options.kafka_config(),
        Some(topic),
        Duration::from_secs(15),
    )?;
    Ok(topics
        .into_iter()
        .find(|t| t.name == topic && t.ok && t.partitions > 0)
        .map(|t| t.partitions as i32))
}

/// How many steps a [`Workflow::call`] moves on past identity conflicts
/// before it returns the conflict itself.
const MAX_CONFLICT_HOPS: u32 = 16;

/// A workflow's steps, numbered in call order. One `Workflow` per workflow run;
/// to resume a run in another process, start numbering where it stopped
/// ([`Workflow::starting_at`]) so resumed steps keep their step keys.
pub struct Workflow<'a> {
    client: &'a Client,
    id: String,
    next: AtomicU64,
    attempts: Mutex<HashMap<u64, u64>>,
}

impl Workflow<'_> {
    pub fn starting_at(self, step_index: u64) -> Self {
        self.next.store(step_index, Ordering::SeqCst);
        self
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Call `tool` as the next step. A call that the gate finds to be another
    /// call than the one recorded at that step (`identity_conflict`: the
    /// tool's identity arguments differ, e.g. a retry of a lost call that
    /// the model replaced with a different one) is sent again as the step
    /// after, and so on: the lost call's step stays open for its real retry.
    pub async fn call(&self, tool: &str, arguments: Value) -> Result<ToolResult, ClientError> {
        let mut tries = 0;
        loop {
            let step = self.next.fetch_add(1, Ordering::SeqCst);
            let result = self
                .client
                .call(StepCall::new(&self.id, step, tool, arguments.clone())?)
                .await?;
            tries += 1;
            let conflict = result.status == crate::contract::Status::Rejected
                && result
                    .error
                    .as_ref()
                    .is_some_and(|e| e.kind == RejectionReason::IdentityConflict.as_str());
            if !conflict || tries >= MAX_CONFLICT_HOPS {
                return Ok(result);
            }
        }
    }

    /// Run step `step_index` again, deliberately: the next `attempt` of it, with
    /// its own provider idempotency key.
    pub async fn retry_step(
        &self,
        step_index: u64,
        tool: &str,
        arguments: Value,
    ) -> Result<ToolResult, ClientError> {
        let attempt = {
            let mut a = self.attempts.lock().expect("attempts lock");
            let n = a.entry(step_index).or_insert(0);
            *n += 1;
            *n
        };
        self.client
            .call(StepCall::new(&self.id, step_index, tool, arguments)?.attempt(attempt))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::mocking::MockCluster;

    #[test]
    fn options_debug_redacts_secret_properties() {
        let mut o = ClientOptions::new("127.0.0.1:9092");
        o.kafka.insert("sasl.password".into(), "hunter2".into());
        o.kafka.insert("sasl.username".into(), "agent".into());
        let d = format!("{o:?}");
        assert!(!d.contains("hunter2"), "{d}");
        assert!(
            d.contains("agent") && d.contains(crate::redact::REDACTED),
            "{d}"
        );
    }

    /// Intents land in the partition `contract::partition_for` names (the one
    /// Java's default partitioner picks), not where librdkafka's default would.
    #[tokio::test(flavor = "multi_thread")]
    async fn intents_are_published_to_the_murmur2_partition() {
        let mock = MockCluster::new(1).unwrap();
        mock.create_topic("in", 7, 1).unwrap();
        mock.create_topic("out", 7, 1).unwrap();
        let mut options = ClientOptions::new(&mock.bootstrap_servers());
        options.intents_topic = "in".into();
        options.results_topic = "out".into();
        let client = Client::new(options.clone()).await.unwrap();
        // Keys whose murmur2 and CRC32 partitions differ among 7 (from the
        // Java vectors in contract::partition's tests).
        let ids = ["order-7781", "wf-0", "wf-1", "abcd", "kafka", "foobar"];
        for id in ids {
            let call = StepCall::new(id, 0, "t", serde_json::json!({})).unwrap();
            client.publish(&call, &format!("c-{id}")).await.unwrap();
        }
        let consumer: BaseConsumer = options
            .kafka_config()
            .set("group.id", "check")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..7 {
            tpl.add_partition_offset("in", p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&tpl).unwrap();
        drop(tpl);
        let mut seen = HashMap::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while seen.len() < ids.len() {
            assert!(std::time::Instant::now() < deadline, "read {seen:?}");
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                let key = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
                seen.insert(key, m.partition());
            }
        }
        for id in ids {
            assert_eq!(seen[id], crate::contract::partition_for(id, 7), "{id}");
            assert_eq!(client.partition_of(id), seen[id]);
        }
        // From the Java clients' own partitioner (kafka-clients 4.4.0).
        assert_eq!(seen["order-7781"], 3);
        assert_eq!(seen["abcd"], 5);
    }

    fn answer(workflow_id: &str, attempt: u64, call_id: Option<&str>) -> ToolResult {
        ToolResult {
            workflow_id: workflow_id.into(),
            step_index: 0,
            tool: "t".into(),
            attempt,
            call_id: call_id.map(str::to_owned),
            status: crate::contract::Status::Ok,
            output: Some(serde_json::json!({})),
            error: None,
            deduplicated: false,
            completed_at: "2026-01-01T00:00:00.000Z".into(),
            in_doubt: None,
        }
    }

    /// Two workflows' calls with one `call_id`: each answer reaches only the
    /// call of its own step key; an answer naming no waiting call, nobody.
    #[test]
    fn an_answer_reaches_only_the_calls_of_its_step_key_and_call_id() {
        let key = |wf: &str| {
            let step = StepCall::new(wf, 0, "t", serde_json::json!({})).unwrap();
            (step.step_key(), "call_0".to_owned())
        };
        let mut w = Waiters::default();
        let (a_tx, _a_rx) = mpsc::unbounded_channel();
        let (b_tx, _b_rx) = mpsc::unbounded_channel();
        let (b2_tx, _b2_rx) = mpsc::unbounded_channel();
        w.add(key("collide-A"), 1, a_tx.clone());
        w.add(key("collide-B"), 2, b_tx.clone());
        w.add(key("collide-B"), 3, b2_tx.clone());
        let to = |r: &ToolResult| w.of(r);
        let a = to(&answer("collide-A", 0, Some("call_0")));
        assert!(a.len() == 1 && a[0].same_channel(&a_tx));
        let b = to(&answer("collide-B", 0, Some("call_0")));
        assert!(b.len() == 2 && b[0].same_channel(&b_tx) && b[1].same_channel(&b2_tx));
        assert!(
            to(&answer("collide-A", 1, Some("call_0"))).is_empty(),
            "another attempt"
        );
        assert!(
            to(&answer("collide-A", 0, Some("call_1"))).is_empty(),
            "another call"
        );
        assert!(to(&answer("collide-A", 0, None)).is_empty(), "no call_id");
        w.remove(&key("collide-B"), 2);
        let b = w.of(&answer("collide-B", 0, Some("call_0")));
        assert!(b.len() == 1 && b[0].same_channel(&b2_tx));
        w.remove(&key("collide-B"), 3);
        w.remove(&key("collide-A"), 1);
        assert!(w.by_call.is_empty());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_missing_intents_topic_is_named() {
        let mock = MockCluster::new(1).unwrap();
        mock.create_topic("out", 2, 1).unwrap();
        let mut options = ClientOptions::new(&mock.bootstrap_servers());
        options.intents_topic = "missing-intents".into();
        options.results_topic = "out".into();
        match Client::new(options).await {
            Err(ClientError::NoIntentsTopic(t)) => assert_eq!(t, "missing-intents"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("connected without an intents topic"),
        }
    }
}
