//! Held calls' lifecycle (`approvals.rs`) and in-doubt steps settled by
//! asking the tool (`reconcile.rs`), over real RocksDB, without Kafka.
use super::*;
use crate::contract::{ApprovalKind, LOOKUP_DISPATCH, Settler, Texts};

const LIFECYCLE: &str = r#"
[state]
retention = "1h"
[gate]
in_doubt_grace = "1s"
[notify]
url = "http://127.0.0.1:1/hook"
key = "a-notify-key-of-at-least-thirty-two-bytes"
expiring_before = "3s"
[tools.wire]
category = "unkeyed"
policy = "approval"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
approval_ttl = "10s"
escalate_after = "4s"
[[tools.wire.approval_by_workflow]]
workflow_prefix = "prod-"
approval_ttl = "30s"
[tools.fax]
category = "unkeyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
reconcile = { url = "http://127.0.0.1:1/lookup", every = "1s", until = "10s", timeout = "1s" }
"#;

const SEC: i64 = 1000;
const T0: i64 = 1_000_000;

fn wire(call_id: &str, principal: Option<&str>) -> serde_json::Value {
    let mut v = json!({"workflow_id": "wf", "step_index": 1, "tool": "wire",
        "arguments": {"amount": 900}, "call_id": call_id});
    if let Some(p) = principal {
        v["metadata"] = json!({"stepgate.principal": p});
    }
    v
}

fn fax(call_id: &str) -> serde_json::Value {
    json!({"workflow_id": "wf", "step_index": 2, "tool": "fax",
        "arguments": {"to": "+331"}, "call_id": call_id})
}

fn wire_step() -> StepKey {
    StepKey {
        workflow_id: "wf".into(),
        step_index: 1,
        tool: "wire".into(),
        attempt: 0,
    }
}

fn command(action: &str, by: &str) -> serde_json::Value {
    json!({"id": format!("{by}-{action}"), "workflow_id": "wf", "step_index": 1, "tool": "wire",
        "attempt": 0, "action": action, "by": by, "at": "2026-11-29T00:00:00.000Z"})
}

/// A command applied to `batch` (not committed).
fn decide(f: &mut Fixture, batch: &mut Batch, cmd: &serde_json::Value, now: i64) {
    let input = f.input("commands", cmd.to_string().into_bytes());
    f.core.on_command(&f.store, batch, &input, now).unwrap();
}

fn events(outs: &[Out]) -> Vec<&'static str> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Approval { event, .. } => Some(match event.event {
                ApprovalKind::Requested { .. } => "requested",
                ApprovalKind::Approved { .. } => "approved",
                ApprovalKind::Denied { .. } => "denied",
                ApprovalKind::Escalated { .. } => "escalated",
                ApprovalKind::Expiring { .. } => "expiring",
                ApprovalKind::Expired { .. } => "expired",
            }),
            _ => None,
        })
        .collect()
}

fn refusals(outs: &[Out]) -> Vec<(RejectionReason, String)> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Dlq { record, .. } => Some((record.reason, record.message.clone())),
            _ => None,
        })
        .collect()
}

fn invoked(outs: &[Out]) -> bool {
    outs.iter()
        .any(|o| matches!(o, Out::Invoke { call, .. } if !call.is_lookup()))
}

#[test]
fn a_held_call_is_escalated_then_warned_then_expires_once_and_nothing_runs() {
    let mut f = Fixture::with_config(LIFECYCLE);
    let outs = f.intent(wire("c1", None), T0);
    assert_eq!(events(&outs), ["requested"]);
    let Some(Out::Approval { event, .. }) = outs.first() else {
        panic!("{outs:?}")
    };
    let ApprovalKind::Requested {
        arguments_sha256,
        policy_version,
        expires_at,
        ..
    } = &event.event
    else {
        panic!()
    };
    assert_eq!(arguments_sha256.as_deref().map(str::len), Some(64));
    assert!(policy_version.as_deref().unwrap().starts_with("pv1-"));
    assert!(expires_at.is_some());
    assert!(f.tick(T0 + 3 * SEC).is_empty(), "nothing before its times");
    assert_eq!(events(&f.tick(T0 + 4 * SEC)), ["escalated"]);
    assert!(events(&f.tick(T0 + 5 * SEC)).is_empty(), "escalated once");
    assert_eq!(events(&f.tick(T0 + 7 * SEC)), ["expiring"]);
    let outs = f.tick(T0 + 10 * SEC);
    assert_eq!(events(&outs), ["expired"]);
    assert!(!invoked(&outs));
    let rs = results(&outs);
    assert_eq!(rs.len(), 1);
    let e = rs[0].error.as_ref().unwrap();
    assert_eq!(
        (rs[0].status, e.kind.as_str()),
        (Status::Error, "approval_expired")
    );
    assert_eq!(e.message, Texts::approval_expired("wire", "10s"));
    assert!(f.tick(T0 + 20 * SEC).is_empty(), "expired once");
    // A repeat gets the same answer; nothing runs.
    let outs = f.intent(wire("c2", None), T0 + 30 * SEC);
    assert!(!invoked(&outs));
    assert_eq!(results(&outs), vec![rs[0].for_repeat(Some("c2".into()))]);
}

