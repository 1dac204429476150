//! The load of the fault tests (`tests/broker/faults.rs`, `tests/broker/cluster_faults.rs`):
//! an agent publishing `keyed` and `unkeyed` intents at a steady pace (some
//! rephrased repeats in flight; an intent whose delivery its producer reports
//! failed sent again as a new call, as an agent would), the duplicate-effect
//! counts at the tool, and the settlement that checks every `call_id` answered
//! exactly once and prints one `FAULTS |` summary line.

use super::*;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepgate::contract::{Status, ToolResult, partition_for};

pub const UNKEYED: &str = "ticket";
pub const KEYED: &str = "charge";
pub const PARTITIONS: i32 = 4;
/// How long the test waits for anything (generous: a compile may share the cores).
pub const WAIT: Duration = Duration::from_secs(180);

/// Poll `cond` every 100 ms until it holds (true) or `limit` passes (false).
pub async fn wait_until<F: FnMut() -> bool>(limit: Duration, mut cond: F) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------- the tool's count

pub fn step_of(c: &Invocation) -> (String, String, String) {
    let h = |k: &str| c.headers.get(k).cloned().unwrap_or_default();
    (
        h("stepgate-workflow-id"),
        h("stepgate-step-index"),
        h("stepgate-attempt"),
    )
}

/// `unkeyed` steps the tool saw invoked more than once (raw invocations).
pub fn duplicate_unkeyed(tools: &ToolServer, tool: &str) -> usize {
    let mut per_step: HashMap<_, usize> = HashMap::new();
    for c in tools.calls(tool) {
        *per_step.entry(step_of(&c)).or_default() += 1;
    }
    per_step.values().filter(|n| **n > 1).count()
}

/// `keyed` steps the tool saw with more than one `Idempotency-Key`: a provider
/// that deduplicates by key would have performed the effect more than once.
pub fn duplicate_keyed(tools: &ToolServer, tool: &str) -> usize {
    tools
        .keys_per_step(tool)
        .values()
        .filter(|keys| keys.len() > 1)
        .count()
}

// ---------------------------------------------------------------- the load

#[derive(Clone, Debug)]
pub struct Call {
    pub id: String,
    pub wf: String,
    pub step: u64,
    pub tool: &'static str,
    pub sent: Instant,
}

/// Workflow ids spread over every partition (by the canonical partitioner).
pub fn workflows(tag: &str, per_partition: usize) -> Vec<String> {
    let mut by_p: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    let mut i = 0;
    while by_p.len() < PARTITIONS as usize || by_p.values().any(|v| v.len() < per_partition) {
        let wf = format!("{tag}-wf{i}");
        let p = by_p.entry(partition_for(&wf, PARTITIONS)).or_default();
        if p.len() < per_partition {
            p.push(wf);
        }
        i += 1;
    }
    by_p.into_values().flatten().collect()
}

pub fn agent_producer(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "0")
        .set("partitioner", "murmur2_random")
        // A retried send across a broker outage must not publish the intent
        // twice (that would be a second call with the same call_id).
        .set("enable.idempotence", "true")
        .set("message.max.bytes", "4194304")
        .create()
        .unwrap()
}

/// One intent of the load, as the agent publishes it (again, if need be).
#[derive(Clone)]
struct Sent {
    wf: String,
    step: u64,
    tool: &'static str,
    args: serde_json::Value,
}

