//! Faults that move partitions, under load, against the real broker (issue #13):
//! a gate killed and kept down past the session timeout, a zombie gate
//! (SIGSTOP past the session timeout, SIGCONT), the broker hard-killed, and
//! poison records published to `intents` among valid ones.
//!
//! Every scenario runs a steady stream of intents (an agent task publishing
//! every 25 ms, `keyed` and `unkeyed` steps, some rephrased repeats in flight)
//! while the fault happens, and checks:
//! - every `call_id` answered exactly once (lost = sent and never answered);
//! - per step, one answer caused the invocation and every other answer is the
//!   same but for `call_id`/`deduplicated`;
//! - duplicate effects counted at the tool: an `unkeyed` step invoked more than
//!   once (raw invocations), a `keyed` step invoked with more than one
//!   `Idempotency-Key` (distinct keys per step, as a provider that deduplicates
//!   by key performs them) — `the_duplicate_checks_can_fail` shows both flag a
//!   duplicate;
//! - the gates still running.
//!
//! Each prints one summary line (`cargo test --test broker faults:: -- --nocapture`).
//! The broker outage lasts 10 s; `STEPGATE_LONG_FAULTS=1` makes it 30 s.
//! The broker-kill test runs its own broker (`deploy/local/kafka.sh`, ports
//! 29092/29093, its own data directory); the others use `KAFKA_BROKERS`.

use crate::common;

use common::load::*;
use common::processes::*;
use common::*;
use rdkafka::message::{BorrowedHeaders, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use stepgate::contract::{Status, partition_for};

fn options(brokers: Option<String>, grace: &'static str) -> StackOptions {
    StackOptions {
        brokers,
        tools: vec![(UNKEYED, "unkeyed", "3s"), (KEYED, "keyed", "3s")],
        // The broker's group.min.session.timeout.ms is 6 s.
        session_timeout: "6s",
        grace,
        ..StackOptions::default()
    }
}

/// Both checks flag a duplicate (they are not implied by how keys are made).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duplicate_checks_can_fail() {
    let tools = ToolServer::start().await;
    let http = reqwest::Client::new();
    let post = |tool: &'static str, step: &'static str, key: &'static str| {
        http.post(format!("{}/{tool}", tools.base))
            .header("Idempotency-Key", key)
            .header("Stepgate-Workflow-Id", "wf")
            .header("Stepgate-Step-Index", step)
            .header("Stepgate-Attempt", "0")
            .body("{}")
            .send()
    };
    post(UNKEYED, "1", "k1").await.unwrap();
    post(KEYED, "1", "k1").await.unwrap();
    post(KEYED, "1", "k1").await.unwrap();
    assert_eq!(duplicate_unkeyed(&tools, UNKEYED), 0);
    assert_eq!(
        duplicate_keyed(&tools, KEYED),
        0,
        "a re-run with the step's one key is one effect"
    );
    post(UNKEYED, "1", "k1").await.unwrap();
    post(KEYED, "1", "k2").await.unwrap();
    assert_eq!(
        duplicate_unkeyed(&tools, UNKEYED),
        1,
        "an unkeyed step run twice"
    );
    assert_eq!(
        duplicate_keyed(&tools, KEYED),
        1,
        "a keyed step with two keys"
    );
}

// ---------------------------------------------------------------- 1. gate killed