#[test]
fn an_approval_and_the_expiry_in_one_batch_first_read_wins() {
    // Approved first, then the tick past the expiry: it runs, nothing expires.
    let mut f = Fixture::with_config(LIFECYCLE);
    f.intent(wire("c1", None), T0);
    f.tick(T0 + 4 * SEC);
    let mut b = Batch::default();
    decide(&mut f, &mut b, &command("approve", "alice"), T0 + 9_999);
    f.core
        .on_deadlines(&f.store, &mut b, T0 + 10 * SEC)
        .unwrap();
    f.commit(b);
    let outs = f.outs();
    assert_eq!(events(&outs), ["approved"]);
    assert!(invoked(&outs));
    assert!(refusals(&outs).is_empty());
    assert_eq!(f.record(&wire_step()).phase, Phase::Started);

    // The tick first, then the approval: expired, the approval refused.
    let mut f = Fixture::with_config(LIFECYCLE);
    f.intent(wire("c1", None), T0);
    let mut b = Batch::default();
    f.core
        .on_deadlines(&f.store, &mut b, T0 + 10 * SEC)
        .unwrap();
    decide(&mut f, &mut b, &command("approve", "alice"), T0 + 10 * SEC);
    f.commit(b);
    let outs = f.outs();
    assert!(events(&outs).contains(&"expired"), "{outs:?}");
    assert!(!events(&outs).contains(&"approved"));
    assert!(!invoked(&outs));
    let refused = refusals(&outs);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].0, RejectionReason::ApprovalExpired);
    let rec = f.record(&wire_step());
    assert_eq!(rec.phase, Phase::Completed);
    assert_eq!(rec.result.unwrap().error.unwrap().kind, "approval_expired");
}

#[test]
fn an_approval_read_after_the_expiry_before_any_tick_expires_the_call_and_is_refused() {
    let mut f = Fixture::with_config(LIFECYCLE);
    f.intent(wire("c1", None), T0);
    let mut b = Batch::default();
    decide(
        &mut f,
        &mut b,
        &command("approve", "alice"),
        T0 + 10 * SEC + 1,
    );
    f.commit(b);
    let outs = f.outs();
    assert_eq!(events(&outs), ["expired"]);
    assert!(!invoked(&outs));
    assert_eq!(
        results(&outs)[0].error.as_ref().unwrap().kind,
        "approval_expired"
    );
    assert_eq!(refusals(&outs)[0].0, RejectionReason::ApprovalExpired);
    // And a later deny too: the step stays expired.
    let mut b = Batch::default();
    decide(&mut f, &mut b, &command("deny", "bob"), T0 + 11 * SEC);
    f.commit(b);
    let outs = f.outs();
    assert_eq!(refusals(&outs)[0].0, RejectionReason::ApprovalExpired);
    assert!(results(&outs).is_empty());
    assert_eq!(f.record(&wire_step()).phase, Phase::Completed);
}

#[test]
fn the_principal_that_sent_a_call_cannot_decide_it() {
    let mut f = Fixture::with_config(LIFECYCLE);
    f.intent(wire("c1", Some("token:agent-7")), T0);
    let mut b = Batch::default();
    decide(
        &mut f,
        &mut b,
        &command("approve", "token:agent-7"),
        T0 + SEC,
    );
    f.commit(b);
    let outs = f.outs();
    assert!(!invoked(&outs));
    let refused = refusals(&outs);
    assert_eq!(refused[0].0, RejectionReason::SelfDecision, "{refused:?}");
    assert!(refused[0].1.contains("token:agent-7"));
    assert_eq!(f.record(&wire_step()).phase, Phase::AwaitingApproval);
    // Anyone else may.
    let mut b = Batch::default();
    decide(&mut f, &mut b, &command("approve", "alice"), T0 + 2 * SEC);
    f.commit(b);
    assert!(invoked(&f.outs()));
}

