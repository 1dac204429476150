//! The one-pass protocol's crash points, against the real broker: a new step is
//! committed as `started` (with its intent's offset), then invoked by the
//! owner of its partition, then its outcome and answer are committed. Each test
//! kills the gate at one point (fault injection by env var, or `kill -9`) and
//! counts at the tool: raw invocations, and effects as a provider that
//! deduplicates by `Idempotency-Key` would perform them.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::Status;

const WAIT: Duration = Duration::from_secs(60);

/// Starts with `var=1` set, publishes `intent`, waits for the injected crash,
/// then restarts without it.
async fn crash_once(s: &mut Stack, var: &str, agent: &Agent, intent: serde_json::Value) {
    crash(s, var, &[], agent, intent).await;
    s.start().await;
}

/// Starts with `var=1` and `env` set, publishes `intent`, and waits for the
/// injected crash (the process is left down).
async fn crash(
    s: &mut Stack,
    var: &str,
    env: &[(&str, &str)],
    agent: &Agent,
    intent: serde_json::Value,
) {
    let mut env = env.to_vec();
    env.push((var, "1"));
    s.spawn(&[], &env);
    s.wait_ready().await;
    agent.send(&intent).await;
    let status = s.exited(WAIT).await;
    assert!(!status.success(), "the fault was injected");
    s.assert_logged(&format!("{var}=1"), "the crash hook announced itself");
}

/// Before the `started` commit: nothing is durable and nothing ran; the intent
/// is read again and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_started_commit_runs_the_step_once_after_restart() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    crash_once(
        &mut s,
        "STEPGATE_TEST_CRASH_BEFORE_COMMIT",
        &agent,
        intent("wf-x", 1, "create_ticket", json!({"t": 1}), "u1"),
    )
    .await;
    let r = agent.answer("u1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert!(
        !r.deduplicated,
        "the aborted step is new again, not a repeat"
    );
    assert_eq!(s.tools.count("create_ticket"), 1);
    assert_eq!(agent.answers("u1").len(), 1, "one answer per call_id");
}

/// After the `started` commit, before the call: the step may not have run, but
/// nothing can tell. An unkeyed tool is never re-run blindly: `in_doubt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_started_commit_before_the_call_is_in_doubt_for_unkeyed() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    crash_once(
        &mut s,
        "STEPGATE_TEST_CRASH_BEFORE_INVOKE",
        &agent,
        intent("wf-y", 1, "wire", json!({"amount": 5}), "w1"),
    )
    .await;
    let r = agent.answer("w1", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(s.tools.count("wire"), 0, "it never ran, and was not re-run");
    assert_eq!(agent.answers("w1").len(), 1);
}

/// The same point for a keyed tool: re-run with the step's one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_started_commit_before_the_call_reruns_keyed_with_its_key() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    crash_once(
        &mut s,
        "STEPGATE_TEST_CRASH_BEFORE_INVOKE",
        &agent,
        intent("wf-z", 1, "charge", json!({"cents": 5}), "k1"),
    )
    .await;
    let r = agent.answer("k1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert_eq!(s.tools.count("charge"), 1);
    assert_eq!(s.tools.effects("charge"), 1);
    assert_eq!(agent.answers("k1").len(), 1);
}

/// A keyed step's call is sent as soon as it is decided, before the batch
/// deciding it commits (held back here by a slow
/// broker). Killed after the call and before any commit, nothing durable says
/// it ran: the intent is read again as new and run again with its one key —
/// two invocations, one effect at a provider deduplicating by key, one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_call_sent_before_its_deciding_commit_runs_again_with_its_key_after_a_kill() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    crash(
        &mut s,
        "STEPGATE_TEST_CRASH_AFTER_INVOKE",
        &[
            ("STEPGATE_TEST_DELAY_COMMIT_MS", "5000"),
            // Its commits are logged at debug.
            ("RUST_LOG", "info,stepgate::gate=debug"),
        ],
        &agent,
        intent("wf-e", 1, "charge", json!({"cents": 3}), "e1"),
    )
    .await;
    s.assert_not_logged("batch committed", "no batch had committed");
    assert_eq!(s.tools.count("charge"), 1, "sent before any commit");
    s.start().await;
    let r = agent.answer("e1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert!(!r.deduplicated, "read again as new: {r:?}");
    assert_eq!(s.tools.count("charge"), 2, "run again after the kill");
    assert_eq!(
        s.tools.effects("charge"),
        1,
        "with the same key: one effect"
    );
    assert_eq!(agent.answers("e1").len(), 1, "one answer per call_id");
}

