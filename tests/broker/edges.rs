//! An effect happens once at the protocol's edges, against the real broker
//! (issue #26): a provider answering "still processing" (409) to a retry, calls
//! queued behind a slow tool when their partition moves to another gate, and a
//! rolling restart (SIGTERM) under backlog.
//!
//! Effects are counted at the tool: raw invocations per step (an `unkeyed`
//! step invoked twice is a duplicate effect), and, for the provider, the keys
//! it performed (it deduplicates by `Idempotency-Key`).

use crate::common;

use common::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use stepgate::contract::{Status, ToolResult};

/// How long anything may take (generous: a compile may share the cores).
const WAIT: Duration = Duration::from_secs(240);

/// A keyed charge whose first try times out while the provider still
/// processes it: the retry, with the same key, is answered 409 until the
/// provider has finished; the step's answer is the provider's real result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_answered_409_while_the_first_try_runs_gets_the_real_result_once() {
    let _one = common::FAULTS.lock().await;
    let mut s = Stack::new(StackOptions {
        tools: vec![],
        tool_tables: r#"
[tools.charge]
category = "keyed"
url = "{tools}/charge"
timeout = "1s"
retries = 2
backoff = "100ms"
busy_wait = "30s"
"#
        .into(),
        ..StackOptions::default()
    })
    .await;
    s.tools
        .script("charge", vec![Reply::Provider(Duration::from_secs(3))]);
    s.start().await;
    let agent = s.agent();
    agent
        .send(&intent("wf-409", 1, "charge", json!({"amount": 5}), "c1"))
        .await;
    let r = agent.answer("c1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "never \"not performed\": {r:?}");
    let output = r.output.clone().expect("ok has an output");
    let invocations = s.tools.calls("charge");
    assert!(
        invocations.len() >= 2,
        "the retry reached the provider while the first try ran: {invocations:?}"
    );
    assert_eq!(
        output["performed_for"], invocations[0].idempotency_key,
        "the provider's own answer for the key"
    );
    assert_eq!(s.tools.performed("charge"), 1, "one effect");
    assert_eq!(s.tools.keys_per_step("charge").len(), 1);
    // A rephrased retry is the same step: the same answer, nothing performed.
    let again = agent
        .call(intent("wf-409", 1, "charge", json!({"amount": "5"}), "c2"))
        .await;
    same_but_call_id(&r, &again);
    assert_eq!(s.tools.performed("charge"), 1);
}

/// Everything the test saw of one run: answers by call id, and the tool's
/// raw invocations per step.
struct Tally {
    answers: HashMap<String, Vec<ToolResult>>,
    invocations: HashMap<String, usize>,
}

fn tally(agent: &Agent, tools: &ToolServer, tool: &str) -> Tally {
    let mut answers: HashMap<String, Vec<ToolResult>> = HashMap::new();
    for r in agent.results.all() {
        let res: ToolResult = serde_json::from_value(r.value).expect("a Result v1");
        answers
            .entry(res.call_id.clone().unwrap_or_default())
            .or_default()
            .push(res);
    }
    let mut invocations: HashMap<String, usize> = HashMap::new();
    for c in tools.calls(tool) {
        let wf = c
            .headers
            .get("stepgate-workflow-id")
            .cloned()
            .unwrap_or_default();
        *invocations.entry(wf).or_default() += 1;
    }
    Tally {
        answers,
        invocations,
    }
}

/// `n` steps of the slow unkeyed tool, one workflow each (spread over the
/// partitions), published at once.
async fn flood(agent: &Agent, name: &str, n: usize) -> Vec<(String, String)> {
    let mut sent = Vec::new();
    for i in 0..n {
        let (wf, id) = (format!("{name}-wf-{i}"), format!("{name}-{i}"));
        agent
            .send(&intent(
                &wf,
                0,
                "ticket",
                json!({"title": "same title"}),
                &id,
            ))
            .await;
        sent.push((wf, id));
    }
    sent
}

/// The operator script: every `in_doubt` answer is resolved "not executed"
/// and the agent retries it (if any call that ran were answered in doubt,
/// this would invoke it twice, and the count below would show it).
async fn resolve_every_in_doubt(s: &Stack, agent: &Agent, sent: &[(String, String)]) -> usize {
    let mut resolved = 0;
    for (wf, id) in sent {
        let Some((_, r)) = agent.answers(id).into_iter().next() else {
            continue;
        };
        if r.status != Status::InDoubt {
            continue;
        }
        let out = s
            .cli(&[
                "resolve",
                wf,
                "0",
                "ticket",
                "--not-executed",
                "--by",
                "script",
            ])
            .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let retry = format!("{id}-retry");
        agent
            .send(&intent(
                wf,
                0,
                "ticket",
                json!({"title": "same title"}),
                &retry,
            ))
            .await;
        agent.answer(&retry, WAIT).await;
        resolved += 1;
    }
    resolved
}

