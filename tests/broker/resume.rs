//! A restart after `kill -9` keeps the local state (docs/design.md "Restart
//! after a crash"): each partition resumes from the offset its state
//! reflects once the batches the dead process applied last are confirmed on
//! the changelog; one the changelog does not hold (a commit the broker
//! acknowledged and then lost) makes its partition restore from the start.
//! Each test kills the gate at one point of a batch and counts at the tool.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::{Status, ToolResult};

const WAIT: Duration = Duration::from_secs(60);

/// Settled steps in several partitions, answered before the crash.
async fn prime(agent: &Agent) -> Vec<ToolResult> {
    let mut firsts = Vec::new();
    for n in 0..6u64 {
        firsts.push(
            agent
                .call(intent(
                    &format!("wf-prime-{n}"),
                    1,
                    "create_ticket",
                    json!({"n": n}),
                    &format!("p{n}"),
                ))
                .await,
        );
    }
    firsts
}

/// The primed steps' repeats are answered from the state, identically, and
/// nothing runs again.
async fn repeats_answered_from_state(agent: &Agent, firsts: &[ToolResult], s: &Stack) {
    for (n, first) in firsts.iter().enumerate() {
        let again = agent
            .call(intent(
                &format!("wf-prime-{n}"),
                1,
                "create_ticket",
                json!({"n": n, "again": true}),
                &format!("p{n}-again"),
            ))
            .await;
        assert!(again.deduplicated, "{again:?}\n{}", s.log_tail(40));
        same_but_call_id(first, &again);
    }
}

/// The counter's value in a scrape (0 when absent).
fn counter(metrics: &str, name: &str) -> f64 {
    parse_metrics(metrics).get(name).copied().unwrap_or(0.0)
}

/// Every partition of the restarted gate resumed from its local state: no
/// restore from the changelog's start.
fn resumed_every_partition(s: &Stack, m: &str) {
    assert_eq!(
        counter(m, "stepgate_state_full_restores_total"),
        0.0,
        "a partition was restored from its changelog's start after kill -9:\n{}",
        s.log_tail(60)
    );
    s.assert_not_logged(
        "restoring it from the changelog's start",
        "no partition started over",
    );
}

/// Primes the state, kills the gate (`kill -9`), starts it with `var=1`,
/// publishes `intent` and waits for the hook's crash; then starts it again
/// without the hook. Returns the primed answers.
async fn crash_at(
    s: &mut Stack,
    agent: &Agent,
    var: &str,
    intent: serde_json::Value,
) -> Vec<ToolResult> {
    s.start().await;
    let firsts = prime(agent).await;
    s.kill();
    s.spawn(&[], &[(var, "1")]);
    s.wait_ready().await;
    // Restarted after kill -9 on the same disk: resumed, not restored.
    resumed_every_partition(s, &s.metrics().await);
    agent.send(&intent).await;
    let status = s.exited(WAIT).await;
    assert!(!status.success(), "the fault was injected");
    s.assert_logged(&format!("{var}=1"), "the crash hook announced itself");
    s.start().await;
    resumed_every_partition(s, &s.metrics().await);
    firsts
}

/// Before the batch commits: nothing of it is durable; the intent is read
/// again and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_a_batch_commits_the_restart_resumes_and_runs_the_step_once() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    let i = intent("wf-c1", 1, "create_ticket", json!({"t": 1}), "c1");
    let firsts = crash_at(&mut s, &agent, "STEPGATE_TEST_CRASH_BEFORE_COMMIT", i).await;
    let r = agent.answer("c1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert!(!r.deduplicated, "{r:?}");
    repeats_answered_from_state(&agent, &firsts, &s).await;
    assert_eq!(s.tools.count("create_ticket"), 7, "six primed, one new");
    assert_eq!(agent.answers("c1").len(), 1, "one answer per call_id");
}