#[test]
fn a_decision_about_other_terms_is_refused_and_a_policy_change_asks_again() {
    let mut f = Fixture::with_config(LIFECYCLE);
    f.intent(wire("c1", None), T0);
    let held = f.record(&wire_step()).hold.unwrap();
    let mut cmd = command("approve", "alice");
    cmd["arguments_sha256"] = json!("00".repeat(32));
    let mut b = Batch::default();
    decide(&mut f, &mut b, &cmd, T0 + SEC);
    f.commit(b);
    let outs = f.outs();
    assert_eq!(refusals(&outs)[0].0, RejectionReason::StaleCommand);
    assert!(!invoked(&outs));

    // The gate restarts with the tool pointed elsewhere: the approval of the
    // call held under the old policy is refused, and it is asked again.
    let moved = LIFECYCLE.replace(
        "url = \"http://127.0.0.1:1/x\"\ntimeout = \"2s\"\nretries = 0\napproval_ttl",
        "url = \"http://127.0.0.1:2/elsewhere\"\ntimeout = \"2s\"\nretries = 0\napproval_ttl",
    );
    let config = Config::from_toml_str(&moved, Vec::new()).unwrap();
    f.core = GateCore::new(&config, Arc::new(Metrics::new()));
    let mut cmd = command("approve", "alice");
    cmd["id"] = json!("alice-approve-2");
    cmd["arguments_sha256"] = json!(held.arguments_sha256);
    cmd["policy_version"] = json!(held.policy_version);
    let mut b = Batch::default();
    decide(&mut f, &mut b, &cmd, T0 + 2 * SEC);
    f.commit(b);
    let outs = f.outs();
    assert!(!invoked(&outs));
    assert_eq!(refusals(&outs)[0].0, RejectionReason::StaleCommand);
    assert_eq!(events(&outs), ["requested"]);
    let again = f.record(&wire_step()).hold.unwrap();
    assert_ne!(again.policy_version, held.policy_version);
    assert_eq!(again.arguments_sha256, held.arguments_sha256);
    assert_eq!(again.since_ms, T0 + 2 * SEC, "its times start again");
    // Approved under the policy in force, it runs.
    let mut cmd = command("approve", "alice");
    cmd["id"] = json!("alice-approve-3");
    cmd["policy_version"] = json!(again.policy_version);
    let mut b = Batch::default();
    decide(&mut f, &mut b, &cmd, T0 + 3 * SEC);
    f.commit(b);
    assert!(invoked(&f.outs()));
}

#[test]
fn a_workflow_prefix_overrides_the_tools_ttl() {
    let f = Fixture::with_config(LIFECYCLE);
    let tool = &f.core.tools["wire"];
    let s = std::time::Duration::from_secs;
    assert_eq!(tool.approval_times("wf"), (Some(s(10)), Some(s(4))));
    assert_eq!(tool.approval_times("prod-7"), (Some(s(30)), Some(s(4))));
}

/// The fax tool's in-doubt step: the call, then its in-doubt answer.
fn fax_in_doubt(f: &mut Fixture) -> (Call, ToolResult) {
    let call = call_of(&f.intent(fax("c1"), T0));
    let outs = f.outcome(
        &call,
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "outcome_unknown".into(),
                message: "HTTP 502".into(),
            },
        },
        T0 + 100,
    );
    (call, results(&outs).remove(0))
}