/// Checks shared by the move and the restart: every call answered, with one
/// answer, none `in_doubt` (no call here was cut off), each step invoked once.
fn check(name: &str, t: &Tally, sent: &[(String, String)], resolved: usize) {
    let mut in_doubt = 0;
    for (wf, id) in sent {
        let answers = t.answers.get(id).map(Vec::as_slice).unwrap_or_default();
        let answer = the_one_answer(&format!("{name}: {id}"), answers);
        if answer.status == Status::InDoubt {
            in_doubt += 1;
        } else {
            assert_eq!(answer.status, Status::Ok, "{name}: {id}: {answers:?}");
        }
        let n = t.invocations.get(wf).copied().unwrap_or(0);
        assert_eq!(n, 1, "{name}: step of {wf} invoked {n} times");
    }
    println!(
        "{name}: {} calls, {} answered, {in_doubt} in doubt, {resolved} resolved by the script, {} invocations",
        sent.len(),
        sent.iter()
            .filter(|(_, id)| t.answers.contains_key(id))
            .count(),
        t.invocations.values().sum::<usize>()
    );
    assert_eq!(
        in_doubt, 0,
        "{name}: calls that never left a process answered in doubt"
    );
}

fn slow_queue() -> StackOptions {
    StackOptions {
        tools: vec![("ticket", "unkeyed", "5s")],
        session_timeout: "6s",
        grace: "2s",
        // A pool of 4: most calls wait in the queue behind the slow tool.
        configure: |c| c.executor.concurrency = 4,
        ..StackOptions::default()
    }
}

async fn metric(http: &str, name: &str) -> f64 {
    common::processes::metric_sum(http, name)
        .await
        .expect("the gate answers /metrics")
}

/// 400 calls queued behind a slow unkeyed tool in one gate; a second gate
/// joins, and partitions move while the calls wait. The queued calls of the
/// moved partitions never run in the old gate: they are handed to the new
/// owner as not invoked, and it runs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_when_their_partition_moves_run_once_and_are_never_in_doubt() {
    let _one = common::FAULTS.lock().await;
    let mut s = Stack::new(slow_queue()).await;
    s.tools
        .script("ticket", vec![Reply::Delay(Duration::from_millis(150))]);
    s.start().await;
    let agent = s.agent();
    let sent = flood(&agent, "mv", 400).await;
    eventually(WAIT, "the first calls run", || {
        s.tools.count("ticket") >= 12
    })
    .await;
    let http_b = format!("127.0.0.1:{}", free_port());
    let mut b = s.spawn_other("b", &http_b, &[]);
    wait_ready(&http_b).await;
    let started = Instant::now();
    eventually(WAIT, "every call answered", || {
        sent.iter().all(|(_, id)| !agent.answers(id).is_empty())
    })
    .await;
    let resolved = resolve_every_in_doubt(&s, &agent, &sent).await;
    // Each partition is owned, and ready, on exactly one of the two gates;
    // the ones the first gate let go read 0 there.
    let partitions = f64::from(s.config.kafka.partitions);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let (owned_a, owned_b) = (
            metric(&s.http, "stepgate_partition_owned").await,
            metric(&http_b, "stepgate_partition_owned").await,
        );
        let (ready_a, ready_b) = (
            metric(&s.http, "stepgate_partition_ready").await,
            metric(&http_b, "stepgate_partition_ready").await,
        );
        if owned_a + owned_b == partitions
            && owned_a > 0.0
            && owned_b > 0.0
            && (ready_a, ready_b) == (owned_a, owned_b)
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "ownership after the move: owned {owned_a} + {owned_b}, ready {ready_a} + {ready_b} of {partitions}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let a_metrics = s.metrics().await;
    assert!(
        a_metrics
            .lines()
            .any(|l| l.starts_with("stepgate_partition_owned{") && l.ends_with("} 0")),
        "a partition the first gate let go reads 0 there:\n{a_metrics}"
    );
    let handed = metric(&s.http, "stepgate_calls_not_invoked_total").await
        + metric(&http_b, "stepgate_calls_not_invoked_total").await;
    let t = tally(&agent, &s.tools, "ticket");
    let _ = b.kill();
    let _ = b.wait();
    println!(
        "moved: {handed} queued calls handed over not invoked; all answered {:?} after the second gate was ready",
        started.elapsed()
    );
    check("moved", &t, &sent, resolved);
    assert!(
        handed > 0.0,
        "the move happened while calls were queued (else this test proves nothing)\n{}",
        s.log_tail(60)
    );
}