/// A repeat of a committed outcome is answered outside the batch's
/// transaction — here while no transaction can
/// commit (a broker that holds every commit 10 minutes). Killed before the
/// repeat's offset commits, the restarted gate reads the repeat again and
/// answers it again: a second, identical answer to its `call_id`, nothing lost,
/// nothing run again: every answer to a `call_id` is the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_answered_at_once_outside_the_transaction_is_answered_again_after_a_kill() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    s.start().await;
    let first = agent
        .call(intent("wf-ao", 1, "charge", json!({"cents": 9}), "o1"))
        .await;
    assert_eq!(first.status, Status::Ok, "{first:?}");
    s.kill();

    s.spawn(
        &[],
        &[
            ("STEPGATE_TEST_DELAY_COMMIT_MS", "600000"),
            ("RUST_LOG", "info,stepgate::gate=debug"),
        ],
    );
    s.wait_ready().await;
    agent
        .send(&intent(
            "wf-ao",
            1,
            "charge",
            json!({"cents": 9, "note": "retry"}),
            "o2",
        ))
        .await;
    let again = agent.answer("o2", WAIT).await;
    s.assert_not_logged("batch committed", "answered while no batch could commit");
    assert_eq!(
        again,
        first.for_repeat(Some("o2".into())),
        "the same answer"
    );
    s.kill();

    s.start().await;
    eventually(WAIT, "the repeat answered again after the kill", || {
        agent.answers("o2").len() == 2
    })
    .await;
    let answers = agent.answers("o2");
    assert_eq!(answers[0].1, answers[1].1, "identical answers: {answers:?}");
    // With nothing else to write and no other input, the repeat's offset is
    // committed all the same (at the gate's next tick): killed once that is
    // done, the next gate does not answer it a third time.
    eventually(WAIT, "both intents committed past", || {
        s.committed_intents() == 2
    })
    .await;
    s.kill();
    s.start().await;
    let next = agent
        .call(intent("wf-ao", 2, "charge", json!({"cents": 1}), "o3"))
        .await;
    assert_eq!(next.status, Status::Ok, "{next:?}");
    assert_eq!(agent.answers("o2").len(), 2, "not answered a third time");
    assert_eq!(s.tools.count("charge"), 2, "nothing ran again");
    assert_eq!(s.tools.effects("charge"), 2);
    assert_eq!(agent.answers("o1").len(), 1);
}

/// After the call, before the outcome's commit: the effect happened and its
/// answer is lost. Unkeyed: `in_doubt`, never re-run. Keyed: re-run with the
/// same key, so the provider performs one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_call_before_the_outcome_commit_never_doubles_an_effect() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    crash_once(
        &mut s,
        "STEPGATE_TEST_CRASH_AFTER_INVOKE",
        &agent,
        intent("wf-u", 1, "wire", json!({"amount": 7}), "a1"),
    )
    .await;
    let r = agent.answer("a1", WAIT).await;
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(s.tools.count("wire"), 1, "ran once, never re-run blindly");
    s.kill();

    crash_once(
        &mut s,
        "STEPGATE_TEST_CRASH_AFTER_INVOKE",
        &agent,
        intent("wf-k", 1, "charge", json!({"cents": 7}), "a2"),
    )
    .await;
    let r = agent.answer("a2", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert_eq!(s.tools.count("charge"), 2, "re-run after the lost outcome");
    assert_eq!(
        s.tools.effects("charge"),
        1,
        "with the same key: one effect"
    );
    assert_eq!(agent.answers("a2").len(), 1);
}

