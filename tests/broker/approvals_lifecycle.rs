//! A held call's lifecycle against the real broker: it expires after its
//! `approval_ttl` (answered `approval_expired`, the tool never runs, a late
//! approval refused, a repeat answered the same), its escalation and its
//! expiry each reach the `[notify]` webhook once, signed, and are counted;
//! the principal that sent a call cannot approve it.

use crate::common;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stepgate::contract::sign::{Signed, sign};
use stepgate::contract::{Status, Texts};

const TOOLS: &str = r#"
[tools.wire_held]
category = "unkeyed"
policy = "approval"
url = "{tools}/wire_held"
timeout = "2s"
approval_ttl = "6s"
escalate_after = "2s"
# Slower decisions (each `stepgate approvals` run reads the changelog).
[[tools.wire_held.approval_by_workflow]]
workflow_prefix = "long-"
approval_ttl = "5m"
"#;

/// The webhook's key, as the gate's config and the receiver share it.
const NOTIFY_KEY: &str = "notify-test-key-0123456789abcdef-0123";

/// What the test webhook received: each notification's body, and whether its
/// signature verified.
#[derive(Clone, Default)]
struct Hook {
    got: Arc<Mutex<Vec<(Value, bool)>>>,
}

impl Hook {
    async fn start() -> (Hook, String) {
        let hook = Hook::default();
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(hook.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (hook, format!("http://{addr}/hook"))
    }

    fn events(&self, event: &str, workflow: &str) -> Vec<(Value, bool)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(v, _)| v["event"] == event && v["workflow_id"] == workflow)
            .cloned()
            .collect()
    }
}

async fn receive(State(hook): State<Hook>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let signature = headers
        .get("stepgate-signature")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let signed = signature == sign(NOTIFY_KEY.as_bytes(), Signed::Notify, &body);
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    hook.got.lock().unwrap().push((v, signed));
    StatusCode::NO_CONTENT
}

/// A stack with the approval tool and the webhook, started.
async fn stack(hook_url: &str) -> Stack {
    let mut s = Stack::new(StackOptions {
        tool_tables: TOOLS.to_owned(),
        ..StackOptions::default()
    })
    .await;
    s.config.notify.url = Some(hook_url.to_owned());
    s.config.notify.key = Some(stepgate::config::HeaderSpec::parse(NOTIFY_KEY));
    s.config.notify.backoff = stepgate::duration::dur("100ms");
    write_config(&s.config, &s.config_path);
    s.start().await;
    s
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A command written straight to the commands topic, past the CLI's checks.
async fn raw_command(s: &Stack, wf: &str, command: Value) {
    let commands = Agent::new(
        &s.config.kafka.brokers,
        &s.topic("commands"),
        &s.topic("results"),
    );
    let partitions = s.config.kafka.partitions;
    let partition = stepgate::contract::partition_for(wf, partitions);
    commands
        .send_raw(wf, command.to_string().as_bytes(), Some(partition), &[])
        .await;
}

fn metric(text: &str, name: &str) -> f64 {
    parse_metrics(text).get(name).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_past_its_ttl_is_answered_expired_and_a_late_approval_is_refused() {
    let (hook, url) = Hook::start().await;
    let s = stack(&url).await;
    let agent = s.agent();
    let wf = "ttl-1";
    agent
        .send(&intent(wf, 0, "wire_held", json!({"amount": 900}), "h1"))
        .await;
    eventually(Duration::from_secs(30), "the held call's hook", || {
        !hook.events("held", wf).is_empty()
    })
    .await;
    let held = &hook.events("held", wf)[0].0;
    assert!(held["expires_at"].is_string(), "{held}");
    assert!(
        held.get("arguments").is_none(),
        "no arguments in a notification"
    );

    // Nobody decides: answered at its ttl, expired; nothing ran.
    let expired = agent.answer("h1", Duration::from_secs(40)).await;
    assert_eq!(expired.status, Status::Error);
    let e = expired.error.clone().unwrap();
    assert_eq!(e.kind, "approval_expired");
    assert_eq!(e.message, Texts::approval_expired("wire_held", "6s"));
    assert_eq!(s.tools.count("wire_held"), 0);

    // A late approval, by the command line: refused, the step is expired.
    let out = s
        .cli(&[
            "approvals",
            "approve",
            wf,
            "0",
            "wire_held",
            "--by",
            "alice",
        ])
        .await;
    assert!(!out.status.success(), "a late approval must not apply");
    // And one written straight to the topic: the gate refuses it itself.
    raw_command(
        &s,
        wf,
        json!({"id": "late-1", "workflow_id": wf, "step_index": 0, "tool": "wire_held",
            "attempt": 0, "action": "approve", "by": "alice", "at": "2026-11-29T00:00:00.000Z"}),
    )
    .await;
    let dlq = s.reader("dlq");
    eventually(Duration::from_secs(30), "the late approval refused", || {
        dlq.all()
            .iter()
            .any(|d| d.value["reason"] == "approval_expired")
    })
    .await;
    // A repeat after expiry gets the same answer; the tool still never ran.
    let again = agent
        .call(intent(wf, 0, "wire_held", json!({"amount": 900}), "h2"))
        .await;
    same_but_call_id(&expired, &again);
    assert!(again.deduplicated);
    assert_eq!(s.tools.count("wire_held"), 0);

    // The escalation and the expiry each reached the hook once, signed.
    eventually(Duration::from_secs(30), "the expiry's hook", || {
        !hook.events("expired", wf).is_empty()
    })
    .await;
    let metrics = s
        .metrics_until(
            r#"stepgate_notifications_total{event="expired",outcome="delivered"} 1"#,
            Duration::from_secs(30),
        )
        .await;
    for event in ["held", "escalated", "expired"] {
        let got = hook.events(event, wf);
        assert_eq!(got.len(), 1, "{event}: {got:?}");
        assert!(got[0].1, "{event}: the signature verifies");
    }
    assert_eq!(hook.events("expired", wf)[0].0["ttl"], "6s");
    assert_eq!(
        metric(
            &metrics,
            r#"stepgate_approval_events_total{event="escalated",tool="wire_held"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            r#"stepgate_approval_events_total{event="expired",tool="wire_held"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            r#"stepgate_notifications_total{event="escalated",outcome="delivered"}"#
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_principal_that_sent_a_call_cannot_approve_it() {
    let (_hook, url) = Hook::start().await;
    let s = stack(&url).await;
    let agent = s.agent();
    let wf = "long-self-1";
    let mut held = intent(wf, 0, "wire_held", json!({"amount": 5}), "p1");
    held["metadata"] = json!({"stepgate.principal": "token:agent-7"});
    agent.send(&held).await;
    let approvals = s.reader("approvals");
    approvals.wait_for(1, Duration::from_secs(30)).await;
    // The command line records `--by` as given: naming the sender is refused.
    let out = s
        .cli(&[
            "approvals",
            "approve",
            wf,
            "0",
            "wire_held",
            "--by",
            "token:agent-7",
        ])
        .await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("self_decision"), "{}", stderr(&out));
    assert_eq!(s.tools.count("wire_held"), 0);
    // Someone else approves it: it runs, once.
    let out = s
        .cli(&[
            "approvals",
            "approve",
            wf,
            "0",
            "wire_held",
            "--by",
            "alice",
        ])
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let answer = agent.answer("p1", Duration::from_secs(30)).await;
    assert_eq!(answer.status, Status::Ok);
    assert_eq!(s.tools.count("wire_held"), 1);
}
