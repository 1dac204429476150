//! Trust at the gate's boundaries (#57; the security review's findings 1, 5
//! and 6), on the real broker: what a writer of `progress` or of a pool's
//! calls topic who is not the holder of a call can do (nothing), and what an
//! agent's intent can hide or mislead (nothing). Effects are counted at the
//! test's tool server, which records every raw invocation.

use crate::common::*;
use crate::workers::{spawn_worker, worker_log};
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use stepgate::config::Config;
use stepgate::contract::headers::SIGNATURE;
use stepgate::contract::sign::{Signed, sign};
use stepgate::contract::{Progress, Status, StepKey, codec, partition_for};

const WAIT: Duration = Duration::from_secs(60);

/// An unkeyed tool this process invokes, and one a pool's workers run; both
/// slow enough that forged records are read while the call runs.
const TOOLS: &str = r#"
[tools.pay]
category = "unkeyed"
url = "{tools}/pay"
timeout = "40s"
retries = 0

[tools.pool_pay]
category = "unkeyed"
pool = "gpu"
timeout = "40s"
retries = 0
"#;

/// How long the tools take: forged records are sent once the call runs,
/// and read (the refusal counted) well before it ends.
const RUNNING: Duration = Duration::from_secs(12);

async fn stack() -> Stack {
    let s = Stack::new(StackOptions {
        tool_tables: TOOLS.into(),
        ..StackOptions::default()
    })
    .await;
    for t in ["pay", "pool_pay"] {
        s.tools.script(t, vec![Reply::Delay(RUNNING), Reply::Ok]);
    }
    s
}

/// The pool's worker config: the stack's, with `pool_pay`'s address and a
/// `/metrics` of its own at `http`.
fn worker_config(s: &Stack, http: &str) -> PathBuf {
    let mut cfg: Config = s.config.clone();
    cfg.http.listen = http.to_owned();
    cfg.state.path = s.dir.path().join("worker-state-unused");
    let tables = format!(
        "[tools.pool_pay]\ncategory = \"unkeyed\"\nurl = \"{}/pool_pay\"\ntimeout = \"40s\"\nretries = 0\n",
        s.tools.base
    );
    cfg.tools = Config::from_toml_str(&tables, Vec::new()).unwrap().tools;
    let path = s.dir.path().join("worker.toml");
    write_config(&cfg, &path);
    path
}

/// Whoever holds Write on a topic of the stack (a worker of any pool, a
/// misplaced ACL): sends what it likes, where it likes.
struct Writer(FutureProducer);

impl Writer {
    fn new(s: &Stack) -> Writer {
        Writer(
            ClientConfig::new()
                .set("bootstrap.servers", &s.config.kafka.brokers)
                .create()
                .unwrap(),
        )
    }

    async fn send(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: &str,
        value: &[u8],
        headers: &[(&str, &[u8])],
    ) {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(*v),
            });
        }
        let mut r = FutureRecord::to(topic).key(key).payload(value).headers(h);
        if let Some(p) = partition {
            r = r.partition(p);
        }
        self.0
            .send(r, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
}

fn step(wf: &str, tool: &str) -> StepKey {
    StepKey {
        workflow_id: wf.into(),
        step_index: 0,
        tool: tool.into(),
        attempt: 0,
    }
}

/// A progress record as JSON (a worker's encoding), as the review's
/// reproduction writes it: for dispatch 1, with `token` when given.
fn json_report(step: &StepKey, token: Option<&str>, event: Value) -> Vec<u8> {
    let mut v = json!({"step": step, "dispatch": 1, "at_ms": 0});
    if let Some(t) = token {
        v["token"] = json!(t);
    }
    v.as_object_mut()
        .unwrap()
        .extend(event.as_object().unwrap().clone());
    v.to_string().into_bytes()
}

/// The same as a gate's hand-over (codec-encoded).
fn handover(step: &StepKey, token: Option<&str>, event: Value) -> Vec<u8> {
    let p: Progress = serde_json::from_slice(&json_report(step, token, event)).unwrap();
    codec::encode(&p)
}