/// A partition revoked while its calls run: the calls finish on the old owner,
/// whose outcomes go through `progress` to the new owner, which settles each
/// step once (no call runs twice, every caller gets one answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_of_calls_whose_partition_moved_are_settled_once_by_the_new_owner() {
    let mut s = Stack::new(StackOptions {
        tools: vec![("create_ticket", "unkeyed", "30s")],
        ..StackOptions::default()
    })
    .await;
    s.tools
        .script("create_ticket", vec![Reply::Delay(Duration::from_secs(6))]);
    s.start().await;
    let agent = s.agent();
    let wfs: Vec<String> = (0..12).map(|n| format!("wf-rv-{n}")).collect();
    for (n, wf) in wfs.iter().enumerate() {
        agent
            .send(&intent(
                wf,
                1,
                "create_ticket",
                json!({"n": n}),
                &format!("rv{n}"),
            ))
            .await;
    }
    let tools = s.tools.clone();
    eventually(WAIT, "every call is running", || {
        tools.count("create_ticket") == wfs.len()
    })
    .await;
    // A second gate joins: the group rebalances while the calls run.
    let b_http = format!("127.0.0.1:{}", free_port());
    let mut gate_b = s.spawn_other("gate-b", &b_http, &[]);
    wait_ready(&b_http).await;
    for n in 0..wfs.len() {
        let r = agent.answer(&format!("rv{n}"), WAIT).await;
        assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.other_log("gate-b"));
    }
    // Repeats, answered by whichever gate owns the step now.
    for (n, wf) in wfs.iter().enumerate() {
        let again = agent
            .call(intent(
                wf,
                1,
                "create_ticket",
                json!({"n": n, "r": 1}),
                &format!("rv{n}-again"),
            ))
            .await;
        assert!(again.deduplicated, "{again:?}");
        assert_eq!(again.status, Status::Ok);
    }
    assert_eq!(
        s.tools.count("create_ticket"),
        wfs.len(),
        "no call ran twice"
    );
    for n in 0..wfs.len() {
        assert_eq!(
            agent.answers(&format!("rv{n}")).len(),
            1,
            "one answer for rv{n}"
        );
    }
    s.assert_logged(
        "handed to the partition's owner",
        "some calls finished after their partition moved to gate B",
    );
    gate_b.kill().unwrap();
    gate_b.wait().unwrap();
}

/// The two-history case: gate A dies with a batch sent but not committed, stays
/// down past the session timeout, gate B takes its partitions and commits its
/// own batches, then A comes back and takes partitions back. A's disk must never
/// hold a history Kafka aborted, and must learn what B committed: every step
/// ran once, every repeat is answered from the record B or A wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_back_after_another_owned_its_partitions_holds_only_committed_history() {
    let mut s = Stack::new(StackOptions {
        session_timeout: "6s",
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let wfs: Vec<String> = (0..8).map(|n| format!("wf-h-{n}")).collect();
    let mut firsts = Vec::new();
    for (n, wf) in wfs.iter().enumerate() {
        firsts.push(
            agent
                .call(intent(
                    wf,
                    1,
                    "create_ticket",
                    json!({"n": n}),
                    &format!("h{n}"),
                ))
                .await,
        );
    }
    s.kill();
    // A again, dying before its next commit: a batch sent and aborted.
    let send = async {
        for (n, wf) in wfs.iter().enumerate() {
            agent
                .send(&intent(
                    wf,
                    2,
                    "create_ticket",
                    json!({"n": n}),
                    &format!("h{n}-2"),
                ))
                .await;
        }
    };
    s.spawn(&[], &[("STEPGATE_TEST_CRASH_BEFORE_COMMIT", "1")]);
    s.wait_ready().await;
    send.await;
    assert!(!s.exited(WAIT).await.success());
    // B owns everything now (A's static membership expires after the session
    // timeout), answers the aborted steps and commits new ones.
    let b_http = format!("127.0.0.1:{}", free_port());
    let mut gate_b = s.spawn_other("gate-b", &b_http, &[]);
    for n in 0..wfs.len() {
        let r = agent.answer(&format!("h{n}-2"), WAIT).await;
        assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.other_log("gate-b"));
    }
    let mut seconds = Vec::new();
    for n in 0..wfs.len() {
        seconds.push(agent.answer(&format!("h{n}-2"), WAIT).await);
    }
    // A comes back beside B and takes half the partitions back.
    s.start().await;
    for (n, wf) in wfs.iter().enumerate() {
        for (step, first) in [(1, &firsts[n]), (2, &seconds[n])] {
            let again = agent
                .call(intent(
                    wf,
                    step,
                    "create_ticket",
                    json!({"again": true}),
                    &format!("h{n}-{step}-r"),
                ))
                .await;
            assert!(again.deduplicated, "{again:?}\n{}", s.log_tail(80));
            same_but_call_id(first, &again);
        }
    }
    assert_eq!(
        s.tools.count("create_ticket"),
        2 * wfs.len(),
        "every step ran once across the aborted batch and both owners"
    );
    for n in 0..wfs.len() {
        assert_eq!(agent.answers(&format!("h{n}-2")).len(), 1);
    }
    gate_b.kill().unwrap();
    gate_b.wait().unwrap();
}