/// Three gates; one is killed (SIGKILL) and kept down past the session timeout,
/// so its partitions move and the survivors restore them from the changelog;
/// then it comes back, takes partitions back, and restores them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_killed_past_the_session_timeout_under_load() {
    let _serial = common::FAULTS.lock().await;
    let s = Stack::new(options(None, "2s")).await;
    tool_delay(&s);
    let mut gates: Vec<Gate> = ["a", "b", "c"].iter().map(|n| Gate::start(&s, n)).collect();
    for g in &gates {
        wait_ready(&g.http).await;
    }
    let results = s.agent().results;
    let mut load = Load::start(&s.config.kafka.brokers, &s.topic("intents"), "k");
    warm_up(&load, &results).await;
    let all: BTreeSet<i32> = (0..PARTITIONS).collect();
    assert!(
        wait_until(WAIT, || {
            gates.iter().flat_map(Gate::owned).collect::<BTreeSet<_>>() == all
        })
        .await,
        "every partition owned"
    );
    let victim = (0..gates.len())
        .max_by_key(|i| gates[*i].owned().len())
        .unwrap();
    let moved = gates[victim].owned();
    let survivors: Vec<usize> = (0..gates.len()).filter(|i| *i != victim).collect();
    let mut restored_before = 0.0;
    let mut warm = BTreeSet::new();
    for i in &survivors {
        restored_before += gates[*i]
            .metric("stepgate_state_restored_records_total")
            .await
            .unwrap();
        warm.extend(gates[*i].standbys().await);
    }

    let in_flight_at_fault = in_flight(&load, &results);
    let killed_at = Instant::now();
    let fault_at = killed_at;
    gates[victim].sigkill();
    assert!(
        wait_until(WAIT, || {
            survivors
                .iter()
                .flat_map(|i| gates[*i].owned())
                .collect::<BTreeSet<_>>()
                == all
        })
        .await,
        "the survivors take the killed gate's partitions {moved:?}"
    );
    let moved_after = killed_at.elapsed();
    // The new owners replay the moved partitions' changelog before serving
    // them (only its tail where a survivor kept a standby copy: maybe none).
    let from_standby = moved.is_subset(&warm);
    let mut restored_after = restored_before;
    let deadline = Instant::now() + WAIT;
    while !from_standby && restored_after <= restored_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        restored_after = 0.0;
        for i in &survivors {
            restored_after += gates[*i]
                .metric("stepgate_state_restored_records_total")
                .await
                .unwrap_or(0.0);
        }
    }
    assert!(
        from_standby || restored_after > restored_before,
        "a survivor restored the moved partitions from the changelog ({restored_before} → {restored_after}):\n{}",
        partition_lines(&gates)
    );
    // The survivors answer new intents of the moved partitions.
    assert!(
        answered_after(&load, &results, Instant::now(), 20, |c| moved
            .contains(&partition_for(&c.wf, PARTITIONS)))
        .await,
        "the moved partitions are served"
    );
    let down_for = killed_at.elapsed();

    // Back: partitions return to it, and it restores what the others wrote.
    gates[victim].spawn();
    wait_ready(&gates[victim].http).await;
    let back = &gates[victim];
    assert!(
        wait_until(WAIT, || !back.owned().is_empty()).await,
        "the restarted gate gets partitions back"
    );
    let mut restored_on_return = 0.0;
    let deadline = Instant::now() + WAIT;
    while restored_on_return == 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        restored_on_return = back
            .metric("stepgate_state_restored_records_total")
            .await
            .unwrap_or(0.0);
    }
    assert!(
        restored_on_return > 0.0,
        "the returning gate replays what the others committed"
    );
    assert!(answered_after(&load, &results, Instant::now(), 60, |_| true).await);

    let mut sum = settle(
        "gate SIGKILLed, down past the session timeout (6 s), restarted",
        &s,
        &mut load,
        &results,
        in_flight_at_fault,
        fault_at,
    )
    .await;
    sum.running = gates.iter_mut().all(Gate::alive);
    sum.extra = format!(
        "{}; partitions {moved:?} moved after {:.1} s, killed gate down {:.1} s, survivors restored {} records, returning gate {}",
        sum.extra,
        moved_after.as_secs_f64(),
        down_for.as_secs_f64(),
        restored_after - restored_before,
        restored_on_return
    );
    sum.print_and_assert();
}

// ---------------------------------------------------------------- 2. zombie