fn not_invoked() -> Value {
    json!({"event": "not_invoked"})
}

fn fake_ok() -> Value {
    json!({"event": "finished", "outcome": {"status": "ok", "output": {"paid": true, "ref": "FAKE"}}})
}

fn refused_line(reason: &str, n: u32) -> String {
    format!("stepgate_progress_refused_total{{reason=\"{reason}\"}} {n}")
}

/// The agent's answer is the tool's own (the test server echoes the
/// arguments), never a forged one.
fn assert_real(answer: &stepgate::contract::ToolResult, args: &Value) {
    assert_eq!(answer.status, Status::Ok, "{answer:?}");
    assert!(!answer.deduplicated);
    assert_eq!(answer.output.as_ref().unwrap()["echo"], *args, "{answer:?}");
}

/// Sends `records` to `progress` while an in-process unkeyed call runs; the
/// agent's answer and the tool's invocations after.
async fn forge_while_running(
    records: impl Fn(&StepKey) -> Vec<Vec<u8>>,
) -> (Stack, stepgate::contract::ToolResult, Value) {
    let mut s = stack().await;
    s.start().await;
    let agent = s.agent();
    let writer = Writer::new(&s);
    let wf = random_name("wf-forged");
    let p = partition_for(&wf, s.config.kafka.partitions);
    let progress = s.topic("progress");
    let args = json!({"amount": 5});
    agent.send(&intent(&wf, 0, "pay", args.clone(), "c1")).await;
    eventually(WAIT, "the tool runs", || s.tools.count("pay") == 1).await;
    for value in records(&step(&wf, "pay")) {
        writer.send(&progress, Some(p), &wf, &value, &[]).await;
    }
    // The call runs for 12 s: the forged records are read meanwhile.
    let answer = agent.answer("c1", WAIT).await;
    assert_eq!(agent.answers("c1").len(), 1, "one answer");
    (s, answer, args)
}

/// A token that is no dispatch's.
const OTHER_TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// Finding 1, in-process: a "not invoked" for the running dispatch of an
/// unkeyed step — as a worker's JSON (the review's reproduction) or as a
/// gate's hand-over without the dispatch's token — ran it a second time and
/// answered one clean `ok`. Now each is refused (counted, dead-lettered):
/// one invocation, the real answer.
#[tokio::test]
async fn a_forged_not_invoked_never_runs_an_in_process_unkeyed_step_twice() {
    let (s, answer, args) = forge_while_running(|st| {
        vec![
            json_report(st, None, not_invoked()),
            handover(st, None, not_invoked()),
            handover(st, Some(OTHER_TOKEN), not_invoked()),
        ]
    })
    .await;
    assert_real(&answer, &args);
    assert_eq!(s.tools.count("pay"), 1, "one invocation");
    s.metrics_until(&refused_line("not_pool_tool", 1), WAIT)
        .await;
    s.metrics_until(&refused_line("token", 2), WAIT).await;
    assert_eq!(s.tools.count("pay"), 1, "never run again");
    let refused: Vec<_> = s
        .reader("dlq")
        .wait_for(3, WAIT)
        .await
        .into_iter()
        .filter(|r| r.value["reason"] == "refused_progress")
        .collect();
    assert_eq!(refused.len(), 3, "each dead-lettered");
    let wf = &answer.workflow_id;
    assert!(
        refused[0].value["message"]
            .as_str()
            .unwrap()
            .contains(&format!("{wf}#0/pay@0 dispatch 1")),
        "{:?}",
        refused[0].value
    );
}

/// Finding 1, variant: a forged `finished` (as a worker's JSON, or a gate's
/// hand-over with another dispatch's token) handed the agent its output.
/// Now refused and counted: the agent gets the tool's own answer.
#[tokio::test]
async fn a_forged_finished_never_answers_an_in_process_step() {
    let (s, answer, args) = forge_while_running(|st| {
        vec![
            json_report(st, None, fake_ok()),
            handover(st, Some(OTHER_TOKEN), fake_ok()),
        ]
    })
    .await;
    assert_real(&answer, &args);
    assert_eq!(s.tools.count("pay"), 1, "one invocation");
    s.metrics_until(&refused_line("not_pool_tool", 1), WAIT)
        .await;
    let m = s.metrics_until(&refused_line("token", 1), WAIT).await;
    assert!(m.contains("stepgate_rejected_inputs_total{reason=\"refused_progress\"} 2"));
}