/// Committed (`started`) but not applied to the local state: the resumed
/// restore reads it from the changelog, and the step that never ran is in
/// doubt at its deadline — not run again, not forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_batch_commits_before_it_is_applied_the_restart_reads_it_from_the_changelog()
{
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    let i = intent("wf-c2", 1, "wire", json!({"amount": 2}), "c2");
    let firsts = crash_at(&mut s, &agent, "STEPGATE_TEST_CRASH_AFTER_COMMIT", i).await;
    let r = agent.answer("c2", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(s.tools.count("wire"), 0, "it never ran, and was not re-run");
    repeats_answered_from_state(&agent, &firsts, &s).await;
    assert_eq!(agent.answers("c2").len(), 1);
}

/// Applied, its call handed over but not started: in doubt (unkeyed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_batch_is_applied_before_its_call_the_restart_resumes_from_it() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    let i = intent("wf-c3", 1, "wire", json!({"amount": 3}), "c3");
    let firsts = crash_at(&mut s, &agent, "STEPGATE_TEST_CRASH_BEFORE_INVOKE", i).await;
    let r = agent.answer("c3", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(s.tools.count("wire"), 0);
    repeats_answered_from_state(&agent, &firsts, &s).await;
    assert_eq!(agent.answers("c3").len(), 1);
}

/// The call ran, its outcome never committed: a keyed step runs again with
/// its key (one effect at the provider).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_call_before_its_outcome_commits_the_restart_reruns_keyed_with_its_key() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    let i = intent("wf-c4", 1, "send_email", json!({"to": "a"}), "c4");
    let firsts = crash_at(&mut s, &agent, "STEPGATE_TEST_CRASH_AFTER_INVOKE", i).await;
    let r = agent.answer("c4", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    repeats_answered_from_state(&agent, &firsts, &s).await;
    assert_eq!(s.tools.effects("send_email"), 1, "one effect");
    assert_eq!(agent.answers("c4").len(), 1);
}

/// The broker acknowledged a batch's commit and lost it (the hook aborts it
/// and reports it committed: applied locally), and the process dies before
/// its next session reads back what was lost. The restarted gate finds that
/// batch's record missing on the changelog and restores the partition from
/// the start instead of trusting its state: the step the lost batch settled
/// is `started` there, and its deadline answers it `in_doubt` (its outcome
/// died with the process). Trusted, the state would hold the settled step
/// and its caller would never be answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_commit_the_broker_lost_is_not_trusted_after_a_crash() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    s.start().await;
    let firsts = prime(&agent).await;
    s.kill();
    // The first transaction that answers (the step's outcome) is lost; the
    // session that follows dies before its read-back.
    s.spawn(
        &[],
        &[
            ("STEPGATE_TEST_LOSE_COMMIT_MARKER", "1"),
            ("STEPGATE_TEST_CRASH_BEFORE_MEND", "1"),
        ],
    );
    s.wait_ready().await;
    agent
        .send(&intent("wf-lost", 1, "wire", json!({"amount": 7}), "l1"))
        .await;
    let status = s.exited(WAIT).await;
    assert!(!status.success(), "the fault was injected");
    s.assert_logged(
        "a transaction is aborted and reported committed",
        "the commit was lost",
    );
    s.assert_logged(
        "STEPGATE_TEST_CRASH_BEFORE_MEND=1",
        "the process died before the mend",
    );
    s.start().await;
    let r = agent.answer("l1", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}\n{}", s.log_tail(60));
    assert_eq!(s.tools.count("wire"), 1, "the tool ran once");
    assert_eq!(agent.answers("l1").len(), 1, "one answer");
    s.assert_logged(
        "holds a batch the changelog does not show committed",
        "the lost batch was found",
    );
    // Only that partition started over; the others resumed.
    let m = s.metrics().await;
    assert_eq!(
        counter(&m, "stepgate_state_full_restores_total"),
        1.0,
        "{}",
        s.log_tail(60)
    );
    repeats_answered_from_state(&agent, &firsts, &s).await;
}