/// Two gates; one is frozen (SIGSTOP) with calls in flight past the session
/// timeout and the transaction timeout, the other takes over and settles its
/// steps; then the frozen one resumes (SIGCONT) with outcomes and a batch of a
/// generation that is gone: whatever it tries to commit is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_gate_is_fenced() {
    let _serial = common::FAULTS.lock().await;
    let s = Stack::new(options(None, "2s")).await;
    tool_delay(&s);
    let mut gates: Vec<Gate> = ["a", "b"].iter().map(|n| Gate::start(&s, n)).collect();
    for g in &gates {
        wait_ready(&g.http).await;
    }
    let results = s.agent().results;
    let mut load = Load::start(&s.config.kafka.brokers, &s.topic("intents"), "z");
    warm_up(&load, &results).await;
    let all: BTreeSet<i32> = (0..PARTITIONS).collect();
    assert!(
        wait_until(WAIT, || {
            gates[0].owned().len() + gates[1].owned().len() == all.len()
                && !gates[0].owned().is_empty()
                && !gates[1].owned().is_empty()
        })
        .await,
        "both gates own partitions:\n{}",
        partition_lines(&gates)
    );
    let (zombie, other) = (0, 1);
    let moved = gates[zombie].owned();
    let invocations_before = s.tools.count(UNKEYED) + s.tools.count(KEYED);

    let in_flight_at_fault = in_flight(&load, &results);
    let stopped_at = Instant::now();
    let fault_at = stopped_at;
    let before_stop: Vec<Call> = load.sent();
    gates[zombie].signal("-STOP");
    let taken = wait_until(WAIT, || gates[other].owned() == all).await;
    if !taken {
        gates[zombie].signal("-CONT");
    }
    assert!(
        taken,
        "the other gate takes every partition:\n{}",
        partition_lines(&gates)
    );
    let moved_after = stopped_at.elapsed();
    // Everything the zombie had taken in is settled by the other gate (its
    // in-flight calls in doubt or re-run with their key), and its open
    // transaction outlives the transaction timeout (10 s).
    let settled = wait_until(WAIT, || {
        let a = answers(&results);
        stopped_at.elapsed() > Duration::from_secs(12)
            && before_stop.iter().all(|c| load.settled(&c.id, &a))
    })
    .await;
    if !settled {
        gates[zombie].signal("-CONT");
    }
    assert!(settled, "the other gate settles the zombie's steps");
    let stopped_for = stopped_at.elapsed();
    let answers_at_resume = results.all().len();

    let log_at_resume = gates[zombie].log().len();
    gates[zombie].signal("-CONT");
    let z = &gates[zombie];
    // The zombie finds out: its session fails or its partitions are revoked,
    // and it rejoins the group.
    assert!(
        wait_until(WAIT, || {
            let log = z.log();
            let after = strip_ansi(&log[log_at_resume.min(log.len())..]);
            (after.contains("gate session failed") || after.contains("partitions revoked"))
                && !owned_from_log(&after).is_empty()
        })
        .await,
        "the zombie notices and rejoins:\n{}\n{}",
        z.log(),
        partition_lines(&gates)
    );
    let zlog = strip_ansi(&z.log()[log_at_resume..]);
    let fenced: Vec<&str> = zlog
        .lines()
        .filter(|l| {
            l.contains("session failed")
                || l.contains("revoked")
                || l.to_lowercase().contains("fenc")
        })
        .take(3)
        .collect();
    println!("zombie after SIGCONT:\n{}", fenced.join("\n"));
    assert!(answered_after(&load, &results, Instant::now(), 60, |_| true).await);
    let late = gates[other]
        .metric("stepgate_late_outcomes_total")
        .await
        .unwrap_or(0.0)
        + gates[zombie]
            .metric("stepgate_late_outcomes_total")
            .await
            .unwrap_or(0.0);

    let mut sum = settle(
        "zombie: SIGSTOP past the session timeout, SIGCONT",
        &s,
        &mut load,
        &results,
        in_flight_at_fault,
        fault_at,
    )
    .await;
    sum.running = gates.iter_mut().all(Gate::alive);
    sum.extra = format!(
        "{}; partitions {moved:?} moved after {:.1} s, zombie frozen {:.1} s, {} invocations before the freeze, {} answers before the resume, late outcomes {late}",
        sum.extra,
        moved_after.as_secs_f64(),
        stopped_for.as_secs_f64(),
        invocations_before,
        answers_at_resume,
    );
    sum.print_and_assert();
}