/// Finding 1, pool: a pool tool's step takes only its worker's Outcome v1,
/// signed with the pool's key and with the dispatch's token — not an
/// unsigned one, not one signed with another key, not one from a worker of
/// the pool that never read this call, not a gate's hand-over.
#[tokio::test]
async fn forged_reports_never_rerun_nor_settle_a_pool_step() {
    let mut s = stack().await;
    s.start().await;
    let wc = worker_config(&s, "");
    let _worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let writer = Writer::new(&s);
    let wf = random_name("wf-pool");
    let p = partition_for(&wf, s.config.kafka.partitions);
    let progress = s.topic("progress");
    let args = json!({"amount": 7});

    agent
        .send(&intent(&wf, 0, "pool_pay", args.clone(), "p1"))
        .await;
    eventually(WAIT, "the worker runs the tool", || {
        s.tools.count("pool_pay") == 1
    })
    .await;
    let st = step(&wf, "pool_pay");
    let key = pool_key(&s.prefix, "gpu");
    let insider = json_report(&st, Some(OTHER_TOKEN), fake_ok());
    let insider_sig = sign(key.as_bytes(), Signed::Outcome, &insider);
    let outsider = json_report(&st, None, fake_ok());
    let outsider_sig = sign(
        b"another-pool-s-key-of-thirty-two-bytes",
        Signed::Outcome,
        &outsider,
    );
    let sends: Vec<(Vec<u8>, Option<String>)> = vec![
        // The review's reproduction: an unsigned "not invoked".
        (json_report(&st, None, not_invoked()), None),
        (outsider.clone(), Some(outsider_sig)),
        (insider.clone(), Some(insider_sig)),
        (handover(&st, None, fake_ok()), None),
    ];
    for (value, signature) in &sends {
        let headers: Vec<(&str, &[u8])> = signature
            .iter()
            .map(|s| (SIGNATURE, s.as_bytes()))
            .collect();
        writer.send(&progress, Some(p), &wf, value, &headers).await;
    }
    // The call runs for 12 s: the forged records are read meanwhile.
    let answer = agent.answer("p1", WAIT).await;
    assert_real(&answer, &args);
    assert_eq!(
        s.tools.count("pool_pay"),
        1,
        "one invocation\n{}",
        worker_log(&s, "a")
    );
    s.metrics_until(&refused_line("signature", 2), WAIT).await;
    s.metrics_until(&refused_line("token", 1), WAIT).await;
    s.metrics_until(&refused_line("pool_handover", 1), WAIT)
        .await;
    assert_eq!(s.tools.count("pool_pay"), 1, "not run again");
}

