//! Operating stepgate against a real Kafka broker (`KAFKA_BROKERS`, default
//! 127.0.0.1:9092): bad input, retention, start-up checks, topics, config,
//! metrics, state rebuild, audit.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::Status;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_goes_to_the_dlq_with_a_rejected_answer_and_the_gate_goes_on() {
    let mut s = Stack::new(StackOptions {
        configure: |c| c.gate.max_intent_bytes = 2048,
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
        configure: |c| {
            c.state.retention = dur("4s");
            c.state.purge_interval = dur("200ms");
        },
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let first = intent("wf-r", 1, "create_ticket", json!({}), "e1");
    let published_ms = chrono::Utc::now().timestamp_millis();
    agent.call(first.clone()).await;
    let r = agent
        .call(intent("wf-r", 1, "create_ticket", json!({}), "e2"))
        .await;
    assert!(
        r.deduplicated,
        "within the retention: answered from the record"
    );
    s.metrics_until("stepgate_steps_purged_total 1", WAIT).await;
    // The first call read again with its old timestamp, as after lost group
    // offsets: its record is purged, and it is older than the retention, so it
    // is dead-lettered — not run again, not answered a second time.
    let dlq = s.reader("dlq");
    agent.send_at(&first, published_ms).await;
    let d = dlq.wait_for(1, WAIT).await;
    assert_eq!(d[0].value["reason"], "expired", "{:?}", d[0].value);
    s.metrics_until(
        r#"stepgate_rejected_inputs_total{reason="expired"} 1"#,
        WAIT,
    )
    .await;
    assert_eq!(agent.answers("e1").len(), 1, "e1 keeps its one answer");
    assert_eq!(s.tools.count("create_ticket"), 1);
    // A new publish of the step (a fresh timestamp) runs it again.
    let r = agent
        .call(intent("wf-r", 1, "create_ticket", json!({}), "e3"))
        .await;
    assert!(!r.deduplicated, "after the retention the record is gone");
    assert_eq!(s.tools.count("create_ticket"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_when_results_has_fewer_partitions_than_intents() {
    let prefix = random_name("sgl");
    let dir = tempfile::tempdir().unwrap();
    let cfg = test_config(&prefix, dir.path().join("s"), "");
    stepgate::kafka::create_topics(&cfg.kafka, &cfg.state)
        .await
        .unwrap();
    let mut small = cfg.clone();
    small.kafka.topics.results = format!("{prefix}.results-small");
    small.kafka.partitions = 2;
    stepgate::kafka::create_topics(&small.kafka, &small.state)
        .await
        .unwrap();
    let path = dir.path().join("c.toml");
    write_config(&small, &path);
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
async fn an_unknown_flag_is_refused_by_name() {
    // `--role` was never in a release: refused as any unknown flag is.
    let s = Stack::new(StackOptions::default()).await;
    let out = s.cli(&["run", "--role", "executor"]).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unexpected argument '--role'"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_create_makes_an_equal_layout_and_is_idempotent() {
    let prefix = random_name("sgc");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config(&prefix, dir.path().join("s"), "");
    cfg.kafka.partitions = 3;
    let path = dir.path().join("c.toml");
    write_config(&cfg, &path);
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
        let received: f64 = m
            .iter()
            .filter(|(k, _)| k.starts_with("stepgate_intents_received_total{"))
            .map(|(_, v)| v)
            .sum();
        let settled = received == 7.0 && m.keys().any(|k| k.starts_with("stepgate_consumer_lag{"));
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let expect = [
        (r#"stepgate_intents_received_total{tool="send_email"}"#, 2.0),
        (
            r#"stepgate_intents_received_total{tool="create_ticket"}"#,
            2.0,
        ),
        (r#"stepgate_intents_received_total{tool="search"}"#, 1.0),
        // `nope` (no such tool) and the unreadable record.
        (r#"stepgate_intents_received_total{tool="unknown"}"#, 2.0),
        // The dedup rate's denominator: recorded tools' calls only.
        (r#"stepgate_effectful_calls_total{tool="send_email"}"#, 2.0),
        (
            r#"stepgate_effectful_calls_total{tool="create_ticket"}"#,
            2.0,
        ),
        (r#"stepgate_effectful_calls_total{tool="search"}"#, 0.0),
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

/// Backpressure: a flood behind a slow tool with a small invoker bound. The
/// gate holds its reading while the invoker is full, pauses its intents when
/// it stays full past the hold (1 s: a call takes 1.2 s here, so draining to
/// room takes longer) and resumes as it drains: every intent is answered
/// once, `ok`, none in doubt, the tool run once per call, and the queue never
/// grows past its bound and the batches being decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_behind_a_slow_tool_pauses_intents_and_every_call_is_answered_once() {
    const CALLS: usize = 20;
    const MAX_QUEUED: usize = 6;
    const MAX_BATCH: usize = 4;
    let mut s = Stack::new(StackOptions {
        configure: |c| {
            c.executor.concurrency = 2;
            c.executor.max_queued_calls = MAX_QUEUED;
            c.gate.max_batch = MAX_BATCH;
        },
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(1200))],
    );
    let agent = s.agent();
    for i in 0..CALLS {
        agent
            .send(&intent(
                &format!("flood-{i}"),
                0,
                "create_ticket",
                json!({"title": format!("t{i}")}),
                &format!("f{i}"),
            ))
            .await;
    }
    // Sample the queue while the flood drains.
    let mut most = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while (0..CALLS).any(|i| agent.answers(&format!("f{i}")).is_empty()) {
        assert!(
            std::time::Instant::now() < deadline,
            "not every call was answered:\n{}",
            s.log_tail(40)
        );
        let m = s.metrics().await;
        if let Some(v) = metric_value(&m, "stepgate_invoker_queued_calls") {
            most = most.max(v as usize);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..CALLS {
        let a = agent.answers(&format!("f{i}"));
        assert_eq!(a.len(), 1, "one answer for f{i}");
        assert_eq!(a[0].1.status, Status::Ok, "f{i}: {:?}", a[0].1);
    }
    assert_eq!(s.tools.count("create_ticket"), CALLS, "each call ran once");
    // The bound, plus what the batches in hand (one deciding, one
    // committing) can hand over before the pause takes.
    assert!(
        most <= MAX_QUEUED + 2 * MAX_BATCH,
        "queued {most} calls at most"
    );
    let m = s.metrics().await;
    assert!(
        metric_value(&m, "stepgate_intents_pauses_total").unwrap_or(0.0) >= 1.0,
        "the intents were paused at least once"
    );
    assert_eq!(metric_value(&m, "stepgate_intents_paused"), Some(0.0));
    assert_eq!(metric_value(&m, "stepgate_invoker_queued_calls"), Some(0.0));
    assert!(
        !m.contains("stepgate_in_doubt_steps_total{"),
        "none in doubt"
    );
}

/// The value of an unlabelled series in a Prometheus text exposition.
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Partitions added to every topic of a running deployment: a workflow's
/// partition (murmur2 % count) moves away from its recorded steps. The
/// running gate stops at the rebalance, and a gate started afresh refuses,
/// each saying why — never deduplicating in the wrong partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_count_changed_under_a_running_deployment_is_refused() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let r = agent
        .call(intent("grow-1", 0, "send_email", json!({}), "g0"))
        .await;
    assert_eq!(r.status, Status::Ok);
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let topics = s.config.kafka.topics.all();
    let grow: Vec<NewPartitions> = topics.iter().map(|t| NewPartitions::new(t, 6)).collect();
    for r in admin
        .create_partitions(&grow, &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let said = "has 6 partitions, but this deployment's state was written with 4";
    let status = s.exited(Duration::from_secs(120)).await;
    assert!(!status.success());
    s.assert_logged(said, "the grown partition count was refused");
    // A gate started afresh on the grown topics refuses too: the group's
    // committed offsets say which count its state was written with.
    s.spawn(&[], &[]);
    let status = s.exited(Duration::from_secs(120)).await;
    assert!(!status.success());
    let log = s.log();
    assert!(log.matches(said).count() >= 2, "{}", s.log_tail(30));
    assert!(log.contains("Growing partitions"));
    assert_eq!(s.tools.count("send_email"), 1);
}
