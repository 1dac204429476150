//! The workload and the agent side: intents, the producer that publishes them, the
//! reader that matches answers to intents by `call_id`, and the no-op tool.

use anyhow::Context as _;
use axum::http::{HeaderMap, StatusCode, header};
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{DeliveryResult, Message};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Deserialize;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The one tool of the workload.
pub const TOOL: &str = "noop";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The first call of a step.
    First,
    /// A repeat with the same arguments.
    Repeat,
    /// A repeat with different arguments (the model rephrased them).
    Rephrased,
    /// A repeat of a step loaded into the changelog before the run.
    Loaded,
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub workflow: String,
    pub step: u64,
    pub kind: Kind,
}

/// The shape of a workload.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub intents: usize,
    pub workflows: usize,
    /// Share of intents that repeat an earlier step (half of them rephrased).
    pub repeat_share: f64,
    /// A repeat follows its first call after about this many other first calls.
    pub repeat_lag: usize,
}

/// A small deterministic generator (the bench needs reproducible workloads, not
/// good randomness).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Produce one record, waiting while librdkafka's queue is full (the loaders
/// and the flood publish faster than the broker takes them).
pub fn send_waiting<C, K, P>(
    producer: &ThreadedProducer<C>,
    mut rec: BaseRecord<'_, K, P, C::DeliveryOpaque>,
) -> rdkafka::error::KafkaResult<()>
where
    C: ProducerContext,
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    loop {
        match producer.send(rec) {
            Ok(()) => return Ok(()),
            Err((
                rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::QueueFull,
                ),
                r,
            )) => {
                rec = r;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// `shape.intents` intents in publication order: distinct steps spread over the
/// workflows, each repeat published a while after its step's first call.
pub fn build(ns: &str, shape: &Shape, seed: u64) -> Vec<Spec> {
    let total = shape.intents;
    let repeats = ((total as f64) * shape.repeat_share.clamp(0.0, 0.99)).round() as usize;
    let distinct = total - repeats;
    let workflows = shape.workflows.max(1);
    let step_of = |j: usize| (format!("{ns}-w{}", j % workflows), (j / workflows) as u64);
    let mut rng = Rng::new(seed);
    let mut due = BinaryHeap::new();
    let mut out = Vec::with_capacity(total);
    // Repeats alternate: verbatim, then rephrased (same step key, other arguments).
    let mut nth_repeat = 0usize;
    let mut repeat = |j: usize| {
        nth_repeat += 1;
        let (workflow, step) = step_of(j);
        let kind = if nth_repeat.is_multiple_of(2) {
            Kind::Rephrased
        } else {
            Kind::Repeat
        };
        Spec {
            workflow,
            step,
            kind,
        }
    };
    for j in 0..distinct {
        while let Some(std::cmp::Reverse((at, _, step))) = due.peek().copied() {
            if at > j {
                break;
            }
            due.pop();
            out.push(repeat(step));
        }
        let (workflow, step) = step_of(j);
        out.push(Spec {
            workflow,
            step,
            kind: Kind::First,
        });
        // Spread the repeats evenly over the distinct steps.
        let n = (j + 1) * repeats / distinct.max(1) - j * repeats / distinct.max(1);
        for k in 0..n {
            let lag = shape.repeat_lag / 2 + rng.below(shape.repeat_lag as u64 + 1) as usize;
            due.push(std::cmp::Reverse((j + 1 + lag, out.len() * 8 + k, j)));
        }
    }
    let mut rest: Vec<_> = due.into_sorted_vec();
    rest.reverse();
    for std::cmp::Reverse((_, _, j)) in rest {
        out.push(repeat(j));
    }
    out
}

/// The partition of a workflow's intents: stepgate's canonical one (the gate
/// refuses others). Explicit, so that steps loaded into the changelog (scale
/// mode) are where their repeats arrive.
pub fn partition_of(workflow: &str, partitions: i32) -> i32 {
    stepgate::contract::partition_for(workflow, partitions)
}

/// Intent v1 JSON; `call_id` carries the intent's index. `pad`: that many more
/// bytes of arguments (a `body` of filler text; 0: none).
pub fn payload(spec: &Spec, index: usize, pad: usize) -> String {
    let subject = match spec.kind {
        Kind::Rephrased => format!("Your order {} is confirmed", spec.step),
        _ => format!("Order {} confirmed", spec.step),
    };
    // `,"body":""` is 10 bytes of the padding.
    let body = match pad {
        0 => String::new(),
        n => format!(r#","body":"{}""#, "x".repeat(n.saturating_sub(10))),
    };
    format!(
        r#"{{"workflow_id":"{wf}","step_index":{step},"tool":"{TOOL}","arguments":{{"to":"{wf}@example.com","subject":"{subject}"{body}}},"call_id":"c{index}"}}"#,
        wf = spec.workflow,
        step = spec.step
    )
}

/// What an answer should say about deduplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The step log: first calls `deduplicated: false`, repeats `true`.
    StepLog,
    /// stepgate's fast path: every call runs, every answer `deduplicated: false`.
    FastPath,
    /// The passthrough echoes intents: no `deduplicated` at all.
    Echo,
}

/// Every intent sent and every answer received, by intent index.
pub struct Tracker {
    expect: Expect,
    kinds: Vec<Kind>,
    sent: Vec<Option<Instant>>,
    arrived: Vec<Option<Instant>>,
    answers: Vec<u16>,
    pub wrong_dedup: u64,
    pub not_ok: u64,
    pub unknown: u64,
    pub sample_wrong: Option<String>,
    /// First answers by `status`.
    statuses: BTreeMap<String, u64>,
    /// Intents whose first answer was `in_doubt`.
    in_doubt: Vec<usize>,
}

#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(borrow)]
    call_id: Option<&'a str>,
    deduplicated: Option<bool>,
    #[serde(borrow)]
    status: Option<&'a str>,
}

impl Tracker {
    fn on_answer(&mut self, payload: &[u8], at: Instant) {
        let Ok(a) = serde_json::from_slice::<Answer>(payload) else {
            self.unknown += 1;
            return;
        };
        let Some(i) = a
            .call_id
            .and_then(|c| c.strip_prefix('c'))
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|i| *i < self.answers.len())
        else {
            self.unknown += 1;
            return;
        };
        self.answers[i] = self.answers[i].saturating_add(1);
        if self.answers[i] > 1 {
            return;
        }
        self.arrived[i] = Some(at);
        let status = a.status.unwrap_or("(none)");
        *self.statuses.entry(status.to_owned()).or_insert(0) += 1;
        if status == "in_doubt" {
            self.in_doubt.push(i);
        }
        let want = match self.expect {
            Expect::StepLog => Some(self.kinds[i] != Kind::First),
            Expect::FastPath => Some(false),
            Expect::Echo => None,
        };
        let wrong_status = self.expect != Expect::Echo && a.status != Some("ok");
        if want != a.deduplicated || wrong_status {
            if want != a.deduplicated {
                self.wrong_dedup += 1;
            }
            if wrong_status {
                self.not_ok += 1;
            }
            if self.sample_wrong.is_none() {
                self.sample_wrong = Some(format!(
                    "{:?} intent c{i} answered {}",
                    self.kinds[i],
                    String::from_utf8_lossy(payload)
                ));
            }
        }
    }
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// What the answers of a range of intents showed.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Verdict {
    pub intents: usize,
    pub answered: usize,
    pub missing: usize,
    /// Intents answered more than once, and the extra answers.
    pub answered_twice: usize,
    pub extra_answers: usize,
    pub wrong_dedup: u64,
    pub not_ok: u64,
    pub unknown: u64,
    pub sample_wrong: Option<String>,
    /// First answers by `status` (every intent of the run, not only the range).
    pub statuses: BTreeMap<String, u64>,
}