/// Finding 1, calls topic: a record on `calls.<pool>` not signed by a gate
/// (no signature, or another key's) is never run — logged, counted, and
/// committed past: the worker goes on with the gate's calls.
#[tokio::test]
async fn a_call_not_written_by_a_gate_is_never_run_by_a_worker() {
    let mut s = stack().await;
    s.tools.script("pool_pay", vec![Reply::Ok]);
    s.start().await;
    let http = format!("127.0.0.1:{}", free_port());
    let wc = worker_config(&s, &http);
    let _worker = spawn_worker(&s, &wc, "a");
    let writer = Writer::new(&s);
    let calls = s.config.kafka.topics.calls_for("gpu");
    let wf = random_name("wf-outside");
    let forged = |token: &str| {
        json!({"step": step(&wf, "pool_pay"), "dispatch": 1, "partition": 0,
            "category": "unkeyed", "arguments": {"forged": true},
            "idempotency_key": step(&wf, "pool_pay").idempotency_key(),
            "take_by_ms": chrono::Utc::now().timestamp_millis() + 600_000,
            "call_id": "x", "token": token})
        .to_string()
        .into_bytes()
    };
    let unsigned = forged("a");
    let other = forged("b");
    let other_sig = sign(
        b"another-pool-s-key-of-thirty-two-bytes",
        Signed::Call,
        &other,
    );
    // To every partition: whichever the worker owns, it reads them.
    for p in 0..s.config.kafka.partitions {
        writer.send(&calls, Some(p), &wf, &unsigned, &[]).await;
        writer
            .send(
                &calls,
                Some(p),
                &wf,
                &other,
                &[(SIGNATURE, other_sig.as_bytes())],
            )
            .await;
    }
    let n = 2 * s.config.kafka.partitions;
    let line =
        format!("stepgate_worker_calls_refused_total{{pool=\"gpu\",reason=\"signature\"}} {n}");
    let scraped = || async {
        reqwest::get(format!("http://{http}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()
    };
    let start = std::time::Instant::now();
    loop {
        if scraped().await.is_some_and(|m| m.contains(&line)) {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "the worker counted {n} refused calls\n{}",
            worker_log(&s, "a")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(s.tools.count("pool_pay"), 0, "never run");
    assert!(worker_log(&s, "a").contains("not a Call v1 signed with the pool's key"));
    // The gate's own calls still run: nothing was left in the way.
    let agent = s.agent();
    let args = json!({"amount": 1});
    let answer = agent
        .call(intent(
            &random_name("wf"),
            0,
            "pool_pay",
            args.clone(),
            "r1",
        ))
        .await;
    assert_real(&answer, &args);
    assert_eq!(s.tools.count("pool_pay"), 1);
}

/// Finding 5: an intent carrying `stepgate-forwarded-from` (a header an
/// agent can set) in its own workflow's partition ran but was counted
/// nowhere. It is decided and counted as any intent.
#[tokio::test]
async fn an_intent_claiming_to_be_re_routed_is_decided_and_counted_as_any_intent() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let wf = random_name("wf-hidden");
    let args = json!({"to": "x@example.com"});
    let body = intent(&wf, 0, "send_email", args.clone(), "h1").to_string();
    agent
        .send_raw(
            &wf,
            body.as_bytes(),
            None,
            &[("stepgate-forwarded-from", "0:0")],
        )
        .await;
    let answer = agent.answer("h1", WAIT).await;
    assert_real(&answer, &args);
    assert_eq!(s.tools.count("send_email"), 1);
    s.metrics_until(
        r#"stepgate_intents_received_total{tool="send_email"} 1"#,
        WAIT,
    )
    .await;
}

/// Finding 6: duplicate keys — the approver (serde_json: last wins) and a
/// first-wins tool would read different calls. Refused at validation, with
/// where; and a `call_id` with control characters (finding 15).
#[tokio::test]
async fn duplicate_keys_and_control_characters_in_call_id_are_rejected() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let wf = random_name("wf-dup");
    let dup = format!(
        r#"{{"workflow_id":"{wf}","step_index":0,"tool":"send_email","arguments":{{"to":"attacker","amount":1000000,"to":"alice","amount":10}},"call_id":"d1"}}"#
    );
    agent.send_raw(&wf, dup.as_bytes(), None, &[]).await;
    let r = agent.answer("d1", WAIT).await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    let e = r.error.unwrap();
    assert_eq!(e.kind, "invalid_value");
    assert!(e.message.contains(r#""/to""#), "{}", e.message);
    assert!(e.message.contains("Send each key once"), "{}", e.message);

    let ctl = json!({"workflow_id": wf, "step_index": 1, "tool": "send_email",
        "arguments": {}, "call_id": "d2\u{1b}[2J"});
    agent.send(&ctl).await;
    let r = agent.answer("d2\u{1b}[2J", WAIT).await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    assert!(r.error.unwrap().message.contains("control characters"));
    assert_eq!(s.tools.count("send_email"), 0, "nothing ran");
}