fn lookup_of(outs: &[Out]) -> Call {
    outs.iter()
        .find_map(|o| match o {
            Out::Invoke { call, .. } if call.is_lookup() => Some(call.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("a lookup was started: {outs:?}"))
}

fn answer(f: &mut Fixture, lookup: &Call, body: serde_json::Value, now: i64) -> Vec<Out> {
    f.outcome(lookup, Outcome::Ok { output: body }, now)
}

#[test]
fn an_in_doubt_step_whose_lookup_reports_the_effect_settles_ok_with_its_output() {
    let mut f = Fixture::with_config(LIFECYCLE);
    let (call, first) = fax_in_doubt(&mut f);
    assert_eq!(first.status, Status::InDoubt);
    let d = first.in_doubt.clone().expect("a structured in_doubt");
    assert_eq!(d.settling, Settler::Reconciler);
    assert_eq!(d.idempotency_key, call.step.idempotency_key());
    assert!(d.until.is_some());
    assert!(
        first
            .error
            .as_ref()
            .unwrap()
            .message
            .contains("stepgate is asking the tool")
    );
    // A repeat meanwhile gets the same answer.
    let outs = f.intent(fax("c2"), T0 + 500);
    assert_eq!(results(&outs), vec![first.for_repeat(Some("c2".into()))]);
    assert!(
        f.tick(T0 + 900).is_empty(),
        "the first lookup waits `every`"
    );
    let outs = f.tick(T0 + 100 + SEC);
    let lookup = lookup_of(&outs);
    assert_eq!(lookup.dispatch, LOOKUP_DISPATCH);
    let body = lookup.arguments.to_value();
    assert_eq!(body["idempotency_key"], json!(call.step.idempotency_key()));
    assert_eq!(body["arguments"], json!({"to": "+331"}));
    assert_eq!(body["ask"], json!(1));
    let outs = answer(
        &mut f,
        &lookup,
        json!({"status": "executed", "output": {"fax_id": "F-1"}}),
        T0 + 1500,
    );
    assert!(results(&outs).is_empty(), "its first caller was answered");
    let decided: Vec<_> = outs
        .iter()
        .filter_map(|o| match o {
            Out::Command { command, .. } => Some(command.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(decided.len(), 1, "{outs:?}");
    assert_eq!(decided[0].by, "stepgate:reconciler");
    assert_eq!(decided[0].evidence.as_ref().unwrap()[0].answer, "executed");
    let rec = f.record(&call.step);
    assert_eq!(rec.phase, Phase::Completed);
    assert_eq!(rec.operator_log[0].by, "stepgate:reconciler");
    // The next repeat gets the lookup's output; the tool never ran again.
    let outs = f.intent(fax("c3"), T0 + 2000);
    assert!(!invoked(&outs));
    let r = results(&outs).remove(0);
    assert_eq!(
        (r.status, r.output),
        (Status::Ok, Some(json!({"fax_id": "F-1"})))
    );
    // Its own command, read back, is already applied.
    let input = f.input("commands", serde_json::to_vec(&decided[0]).unwrap());
    let mut b = Batch::default();
    f.core
        .on_command(&f.store, &mut b, &input, T0 + 3000)
        .unwrap();
    f.commit(b);
    assert!(f.outs().is_empty());
}

#[test]
fn an_in_doubt_step_whose_lookup_reports_nothing_happened_runs_on_its_next_call() {
    let mut f = Fixture::with_config(LIFECYCLE);
    let (call, _) = fax_in_doubt(&mut f);
    let lookup = lookup_of(&f.tick(T0 + 100 + SEC));
    let outs = answer(
        &mut f,
        &lookup,
        json!({"status": "not_executed"}),
        T0 + 1500,
    );
    assert!(results(&outs).is_empty());
    assert_eq!(f.record(&call.step).phase, Phase::NotExecuted);
    let outs = f.intent(fax("c2"), T0 + 2000);
    let again = call_of(&outs);
    assert!(!again.is_lookup());
    assert_eq!(again.step, call.step, "the same step, with the same key");
    assert_eq!(again.dispatch, call.dispatch + 1);
}

#[test]
fn lookups_that_cannot_tell_back_off_then_leave_the_step_to_a_person() {
    let mut f = Fixture::with_config(LIFECYCLE);
    let (call, _) = fax_in_doubt(&mut f);
    let since = T0 + 100;
    let mut now = since;
    let mut asked = Vec::new();
    while now < since + 12 * SEC {
        now += 100;
        let outs = f.tick(now);
        if let Some(l) = outs.iter().find_map(|o| match o {
            Out::Invoke { call, .. } if call.is_lookup() => Some(call.clone()),
            _ => None,
        }) {
            asked.push(now - since);
            let reply = if asked.len() % 2 == 0 {
                Outcome::Error {
                    error: ErrorBody {
                        kind: "lookup_failed".into(),
                        message: "HTTP 503".into(),
                    },
                }
            } else {
                Outcome::Ok {
                    output: json!({"status": "unknown"}),
                }
            };
            f.outcome(&l, reply, now + 50);
        }
    }
    // every 1s, doubling: at 1s, 3s, 7s after; then `until` (10s) ends it.
    assert_eq!(asked, vec![1000, 3000, 7000], "{asked:?}");
    let rec = f.record(&call.step);
    assert_eq!(rec.phase, Phase::InDoubt);
    let rc = rec.reconcile.unwrap();
    assert_eq!(rc.settling, Settler::Person);
    assert_eq!(rc.lookups.len(), 3);
    assert_eq!(rc.lookups[1].answer, "failed");
    // A repeat now says a person settles it.
    let r = results(&f.intent(fax("c9"), now)).remove(0);
    assert_eq!(r.status, Status::InDoubt);
    let d = r.in_doubt.unwrap();
    assert_eq!((d.settling, d.until), (Settler::Person, None));
    assert_eq!(
        r.error.unwrap().message,
        Texts::in_doubt_unsettled("fax", 3)
    );
}

#[test]
fn an_in_doubt_step_without_a_lookup_is_a_persons_and_says_so() {
    let mut f = Fixture::new();
    let outs = f.intent(
        json!({"workflow_id": "wf", "step_index": 1, "tool": "wire", "arguments": {}}),
        1000,
    );
    let call = call_of(&outs);
    let outs = f.tick(1000 + 10_000);
    let r = results(&outs).remove(0);
    assert_eq!(r.status, Status::InDoubt);
    let d = r.in_doubt.unwrap();
    assert_eq!(d.settling, Settler::Person);
    assert_eq!(d.idempotency_key, call.step.idempotency_key());
    assert_eq!(r.error.unwrap().message, Texts::in_doubt_lost("wire"));
}