/// Publishes intents and reads answers.
pub struct Agent {
    producer: ThreadedProducer<Deliveries>,
    topic: String,
    partitions: i32,
    tracker: Arc<Mutex<Tracker>>,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Bytes of filler added to every intent's arguments.
    pad: usize,
}

/// Counts failed deliveries.
#[derive(Default)]
pub struct Deliveries(AtomicU64);

impl Deliveries {
    pub fn failed(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();
    fn delivery(&self, r: &DeliveryResult<'_>, _: ()) {
        if r.is_err() {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Agent {
    /// Read answers from `output` (from its beginning: topics are fresh) for
    /// one intent per entry of `kinds`. `linger_ms`: the producer's (1 for
    /// floods; 0 when one call at a time is timed).
    pub fn start(
        brokers: &str,
        input: &str,
        output: &str,
        partitions: i32,
        expect: Expect,
        kinds: Vec<Kind>,
        linger_ms: &str,
    ) -> anyhow::Result<Agent> {
        let producer: ThreadedProducer<Deliveries> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("linger.ms", linger_ms)
            .set("acks", "all")
            .set("queue.buffering.max.messages", "1000000")
            .create_with_context(Deliveries::default())?;
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("{output}-bench-reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "5")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(output, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        drop(tpl);
        let n = kinds.len();
        let tracker = Arc::new(Mutex::new(Tracker {
            expect,
            kinds,
            sent: vec![None; n],
            arrived: vec![None; n],
            answers: vec![0; n],
            wrong_dedup: 0,
            not_ok: 0,
            unknown: 0,
            sample_wrong: None,
            statuses: BTreeMap::new(),
            in_doubt: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s) = (tracker.clone(), stop.clone());
        let reader = std::thread::Builder::new()
            .name("answers".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    match consumer.poll(Duration::from_millis(100)) {
                        Some(Ok(m)) => {
                            let at = Instant::now();
                            if let Some(p) = m.payload() {
                                t.lock().expect("tracker lock").on_answer(p, at);
                            }
                        }
                        Some(Err(e)) => eprintln!("answer reader: {e}"),
                        None => {}
                    }
                }
            })?;
        Ok(Agent {
            producer,
            topic: input.to_owned(),
            partitions,
            tracker,
            stop,
            reader: Some(reader),
            pad: 0,
        })
    }

    /// Add about `bytes` of filler to every intent's arguments.
    pub fn with_padding(mut self, bytes: usize) -> Agent {
        self.pad = bytes;
        self
    }

    /// Publish `specs` as intents `first..`, as fast as possible or at `rate`
    /// per second. Blocking.
    pub fn publish(&self, specs: &[Spec], first: usize, rate: Option<f64>) -> anyhow::Result<()> {
        let start = Instant::now();
        for (k, spec) in specs.iter().enumerate() {
            let i = first + k;
            if let Some(r) = rate {
                let due = start + Duration::from_secs_f64(k as f64 / r);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
            }
            let body = payload(spec, i, self.pad);
            let partition = partition_of(&spec.workflow, self.partitions);
            self.tracker.lock().expect("tracker lock").sent[i] = Some(Instant::now());
            let rec = BaseRecord::to(&self.topic)
                .key(spec.workflow.as_str())
                .payload(body.as_str())
                .partition(partition);
            send_waiting(&self.producer, rec).context("publishing an intent")?;
        }
        self.producer
            .flush(Duration::from_secs(60))
            .context("flushing intents")?;
        let failed = self.producer.context().failed();
        anyhow::ensure!(failed == 0, "{failed} intents were not delivered");
        Ok(())
    }

    /// Intents of `range` answered so far, and the last arrival among them.
    pub fn progress(&self, range: std::ops::Range<usize>) -> (usize, Option<Instant>) {
        let t = self.tracker.lock().expect("tracker lock");
        let answered = t.answers[range.clone()].iter().filter(|a| **a > 0).count();
        let last = t.arrived[range].iter().flatten().max().copied();
        (answered, last)
    }

    /// When the first intent of `range` was sent.
    pub fn first_sent(&self, range: std::ops::Range<usize>) -> Option<Instant> {
        self.tracker.lock().expect("tracker lock").sent[range]
            .iter()
            .flatten()
            .min()
            .copied()
    }

    pub fn latency(&self, range: std::ops::Range<usize>) -> Latency {
        let t = self.tracker.lock().expect("tracker lock");
        let mut ms: Vec<f64> = range
            .filter_map(|i| Some((t.arrived[i]? - t.sent[i]?).as_secs_f64() * 1000.0))
            .collect();
        if ms.is_empty() {
            return Latency::default();
        }
        ms.sort_by(f64::total_cmp);
        let q = |f: f64| ms[((ms.len() as f64 * f) as usize).min(ms.len() - 1)];
        Latency {
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            max: ms[ms.len() - 1],
        }
    }

    pub fn verdict(&self, range: std::ops::Range<usize>) -> Verdict {
        let t = self.tracker.lock().expect("tracker lock");
        let a = &t.answers[range.clone()];
        Verdict {
            intents: range.len(),
            answered: a.iter().filter(|n| **n > 0).count(),
            missing: a.iter().filter(|n| **n == 0).count(),
            answered_twice: a.iter().filter(|n| **n > 1).count(),
            extra_answers: a.iter().map(|n| (*n as usize).saturating_sub(1)).sum(),
            wrong_dedup: t.wrong_dedup,
            not_ok: t.not_ok,
            unknown: t.unknown,
            sample_wrong: t.sample_wrong.clone(),
            statuses: t.statuses.clone(),
        }
    }

    /// The intents whose first answer was `in_doubt`.
    pub fn in_doubt(&self) -> Vec<usize> {
        self.tracker.lock().expect("tracker lock").in_doubt.clone()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// The no-op HTTP tool: answers `{}` and counts invocations by `Idempotency-Key`.
pub struct ToolServer {
    pub url: String,
    keys: Arc<Mutex<HashMap<String, u32>>>,
}

impl ToolServer {
    pub async fn start() -> anyhow::Result<ToolServer> {
        let keys = Arc::new(Mutex::new(HashMap::new()));
        let k = keys.clone();
        let app = axum::Router::new().route(
            "/noop",
            axum::routing::post(move |headers: HeaderMap| {
                let k = k.clone();
                async move {
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    *k.lock().expect("tool lock").entry(key).or_insert(0) += 1;
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/json")],
                        "{}",
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("tool server: {e}");
            }
        });
        Ok(ToolServer {
            url: format!("http://{addr}/noop"),
            keys,
        })
    }

    /// Invocations per key since the last call, as a histogram: times invoked →
    /// number of keys.
    pub fn take(&self) -> BTreeMap<u32, usize> {
        let keys = std::mem::take(&mut *self.keys.lock().expect("tool lock"));
        let mut h = BTreeMap::new();
        for n in keys.values() {
            *h.entry(*n).or_insert(0) += 1;
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_follow_their_first_call() {
        let shape = Shape {
            intents: 10_000,
            workflows: 100,
            repeat_share: 0.2,
            repeat_lag: 50,
        };
        let specs = build("t", &shape, 1);
        assert_eq!(specs.len(), 10_000);
        let firsts = specs.iter().filter(|s| s.kind == Kind::First).count();
        assert_eq!(firsts, 8_000);
        let rephrased = specs.iter().filter(|s| s.kind == Kind::Rephrased).count();
        assert_eq!(rephrased, 1_000);
        let mut seen = std::collections::HashSet::new();
        for s in &specs {
            let key = (s.workflow.clone(), s.step);
            if s.kind == Kind::First {
                assert!(seen.insert(key));
            } else {
                assert!(seen.contains(&key), "a repeat before its first call");
            }
        }
    }
}
