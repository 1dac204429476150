//! Unkeyed-tool policies (`last_step`, `approval`) and the operators' commands
//! (`steps show`, `resolve`, `approvals list|approve|deny`), against the real
//! broker and the `stepgate` binary.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::time::Duration;
use stepgate::contract::{Status, Texts};

const POLICY_TOOLS: &str = r#"
[tools.send_fax]
category = "unkeyed"
policy = "last_step"
url = "{tools}/send_fax"
timeout = "2s"

[tools.wire_approved]
category = "unkeyed"
policy = "approval"
url = "{tools}/wire_approved"
timeout = "2s"
"#;

async fn stack() -> Stack {
    let mut s = Stack::new(StackOptions {
        tool_tables: POLICY_TOOLS.to_owned(),
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    s
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `steps show --json` of a workflow.
async fn steps(s: &Stack, wf: &str) -> Value {
    let out = s.cli(&["steps", "show", wf, "--json"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn step_of(steps: &Value, index: u64) -> &Value {
    steps["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["step"]["step_index"] == index)
        .unwrap_or_else(|| panic!("no step {index} in {steps}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_step_tool_ends_its_workflow() {
    let s = stack().await;
    let agent = s.agent();
    let r = agent
        .call(intent("fax-1", 0, "search", json!({"q": "x"}), "c0"))
        .await;
    assert_eq!(r.status, Status::Ok);
    let fax = agent
        .call(intent("fax-1", 1, "send_fax", json!({"to": "1"}), "c1"))
        .await;
    assert_eq!(fax.status, Status::Ok);

    // Any new step after it is refused, read-only ones too, with why.
    for (i, (step, tool)) in [(2, "search"), (3, "send_email")].into_iter().enumerate() {
        let call_id = format!("late-{i}");
        let late = agent
            .call(intent("fax-1", step, tool, json!({}), &call_id))
            .await;
        assert_eq!(late.status, Status::Rejected);
        let e = late.error.unwrap();
        assert_eq!(e.kind, "workflow_ended");
        assert_eq!(
            e.message,
            Texts::workflow_ended(tool, "fax-1", 1, "send_fax")
        );
    }
    assert_eq!(s.tools.count("send_email"), 0);
    // A repeat of the last step itself is answered as always.
    let again = agent
        .call(intent("fax-1", 1, "send_fax", json!({"to": "1"}), "c1b"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&fax, &again);
    assert_eq!(s.tools.count("send_fax"), 1);
    // Other workflows are not affected.
    let other = agent
        .call(intent("fax-2", 0, "search", json!({}), "o0"))
        .await;
    assert_eq!(other.status, Status::Ok);
    // Every rejection is also in the DLQ.
    let dlq = s.reader("dlq").wait_for(2, Duration::from_secs(20)).await;
    assert!(
        dlq.iter().all(|d| d.value["reason"] == "workflow_ended"),
        "{dlq:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_tool_waits_for_a_person_without_blocking_others() {
    let s = stack().await;
    let agent = s.agent();
    agent
        .send(&intent(
            "pay-1",
            0,
            "wire_approved",
            json!({"amount": 900}),
            "w0",
        ))
        .await;
    // Other steps of the same workflow and other workflows go on meanwhile.
    let r = agent
        .call(intent("pay-1", 1, "search", json!({}), "s1"))
        .await;
    assert_eq!(r.status, Status::Ok);
    let r = agent
        .call(intent("pay-2", 0, "send_email", json!({}), "e0"))
        .await;
    assert_eq!(r.status, Status::Ok);
    // A repeat while it waits joins the wait.
    agent
        .send(&intent(
            "pay-1",
            0,
            "wire_approved",
            json!({"amount": "900 EUR"}),
            "w0-again",
        ))
        .await;
    // A later step of the workflow answered (same partition, read in order):
    // the gate has read the repeat, and answered neither.
    let r = agent
        .call(intent("pay-1", 2, "search", json!({}), "s2"))
        .await;
    assert_eq!(r.status, Status::Ok);
    assert!(agent.answers("w0").is_empty() && agent.answers("w0-again").is_empty());
    assert_eq!(
        s.tools.count("wire_approved"),
        0,
        "nothing runs before approval"
    );

    let list = s.cli(&["approvals", "list", "--json"]).await;
    assert!(list.status.success(), "{}", stderr(&list));
    let pending: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(pending.as_array().unwrap().len(), 1, "{pending}");
    assert_eq!(pending[0]["workflow_id"], "pay-1");
    assert_eq!(pending[0]["event"], "requested");
    assert_eq!(pending[0]["arguments"], json!({"amount": 900}));
    let text = s.cli(&["approvals", "list"]).await;
    assert!(stdout(&text).contains("pay-1"), "{}", stdout(&text));
    assert_eq!(
        step_of(&steps(&s, "pay-1").await, 0)["phase"],
        "awaiting_approval"
    );
    s.metrics_until(
        r#"stepgate_open_steps{phase="awaiting_approval"} 1"#,
        Duration::from_secs(60),
    )
    .await;

    let ok = s
        .cli(&[
            "approvals",
            "approve",
            "pay-1",
            "0",
            "wire_approved",
            "--by",
            "alice",
        ])
        .await;
    assert!(ok.status.success(), "{}{}", stdout(&ok), stderr(&ok));
    let first = agent.answer("w0", Duration::from_secs(20)).await;
    assert_eq!(first.status, Status::Ok);
    assert!(!first.deduplicated);
    let waiter = agent.answer("w0-again", Duration::from_secs(20)).await;
    assert!(waiter.deduplicated);
    same_but_call_id(&first, &waiter);
    assert_eq!(s.tools.count("wire_approved"), 1);
    // The first call's arguments are what ran.
    assert_eq!(
        s.tools.calls("wire_approved")[0].body,
        json!({"amount": 900})
    );

    let list = s.cli(&["approvals", "list", "--json"]).await;
    let pending: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(pending, json!([]));
    let shown = steps(&s, "pay-1").await;
    let log = &step_of(&shown, 0)["operator_log"][0];
    assert_eq!(
        (&log["action"], &log["by"], &log["from"]),
        (
            &json!("approve"),
            &json!("alice"),
            &json!("awaiting_approval")
        )
    );
    assert!(log["at"].as_str().unwrap().ends_with('Z'));
    // Approving twice is refused with the reason, by the command line.
    let again = s
        .cli(&[
            "approvals",
            "approve",
            "pay-1",
            "0",
            "wire_approved",
            "--by",
            "alice",
        ])
        .await;
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("is completed"),
        "{}",
        stderr(&again)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_reaches_the_agent_as_a_refusal_by_a_person() {
    let s = stack().await;
    let agent = s.agent();
    agent
        .send(&intent(
            "deny-1",
            0,
            "wire_approved",
            json!({"amount": 5}),
            "d0",
        ))
        .await;
    let approvals = s.reader("approvals");
    approvals.wait_for(1, Duration::from_secs(20)).await;
    // A denial without a reason is refused: the model is told the reason.
    let no_reason = s
        .cli(&[
            "approvals",
            "deny",
            "deny-1",
            "0",
            "wire_approved",
            "--by",
            "bob",
        ])
        .await;
    assert!(!no_reason.status.success());
    assert!(
        stderr(&no_reason).contains("--reason"),
        "{}",
        stderr(&no_reason)
    );

    let out = s
        .cli(&[
            "approvals",
            "deny",
            "deny-1",
            "0",
            "wire_approved",
            "--by",
            "bob",
            "--reason",
            "the account is frozen",
        ])
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let r = agent.answer("d0", Duration::from_secs(20)).await;
    assert_eq!(r.status, Status::Error);
    let e = r.error.clone().unwrap();
    assert_eq!(e.kind, "denied");
    assert_eq!(
        e.message,
        Texts::denied("wire_approved", Some("the account is frozen"))
    );
    assert_eq!(s.tools.count("wire_approved"), 0);
    let again = agent
        .call(intent(
            "deny-1",
            0,
            "wire_approved",
            json!({"amount": 5}),
            "d1",
        ))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&r, &again);
    let events = approvals.wait_for(2, Duration::from_secs(20)).await;
    assert_eq!(events[1].value["event"], "denied");
    assert_eq!(events[1].value["by"], "bob");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_in_doubt_step_as_failed() {
    let s = stack().await;
    let agent = s.agent();
    s.tools.script("wire", vec![Reply::Status(503)]);
    let doubt = agent
        .call(intent("fail-1", 0, "wire", json!({"amount": 9}), "f0"))
        .await;
    assert_eq!(doubt.status, Status::InDoubt);
    // `--failed` needs what was found: the model is told it.
    let out = s
        .cli(&["resolve", "fail-1", "0", "wire", "--failed", "--by", "dave"])
        .await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--reason"), "{}", stderr(&out));
    let found = "the bank rejected it: account closed";
    let out = s
        .cli(&[
            "resolve", "fail-1", "0", "wire", "--failed", "--reason", found, "--by", "dave",
        ])
        .await;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // The step's later calls get the error, and the tool is not run again.
    let repeat = agent
        .call(intent("fail-1", 0, "wire", json!({"amount": 9}), "f0b"))
        .await;
    assert!(repeat.deduplicated);
    assert_eq!(repeat.status, Status::Error);
    let e = repeat.error.clone().unwrap();
    assert_eq!(e.kind, "tool_failed");
    assert_eq!(e.message, Texts::resolved_failed("wire", Some(found)));
    assert_eq!(s.tools.count("wire"), 1);
    assert_eq!(agent.answers("f0").len(), 1, "one final answer per call_id");
    let shown = steps(&s, "fail-1").await;
    let s0 = step_of(&shown, 0);
    assert_eq!(s0["phase"], "completed");
    assert_eq!(s0["operator_log"][0]["action"], "resolve_failed");
    assert_eq!(s0["operator_log"][0]["by"], "dave");
    assert_eq!(s0["operator_log"][0]["reason"], found);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_in_doubt_steps() {
    let s = stack().await;
    let agent = s.agent();
    s.tools.script(
        "wire",
        vec![Reply::Status(503), Reply::Status(503), Reply::Ok],
    );
    let doubt = agent
        .call(intent("res-1", 0, "wire", json!({"amount": 1}), "r0"))
        .await;
    assert_eq!(doubt.status, Status::InDoubt);
    let doubt2 = agent
        .call(intent("res-1", 1, "wire", json!({"amount": 2}), "r1"))
        .await;
    assert_eq!(doubt2.status, Status::InDoubt);
    assert_eq!(s.tools.count("wire"), 2);
    // The gauge the in-doubt alert watches stays up until a person acts.
    s.metrics_until(
        r#"stepgate_open_steps{phase="in_doubt"} 2"#,
        Duration::from_secs(60),
    )
    .await;

    let text = s.cli(&["steps", "show", "res-1"]).await;
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(stdout(&text).contains("in_doubt"), "{}", stdout(&text));

    // --executed: the operator's output becomes the step's ok answer.
    let out = s
        .cli(&[
            "resolve",
            "res-1",
            "0",
            "wire",
            "--executed",
            "--output",
            r#"{"confirmation": "BANK-77"}"#,
            "--by",
            "carol",
            "--reason",
            "seen in the bank statement",
        ])
        .await;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // `resolve` returns once the gate applied it; the step's later calls get
    // the resolved answer, and the first caller keeps its one final answer
    // (results are ordered per partition: a second answer to r0 would have
    // come before r0b's).
    let repeat = agent
        .call(intent("res-1", 0, "wire", json!({"amount": 1}), "r0b"))
        .await;
    assert!(repeat.deduplicated);
    assert_eq!(repeat.status, Status::Ok);
    assert_eq!(repeat.output, Some(json!({"confirmation": "BANK-77"})));
    assert_eq!(agent.answers("r0").len(), 1, "one final answer per call_id");

    // --not-executed: the step's next call runs it, with the same key.
    let out = s
        .cli(&[
            "resolve",
            "res-1",
            "1",
            "wire",
            "--not-executed",
            "--by",
            "carol",
        ])
        .await;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let rerun = agent
        .call(intent("res-1", 1, "wire", json!({"amount": 2}), "r1b"))
        .await;
    assert_eq!(rerun.status, Status::Ok);
    assert!(!rerun.deduplicated);
    let calls = s.tools.calls("wire");
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[1].idempotency_key, calls[2].idempotency_key);
    let again = agent
        .call(intent("res-1", 1, "wire", json!({"amount": 2}), "r1c"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&rerun, &again);
    assert_eq!(s.tools.count("wire"), 3);
    assert_eq!(agent.answers("r1").len(), 1, "one final answer per call_id");
    s.metrics_until(
        r#"stepgate_open_steps{phase="in_doubt"} 0"#,
        Duration::from_secs(60),
    )
    .await;

    // Who and when, for audit: the step records, and `stepgate audit`.
    let shown = steps(&s, "res-1").await;
    let s0 = step_of(&shown, 0);
    assert_eq!(s0["phase"], "completed");
    assert_eq!(s0["operator_log"][0]["action"], "resolve_executed");
    assert_eq!(s0["operator_log"][0]["by"], "carol");
    assert_eq!(
        s0["operator_log"][0]["reason"],
        "seen in the bank statement"
    );
    let s1 = step_of(&shown, 1);
    assert_eq!(s1["operator_log"][0]["action"], "resolve_not_executed");
    assert_eq!(s1["dispatch"], 2);
    let audit = s.cli(&["audit", "--workflow", "res-1"]).await;
    assert!(audit.status.success(), "{}", stderr(&audit));
    let text = stdout(&audit);
    assert!(
        text.contains("2 in doubt (2 resolved by an operator)"),
        "{text}"
    );
    assert!(
        text.contains("resolve_executed by carol at")
            && text.contains("seen in the bank statement")
            && text.contains("resolve_not_executed by carol at"),
        "{text}"
    );

    // A resolution of a settled step is refused, saying why.
    let out = s
        .cli(&[
            "resolve",
            "res-1",
            "0",
            "wire",
            "--not-executed",
            "--by",
            "carol",
        ])
        .await;
    assert!(!out.status.success());
    assert!(
        stderr(&out)
            .contains("is completed; `resolve_not_executed` applies to a step that is in_doubt"),
        "{}",
        stderr(&out)
    );
    // So is an unknown workflow, and --executed without --output.
    let out = s.cli(&["steps", "show", "nobody"]).await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no recorded steps for workflow `nobody`"));
    let out = s
        .cli(&["resolve", "res-1", "0", "wire", "--executed", "--by", "x"])
        .await;
    assert!(!out.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_does_not_fit_goes_to_the_dlq() {
    let s = stack().await;
    let agent = s.agent();
    let r = agent
        .call(intent("cmd-1", 0, "send_email", json!({}), "m0"))
        .await;
    assert_eq!(r.status, Status::Ok);
    // Written straight to the topic, past the command line's checks: an
    // unreadable command, and one for a settled step.
    let commands = Agent::new(
        &s.config.kafka.brokers,
        &s.topic("commands"),
        &s.topic("results"),
    );
    let partition = steps(&s, "cmd-1").await["partition"].as_i64().unwrap() as i32;
    commands
        .send_raw("cmd-1", b"{not json", Some(partition), &[])
        .await;
    let approve = json!({
        "id": "t-1", "workflow_id": "cmd-1", "step_index": 0, "tool": "send_email",
        "attempt": 0, "action": "approve", "by": "mallory", "at": "2026-11-29T00:00:00.000Z"
    });
    commands
        .send_raw(
            "cmd-1",
            approve.to_string().as_bytes(),
            Some(partition),
            &[],
        )
        .await;
    let dlq = s.reader("dlq").wait_for(2, Duration::from_secs(20)).await;
    assert!(
        dlq.iter().all(|d| d.value["reason"] == "bad_command"),
        "{dlq:?}"
    );
    assert!(
        dlq[1].value["message"]
            .as_str()
            .unwrap()
            .contains("`approve` applies to a step that is awaiting_approval"),
        "{dlq:?}"
    );
    // The gate goes on, and the step is untouched.
    let again = agent
        .call(intent("cmd-1", 0, "send_email", json!({}), "m1"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&r, &again);
}

/// A decision is bound to the run of the step it was made about: a resolve
/// re-sent after the step ran again (the first copy applied, the retry ran
/// and was cut off again) is refused as stale and decides nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_re_sent_after_a_second_run_started_is_refused_as_stale() {
    let s = stack().await;
    let agent = s.agent();
    // Every try is cut off: in doubt each time.
    s.tools.script("wire", vec![Reply::Status(503)]);
    let first = agent
        .call(intent("stale-1", 0, "wire", json!({"amount": 1}), "s0"))
        .await;
    assert_eq!(first.status, Status::InDoubt);
    assert_eq!(step_of(&steps(&s, "stale-1").await, 0)["dispatch"], 1);
    let resolve_run_1 = ["resolve", "stale-1", "0", "wire", "--not-executed"];
    let by = ["--by", "carol", "--run", "1"];
    let args: Vec<&str> = resolve_run_1.iter().chain(&by).copied().collect();
    let out = s.cli(&args).await;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // The agent's retry runs the step again, and is cut off again.
    let second = agent
        .call(intent("stale-1", 0, "wire", json!({"amount": 1}), "s1"))
        .await;
    assert_eq!(second.status, Status::InDoubt);
    assert!(!second.deduplicated, "run 2 was invoked for s1");
    assert_eq!(s.tools.count("wire"), 2);
    // The re-sent decision about run 1 must not settle run 2.
    let out = s.cli(&args).await;
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("stale_command") && stderr(&out).contains("current run is 2"),
        "{}",
        stderr(&out)
    );
    let rec = steps(&s, "stale-1").await;
    let s0 = step_of(&rec, 0);
    assert_eq!(
        (s0["phase"].as_str(), s0["dispatch"].as_u64()),
        (Some("in_doubt"), Some(2))
    );
    assert_eq!(s0["operator_log"].as_array().unwrap().len(), 1, "{s0}");
    let again = agent
        .call(intent("stale-1", 0, "wire", json!({"amount": 1}), "s2"))
        .await;
    assert_eq!(again.status, Status::InDoubt);
    assert!(again.deduplicated);
    assert_eq!(s.tools.count("wire"), 2, "the stale decision ran nothing");
    // A decision about the current run applies.
    let out = s
        .cli(&[
            "resolve",
            "stale-1",
            "0",
            "wire",
            "--not-executed",
            "--by",
            "carol",
            "--run",
            "2",
        ])
        .await;
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
}

/// An `in_doubt` step and a held approval outlive a retention of a few
/// seconds: a later retry is answered in doubt (not run again), the approval
/// still applies, and `steps list --unresolved` shows both until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unresolved_steps_outlive_the_retention() {
    let mut s = Stack::new(StackOptions {
        tool_tables: POLICY_TOOLS.to_owned(),
        configure: |c| {
            c.state.retention = dur("3s");
            c.state.purge_interval = dur("200ms");
        },
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    s.tools
        .script("wire", vec![Reply::Status(503), Reply::Status(503)]);
    let doubt = agent
        .call(intent("keep-1", 0, "wire", json!({"amount": 1}), "k0"))
        .await;
    assert_eq!(doubt.status, Status::InDoubt);
    let wired = s.tools.count("wire");
    agent
        .send(&intent(
            "keep-1",
            1,
            "wire_approved",
            json!({"amount": 900}),
            "k1",
        ))
        .await;
    // A settled step recorded after both: once it is purged, the purge has
    // gone past both unresolved records' retention.
    let done = agent
        .call(intent("keep-1", 2, "send_email", json!({}), "k2"))
        .await;
    assert_eq!(done.status, Status::Ok);
    s.metrics_until("stepgate_steps_purged_total 1", Duration::from_secs(60))
        .await;
    let shown = steps(&s, "keep-1").await;
    assert_eq!(step_of(&shown, 0)["phase"], "in_doubt");
    assert_eq!(step_of(&shown, 1)["phase"], "awaiting_approval");
    assert!(
        shown["steps"].as_array().unwrap().len() == 2,
        "the settled step is gone: {shown}"
    );
    let list = s.cli(&["steps", "list", "--unresolved", "--json"]).await;
    assert!(list.status.success(), "{}", stderr(&list));
    let listed: Value = serde_json::from_slice(&list.stdout).unwrap();
    let phases: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["in_doubt", "awaiting_approval"], "{listed}");
    let text = s.cli(&["steps", "list", "--unresolved"]).await;
    assert!(
        stdout(&text).contains("2 unresolved step(s)"),
        "{}",
        stdout(&text)
    );
    s.metrics_until(
        r#"stepgate_open_steps{phase="in_doubt"} 1"#,
        Duration::from_secs(60),
    )
    .await;
    // The retry, past the retention: in doubt, not run again.
    let retry = agent
        .call(intent(
            "keep-1",
            0,
            "wire",
            json!({"amount": "1 EUR"}),
            "k0b",
        ))
        .await;
    assert_eq!(retry.status, Status::InDoubt);
    assert!(retry.deduplicated);
    same_but_call_id(&doubt, &retry);
    assert_eq!(s.tools.count("wire"), wired, "not run again");
    // The approval, past the retention, still applies.
    let ok = s
        .cli(&[
            "approvals",
            "approve",
            "keep-1",
            "1",
            "wire_approved",
            "--by",
            "alice",
        ])
        .await;
    assert!(ok.status.success(), "{}{}", stdout(&ok), stderr(&ok));
    let approved = agent.answer("k1", Duration::from_secs(20)).await;
    assert_eq!(approved.status, Status::Ok);
    assert_eq!(s.tools.count("wire_approved"), 1);
}

/// Tools whose configured secrets must never be shown: a header holding a
/// key, and a `Bearer` one whose token may turn up alone.
const SECRET_TOOLS: &str = r#"
[tools.open_account]
category = "keyed"
url = "{tools}/open_account"
timeout = "2s"
headers = { Authorization = "Bearer s3cr3t-token-value-123" }

[tools.wire_held]
category = "unkeyed"
policy = "approval"
url = "{tools}/wire_held"
timeout = "2s"
headers = { "X-Api-Key" = "sk-live-OPERATORS-0042" }
"#;

/// Every secret the commands below must not print.
const NEVER_SHOWN: [&str; 5] = [
    "s3cr3t-token-value-123",
    "sk-live-OPERATORS-0042",
    "hunter2-first",
    "hunter2-second",
    "pay-tok-visible-77",
];

/// `approvals list`, `steps show` and `stepgate audit` show what the console
/// shows: the one redaction rule (configured secrets whole and as bare
/// tokens, fields named like credentials, a rephrasing's diff by its path),
/// in text, JSON and HTML.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_and_the_audit_redact_as_the_console_does() {
    let mut s = Stack::new(StackOptions {
        tool_tables: SECRET_TOOLS.to_owned(),
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let wf = "wf-redact";
    let first = agent
        .call(intent(
            wf,
            0,
            "open_account",
            json!({"owner": "ana", "password": "hunter2-first", "memo": "key s3cr3t-token-value-123"}),
            "r0",
        ))
        .await;
    assert_eq!(first.status, Status::Ok);
    // A rephrased repeat: its diff names the password's path.
    agent
        .call(intent(
            wf,
            0,
            "open_account",
            json!({"owner": "ana", "password": "hunter2-second", "memo": "key s3cr3t-token-value-123"}),
            "r1",
        ))
        .await;
    agent
        .send(&intent(
            wf,
            1,
            "wire_held",
            json!({"amount_eur": 9, "api_key": "sk-live-OPERATORS-0042", "payment_token": "pay-tok-visible-77"}),
            "r2",
        ))
        .await;
    let mut shown = Vec::new();
    for args in [
        vec!["approvals", "list"],
        vec!["approvals", "list", "--json"],
        vec!["steps", "show", wf],
        vec!["steps", "show", wf, "--json"],
        vec!["audit", "--workflow", wf, "--format", "text"],
        vec!["audit", "--workflow", wf, "--format", "json"],
        vec!["audit", "--workflow", wf, "--format", "html"],
    ] {
        // The held call is in the list once the gate has held it.
        let until = std::time::Instant::now() + Duration::from_secs(20);
        let out = loop {
            let out = s.cli(&args).await;
            assert!(out.status.success(), "{args:?}: {}", stderr(&out));
            if args[0] != "approvals" || stdout(&out).contains("wire_held") {
                break stdout(&out);
            }
            assert!(std::time::Instant::now() < until, "{args:?}: nothing held");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        for secret in NEVER_SHOWN {
            assert!(!out.contains(secret), "{args:?} shows {secret}:\n{out}");
        }
        assert!(
            out.contains("<redacted>") || out.contains("&lt;redacted&gt;"),
            "{args:?} says what it hid:\n{out}"
        );
        shown.push(out);
    }
    // The same rule: the arguments `steps show --json` prints are those the
    // audit prints for the step's first call.
    let steps: Value = serde_json::from_str(&shown[3]).unwrap();
    let audit: Value = serde_json::from_str(&shown[5]).unwrap();
    let recorded = &step_of(&steps, 0)["arguments"];
    let audited = &audit["workflows"][0]["steps"][0]["calls"][0]["arguments"];
    assert_eq!(recorded, audited);
    assert_eq!(recorded["password"], "<redacted>");
    assert_eq!(recorded["memo"], "key <redacted>");
    let change = &audit["workflows"][0]["steps"][0]["calls"][1]["changes"][0];
    assert_eq!(
        (
            change["path"].as_str(),
            change["before"].as_str(),
            change["after"].as_str()
        ),
        (Some("password"), Some("<redacted>"), Some("<redacted>"))
    );
}

/// `stepgate audit` cannot be fooled: an intent claiming to be a gate's
/// forwarded copy is reported (flagged) unless its identical original is
/// where it points; a real re-routed copy is counted once; answers pair with
/// calls by workflow and `call_id`; no agent text reaches the terminal as a
/// control sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_cannot_be_fooled() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let prefix = random_name("aud");
    let wf = |name: &str| format!("{prefix}-{name}");
    let n = s.config.kafka.partitions as i32;

    // An agent sets the gate's header itself, naming a record that is not
    // its original: the call runs, and the audit reports it.
    let hidden = wf("hidden");
    let forged = intent(
        &hidden,
        0,
        "send_email",
        json!({"to": "x@example.com"}),
        "f0",
    );
    agent
        .send_raw(
            &hidden,
            forged.to_string().as_bytes(),
            None,
            &[("stepgate-forwarded-from", "0:0")],
        )
        .await;
    agent.answer("f0", Duration::from_secs(30)).await;

    // An intent published to the wrong partition: the gate re-routes a copy,
    // and the audit counts the call once.
    let moved = wf("moved");
    let right = stepgate::contract::partition_for(&moved, n);
    let wrong = (right + 1) % n;
    let m = intent(
        &moved,
        0,
        "send_email",
        json!({"to": "y@example.com"}),
        "m0",
    );
    agent
        .send_raw(&moved, m.to_string().as_bytes(), Some(wrong), &[])
        .await;
    agent.answer("m0", Duration::from_secs(30)).await;

    // Two workflows use the same call_id; the second is called after the
    // first was answered.
    let (a, b) = (wf("pair-a"), wf("pair-b"));
    agent
        .call(intent(&a, 0, "send_email", json!({"to": "a"}), "call_0"))
        .await;
    agent
        .send(&intent(&b, 0, "send_email", json!({"to": "b"}), "call_0"))
        .await;
    eventually(Duration::from_secs(30), "both answers", || {
        agent.answers("call_0").len() == 2
    })
    .await;

    // Terminal escapes in what an agent chose.
    let esc = wf("esc");
    let raw = format!(
        r#"{{"workflow_id":"{esc}","step_index":0,"tool":"send_email","arguments":{{"k\u001b]52;c;cHduZWQ=\u0007":"v"}},"call_id":"c\u001b[2J\u001b[Hall clear"}}"#
    );
    agent.send_raw(&esc, raw.as_bytes(), None, &[]).await;
    eventually(
        Duration::from_secs(30),
        "the escape intent's answer",
        || {
            agent
                .results
                .all()
                .iter()
                .any(|r| r.value["workflow_id"] == esc.as_str())
        },
    )
    .await;

    let audit = |format: &str| {
        let out = std::process::Command::new(stepgate_bin())
            .args(["audit", "--format", format, "--config"])
            .arg(&s.config_path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        out.stdout
    };
    let report: Value = serde_json::from_slice(&audit("json")).unwrap();
    let calls_of = |w: &str| -> Vec<Value> {
        report["workflows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["workflow_id"] == w)
            .flat_map(|x| x["steps"][0]["calls"].as_array().unwrap().clone())
            .collect()
    };
    let h = calls_of(&hidden);
    assert_eq!(h.len(), 1, "the forged copy is reported: {report}");
    assert_eq!(h[0]["claims_forwarded"], true);
    assert!(report["summary"]["claimed_forwarded"].as_u64() >= Some(1));
    let m = calls_of(&moved);
    assert_eq!(m.len(), 1, "the original and its copy are one call: {m:?}");
    assert!(m[0].get("claims_forwarded").is_none(), "{m:?}");
    for w in [&a, &b] {
        let c = calls_of(w);
        assert_eq!(c.len(), 1);
        let latency = c[0]["latency_ms"].as_i64().expect("answered");
        assert!(
            latency >= 0,
            "{w}: paired with another workflow's answer ({latency} ms)"
        );
    }
    let text = audit("text");
    assert!(
        !text.contains(&0x1b) && !text.contains(&0x07),
        "the text report carries terminal escapes"
    );
    let text = String::from_utf8(text).unwrap();
    assert!(text.contains("\\u{1b}[2J"), "{text}");
    assert!(text.contains("claims to be forwarded"), "{text}");
}
