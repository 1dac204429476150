//! End to end against a real Kafka broker (`KAFKA_BROKERS`, default
//! 127.0.0.1:9092): the stepgate binary, real HTTP tools, real RocksDB.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::Status;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rephrased_retry_runs_once_and_gets_the_original_answer() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let first = agent
        .call(intent(
            "order-1",
            1,
            "send_email",
            json!({"to": "a@example.com", "subject": "Order confirmed"}),
            "c1",
        ))
        .await;
    let retry = agent
        .call(intent(
            "order-1",
            1,
            "send_email",
            json!({"to": "a@example.com", "subject": "Your order is confirmed"}),
            "c2",
        ))
        .await;
    assert_eq!(first.status, Status::Ok);
    assert!(!first.deduplicated && retry.deduplicated);
    assert_eq!(retry.call_id.as_deref(), Some("c2"));
    same_but_call_id(&first, &retry);
    assert_eq!(s.tools.count("send_email"), 1, "the tool ran once");
    assert_eq!(
        s.tools.calls("send_email")[0].body["subject"],
        "Order confirmed",
        "the first call's arguments ran"
    );
    let m = s.metrics().await;
    assert!(
        m.contains(r#"stepgate_rephrased_retries_total{tool="send_email"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"stepgate_repeats_total{state="completed",tool="send_email"} 1"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_arguments_at_two_steps_run_twice() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let a = agent
        .call(intent(
            "wf-t",
            1,
            "create_ticket",
            json!({"title": "Printer broken"}),
            "t1",
        ))
        .await;
    let b = agent
        .call(intent(
            "wf-t",
            2,
            "create_ticket",
            json!({"title": "Printer broken"}),
            "t2",
        ))
        .await;
    assert_eq!((a.status, b.status), (Status::Ok, Status::Ok));
    assert!(!a.deduplicated && !b.deduplicated);
    let calls = s.tools.calls("create_ticket");
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].idempotency_key, calls[1].idempotency_key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_concurrent_repeats_of_a_slow_step_run_once_and_all_are_answered() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "send_email",
        vec![Reply::Delay(Duration::from_millis(1500))],
    );
    s.start().await;
    let agent = s.agent();
    for n in 0..5 {
        agent
            .send(&intent(
                "wf-slow",
                7,
                "send_email",
                json!({"subject": format!("try {n}")}),
                &format!("r{n}"),
            ))
            .await;
    }
    let mut answers = Vec::new();
    for n in 0..5 {
        answers.push(agent.answer(&format!("r{n}"), WAIT).await);
    }
    assert_eq!(s.tools.count("send_email"), 1);
    assert_eq!(
        answers.iter().filter(|a| !a.deduplicated).count(),
        1,
        "exactly one caller caused the invocation"
    );
    for a in &answers[1..] {
        same_but_call_id(&answers[0], a);
    }
    for n in 0..5 {
        assert_eq!(
            agent.answers(&format!("r{n}")).len(),
            1,
            "one answer per call"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_one_runs_again_with_its_own_key() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    agent
        .call(intent(
            "wf-a",
            1,
            "send_email",
            json!({"subject": "x"}),
            "a0",
        ))
        .await;
    let mut again = intent("wf-a", 1, "send_email", json!({"subject": "x"}), "a1");
    again["attempt"] = json!(1);
    let r = agent.call(again).await;
    assert!(!r.deduplicated);
    assert_eq!(r.attempt, 1);
    let calls = s.tools.calls("send_email");
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].idempotency_key, calls[1].idempotency_key);
    assert_eq!(calls[1].headers["stepgate-attempt"], "1");
    assert_eq!(calls[1].headers["stepgate-workflow-id"], "wf-a");
    assert_eq!(calls[1].headers["stepgate-step-index"], "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_and_restart_repeats_are_answered_from_state() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let first = agent
        .call(intent(
            "wf-k",
            1,
            "create_ticket",
            json!({"title": "x"}),
            "k1",
        ))
        .await;
    s.kill();
    s.start().await;
    let repeat = agent
        .call(intent(
            "wf-k",
            1,
            "create_ticket",
            json!({"title": "x, again"}),
            "k2",
        ))
        .await;
    assert!(repeat.deduplicated);
    same_but_call_id(&first, &repeat);
    assert_eq!(s.tools.count("create_ticket"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unkeyed_call_cut_off_by_a_crash_is_in_doubt_and_not_rerun() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools
        .script("wire", vec![Reply::Delay(Duration::from_secs(60))]);
    s.start().await;
    let agent = s.agent();
    agent
        .send(&intent("wf-d", 3, "wire", json!({"amount": 120}), "d1"))
        .await;
    let tools = s.tools.clone();
    eventually(WAIT, "the tool is invoked", || tools.count("wire") == 1).await;
    s.kill();
    s.start().await;
    // deadline = timeout 2 s × 2 tries + 50 ms backoff + 1 s grace after `started` was read.
    let r = agent.answer("d1", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(r.error.as_ref().unwrap().kind, "executor_lost");
    assert!(
        r.error
            .as_ref()
            .unwrap()
            .message
            .contains("Do not call `wire` again")
    );
    let again = agent
        .call(intent("wf-d", 3, "wire", json!({"amount": 120}), "d2"))
        .await;
    assert_eq!(again.status, Status::InDoubt);
    assert!(again.deduplicated);
    same_but_call_id(&r, &again);
    assert_eq!(s.tools.count("wire"), 1, "never re-run blindly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_call_cut_off_by_a_crash_is_rerun_with_the_same_key() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "charge",
        vec![Reply::Delay(Duration::from_secs(60)), Reply::Ok],
    );
    s.start().await;
    let agent = s.agent();
    agent
        .send(&intent("wf-c", 2, "charge", json!({"cents": 999}), "ch1"))
        .await;
    let tools = s.tools.clone();
    eventually(WAIT, "the tool is invoked", || tools.count("charge") == 1).await;
    s.kill();
    s.start().await;
    let r = agent.answer("ch1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let calls = s.tools.calls("charge");
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[0].idempotency_key, calls[1].idempotency_key,
        "the provider sees one operation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_goes_to_the_dlq_with_a_rejected_answer_and_the_gate_goes_on() {
    let mut s = Stack::new(StackOptions {
        gate: "max_intent_bytes = 2048",
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let dlq = s.reader("dlq");
    let big = "x".repeat(4000);
    let cases: Vec<(Vec<u8>, &str, Option<&str>)> = vec![
        (b"{not json".to_vec(), "malformed_json", None),
        (b"[1,2,3]".to_vec(), "not_an_object", None),
        (json!({"workflow_id": "wf-b", "step_index": 1, "tool": "send_email", "call_id": "b1"}).to_string().into_bytes(), "missing_field", Some("b1")),
        (json!({"workflow_id": "wf-b", "step_index": "two", "tool": "send_email", "arguments": {}, "call_id": "b2"}).to_string().into_bytes(), "wrong_type", None),
        (json!({"workflow_id": "wf-b", "step_index": 3, "tool": "send_email", "arguments": "hi", "call_id": "b3"}).to_string().into_bytes(), "wrong_type", Some("b3")),
        (json!({"workflow_id": "wf-b", "step_index": 4, "tool": "send_mail", "arguments": {}, "call_id": "b4"}).to_string().into_bytes(), "unknown_tool", Some("b4")),
        (json!({"workflow_id": "wf-b", "step_index": 5, "tool": "send_email", "arguments": {"body": big}, "call_id": "b5"}).to_string().into_bytes(), "oversized", Some("b5")),
        (vec![0xff, 0xfe, 0x00], "malformed_json", None),
    ];
    for (payload, _, _) in &cases {
        agent
            .send_raw("wf-b", payload, None, &[("x-origin", "test")])
            .await;
    }
    let ok = agent
        .call(intent(
            "wf-b",
            9,
            "send_email",
            json!({"subject": "still works"}),
            "b-ok",
        ))
        .await;
    assert_eq!(ok.status, Status::Ok);
    let records = dlq.wait_for(cases.len(), WAIT).await;
    let reasons: Vec<&str> = records
        .iter()
        .map(|r| r.value["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, cases.iter().map(|c| c.1).collect::<Vec<_>>());
    for r in &records {
        assert_eq!(
            r.key.as_deref(),
            Some(b"wf-b".as_slice()),
            "the original key is kept"
        );
        assert!(
            r.headers
                .iter()
                .any(|(k, v)| k == "x-origin" && v == b"test"),
            "the original headers are kept"
        );
        assert!(r.value["offset"].is_i64() && r.value["topic"] == s.topic("intents"));
    }
    assert_eq!(records[7].value["payload_encoding"], "base64");
    for (_, reason, call_id) in &cases {
        if let Some(id) = call_id {
            let r = agent.answer(id, WAIT).await;
            assert_eq!(r.status, Status::Rejected);
            let e = r.error.unwrap();
            assert_eq!(e.kind, *reason);
            assert!(e.message.contains("nothing was performed"), "{}", e.message);
        }
    }
    let b4 = agent.answer("b4", WAIT).await.error.unwrap().message;
    assert!(b4.contains("`send_email`"), "lists the real tools: {b4}");
    assert_eq!(s.tools.count("send_email"), 1, "only the valid intent ran");
    let m = s.metrics().await;
    assert!(
        m.contains(r#"stepgate_rejected_inputs_total{reason="wrong_type"} 2"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_after_the_retention_and_until_then_answer_repeats() {
    let mut s = Stack::new(StackOptions {
        state: "retention = \"4s\"\npurge_interval = \"200ms\"",
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    agent
        .call(intent("wf-r", 1, "create_ticket", json!({}), "e1"))
        .await;
    let r = agent
        .call(intent("wf-r", 1, "create_ticket", json!({}), "e2"))
        .await;
    assert!(
        r.deduplicated,
        "within the retention: answered from the record"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let m = s.metrics().await;
    assert!(m.contains("stepgate_steps_purged_total 1"), "{m}");
    let r = agent
        .call(intent("wf-r", 1, "create_ticket", json!({}), "e3"))
        .await;
    assert!(!r.deduplicated, "after the retention the record is gone");
    assert_eq!(s.tools.count("create_ticket"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_call_in_flight_and_commits_it() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools
        .script("create_ticket", vec![Reply::Delay(Duration::from_secs(2))]);
    s.start().await;
    let agent = s.agent();
    agent
        .send(&intent(
            "wf-t",
            1,
            "create_ticket",
            json!({"title": "x"}),
            "g1",
        ))
        .await;
    let tools = s.tools.clone();
    eventually(WAIT, "the tool is invoked", || {
        tools.count("create_ticket") == 1
    })
    .await;
    let status = s.terminate().await;
    assert!(status.success(), "clean exit: {status:?}\n{}", s.log());
    s.start().await;
    let r = agent.answer("g1", WAIT).await;
    assert_eq!(
        r.status,
        Status::Ok,
        "the drained outcome was committed: {r:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        s.tools.count("create_ticket"),
        1,
        "not re-run after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intent_outside_its_workflows_partition_is_refused_in_the_partition_it_reached() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let owner = stepgate::contract::partition_for("same-key", 4);
    // One step published to every partition, as four clients with different
    // partitioners would: only the workflow's own partition may run it.
    for p in 0..4 {
        let i = intent(
            "same-key",
            100,
            "send_email",
            json!({"q": p}),
            &format!("p{p}"),
        );
        agent
            .send_raw(
                "same-key",
                i.to_string().as_bytes(),
                Some(p),
                &[(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                )],
            )
            .await;
    }
    for p in 0..4 {
        agent.answer(&format!("p{p}"), WAIT).await;
        let (partition, r) = agent.answers(&format!("p{p}")).remove(0);
        assert_eq!(partition, p, "answered in the partition the intent reached");
        if p == owner {
            assert_eq!(r.status, Status::Ok);
        } else {
            assert_eq!(r.status, Status::Rejected);
            let e = r.error.unwrap();
            assert_eq!(e.kind, "wrong_partition");
            assert!(
                e.message.contains("Nothing was performed")
                    && e.message.contains(&format!("belong to partition {owner}")),
                "{}",
                e.message
            );
        }
    }
    assert_eq!(s.tools.count("send_email"), 1, "run once, in its partition");
    let calls = s.tools.calls("send_email");
    assert!(
        calls
            .iter()
            .all(|c| c.headers.get("traceparent").map(String::as_str)
                == Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    );
    let results = agent.results.all();
    assert!(
        results
            .iter()
            .all(|r| r.headers.iter().any(|(k, _)| k == "traceparent")),
        "traceparent reaches the result"
    );
    let dlq = s.reader("dlq").wait_for(3, WAIT).await;
    assert!(dlq.iter().all(|r| r.value["reason"] == "wrong_partition"));
}

/// `gate.check_partition = false`: any partition is accepted (for producers
/// with a stable partitioner of their own); answers go to the intent's partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_partition_check_answers_go_to_the_intents_partition_whatever_the_partitioner()
{
    let mut s = Stack::new(StackOptions {
        gate: "check_partition = false",
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    for p in 0..4 {
        let i = intent(
            "same-key",
            100 + p as u64,
            "search",
            json!({"q": p}),
            &format!("p{p}"),
        );
        agent
            .send_raw("same-key", i.to_string().as_bytes(), Some(p), &[])
            .await;
    }
    for p in 0..4 {
        agent.answer(&format!("p{p}"), WAIT).await;
        let (partition, r) = agent.answers(&format!("p{p}")).remove(0);
        assert_eq!(partition, p, "answered in the intent's partition");
        assert_eq!(r.status, Status::Ok);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_repeats_are_rerun_not_recorded() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let a = agent
        .call(intent("wf-s", 1, "search", json!({"q": "x"}), "s1"))
        .await;
    let b = agent
        .call(intent("wf-s", 1, "search", json!({"q": "x"}), "s2"))
        .await;
    assert!(!a.deduplicated && !b.deduplicated);
    assert_eq!(s.tools.count("search"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_when_results_has_fewer_partitions_than_intents() {
    let prefix = random_name("sgl");
    let mut cfg = stepgate::config::Config::default();
    cfg.kafka.brokers = brokers();
    cfg.kafka.topics = stepgate::config::TopicsConfig::with_prefix(&prefix);
    cfg.kafka.partitions = 4;
    stepgate::kafka::create_topics(&cfg.kafka, &cfg.state)
        .await
        .unwrap();
    let mut small = cfg.clone();
    small.kafka.topics.results = format!("{prefix}.results-small");
    small.kafka.partitions = 2;
    stepgate::kafka::create_topics(&small.kafka, &small.state)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[kafka]\nbrokers = \"{}\"\n[kafka.topics]\nintents = \"{prefix}.intents\"\nresults = \"{prefix}.results-small\"\ndlq = \"{prefix}.dlq\"\nprogress = \"{prefix}.progress\"\nchangelog = \"{prefix}.changelog\"\ncommands = \"{prefix}.commands\"\napprovals = \"{prefix}.approvals\"\n[state]\npath = \"{}\"\n[http]\nlisten = \"\"\n",
            brokers(),
            dir.path().join("s").display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(stepgate_bin())
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has 2 partitions but") && err.contains("at least as many"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_removed_executor_role_is_refused_with_a_pointer() {
    let s = Stack::new(StackOptions::default()).await;
    let out = s.cli(&["run", "--role", "executor"]).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`--role executor` was removed") && err.contains("invokes the tools"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_create_makes_an_equal_layout_and_is_idempotent() {
    let prefix = random_name("sgc");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!("[kafka]\nbrokers = \"{}\"\npartitions = 3\n[kafka.topics]\nintents = \"{prefix}.intents\"\nresults = \"{prefix}.results\"\ndlq = \"{prefix}.dlq\"\nprogress = \"{prefix}.progress\"\nchangelog = \"{prefix}.changelog\"\ncommands = \"{prefix}.commands\"\napprovals = \"{prefix}.approvals\"\n", brokers()),
    )
    .unwrap();
    for expected in ["created", "exists"] {
        let out = std::process::Command::new(stepgate_bin())
            .args(["topics", "create", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            stdout.lines().filter(|l| l.starts_with(expected)).count(),
            7,
            "{stdout}"
        );
        assert!(stdout.contains("(3 intent partitions)"), "{stdout}");
    }
    // Steps are kept `state.retention` (7 days by default); operators'
    // decisions, for the audit, forever unless `state.decisions_retention`.
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let retention = |topic: String| {
        let admin = &admin;
        async move {
            let r = admin
                .describe_configs(&[ResourceSpecifier::Topic(&topic)], &AdminOptions::new())
                .await
                .unwrap();
            let c = r[0].as_ref().unwrap();
            c.get("retention.ms").unwrap().value.clone().unwrap()
        }
    };
    assert_eq!(retention(format!("{prefix}.commands")).await, "-1");
    assert_eq!(retention(format!("{prefix}.results")).await, "604800000");
}

#[test]
fn an_invalid_config_fails_at_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[tools.pay]\ncategory = \"keyed\"\nurl = \"not a url\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(stepgate_bin())
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tools.pay.url"), "{err}");
    let out = std::process::Command::new(stepgate_bin())
        .args(["check-config", "--config"])
        .arg(&path)
        .env("STEPGATE_TOOLS_PAY_URL", "http://127.0.0.1:1/pay")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("http://127.0.0.1:1/pay"));
}

/// kill -9 in the middle of a stream of new steps and repeats: every call is
/// answered exactly once, no unkeyed step runs twice, and repeats carry the
/// original answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing_and_runs_nothing_twice() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(20))],
    );
    s.start().await;
    let agent = s.agent();
    let steps: Vec<(String, u64)> = (0..120)
        .map(|i| (format!("wf-m{}", i % 12), i / 12))
        .collect();
    let mut ids = Vec::new();
    for (n, (wf, step)) in steps.iter().enumerate() {
        let id = format!("m{n}");
        agent
            .send(&intent(wf, *step, "create_ticket", json!({"n": n}), &id))
            .await;
        ids.push((wf.clone(), *step, id));
        if n == 60 {
            s.kill();
        }
    }
    s.start().await;
    // Repeats of every step, rephrased, after the restart.
    for (n, (wf, step)) in steps.iter().enumerate() {
        let id = format!("m{n}-again");
        agent
            .send(&intent(
                wf,
                *step,
                "create_ticket",
                json!({"n": n, "rephrased": true}),
                &id,
            ))
            .await;
        ids.push((wf.clone(), *step, id));
    }
    for (_, _, id) in &ids {
        agent.answer(id, Duration::from_secs(60)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut by_step = std::collections::HashMap::new();
    for (wf, step, id) in &ids {
        let answers = agent.answers(id);
        assert_eq!(answers.len(), 1, "{id} answered exactly once");
        by_step
            .entry((wf.clone(), *step))
            .or_insert_with(Vec::new)
            .push(answers[0].1.clone());
    }
    for answers in by_step.values() {
        assert_eq!(
            answers.iter().filter(|a| !a.deduplicated).count(),
            1,
            "{answers:?}"
        );
        let first = answers.iter().find(|a| !a.deduplicated).unwrap();
        for a in answers {
            same_but_call_id(first, a);
        }
    }
    let mut keys: Vec<String> = s
        .tools
        .calls("create_ticket")
        .into_iter()
        .map(|c| c.idempotency_key)
        .collect();
    let invoked = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), invoked, "no unkeyed step ran twice");
    assert!(invoked <= steps.len());
}

/// A lost disk: the gate's RocksDB is deleted while it is down; on restart each
/// partition is restored from the changelog and repeats are still answered from
/// the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_disk_is_restored_from_the_changelog() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let mut firsts = Vec::new();
    for n in 0..8u64 {
        let wf = format!("wf-disk-{n}");
        firsts.push(
            agent
                .call(intent(
                    &wf,
                    1,
                    "create_ticket",
                    json!({"n": n}),
                    &format!("ld{n}"),
                ))
                .await,
        );
    }
    s.kill();
    std::fs::remove_dir_all(s.dir.path().join("state")).unwrap();
    s.start().await;
    for (n, first) in firsts.iter().enumerate() {
        let wf = format!("wf-disk-{n}");
        let again = agent
            .call(intent(
                &wf,
                1,
                "create_ticket",
                json!({"n": n, "again": 1}),
                &format!("ld{n}-r"),
            ))
            .await;
        assert!(again.deduplicated, "{again:?}");
        same_but_call_id(first, &again);
    }
    assert_eq!(s.tools.count("create_ticket"), 8, "nothing ran twice");
    let m = s.metrics().await;
    assert!(!m.contains("stepgate_state_full_restores_total 0"), "{m}");
    assert!(
        !m.contains("stepgate_state_restored_records_total 0"),
        "records were restored: {m}"
    );
}

/// Two gates in one group split the partitions; when one is killed its
/// partitions move to the other, which restores them from the changelog, and
/// deduplication holds across the move (and back again after a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deduplication_holds_when_partitions_move_between_gates() {
    let mut s = Stack::new(StackOptions {
        session_timeout: "6s",
        ..StackOptions::default()
    })
    .await;
    let b_http = format!("127.0.0.1:{}", free_port());
    let mut gate_b = s.spawn_other("gate-b", &b_http, &[]);
    s.start().await;
    let agent = s.agent();
    let wfs: Vec<String> = (0..16).map(|n| format!("wf-move-{n}")).collect();
    let mut firsts = Vec::new();
    for (n, wf) in wfs.iter().enumerate() {
        firsts.push(
            agent
                .call(intent(
                    wf,
                    1,
                    "create_ticket",
                    json!({"n": n}),
                    &format!("mv{n}"),
                ))
                .await,
        );
    }
    // Kill gate A: after the session timeout its partitions go to gate B.
    s.kill();
    for (n, wf) in wfs.iter().enumerate() {
        let again = agent
            .call(intent(
                wf,
                1,
                "create_ticket",
                json!({"n": n, "r": 1}),
                &format!("mv{n}-b"),
            ))
            .await;
        assert!(again.deduplicated, "{again:?}\n{}", s.other_log("gate-b"));
        same_but_call_id(&firsts[n], &again);
    }
    assert!(
        s.other_log("gate-b")
            .contains("restored from the changelog"),
        "{}",
        s.other_log("gate-b")
    );
    // Gate A comes back: partitions are split again, A's stale state is replaced.
    s.start().await;
    for (n, wf) in wfs.iter().enumerate() {
        let again = agent
            .call(intent(
                wf,
                1,
                "create_ticket",
                json!({"n": n, "r": 2}),
                &format!("mv{n}-a"),
            ))
            .await;
        assert!(again.deduplicated);
        same_but_call_id(&firsts[n], &again);
    }
    assert_eq!(
        s.tools.count("create_ticket"),
        wfs.len(),
        "each step ran once across both moves"
    );
    gate_b.kill().unwrap();
    gate_b.wait().unwrap();
}

/// Lost disk *and* lost group offsets (a new group id, or offsets expired while
/// the group was idle): the changelog still restores the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_changelog_restores_state_even_when_group_offsets_are_gone() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let first = agent
        .call(intent("wf-og", 1, "create_ticket", json!({}), "og1"))
        .await;
    s.kill();
    std::fs::remove_dir_all(s.dir.path().join("state")).unwrap();
    let text = std::fs::read_to_string(&s.config_path).unwrap().replace(
        &format!("gate_group = \"{}-gate\"", s.prefix),
        &format!("gate_group = \"{}-gate2\"", s.prefix),
    );
    std::fs::write(&s.config_path, text).unwrap();
    s.start().await;
    let again = agent
        .call(intent("wf-og", 1, "create_ticket", json!({"r": 1}), "og2"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&first, &again);
    assert_eq!(s.tools.count("create_ticket"), 1);
}

/// A changelog deleted and recreated under a gate's local state: the state
/// reflects an offset the new topic does not hold, so it is not trusted — the
/// partition is restored from the new changelog's start (a position past the
/// end is refused by the broker; no watermark query is involved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_changelog_is_restored_from_its_start_not_trusted() {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    for n in 0..3 {
        agent
            .call(intent(
                "wf-rc",
                n,
                "create_ticket",
                json!({}),
                &format!("rc{n}"),
            ))
            .await;
    }
    s.kill();
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let changelog = s.topic("changelog");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    admin.delete_topics(&[&changelog], &opts).await.unwrap()[0]
        .as_ref()
        .unwrap();
    // Deletion completes in the background: create until the topic is new.
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while !stepgate::kafka::create_topics(&s.config.kafka, &s.config.state)
        .await
        .is_ok_and(|r| r.iter().any(|(t, new)| *t == changelog && *new))
    {
        assert!(
            std::time::Instant::now() < until,
            "the changelog was not recreated in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.start().await;
    let next = agent
        .call(intent("wf-rc", 3, "create_ticket", json!({}), "rc3"))
        .await;
    assert_eq!(next.status, Status::Ok, "{}", s.log_tail(100));
    assert!(
        s.log()
            .contains("the changelog does not hold the offset the local state reflects"),
        "{}",
        s.log_tail(100)
    );
}

/// A fatal consumer error — here another consumer joining with the gate's
/// static member id, which fences the gate's consumer for good — restarts the
/// gate's session with a new consumer instead of leaving it deaf.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatally_fenced_consumer_is_replaced() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    agent
        .call(intent("wf-ff", 0, "create_ticket", json!({}), "ff0"))
        .await;
    let k = &s.config.kafka;
    let usurper: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &k.brokers)
        .set("group.id", &k.gate_group)
        .set("group.instance.id", format!("{}-gate", k.instance_id))
        .set("partition.assignment.strategy", "range")
        .set("session.timeout.ms", "6000")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    usurper.subscribe(&[&k.topics.intents]).unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(60);
    // librdkafka either raises a fatal error (the gate then starts a new
    // consumer) or, seeing the fence on a heartbeat, rejoins by itself.
    while !(s.log().contains("failed for good") || s.log().contains("fenced by other consumer")) {
        assert!(
            std::time::Instant::now() < until,
            "the gate's consumer was not fenced: {}",
            s.log_tail(60)
        );
        let _ = usurper.poll(Duration::from_millis(100));
    }
    drop(usurper);
    // The gate's new consumer takes the member id back and answers again.
    let next = agent
        .call(intent("wf-ff", 1, "create_ticket", json!({}), "ff1"))
        .await;
    assert_eq!(next.status, Status::Ok, "{}", s.log_tail(60));
    assert_eq!(s.tools.count("create_ticket"), 2);
}

/// A gate whose loop is stuck (here made to block for good by a test hook)
/// fails `/healthz` once `gate.stall_timeout` passes, so an orchestrator
/// restarts it; while its loop goes round, `/healthz` is ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_gate_fails_healthz() {
    let mut s = Stack::new(StackOptions {
        gate: "stall_timeout = \"2s\"",
        ..StackOptions::default()
    })
    .await;
    s.spawn(&[], &[("STEPGATE_TEST_STALL_AFTER", "20")]);
    s.wait_ready().await;
    let healthz = || async {
        reqwest::get(format!("http://{}/healthz", s.http))
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(healthz().await, 200, "{}", s.log_tail(40));
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while healthz().await != 503 {
        assert!(
            std::time::Instant::now() < until,
            "/healthz still ok 60 s in: {}",
            s.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(s.log().contains("the gate's loop stops here for good"));
}

/// After a known workload, `/metrics` counts exactly what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_known_workload_exactly() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(1500))],
    );
    s.start().await;
    let agent = s.agent();
    agent
        .call(intent(
            "wf-m",
            1,
            "send_email",
            json!({"subject": "a"}),
            "m1",
        ))
        .await;
    agent
        .call(intent(
            "wf-m",
            1,
            "send_email",
            json!({"subject": "a, rephrased"}),
            "m2",
        ))
        .await;
    agent
        .send(&intent("wf-m", 2, "create_ticket", json!({"t": 1}), "m3"))
        .await;
    agent
        .send(&intent("wf-m", 2, "create_ticket", json!({"t": 1}), "m4"))
        .await;
    agent
        .call(intent("wf-m", 3, "search", json!({"q": "x"}), "m5"))
        .await;
    agent.call(intent("wf-m", 4, "nope", json!({}), "m6")).await;
    agent.send_raw("wf-m", b"{broken", None, &[]).await;
    agent.answer("m3", WAIT).await;
    agent.answer("m4", WAIT).await;
    let s_ref = &s;
    let mut m = std::collections::HashMap::new();
    let start = std::time::Instant::now();
    while start.elapsed() < WAIT {
        m = parse_metrics(&s_ref.metrics().await);
        let settled = m.get("stepgate_intents_received_total") == Some(&7.0)
            && m.keys().any(|k| k.starts_with("stepgate_consumer_lag{"));
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let expect = [
        ("stepgate_intents_received_total", 7.0),
        (
            r#"stepgate_steps_forwarded_total{category="keyed",tool="send_email"}"#,
            1.0,
        ),
        (
            r#"stepgate_steps_forwarded_total{category="unkeyed",tool="create_ticket"}"#,
            1.0,
        ),
        (
            r#"stepgate_repeats_total{state="completed",tool="send_email"}"#,
            1.0,
        ),
        (
            r#"stepgate_repeats_total{state="in_flight",tool="create_ticket"}"#,
            1.0,
        ),
        (
            r#"stepgate_rephrased_retries_total{tool="send_email"}"#,
            1.0,
        ),
        (r#"stepgate_fast_path_calls_total{tool="search"}"#, 1.0),
        (
            r#"stepgate_rejected_inputs_total{reason="unknown_tool"}"#,
            1.0,
        ),
        (
            r#"stepgate_rejected_inputs_total{reason="malformed_json"}"#,
            1.0,
        ),
        (
            r#"stepgate_invocations_total{outcome="ok",tool="send_email"}"#,
            1.0,
        ),
        (
            r#"stepgate_invocations_total{outcome="ok",tool="create_ticket"}"#,
            1.0,
        ),
        (
            r#"stepgate_invocations_total{outcome="ok",tool="search"}"#,
            1.0,
        ),
        (
            r#"stepgate_results_total{deduplicated="false",status="ok"}"#,
            3.0,
        ),
        (
            r#"stepgate_results_total{deduplicated="true",status="ok"}"#,
            2.0,
        ),
        (
            r#"stepgate_results_total{deduplicated="false",status="rejected"}"#,
            1.0,
        ),
        (
            r#"stepgate_answer_latency_seconds_count{deduplicated="false"}"#,
            4.0,
        ),
        (
            r#"stepgate_answer_latency_seconds_count{deduplicated="true"}"#,
            2.0,
        ),
        (
            r#"stepgate_tool_latency_seconds_count{tool="create_ticket"}"#,
            1.0,
        ),
    ];
    for (k, v) in expect {
        assert_eq!(m.get(k), Some(&v), "{k}\n{m:#?}");
    }
    assert!(
        !m.contains_key(r#"stepgate_rephrased_retries_total{tool="create_ticket"}"#),
        "identical repeat is not rephrased"
    );
    assert!(!m.contains_key(r#"stepgate_in_doubt_steps_total{tool="create_ticket"}"#));
    assert!(
        m.keys().any(|k| k.starts_with(&format!(
            "stepgate_consumer_lag{{group=\"{}-gate\"",
            s.prefix
        ))),
        "{m:#?}"
    );
    assert!(m["stepgate_commit_latency_seconds_count"] >= 1.0);
    assert!(m["stepgate_state_write_seconds_count"] >= 1.0);
    assert!(m["stepgate_state_write_seconds_sum"] <= m["stepgate_commit_latency_seconds_sum"]);
    let health = reqwest::get(format!("http://{}/healthz", s.http))
        .await
        .unwrap();
    assert!(health.status().is_success());
}

fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// `stepgate state rebuild` reconstructs the state from the topics into a new
/// directory; a gate started on it answers repeats as before, and finds every
/// partition in sync (no restore needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_rebuild_reconstructs_a_state_that_answers_the_same() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let mut firsts = Vec::new();
    for n in 0..6u64 {
        firsts.push(
            agent
                .call(intent(
                    &format!("wf-rb-{n}"),
                    n,
                    "create_ticket",
                    json!({}),
                    &format!("rb{n}"),
                ))
                .await,
        );
    }
    s.terminate().await;
    let rebuilt = s.dir.path().join("rebuilt");
    let run = |path: &std::path::Path| {
        std::process::Command::new(stepgate_bin())
            .args(["state", "rebuild", "--config"])
            .arg(&s.config_path)
            .arg("--path")
            .arg(path)
            .output()
            .unwrap()
    };
    let out = run(&rebuilt);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("rebuilt 4 partitions"), "{stdout}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("partition 3/4"),
        "progress is shown"
    );
    let again = run(&rebuilt);
    assert!(!again.status.success(), "never overwrites a state");
    assert!(String::from_utf8_lossy(&again.stderr).contains("is not empty"));

    let text = std::fs::read_to_string(&s.config_path).unwrap().replace(
        &s.dir.path().join("state").display().to_string(),
        &rebuilt.display().to_string(),
    );
    std::fs::write(&s.config_path, text).unwrap();
    s.start().await;
    for (n, first) in firsts.iter().enumerate() {
        let r = agent
            .call(intent(
                &format!("wf-rb-{n}"),
                n as u64,
                "create_ticket",
                json!({"r": 1}),
                &format!("rb{n}-again"),
            ))
            .await;
        same_but_call_id(first, &r);
    }
    assert_eq!(s.tools.count("create_ticket"), 6);
    let m = s.metrics().await;
    assert!(
        m.contains("stepgate_state_full_restores_total 0"),
        "the rebuilt state only reads what came after it: {m}"
    );
}

/// `stepgate audit` over a known recorded workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_reports_a_recorded_workload() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools
        .script("wire", vec![Reply::Delay(Duration::from_secs(3))]);
    s.start().await;
    let agent = s.agent();
    let wf = "wf-audit";
    agent
        .call(intent(
            wf,
            1,
            "send_email",
            json!({"to": "a", "subject": "Order confirmed"}),
            "a1",
        ))
        .await;
    agent
        .call(intent(
            wf,
            1,
            "send_email",
            json!({"to": "a", "subject": "Your order is confirmed"}),
            "a2",
        ))
        .await;
    agent
        .call(intent(
            wf,
            2,
            "create_ticket",
            json!({"title": "Refund"}),
            "a3",
        ))
        .await;
    agent
        .call(intent(
            wf,
            3,
            "create_ticket",
            json!({"title": "Refund"}),
            "a4",
        ))
        .await;
    let d = agent
        .call(intent(wf, 4, "wire", json!({"eur": 5}), "a5"))
        .await;
    assert_eq!(d.status, Status::InDoubt);
    agent
        .call(intent("wf-other", 0, "create_ticket", json!({}), "o1"))
        .await;
    let audit = |format: &str| {
        let out = std::process::Command::new(stepgate_bin())
            .args(["audit", "--workflow", wf, "--format", format, "--config"])
            .arg(&s.config_path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let report: serde_json::Value = serde_json::from_str(&audit("json")).unwrap();
    let sum = &report["summary"];
    assert_eq!(
        (
            sum["workflows"].as_u64(),
            sum["steps"].as_u64(),
            sum["calls"].as_u64(),
            sum["repeats"].as_u64()
        ),
        (Some(1), Some(4), Some(5), Some(1))
    );
    assert_eq!(
        (
            sum["rephrased"].as_u64(),
            sum["in_doubt"].as_u64(),
            sum["hash_collisions"].as_u64()
        ),
        (Some(1), Some(1), Some(1))
    );
    let change = &report["workflows"][0]["steps"][0]["calls"][1]["changes"][0];
    assert_eq!(
        (change["path"].as_str(), change["after"].as_str()),
        (Some("subject"), Some("Your order is confirmed"))
    );
    let text = audit("text");
    println!("{text}");
    assert!(
        text.contains(r#"rephrased subject: "Order confirmed" → "Your order is confirmed""#),
        "{text}"
    );
    assert!(
        text.contains("identical arguments to create_ticket at steps 2, 3"),
        "{text}"
    );
    assert!(
        text.contains("step 4 wire (attempt 0) → in_doubt"),
        "{text}"
    );
    let html = audit("html");
    assert!(
        html.contains("<!doctype html>") && html.contains("in doubt: may have run"),
        "{html}"
    );
    assert_eq!(s.tools.count("send_email"), 1, "the audit touched nothing");
}

/// A step record no reader can decode (here: on the changelog, with a version
/// byte no stepgate writes) wedged the partition: every session failed on the
/// intent that read it and re-read the same intent. Now the restore keeps the
/// record unindexed, the intent fails a few times and is then set aside —
/// dead-lettered with the reason and answered `rejected`/`unprocessable` with a
/// text that says whether the step ran is unknown — and the partition goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_step_record_sets_its_intent_aside_and_the_partition_goes_on() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let mut s = Stack::new(StackOptions::default()).await;
    let wf = "wf-poison";
    let p = stepgate::contract::partition_for(wf, 4);
    // The changelog key of the step, as the gate writes it; a value no version reads.
    let scratch = tempfile::tempdir().unwrap();
    let store = stepgate::state::StateStore::open(scratch.path()).unwrap();
    let mut b = stepgate::state::Batch::default();
    let mut record = stepgate::state::StepRecord {
        step: stepgate::contract::StepKey {
            workflow_id: wf.into(),
            step_index: 1,
            tool: "send_email".into(),
            attempt: 0,
        },
        category: stepgate::config::Category::Keyed,
        phase: stepgate::state::Phase::Completed,
        arguments: serde_json::Map::new(),
        call_id: Some("old".into()),
        metadata: None,
        traceparent: None,
        dispatch: 1,
        intended_at_ms: 0,
        started_at_ms: None,
        deadline_ms: None,
        result: None,
        waiters: Vec::new(),
        repeats: 0,
        rephrased_count: 0,
        rephrased: Vec::new(),
        late_outcome: None,
        expires_at_ms: i64::MAX / 2,
        intent_ts_ms: None,
        operator_log: Vec::new(),
        partition: p,
    };
    record.partition = p;
    b.put_step(&store, p, &record).unwrap();
    let entry = b.changelog().into_iter().next().unwrap();
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::to(&s.topic("changelog"))
                .partition(p)
                .key(&entry.key)
                .payload(&[0x7f_u8, 1, 2, 3][..]),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    s.start().await;
    let agent = s.agent();
    let dlq = s.reader("dlq");
    // Both in the step's partition, whatever the test client's partitioner.
    for (step, id) in [(1, "p1"), (2, "p2")] {
        let i = intent(wf, step, "send_email", json!({"subject": id}), id);
        agent
            .send_raw(wf, i.to_string().as_bytes(), Some(p), &[])
            .await;
    }
    // The same partition goes on: a later step of the same workflow runs.
    let next = agent.answer("p2", WAIT).await;
    assert_eq!(next.status, Status::Ok, "{}", s.log());
    let set_aside = agent.answer("p1", WAIT).await;
    assert_eq!(set_aside.status, Status::Rejected);
    let e = set_aside.error.unwrap();
    assert_eq!(e.kind, "unprocessable");
    assert!(
        e.message.contains("cannot tell whether an earlier call"),
        "{}",
        e.message
    );
    let records = dlq.wait_for(1, WAIT).await;
    assert_eq!(records[0].value["reason"], "unprocessable");
    assert_eq!(records[0].value["offset"], 0);
    assert_eq!(
        s.tools.count("send_email"),
        1,
        "the set-aside call was not made"
    );
    assert!(
        s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "still running"
    );
}