/// A keyed step is recorded once, settled (docs/design.md "One record for a
/// re-runnable step"): while its call runs, the gate holds the partition's
/// committed offset at its intent and settles later steps past it. A kill -9
/// then re-reads from the held offset: the step in flight runs again with its
/// one key (one effect at a provider deduplicating by key), and the steps
/// answered after it are neither run nor answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_call_in_flight_at_a_kill_runs_again_with_its_key_and_nothing_after_it_does() {
    let mut s = Stack::new(StackOptions {
        tools: vec![("charge", "keyed", "60s")],
        ..StackOptions::default()
    })
    .await;
    // The first invocation hangs past the kill; every later one answers at once.
    s.tools.script(
        "charge",
        vec![Reply::Delay(Duration::from_secs(120)), Reply::Ok],
    );
    s.start().await;
    let agent = s.agent();
    let wf = "wf-held";
    agent
        .send(&intent(wf, 1, "charge", json!({"cents": 1}), "held-1"))
        .await;
    let tools = s.tools.clone();
    eventually(WAIT, "the first charge is running", || {
        tools.count("charge") == 1
    })
    .await;
    // Later steps of the same workflow (the same partition): answered past it.
    for n in 2..=6 {
        let r = agent
            .call(intent(
                wf,
                n,
                "charge",
                json!({"cents": n}),
                &format!("held-{n}"),
            ))
            .await;
        assert_eq!(r.status, Status::Ok, "{r:?}");
    }
    assert!(
        agent.answers("held-1").is_empty(),
        "the first is still running"
    );
    s.kill();
    s.start().await;
    let r = agent.answer("held-1", WAIT).await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(80));
    assert!(!r.deduplicated, "{r:?}");
    // A new step after them all: once it is answered, everything before it in
    // the partition has been read again.
    let last = agent
        .call(intent(wf, 7, "charge", json!({"cents": 7}), "held-7"))
        .await;
    assert_eq!(last.status, Status::Ok, "{last:?}");
    for n in 1..=7 {
        assert_eq!(
            agent.answers(&format!("held-{n}")).len(),
            1,
            "one answer for held-{n}"
        );
    }
    // Steps 2..6 ran once; step 1 twice (the hung call and its re-run), with
    // one key: seven effects in eight invocations.
    assert_eq!(
        s.tools.count("charge"),
        8,
        "{:?}",
        s.tools.keys_per_step("charge")
    );
    for (step, keys) in s.tools.keys_per_step("charge") {
        assert_eq!(keys.len(), 1, "one key for {step:?}");
    }
    assert_eq!(s.tools.effects("charge"), 7);
}

/// A keyed step whose call takes longer than a commit is still one
/// transaction. The batch that read it holds
/// nothing but the call started at once, so it waits for the outcome instead
/// of committing the read by itself (which cost a second transaction a step
/// for every tool slower than a commit, and for the first call of any tool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_step_slower_than_a_commit_is_still_one_transaction() {
    let mut s = Stack::new(StackOptions::default()).await;
    let agent = s.agent();
    s.tools
        .script("charge", vec![Reply::Provider(Duration::from_millis(400))]);
    s.start().await;
    let commits = |m: &str| -> f64 {
        parse_metrics(m)
            .get("stepgate_commit_latency_seconds_count")
            .copied()
            .unwrap_or(0.0)
    };
    let before = commits(&s.metrics().await);
    for (i, call_id) in ["s1", "s2"].into_iter().enumerate() {
        let r = agent
            .call(intent(
                "wf-s",
                i as u64 + 1,
                "charge",
                json!({"cents": 5}),
                call_id,
            ))
            .await;
        assert_eq!(r.status, Status::Ok, "{r:?}");
    }
    // The answer is read once its transaction commits; the gate counts that
    // commit when the reply reaches it.
    let mut after = commits(&s.metrics().await);
    let start = std::time::Instant::now();
    while after < before + 2.0 && start.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = commits(&s.metrics().await);
    }
    assert_eq!(
        after - before,
        2.0,
        "one transaction a step:\n{}",
        s.log_tail(40)
    );
    assert_eq!(s.tools.count("charge"), 2);
    assert_eq!(s.tools.effects("charge"), 2);
}