// ---------------------------------------------------------------- 3. broker killed

/// At most this many answers lost or repeated when the broker loses one
/// acknowledged commit marker (one batch at this test's load is ~10 intents).
const ONE_LOST_BATCH: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_killed_under_load() {
    let _serial = common::FAULTS.lock().await;
    let long = std::env::var("STEPGATE_LONG_FAULTS").as_deref() == Ok("1");
    let outage = Duration::from_secs(if long { 30 } else { 10 });
    let broker = Broker {
        dir: tempfile::tempdir().unwrap(),
    };
    broker.start();
    let mut s = Stack::new(options(Some(BROKER.into()), "10s")).await;
    tool_delay(&s);
    s.start().await;
    let results = s.agent().results;
    let mut load = Load::start(BROKER, &s.topic("intents"), "br");
    warm_up(&load, &results).await;

    let in_flight_at_fault = in_flight(&load, &results);
    let invocations_at_fault = s.tools.count(UNKEYED) + s.tools.count(KEYED);
    let fault_at = Instant::now();
    let sent_at_kill = load.sent().len();
    broker.kill_9();
    let killed_at = Instant::now();
    // The outage itself (not a wait for a condition): the load goes on
    // publishing into the agent's producer, the calls running finish.
    tokio::time::sleep(outage).await;
    broker.start();
    let sent_during_outage = load.sent().len();
    let down_for = killed_at.elapsed();
    let back_at = Instant::now();
    let recovered =
        answered_after(&load, &results, load.started, sent_during_outage, |_| true).await;
    let recovery = back_at.elapsed();
    if !recovered {
        let a = answers(&results);
        let missing: Vec<String> = load
            .sent()
            .iter()
            .filter(|c| !load.settled(&c.id, &a))
            .map(|c| format!("{} ({} step {})", c.id, c.wf, c.step))
            .collect();
        let metrics = s.metrics().await;
        let answered: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("stepgate_") && !l.contains("_bucket"))
            .filter(|l| l.contains("result") || l.contains("session") || l.contains("restore"))
            .collect();
        panic!(
            "stepgate answers again after the broker is back: {} of {} sent unanswered (first: {:?}), {} undelivered by the agent's producer, {} answers read\nmetrics:\n{}\nlog (tail):\n{}",
            missing.len(),
            load.sent().len(),
            &missing[..missing.len().min(5)],
            load.undelivered.load(Ordering::SeqCst),
            a.len(),
            answered.join("\n"),
            s.log_tail(150)
        );
    }
    assert!(answered_after(&load, &results, Instant::now(), 60, |_| true).await);

    let mut sum = settle(
        &format!("broker SIGKILLed for {} s under load", outage.as_secs()),
        &s,
        &mut load,
        &results,
        in_flight_at_fault,
        fault_at,
    )
    .await;
    sum.running = s.child.as_mut().unwrap().try_wait().unwrap().is_none();
    // A single broker SIGKILLed mid-commit can come back without the commit
    // marker of a transaction it acknowledged (reproduced with librdkafka alone:
    // deploy/local/repro/hanging-transaction.sh; docs/guarantees.md "Faults and
    // bad input"). The next session ends it by aborting it and then writes
    // again what its last commits lost (`gate::lost`), so no answer is lost for
    // it. Only where the gate says it could not (the read-back timed out, or a
    // partition was written to since) is one batch's loss tolerated, and said.
    let log = s.log();
    let could_not_mend = log.contains("not checked for what a broker may have lost")
        || log.contains("other records were written after them: not written again");
    let lost_to_the_broker = sum.lost + sum.dup_answers;
    if could_not_mend
        && lost_to_the_broker > 0
        && lost_to_the_broker <= ONE_LOST_BATCH
        && sum.dup_unkeyed == 0
        && sum.dup_keyed == 0
    {
        println!(
            "FAULTS | KNOWN BROKER LIMIT | {} answers lost and {} given twice, and the gate could not mend the lost commit (docs/guarantees.md); tolerated: {:?}",
            sum.lost, sum.dup_answers, sum.violations
        );
        sum.violations.retain(|v| {
            !(v.contains("never answered")
                || v.contains("lost or answered twice")
                || v.contains("answered 2 times"))
        });
        sum.lost = 0;
        sum.dup_answers = 0;
    }
    if log.contains("lost its commit marker: writing its records again") {
        println!(
            "FAULTS | the broker lost an acknowledged commit marker; the gate wrote the lost records again"
        );
    }
    sum.extra = format!(
        "{}; broker down {:.1} s (restarted after {} s), {} intents published while it was down, {} invocations before the kill, everything sent until the restart answered {:.1} s after it, stepgate never restarted",
        sum.extra,
        down_for.as_secs_f64(),
        outage.as_secs(),
        sent_during_outage - sent_at_kill,
        invocations_at_fault,
        recovery.as_secs_f64()
    );
    sum.print_and_assert();
}