/// A rolling restart: SIGTERM while 200 calls wait behind a slow unkeyed
/// tool (10 a second: more than the 10 s drain lets finish), then the gate
/// starts again. The calls it had not started are
/// recorded as not invoked and run by the next owner — never `in_doubt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_backlog_leaves_no_false_in_doubt() {
    let _one = common::FAULTS.lock().await;
    let mut s = Stack::new(slow_queue()).await;
    s.tools
        .script("ticket", vec![Reply::Delay(Duration::from_millis(400))]);
    s.start().await;
    let agent = s.agent();
    let sent = flood(&agent, "rr", 200).await;
    eventually(WAIT, "the first calls run", || {
        s.tools.count("ticket") >= 12
    })
    .await;
    let status = s.terminate().await;
    assert!(status.success(), "a clean exit on SIGTERM: {status}");
    let ran_before = s.tools.count("ticket");
    assert!(
        ran_before < sent.len(),
        "calls were still queued at SIGTERM ({ran_before} of {} ran)",
        sent.len()
    );
    s.start().await;
    eventually(WAIT, "every call answered", || {
        sent.iter().all(|(_, id)| !agent.answers(id).is_empty())
    })
    .await;
    let resolved = resolve_every_in_doubt(&s, &agent, &sent).await;
    let t = tally(&agent, &s.tools, "ticket");
    println!("restart: {ran_before} calls ran before SIGTERM");
    check("restart", &t, &sent, resolved);
}

/// `send_email(to=alice)` times out at the client, and the model sends a
/// *different* `send_email(to=bob)`, which the restarted adapter numbers as
/// the lost call's step. With `identity = ["to"]` bob's call is not taken for
/// alice's retry: refused as `identity_conflict`, and the Rust client sends it
/// as the next step. Both emails are sent once; alice's rephrased retry still
/// runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_call_in_a_lost_calls_step_is_not_swallowed_as_its_retry() {
    let _one = common::FAULTS.lock().await;
    let mut s = Stack::new(StackOptions {
        tools: vec![],
        tool_tables: r#"
[tools.send_email]
category = "keyed"
url = "{tools}/send_email"
timeout = "10s"
identity = ["to"]
"#
        .into(),
        ..StackOptions::default()
    })
    .await;
    // Alice's email takes a while: the client gives up waiting on it.
    s.tools.script(
        "send_email",
        vec![Reply::Delay(Duration::from_secs(2)), Reply::Ok],
    );
    s.start().await;
    let agent = s.agent();
    let mail = |to: &str, subject: &str| json!({"to": to, "subject": subject});
    agent
        .send(&intent(
            "wf-ab",
            0,
            "send_email",
            mail("alice@example.com", "Order confirmed"),
            "a1",
        ))
        .await;
    let client = stepgate::client::Client::new(stepgate::client::options_from_config(&s.config))
        .await
        .unwrap();
    // The restarted adapter numbers the model's next call as step 0 again.
    let bob = client
        .workflow("wf-ab")
        .starting_at(0)
        .call("send_email", mail("bob@example.com", "Order confirmed"))
        .await
        .unwrap();
    assert_eq!(bob.status, Status::Ok, "bob's email was sent: {bob:?}");
    assert_eq!(bob.step_index, 1, "as the step after the lost call's");
    assert_eq!(
        bob.output.as_ref().unwrap()["echo"]["to"],
        "bob@example.com"
    );
    let alice = agent.answer("a1", WAIT).await;
    assert_eq!(alice.status, Status::Ok);
    // Alice's rephrased retry, in her step: her answer, nothing run.
    let retry = agent
        .call(intent(
            "wf-ab",
            0,
            "send_email",
            mail("alice@example.com", "Your order is confirmed"),
            "a2",
        ))
        .await;
    same_but_call_id(&alice, &retry);
    let sent: Vec<String> = s
        .tools
        .calls("send_email")
        .iter()
        .map(|c| c.body["to"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        sent,
        ["alice@example.com", "bob@example.com"],
        "each sent once"
    );
    let conflicts = metric(&s.http, "stepgate_identity_conflicts_total").await;
    assert_eq!(conflicts, 1.0);
}
