//! The Rust client against the real broker and the stepgate binary.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::client::{Client, ClientOptions, StepCall};
use stepgate::contract::Status;

fn options(s: &Stack) -> ClientOptions {
    let mut o = stepgate::client::options_from_config(&s.config);
    o.timeout = Duration::from_secs(60);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_calls_from_one_client_each_get_their_answer() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(200))],
    );
    s.start().await;
    let client = Client::new(options(&s)).await.unwrap();
    let calls = (0..40u64).map(|n| {
        let c = StepCall::new(
            &format!("wf-cc-{}", n % 8),
            n,
            "create_ticket",
            json!({"n": n}),
        )
        .unwrap();
        client.call(c)
    });
    let answers = futures::future::join_all(calls).await;
    for (n, a) in answers.into_iter().enumerate() {
        let a = a.unwrap();
        assert_eq!((a.status, a.step_index), (Status::Ok, n as u64));
        assert_eq!(
            a.output.unwrap()["echo"]["n"],
            n as u64,
            "each call got its own answer"
        );
    }
    assert_eq!(s.tools.count("create_ticket"), 40);
}

/// Two workflows' calls with one `call_id` (models number their calls
/// alike): the first's answer comes while the second waits under the same
/// `call_id`, and each caller gets its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workflows_sharing_a_call_id_each_get_their_own_answer() {
    let mut s = Stack::new(StackOptions::default()).await;
    // B's call (the first) is answered while A's (the second) is in the tool.
    s.tools.script(
        "create_ticket",
        vec![
            Reply::Delay(Duration::from_millis(2500)),
            Reply::Delay(Duration::from_secs(4)),
        ],
    );
    s.start().await;
    let mut o = options(&s);
    // An answer lost to another caller shows as a timeout, not a re-publish.
    o.republish_after = Duration::from_secs(90);
    o.timeout = Duration::from_secs(45);
    let client = Client::new(o).await.unwrap();
    let call = |wf: &str| {
        StepCall::new(wf, 0, "create_ticket", json!({"who": wf}))
            .unwrap()
            .call_id("call_0")
    };
    let b = client.call(call("collide-B"));
    let a = async {
        eventually(Duration::from_secs(30), "B's call is in the tool", || {
            s.tools.count("create_ticket") == 1
        })
        .await;
        client.call(call("collide-A")).await
    };
    let (b, a) = tokio::join!(b, a);
    for (answer, wf) in [(a, "collide-A"), (b, "collide-B")] {
        let answer = answer.unwrap_or_else(|e| panic!("{wf}: {e}\n{}", s.log_tail(60)));
        assert_eq!(
            (answer.workflow_id.as_str(), answer.status),
            (wf, Status::Ok),
            "{wf}'s caller got {answer:?}"
        );
        assert_eq!(answer.output.unwrap()["echo"]["who"], wf);
    }
    assert_eq!(s.tools.count("create_ticket"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_is_republished_as_the_same_step() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools
        .script("create_ticket", vec![Reply::Delay(Duration::from_secs(3))]);
    s.start().await;
    let mut o = options(&s);
    o.republish_after = Duration::from_millis(700);
    let client = Client::new(o).await.unwrap();
    let a = client
        .call(
            StepCall::new("wf-rp", 1, "create_ticket", json!({}))
                .unwrap()
                .call_id("first"),
        )
        .await
        .unwrap();
    assert_eq!(a.status, Status::Ok);
    assert_eq!(
        s.tools.count("create_ticket"),
        1,
        "re-publishing never re-ran the tool\n{}",
        s.log_tail(80)
    );
    let agent = s.agent();
    agent.answer("first", Duration::from_secs(10)).await;
    let m = s.metrics().await;
    assert!(
        m.contains(r#"stepgate_repeats_total{state="in_flight",tool="create_ticket"}"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_restarted_mid_wait_gets_the_answer_by_calling_the_same_step() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools
        .script("create_ticket", vec![Reply::Delay(Duration::from_secs(2))]);
    s.start().await;
    {
        let client = Client::new(options(&s)).await.unwrap();
        let pending =
            client.call(StepCall::new("wf-rs", 4, "create_ticket", json!({"t": "x"})).unwrap());
        // The agent dies before the answer.
        let _ = tokio::time::timeout(Duration::from_millis(500), pending).await;
    }
    let client = Client::new(options(&s)).await.unwrap();
    let a = client
        .call(StepCall::new("wf-rs", 4, "create_ticket", json!({"t": "x, rephrased"})).unwrap())
        .await
        .unwrap();
    assert_eq!(a.status, Status::Ok);
    assert!(
        a.deduplicated,
        "the restarted client's call is a repeat of the same step"
    );
    assert_eq!(
        a.output.unwrap()["echo"]["t"],
        "x",
        "the first call's arguments ran"
    );
    assert_eq!(s.tools.count("create_ticket"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_numbers_its_steps_and_retry_step_bumps_the_attempt() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let client = Client::new(options(&s)).await.unwrap();
    let wf = client.workflow("wf-num");
    let a = wf
        .call("create_ticket", json!({"title": "same"}))
        .await
        .unwrap();
    let b = wf
        .call("create_ticket", json!({"title": "same"}))
        .await
        .unwrap();
    assert_eq!((a.step_index, b.step_index), (0, 1));
    let again = wf
        .retry_step(0, "create_ticket", json!({"title": "same"}))
        .await
        .unwrap();
    assert_eq!(
        (again.step_index, again.attempt, again.deduplicated),
        (0, 1, false)
    );
    assert_eq!(s.tools.count("create_ticket"), 3);
    // A resumed workflow keeps its step keys: step 1 again is a repeat.
    let resumed = client.workflow("wf-num").starting_at(1);
    let r = resumed
        .call("create_ticket", json!({"title": "same, resumed"}))
        .await
        .unwrap();
    assert!(r.deduplicated && r.step_index == 1);
    assert_eq!(s.tools.count("create_ticket"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_command_prints_the_answer_and_exits_by_status() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let run = |args: &[&str]| {
        std::process::Command::new(stepgate_bin())
            .arg("call")
            .arg("--config")
            .arg(&s.config_path)
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&[
        "--workflow",
        "wf-cli",
        "--step",
        "1",
        "--tool",
        "send_email",
        "--args",
        r#"{"to":"a@example.com"}"#,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["status"].as_str(), v["deduplicated"].as_bool()),
        (Some("ok"), Some(false))
    );
    let out = run(&[
        "--workflow",
        "wf-cli",
        "--step",
        "1",
        "--tool",
        "send_email",
        "--args",
        r#"{"to":"b@example.com"}"#,
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["deduplicated"], true);
    let out = run(&[
        "--workflow",
        "wf-cli",
        "--step",
        "2",
        "--tool",
        "no_such_tool",
    ]);
    assert_eq!(out.status.code(), Some(2), "a rejected call exits 2");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "rejected");
    assert_eq!(s.tools.count("send_email"), 1);
}