// ---------------------------------------------------------------- 4. poison

/// Kafka headers with raw (possibly non-UTF-8) names: rdkafka's `OwnedHeaders`
/// only takes `&str` names, so through librdkafka's C API.
fn raw_headers(headers: &[(&[u8], &[u8])]) -> OwnedHeaders {
    let h = OwnedHeaders::new();
    let ptr =
        h.as_borrowed() as *const BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
    for (name, value) in headers {
        // SAFETY: `ptr` is the live, writable header list `h` owns; librdkafka
        // copies name and value.
        let err = unsafe {
            rdkafka::bindings::rd_kafka_header_add(
                ptr,
                name.as_ptr().cast(),
                name.len() as isize,
                value.as_ptr().cast(),
                value.len() as isize,
            )
        };
        assert_eq!(
            err,
            rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        );
    }
    h
}

struct Poison {
    name: &'static str,
    payload: Vec<u8>,
    headers: Vec<(&'static [u8], &'static [u8])>,
    /// The DLQ reason it must get (None: a valid intent, answered normally).
    reason: Option<&'static str>,
    /// The call id a rejected answer must reach.
    call_id: Option<&'static str>,
}

fn nested(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!({ "a": v });
    }
    v
}

fn poisons() -> Vec<Poison> {
    let mut not_utf8 = Vec::with_capacity(900 * 1024);
    while not_utf8.len() < 900 * 1024 {
        not_utf8.extend_from_slice(&[0xff, 0xfe, 0x80, 0xc3, 0x00]);
    }
    not_utf8.truncate(900 * 1024);
    let big = "x".repeat(1_200_000);
    let p = |v: Value| v.to_string().into_bytes();
    vec![
        Poison {
            name: "900 KiB of non-UTF-8 bytes",
            payload: not_utf8,
            headers: vec![],
            reason: Some("malformed_json"),
            call_id: None,
        },
        Poison {
            name: "valid intent, header name 0xff 0xfe",
            payload: p(intent("poison-hdr", 1, KEYED, json!({"h": 1}), "p-hdr")),
            headers: vec![(b"\xff\xfe", b"x")],
            reason: None,
            call_id: Some("p-hdr"),
        },
        Poison {
            name: "malformed JSON",
            payload: br#"{"workflow_id": "poison-json", "step_index": 1, "tool": "#.to_vec(),
            headers: vec![],
            reason: Some("malformed_json"),
            call_id: None,
        },
        Poison {
            name: "wrong-typed step_index (\"two\")",
            payload: p(
                json!({"workflow_id": "poison-type", "step_index": "two", "tool": KEYED, "arguments": {}, "call_id": "p-type1"}),
            ),
            headers: vec![],
            reason: Some("wrong_type"),
            call_id: None,
        },
        Poison {
            name: "wrong-typed arguments (a string)",
            payload: p(
                json!({"workflow_id": "poison-type", "step_index": 2, "tool": KEYED, "arguments": "hi", "call_id": "p-type2"}),
            ),
            headers: vec![],
            reason: Some("wrong_type"),
            call_id: Some("p-type2"),
        },
        Poison {
            name: "unknown tool",
            payload: p(intent("poison-tool", 1, "chrage", json!({}), "p-tool")),
            headers: vec![],
            reason: Some("unknown_tool"),
            call_id: Some("p-tool"),
        },
        Poison {
            name: "oversized (1.2 MB, over gate.max_intent_bytes)",
            payload: p(intent(
                "poison-big",
                1,
                KEYED,
                json!({"body": big}),
                "p-big",
            )),
            headers: vec![],
            reason: Some("oversized"),
            call_id: Some("p-big"),
        },
        Poison {
            name: "a number beyond a double in arguments (1e400)",
            payload: format!(
                r#"{{"workflow_id":"poison-num","step_index":1,"tool":"{KEYED}","arguments":{{"amount":1e400}},"call_id":"p-num"}}"#
            )
            .into_bytes(),
            headers: vec![],
            reason: Some("invalid_value"),
            call_id: Some("p-num"),
        },
        Poison {
            name: "arguments nested 70 deep",
            payload: p(intent("poison-deep", 1, KEYED, nested(70), "p-deep")),
            headers: vec![],
            reason: Some("too_deep"),
            call_id: Some("p-deep"),
        },
    ]
}