impl Sent {
    /// Publish it as call `id` (noted in `calls` first), waiting while the
    /// producer's queue is full (the broker away), in order.
    async fn publish(
        &self,
        producer: &FutureProducer,
        topic: &str,
        id: &str,
        calls: &Mutex<Vec<Call>>,
    ) -> rdkafka::producer::DeliveryFuture {
        let payload = intent(&self.wf, self.step, self.tool, self.args.clone(), id).to_string();
        calls.lock().unwrap().push(Call {
            id: id.to_owned(),
            wf: self.wf.clone(),
            step: self.step,
            tool: self.tool,
            sent: Instant::now(),
        });
        loop {
            match producer.send_result(FutureRecord::to(topic).key(&self.wf).payload(&payload)) {
                Ok(f) => return f,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

/// An agent publishing intents at a steady pace until stopped.
pub struct Load {
    pub started: Instant,
    pub calls: Arc<Mutex<Vec<Call>>>,
    pub undelivered: Arc<AtomicUsize>,
    /// The delivery errors the agent's producer reported: (call id, error).
    pub delivery_errors: Arc<Mutex<Vec<(String, String)>>>,
    /// A call whose delivery failed → the call the agent sent again for it.
    pub resent: Arc<Mutex<HashMap<String, String>>>,
    pub stop: Arc<AtomicBool>,
    pub task: Option<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(brokers: &str, intents: &str, tag: &str) -> Load {
        let started = Instant::now();
        let producer = agent_producer(brokers);
        let wfs = workflows(tag, 6);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let undelivered = Arc::new(AtomicUsize::new(0));
        let delivery_errors = Arc::new(Mutex::new(Vec::new()));
        let resent = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, u, errs, rs, st, topic, tag) = (
            calls.clone(),
            undelivered.clone(),
            delivery_errors.clone(),
            resent.clone(),
            stop.clone(),
            intents.to_owned(),
            tag.to_owned(),
        );
        let task = tokio::spawn(async move {
            let mut n: usize = 0;
            while !st.load(Ordering::SeqCst) {
                let wf = wfs[n % wfs.len()].clone();
                let step = (n / wfs.len()) as u64;
                let tool = if (n + n / wfs.len()).is_multiple_of(2) {
                    UNKEYED
                } else {
                    KEYED
                };
                let id = format!("{tag}-{n}");
                let mut send = vec![(id.clone(), json!({"n": n}))];
                if n % 8 == 3 {
                    // A rephrased repeat while the step is in flight.
                    send.push((format!("{id}-r"), json!({"n": n, "again": true})));
                }
                for (id, args) in send {
                    let record = Sent {
                        wf: wf.clone(),
                        step,
                        tool,
                        args,
                    };
                    let fut = record.publish(&producer, &topic, &id, &c).await;
                    let (u, errs, c, producer, topic, resent) = (
                        u.clone(),
                        errs.clone(),
                        c.clone(),
                        producer.clone(),
                        topic.clone(),
                        rs.clone(),
                    );
                    tokio::spawn(async move {
                        let (mut fut, mut this) = (fut, id.clone());
                        for again in 1.. {
                            let error = match fut.await {
                                Ok(Ok(_)) => return,
                                Ok(Err((e, _))) => e.to_string(),
                                Err(_) => "the delivery report was dropped".to_owned(),
                            };
                            u.fetch_add(1, Ordering::SeqCst);
                            errs.lock().unwrap().push((this.clone(), error));
                            // Told its intent was not delivered (it may have
                            // been: a purged in-flight request can have been
                            // written), the agent sends the step again as a
                            // new call, as a model's retry would.
                            let next = format!("{id}-resent{again}");
                            resent.lock().unwrap().insert(this, next.clone());
                            this = next;
                            fut = record.publish(&producer, &topic, &this, &c).await;
                        }
                    });
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        });
        Load {
            started,
            calls,
            undelivered,
            delivery_errors,
            resent,
            stop,
            task: Some(task),
        }
    }

    pub fn sent(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Whether `id` is answered, or was re-sent by the agent (its delivery
    /// failed) and that call is.
    pub fn settled(&self, id: &str, a: &HashMap<String, Vec<ToolResult>>) -> bool {
        let resent = self.resent.lock().unwrap();
        let mut id = id;
        loop {
            if a.contains_key(id) {
                return true;
            }
            match resent.get(id) {
                Some(next) => id = next,
                None => return false,
            }
        }
    }

    pub async fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub fn answers(results: &TopicReader) -> HashMap<String, Vec<ToolResult>> {
    let mut out: HashMap<String, Vec<ToolResult>> = HashMap::new();
    for r in results.all() {
        let t: ToolResult =
            serde_json::from_value(r.value.clone()).expect("every result is a Result v1");
        out.entry(t.call_id.clone().unwrap_or_default())
            .or_default()
            .push(t);
    }
    out
}

/// Calls sent and not yet answered.
pub fn in_flight(load: &Load, results: &TopicReader) -> usize {
    let a = answers(results);
    load.sent()
        .iter()
        .filter(|c| !load.settled(&c.id, &a))
        .count()
}

/// Wait until `n` more calls sent after `since` (and matching `filter`) are answered.
pub async fn answered_after(
    load: &Load,
    results: &TopicReader,
    since: Instant,
    n: usize,
    filter: impl Fn(&Call) -> bool,
) -> bool {
    wait_until(WAIT, || {
        let a = answers(results);
        load.sent()
            .iter()
            .filter(|c| c.sent >= since && filter(c) && a.contains_key(&c.id))
            .count()
            >= n
    })
    .await
}

pub struct Summary {
    pub scenario: String,
    pub in_flight: usize,
    pub sent: usize,
    pub answered: usize,
    pub dup_unkeyed: usize,
    pub dup_keyed: usize,
    pub dup_answers: usize,
    pub lost: usize,
    pub ok: usize,
    pub in_doubt: usize,
    pub running: bool,
    pub violations: Vec<String>,
    pub extra: String,
}

impl Summary {
    pub fn print_and_assert(&self) {
        println!(
            "FAULTS | {} | in flight at the fault: {} | sent: {} | answered: {} | duplicate effects unkeyed/keyed: {}/{} | differing answers to one call_id: {} | lost: {} | ok {} in_doubt {} | stepgate kept running: {} | {}",
            self.scenario,
            self.in_flight,
            self.sent,
            self.answered,
            self.dup_unkeyed,
            self.dup_keyed,
            self.dup_answers,
            self.lost,
            self.ok,
            self.in_doubt,
            if self.running { "yes" } else { "NO" },
            self.extra,
        );
        // Printed before the asserts: a failure's message may be cut short.
        for v in self.violations.iter().take(12) {
            println!("FAULTS violation | {v}");
        }
        assert_eq!(
            self.lost, 0,
            "{}: intents lost: {:?}",
            self.scenario, self.violations
        );
        assert_eq!(
            self.dup_answers, 0,
            "{}: a call_id answered twice, differently: {:?}",
            self.scenario, self.violations
        );
        assert_eq!(
            self.dup_unkeyed, 0,
            "{}: an unkeyed step ran twice",
            self.scenario
        );
        assert_eq!(
            self.dup_keyed, 0,
            "{}: a keyed step took effect twice",
            self.scenario
        );
        assert!(
            self.violations.is_empty(),
            "{}: {:#?}",
            self.scenario,
            self.violations
        );
        assert!(self.running, "{}: stepgate stopped", self.scenario);
    }
}

/// Stop the load, wait for every answer, and count.
pub async fn settle(
    scenario: &str,
    s: &Stack,
    load: &mut Load,
    results: &TopicReader,
    in_flight_at_fault: usize,
    fault_at: Instant,
) -> Summary {
    load.stop().await;
    let calls = load.sent();
    let all_answered = wait_until(Duration::from_secs(240), || {
        let a = answers(results);
        calls.iter().all(|c| load.settled(&c.id, &a))
    })
    .await;
    // A window for late duplicates (e.g. a zombie's) to show; passing never
    // depends on it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let a = answers(results);
    let mut violations = Vec::new();
    let (mut answered, mut lost, mut dup_answers, mut ok, mut in_doubt) = (0, 0, 0, 0, 0);
    let mut same_again = 0;
    let mut by_step: BTreeMap<(String, u64, &str), Vec<&ToolResult>> = BTreeMap::new();
    let (mut doubt_at, mut doubt_parts) = (Vec::new(), BTreeSet::new());
    let mut doubt_msg = String::new();
    // Unanswered calls whose delivery the agent's producer reported failed
    // (and which it sent again): lost only if their intent is on `intents`.
    let mut unanswered_resent = Vec::new();
    for c in &calls {
        match a.get(&c.id).map(Vec::as_slice) {
            None | Some([]) if load.resent.lock().unwrap().contains_key(&c.id) => {
                unanswered_resent.push(c.id.clone())
            }
            None | Some([]) => lost += 1,
            Some(rs) => {
                answered += 1;
                // Every answer to a call_id is the same answer: a repeat
                // answered at once and read again after a fault may get it a
                // second time (docs/design.md "Repeats answered at once").
                if rs.iter().any(|r| r != &rs[0]) {
                    dup_answers += 1;
                    violations.push(format!(
                        "{} answered {} times, differently: {rs:?}",
                        c.id,
                        rs.len()
                    ));
                } else if rs.len() > 1 {
                    same_again += 1;
                }
                let r = &rs[0];
                match r.status {
                    Status::Ok => ok += 1,
                    Status::InDoubt if c.tool == UNKEYED => {
                        in_doubt += 1;
                        if doubt_msg.is_empty() {
                            doubt_msg = format!("{} {:?}", c.id, r.error);
                        }
                        let at = if c.sent >= fault_at {
                            (c.sent - fault_at).as_secs_f64()
                        } else {
                            -(fault_at - c.sent).as_secs_f64()
                        };
                        doubt_at.push(at);
                        doubt_parts.insert(partition_for(&c.wf, PARTITIONS));
                    }
                    _ => violations.push(format!("{}: unexpected answer {r:?}", c.id)),
                }
                if (r.workflow_id.as_str(), r.step_index, r.tool.as_str())
                    != (c.wf.as_str(), c.step, c.tool)
                {
                    violations.push(format!("{}: answer for another step {r:?}", c.id));
                }
                by_step
                    .entry((c.wf.clone(), c.step, c.tool))
                    .or_default()
                    .push(r);
            }
        }
    }
    let mut not_delivered = 0;
    if !unanswered_resent.is_empty() {
        let intents = TopicReader::new(&s.config.kafka.brokers, &s.topic("intents"));
        let delivered = calls.len() - unanswered_resent.len();
        wait_until(Duration::from_secs(30), || intents.all().len() >= delivered).await;
        let on_topic: BTreeSet<String> = intents
            .all()
            .iter()
            .filter_map(|r| r.value["call_id"].as_str().map(str::to_owned))
            .collect();
        for id in &unanswered_resent {
            if on_topic.contains(id) {
                lost += 1;
                violations.push(format!(
                    "{id}: on `intents` (its delivery reported failed) and never answered"
                ));
            } else if !load.settled(id, &a) {
                lost += 1;
            } else {
                not_delivered += 1;
            }
        }
    }
    if !all_answered {
        violations.push(format!("{lost} calls never answered in 240 s"));
    }
    for (key, rs) in &by_step {
        let firsts: Vec<&&ToolResult> = rs.iter().filter(|r| !r.deduplicated).collect();
        if firsts.len() != 1 {
            violations.push(format!(
                "{key:?}: {} answers say they caused the invocation: {rs:?}",
                firsts.len()
            ));
            continue;
        }
        for r in rs {
            let mut same = (*r).clone();
            same.call_id = firsts[0].call_id.clone();
            same.deduplicated = false;
            if &same != *firsts[0] {
                violations.push(format!("{key:?}: answers differ: {rs:?}"));
                break;
            }
        }
    }
    let late_doubt = doubt_at.iter().filter(|t| **t > 1.0).count();
    // Doubt about calls the fault cannot have cut off, or a call lost or
    // answered twice: keep the logs.
    let keep_logs = || {
        let keep = std::env::temp_dir().join(format!("stepgate-faults-{}", s.prefix));
        std::fs::create_dir_all(&keep).unwrap();
        for e in std::fs::read_dir(s.dir.path()).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                let _ = std::fs::copy(e.path(), keep.join(e.file_name()));
            }
        }
        keep
    };
    if late_doubt > 0 {
        let keep = keep_logs();
        println!(
            "{scenario}: {in_doubt} in doubt ({late_doubt} sent over 1 s after the fault), first: {doubt_msg}; logs kept in {}",
            keep.display()
        );
    }
    if lost > 0 || dup_answers > 0 {
        violations.push(format!("logs kept in {}", keep_logs().display()));
        violations.push(on_the_intents_topic(s, &calls, &a).await);
    }
    // A delivery report can say failed for a record the broker did write
    // (librdkafka purging an in-flight request it gave up on, e.g. when the
    // leader or the active controller of a cluster dies): an intent that was
    // answered was delivered. One that is not on `intents` was not: the agent
    // sent it again (`Load::start`), and that call is answered.
    let reached: Vec<_> = load
        .delivery_errors
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, _)| a.contains_key(id))
        .cloned()
        .collect();
    let mut misreported = if reached.is_empty() {
        String::new()
    } else {
        format!(
            "; {} intents the agent's producer reported failed were delivered and answered ({})",
            reached.len(),
            reached[0].1
        )
    };
    if not_delivered > 0 {
        misreported += &format!(
            "; {not_delivered} intents the agent's producer reported failed were not on `intents`: sent again as new calls, answered"
        );
    }
    Summary {
        scenario: scenario.into(),
        in_flight: in_flight_at_fault,
        sent: calls.len(),
        answered,
        dup_unkeyed: duplicate_unkeyed(&s.tools, UNKEYED),
        dup_keyed: duplicate_keyed(&s.tools, KEYED),
        dup_answers,
        lost,
        ok,
        in_doubt,
        running: true,
        violations,
        extra: format!(
            "the same answer again to {same_again} calls; invocations unkeyed {} keyed {} (keyed effects {}){}{misreported}",
            s.tools.count(UNKEYED),
            s.tools.count(KEYED),
            s.tools.effects(KEYED),
            if doubt_at.is_empty() {
                String::new()
            } else {
                format!(
                    ", in-doubt steps sent {:+.1}..{:+.1} s from the fault, partitions {doubt_parts:?}",
                    doubt_at.iter().copied().fold(f64::MAX, f64::min),
                    doubt_at.iter().copied().fold(f64::MIN, f64::max)
                )
            }
        ),
    }
}

/// What the intents topic holds of the calls lost or answered twice: tells a
/// call the agent's producer never delivered (or delivered twice) from one
/// stepgate did not answer (or answered twice).
pub async fn on_the_intents_topic(
    s: &Stack,
    calls: &[Call],
    a: &HashMap<String, Vec<ToolResult>>,
) -> String {
    let odd: Vec<&Call> = calls
        .iter()
        .filter(|c| a.get(&c.id).is_none_or(|rs| rs.len() != 1))
        .collect();
    let intents = TopicReader::new(&s.config.kafka.brokers, &s.topic("intents"));
    let total = calls.len();
    wait_until(Duration::from_secs(30), || intents.all().len() >= total).await;
    let mut copies: HashMap<String, Vec<(i32, Option<u64>)>> = HashMap::new();
    for r in intents.all() {
        if let Some(id) = r.value["call_id"].as_str() {
            copies
                .entry(id.to_owned())
                .or_default()
                .push((r.partition, r.value["step_index"].as_u64()));
        }
    }
    let lines: Vec<String> = odd
        .iter()
        .take(12)
        .map(|c| {
            format!(
                "{} (wf {} step {}): {} answer(s), on `intents` {:?}",
                c.id,
                c.wf,
                c.step,
                a.get(&c.id).map_or(0, Vec::len),
                copies.get(&c.id).cloned().unwrap_or_default()
            )
        })
        .collect();
    format!(
        "{} calls lost or answered twice; `intents` holds {} records for {} sent: {}",
        odd.len(),
        intents.all().len(),
        total,
        lines.join("; ")
    )
}

pub fn tool_delay(s: &Stack) {
    for t in [UNKEYED, KEYED] {
        s.tools
            .script(t, vec![Reply::Delay(Duration::from_millis(150))]);
    }
}

pub async fn warm_up(load: &Load, results: &TopicReader) {
    assert!(
        answered_after(load, results, load.started, 60, |_| true).await,
        "the load is answered before the fault"
    );
}