/// Poison records published to `intents` one after another among a steady
/// stream of valid intents: each lands on the DLQ (with a model-readable
/// `rejected` answer when its call can be addressed), and the others keep
/// being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_inputs_under_load() {
    let _serial = common::FAULTS.lock().await;
    let mut s = Stack::new(options(None, "2s")).await;
    tool_delay(&s);
    s.start().await;
    let results = s.agent().results;
    let dlq = s.reader("dlq");
    let mut load = Load::start(&s.config.kafka.brokers, &s.topic("intents"), "p");
    warm_up(&load, &results).await;
    let producer = agent_producer(&s.config.kafka.brokers);
    let intents = s.topic("intents");
    let first_in_flight = in_flight(&load, &results);
    let first_published = Instant::now();
    let mut rows = Vec::new();
    for poison in poisons() {
        let in_flight_now = in_flight(&load, &results);
        // Keyed and partitioned by its workflow when it names one (the gate
        // refuses a valid intent outside its workflow's partition).
        // (Read without parsing the numbers: `1e400` is one of the poisons.)
        #[derive(serde::Deserialize)]
        struct Named {
            workflow_id: String,
        }
        let workflow = serde_json::from_slice::<Named>(&poison.payload)
            .ok()
            .map(|n| n.workflow_id);
        let key = workflow.clone().unwrap_or_else(|| "poison-key".to_owned());
        let mut rec = FutureRecord::to(&intents)
            .key(&key)
            .payload(&poison.payload);
        if let Some(wf) = &workflow {
            rec = rec.partition(stepgate::contract::partition_for(wf, PARTITIONS));
        }
        if !poison.headers.is_empty() {
            rec = rec.headers(raw_headers(&poison.headers));
        }
        let delivered = producer
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("the poison is published");
        let published_at = Instant::now();
        let dlq_record = if let Some(reason) = poison.reason {
            let found = wait_until(WAIT, || {
                dlq.all().iter().any(|r| {
                    r.value["partition"] == delivered.partition
                        && r.value["offset"] == delivered.offset
                })
            })
            .await;
            assert!(found, "{}: no DLQ record\n{}", poison.name, s.log_tail(150));
            let r = dlq
                .all()
                .into_iter()
                .find(|r| {
                    r.value["partition"] == delivered.partition
                        && r.value["offset"] == delivered.offset
                })
                .unwrap();
            assert_eq!(r.value["reason"], reason, "{}: {:?}", poison.name, r.value);
            assert_eq!(r.key.as_deref(), Some(key.as_bytes()), "the key is kept");
            assert_eq!(
                r.value["payload_bytes"],
                poison.payload.len(),
                "{}",
                poison.name
            );
            Some(r)
        } else {
            None
        };
        let answer = match poison.call_id {
            Some(id) => {
                assert!(
                    wait_until(WAIT, || answers(&results).contains_key(id)).await,
                    "{}: no answer for {id}\n{}",
                    poison.name,
                    s.log_tail(150)
                );
                let a = answers(&results)[id][0].clone();
                match poison.reason {
                    Some(reason) => {
                        assert_eq!(a.status, Status::Rejected, "{a:?}");
                        let e = a.error.clone().unwrap();
                        assert_eq!(e.kind, reason, "{a:?}");
                        assert!(
                            e.message.contains("nothing was performed"),
                            "model-readable: {}",
                            e.message
                        );
                    }
                    None => assert_eq!(a.status, Status::Ok, "{a:?}"),
                }
                Some(a)
            }
            None => None,
        };
        // The others keep being answered.
        assert!(
            answered_after(&load, &results, published_at, 20, |_| true).await,
            "{}: the gate goes on\n{}",
            poison.name,
            s.log_tail(150)
        );
        let running = s.child.as_mut().unwrap().try_wait().unwrap().is_none();
        rows.push((
            poison.name,
            in_flight_now,
            dlq_record
                .map(|r| {
                    format!(
                        "DLQ {} (payload_bytes {}, truncated {}, encoding {})",
                        r.value["reason"].as_str().unwrap_or("?"),
                        r.value["payload_bytes"],
                        r.value["payload_truncated"],
                        r.value["payload_encoding"].as_str().unwrap_or("utf-8")
                    )
                })
                .unwrap_or_else(|| "not dead-lettered (valid)".into()),
            answer
                .map(|a| match a.error {
                    Some(e) => format!("answer {:?} {}", a.status, e.kind),
                    None => format!("answer {:?}", a.status),
                })
                .unwrap_or_else(|| "no answer (no call addressable)".into()),
            running,
        ));
    }
    let mut sum = settle(
        "poison inputs among valid intents",
        &s,
        &mut load,
        &results,
        first_in_flight,
        first_published,
    )
    .await;
    sum.running = s.child.as_mut().unwrap().try_wait().unwrap().is_none();
    // Each poison call_id answered once; nothing rejected reached a tool.
    let a = answers(&results);
    for p in poisons() {
        if let Some(id) = p.call_id
            && a.get(id).map_or(0, Vec::len) != 1
        {
            sum.violations
                .push(format!("{id} answered {:?}", a.get(id)));
        }
    }
    for tool in [UNKEYED, KEYED] {
        for c in s.tools.calls(tool) {
            let wf = step_of(&c).0;
            if wf.starts_with("poison-") && wf != "poison-hdr" {
                sum.violations
                    .push(format!("a rejected intent reached {tool}: {wf}"));
            }
        }
    }
    for (name, in_flight_then, dlq, answer, running) in &rows {
        println!(
            "FAULTS | poison: {name} | in flight when published: {in_flight_then} | {dlq} | {answer} | the next 20 intents answered | duplicate effects unkeyed/keyed: {}/{} (whole run) | lost: {} (whole run) | stepgate kept running: {}",
            sum.dup_unkeyed,
            sum.dup_keyed,
            sum.lost,
            if *running { "yes" } else { "NO" }
        );
    }
    sum.print_and_assert();
}
