//! Recovery against a real Kafka broker (`KAFKA_BROKERS`, default 127.0.0.1:9092):
//! kill -9, SIGTERM, lost disks and group offsets, partitions moving between
//! gates, a recreated changelog, a fenced consumer, a stuck gate, unreadable
//! records. The crash points of the one-pass protocol are in `one_pass.rs`.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::{Status, ToolResult};

const WAIT: Duration = Duration::from_secs(30);

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
    assert!(
        status.success(),
        "clean exit: {status:?}\n{}",
        s.log_tail(80)
    );
    s.start().await;
    let r = agent.answer("g1", WAIT).await;
    assert_eq!(
        r.status,
        Status::Ok,
        "the drained outcome was committed: {r:?}"
    );
    // A window for a second invocation to show; passing never depends on it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        s.tools.count("create_ticket"),
        1,
        "not re-run after the restart"
    );
}

/// kill -9 in the middle of a stream of new steps and repeats: every call is
/// answered, always with the same answer, no unkeyed step runs twice, and repeats carry the
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
    // A window for late duplicate answers to show; passing never depends on it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut by_step = std::collections::HashMap::new();
    for (wf, step, id) in &ids {
        let answers: Vec<ToolResult> = agent.answers(id).into_iter().map(|a| a.1).collect();
        by_step
            .entry((wf.clone(), *step))
            .or_insert_with(Vec::new)
            .push(the_one_answer(id, &answers).clone());
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
/// partitions move to the other, which restores them from the changelog (no
/// standby replicas here: `standby.rs` has the takeover from one), and
/// deduplication holds across the move (and back again after a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deduplication_holds_when_partitions_move_between_gates() {
    let mut s = Stack::new(StackOptions {
        session_timeout: "6s",
        configure: |c| c.gate.standby_replicas = 0,
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
    // Stopped gracefully: after a kill -9 every partition is restored from
    // the changelog's start anyway (an unclean shutdown), and the offset
    // would never be tried.
    assert!(s.terminate().await.success());
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
    s.assert_logged(
        "the changelog does not hold the offset the local state reflects",
        "the recreated changelog was noticed",
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
    // A fatal fence says what happened and what to do about it.
    if s.log().contains("failed for good") {
        s.assert_logged(
            "with this process's instance id",
            "the fence named as another process using this instance id",
        );
        s.assert_logged("--instance-id", "the flag that ends it named");
    }
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
        configure: |c| c.gate.stall_timeout = dur("2s"),
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
    s.assert_logged(
        "the gate's loop stops here for good",
        "the stall hook stopped the loop",
    );
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
        call_id: Some("old".into()),
        ..stepgate::state::StepRecord::new(
            stepgate::contract::StepKey {
                workflow_id: wf.into(),
                step_index: 1,
                tool: "send_email".into(),
                attempt: 0,
            },
            stepgate::tools::Category::Keyed,
            stepgate::state::Phase::Completed,
            stepgate::contract::Arguments::empty(),
            p,
            0,
            i64::MAX / 2,
        )
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
    assert_eq!(next.status, Status::Ok, "{}", s.log_tail(80));
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

/// A commit whose reply is lost (reported failed, landed all the same): the
/// session starts over from what committed, where the step is `started` and
/// was never invoked. It runs once, and its answer is its outcome — not
/// `in_doubt` at the deadline, as a step that might have run would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_reported_failed_that_landed_runs_its_calls_once() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.spawn(&[], &[("STEPGATE_TEST_LOSE_COMMIT_REPLY", "1")]);
    s.wait_ready().await;
    let agent = s.agent();
    let r = agent
        .call(intent("wf-lost", 1, "wire", json!({"amount": 5}), "l1"))
        .await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(40));
    assert_eq!(s.tools.count("wire"), 1, "invoked once");
    s.assert_logged(
        "its commit was reported failed but had landed",
        "the lost reply happened and was recovered from",
    );
    let again = agent
        .call(intent("wf-lost", 1, "wire", json!({"amount": 5}), "l2"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&r, &again);
    assert_eq!(s.tools.count("wire"), 1);
}

/// A commit that ended slowly enough that librdkafka may have sent its
/// `EndTxn` twice (`kafka::stale_end_possible`; forced here by a hook) is
/// honoured — its call runs once and is answered with its outcome — and the
/// session then starts over with new producers, whose new epoch fences a late
/// copy before any other transaction begins. The gate goes on answering:
/// a repeat from the record, a new step once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_ended_slowly_is_honoured_and_its_producers_replaced() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.spawn(&[], &[("STEPGATE_TEST_SLOW_TRANSACTION_END", "1")]);
    s.wait_ready().await;
    let agent = s.agent();
    let r = agent
        .call(intent("wf-slow-end", 1, "wire", json!({"amount": 3}), "e1"))
        .await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(40));
    assert_eq!(s.tools.count("wire"), 1, "invoked once");
    // Counted as the session ends, after the answer went out: wait for it.
    let line = r#"stepgate_gate_session_failures_total{reason="slow_transaction_end"} "#;
    let m = s.metrics_until(line, WAIT).await;
    let restarts: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert_eq!(restarts, 1.0, "one session restart:\n{}", s.log_tail(40));
    s.assert_logged(
        "starting new producers, which fence a late copy",
        "the session was started over with new producers",
    );
    let again = agent
        .call(intent("wf-slow-end", 1, "wire", json!({"amount": 3}), "e2"))
        .await;
    assert!(again.deduplicated, "{again:?}");
    same_but_call_id(&r, &again);
    let next = agent
        .call(intent("wf-slow-end", 2, "wire", json!({"amount": 4}), "e3"))
        .await;
    assert_eq!(next.status, Status::Ok, "{next:?}\n{}", s.log_tail(40));
    assert!(!next.deduplicated);
    assert_eq!(s.tools.count("wire"), 2, "each step ran once");
    assert_eq!(agent.answers("e1").len(), 1, "e1 answered once");
}

/// The fault itself: a request ending a transaction that is slow, not lost.
/// A proxy holds the gate's next `EndTxn(commit)` back; librdkafka times it
/// out (`socket.timeout.ms`, 2 s here), reconnects and sends it again, and the
/// commit completes. The held copy is let through only after the gate has
/// answered a later step. The gate had taken that commit as possibly sent
/// twice and started its session over with new producers, so the coordinator
/// refuses the late copy (a fenced epoch). Without that restart, it answers
/// `NONE` (checked): accepted, and applied to whatever that producer has open
/// by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_a_commit_request_is_fenced() {
    let _one = common::proxy::PROXY.lock().await;
    let (listen, upstream) = common::proxy::ports(&common::brokers());
    let proxy = common::proxy::KafkaProxy::start(listen, upstream).await;
    let mut s = Stack::new(StackOptions {
        brokers: Some(proxy.brokers.clone()),
        configure: |c| {
            c.kafka
                .client
                .insert("socket.timeout.ms".into(), "2000".into());
        },
        ..StackOptions::default()
    })
    .await;
    s.spawn(&[], &[]);
    s.wait_ready().await;
    let agent = s.agent();
    proxy.hold_next_commit();
    let r = agent
        .call(intent("wf-late-end", 1, "wire", json!({"amount": 1}), "t1"))
        .await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(40));
    assert!(proxy.holding(), "a commit request was held");
    assert!(
        common::load::wait_until(WAIT, || s
            .log()
            .contains("starting new producers, which fence a late copy"))
        .await,
        "the slow end was seen:\n{}",
        s.log_tail(60)
    );
    let next = agent
        .call(intent("wf-late-end", 2, "wire", json!({"amount": 2}), "t2"))
        .await;
    assert_eq!(next.status, Status::Ok, "{next:?}\n{}", s.log_tail(40));
    // INVALID_PRODUCER_EPOCH (47) or PRODUCER_FENCED (90).
    let code = proxy.release().await;
    assert!(
        code == 47 || code == 90,
        "the late copy is refused, not applied: error code {code}\n{}",
        s.log_tail(40)
    );
    let again = agent
        .call(intent("wf-late-end", 1, "wire", json!({"amount": 1}), "t3"))
        .await;
    assert!(again.deduplicated, "{again:?}");
    same_but_call_id(&r, &again);
    assert_eq!(s.tools.count("wire"), 2, "each step ran once");
}

/// A transaction whose send never returns — seen after a partition leader's
/// SIGKILL on a three-node cluster (the gate then answered nothing for
/// minutes) — is bounded (`kafka::send_limit`: the transaction timeout, at
/// least 30 s, + 10 s), aborted, and the session started over; the outcome it
/// carried is settled by the next session: the unkeyed call ran once and its
/// answer arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_whose_send_never_returns_is_aborted_and_its_outcome_settled_once() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.spawn(&[], &[("STEPGATE_TEST_HANG_SEND", "1")]);
    s.wait_ready().await;
    let agent = s.agent();
    let first = intent("wf-hang", 1, "wire", json!({"amount": 9}), "h1");
    agent.send(&first).await;
    let r = agent.answer("h1", Duration::from_secs(150)).await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(40));
    s.assert_logged("this transaction's send never returns", "the hook fired");
    s.assert_logged(
        "were not all acknowledged in time: aborted",
        "the hung send was bounded",
    );
    s.assert_logged(
        "a batch's commit is still in flight",
        "the slow commit was logged",
    );
    assert_eq!(s.tools.count("wire"), 1, "invoked once");
    let again = agent
        .call(intent("wf-hang", 1, "wire", json!({"amount": 9}), "h2"))
        .await;
    assert!(again.deduplicated, "{again:?}");
    same_but_call_id(&r, &again);
    assert_eq!(s.tools.count("wire"), 1);
    assert_eq!(agent.answers("h1").len(), 1, "h1 answered once");
}

/// The test hook lost a commit (`STEPGATE_TEST_LOSE_COMMIT_MARKER`), and
/// the next session wrote its records again (waited for: an answer sent at
/// once, before its transaction, reaches its caller before the loss).
async fn assert_lost_commit_written_again(s: &Stack) {
    s.assert_logged(
        "a transaction is aborted and reported committed",
        "the hook fired",
    );
    let written = "lost its commit marker: writing its records again";
    eventually(
        Duration::from_secs(60),
        "the lost commit written again",
        || s.log().contains(written),
    )
    .await;
    s.assert_logged(written, "the lost answer was written again");
}

/// A transaction the broker acknowledged and then lost — a commit marker lost
/// when a single broker is SIGKILLed mid-commit (`deploy/local/repro/
/// hanging-transaction.sh`), which the next session's end of hanging
/// transactions turns into an abort. Here it is aborted where it would commit
/// and reported committed, and the session then fails as when the broker went
/// away. The next session reads back the gate's last commits and writes again
/// what a reader does not see: the answer arrives once, and the tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_broker_acknowledged_and_lost_is_written_again() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.spawn(&[], &[("STEPGATE_TEST_LOSE_COMMIT_MARKER", "1")]);
    s.wait_ready().await;
    let agent = s.agent();
    let r = agent
        .call(intent("wf-marker", 1, "wire", json!({"amount": 7}), "m1"))
        .await;
    assert_eq!(r.status, Status::Ok, "{r:?}\n{}", s.log_tail(40));
    assert!(!r.deduplicated, "the first answer, not a repeat's: {r:?}");
    assert_lost_commit_written_again(&s).await;
    let m = s.metrics().await;
    assert!(
        !m.contains("stepgate_lost_commit_records_rewritten_total 0"),
        "{m}"
    );
    // A later step of the same partition is answered after anything written
    // for the first (read in order): by then a second answer would show.
    let again = agent
        .call(intent(
            "wf-marker",
            1,
            "wire",
            json!({"amount": 7, "note": "retry"}),
            "m2",
        ))
        .await;
    assert!(again.deduplicated, "{again:?}");
    same_but_call_id(&r, &again);
    assert_eq!(agent.answers("m1").len(), 1, "one answer per call_id");
    assert_eq!(s.tools.count("wire"), 1, "the tool ran once");
}

/// The lost transaction's offset commit held the partition's committed offset
/// where it was (at a keyed step still running, recorded only once settled)
/// and moved only its applied mark, past a repeat it answered. Written again,
/// the offset must carry that mark: with the mark before it, the repeat is
/// read again as new and answered a second time (seen once in
/// `the_broker_killed_under_load`: two identical answers to one repeat).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_that_moved_only_the_applied_mark_is_written_again_with_it() {
    let mut s = Stack::new(StackOptions::default()).await;
    // The second transaction that publishes answers is lost: the first
    // carries s1's.
    s.spawn(&[], &[("STEPGATE_TEST_LOSE_COMMIT_MARKER", "2")]);
    s.wait_ready().await;
    let agent = s.agent();
    let first = agent
        .call(intent("wf-mark", 1, "charge", json!({"cents": 1}), "s1"))
        .await;
    assert_eq!(first.status, Status::Ok, "{first:?}\n{}", s.log_tail(40));
    // A keyed step that runs a while holds the committed offset at its
    // intent; the repeat behind it is answered, and its batch lost.
    s.tools
        .script("charge", vec![Reply::Delay(Duration::from_millis(1200))]);
    agent
        .send(&intent("wf-mark", 2, "charge", json!({"cents": 2}), "a1"))
        .await;
    let repeat = agent
        .call(intent(
            "wf-mark",
            1,
            "charge",
            json!({"cents": 1, "note": "again"}),
            "s2",
        ))
        .await;
    assert!(repeat.deduplicated, "{repeat:?}");
    same_but_call_id(&first, &repeat);
    assert_lost_commit_written_again(&s).await;
    // Read in order: once a later step of the partition is answered, the
    // repeat's intent has been read again and a second answer would show.
    let a1 = agent.answer("a1", Duration::from_secs(30)).await;
    assert_eq!(a1.status, Status::Ok, "{a1:?}");
    let later = agent
        .call(intent("wf-mark", 3, "charge", json!({"cents": 3}), "b1"))
        .await;
    assert_eq!(later.status, Status::Ok, "{later:?}");
    assert_eq!(
        agent.answers("s2").len(),
        1,
        "the repeat answered once:\n{}",
        s.log_tail(60)
    );
    assert_eq!(agent.answers("a1").len(), 1, "a1 answered once");
    assert_eq!(agent.answers("s1").len(), 1, "s1 answered once");
}

/// A topic's `max.message.bytes` lowered below a step record after the gate
/// started: every batch carrying that record is refused. The failures are
/// counted (`stepgate_gate_session_failures_total{reason="record_refused"}`),
/// the gate narrows its batches to one input, and after 3 refusals sets the
/// input aside — dead-lettered and answered `rejected` — so the steps behind
/// it in the partition flow again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_kafka_keeps_refusing_is_counted_and_its_input_set_aside() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let warm = agent
        .call(intent(
            "refused-1",
            0,
            "send_email",
            json!({"subject": "hi"}),
            "r0",
        ))
        .await;
    assert_eq!(warm.status, Status::Ok);
    set_topic_config(
        &s.config.kafka.topics.changelog,
        "max.message.bytes",
        "4096",
    )
    .await;
    // Random text: its step record stays over 4 KiB whatever the compression.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: String = (0..24_000)
        .map(|_| {
            // xorshift64: incompressible enough for any codec.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b"0123456789abcdef"[(x % 16) as usize])
        })
        .collect();
    agent
        .send(&intent(
            "refused-1",
            1,
            "send_email",
            json!({"subject": "big", "body": noise}),
            "r1",
        ))
        .await;
    agent
        .send(&intent(
            "refused-1",
            2,
            "send_email",
            json!({"subject": "small"}),
            "r2",
        ))
        .await;
    let big = agent.answer("r1", Duration::from_secs(120)).await;
    assert_eq!(big.status, Status::Rejected, "{big:?}");
    let e = big.error.unwrap();
    assert_eq!(e.kind, "unprocessable");
    let small = agent.answer("r2", Duration::from_secs(60)).await;
    assert_eq!(small.status, Status::Ok, "the partition goes on: {small:?}");
    assert_eq!(
        s.tools
            .calls("send_email")
            .iter()
            .filter(|c| c.headers.get("stepgate-step-index").map(String::as_str) == Some("1"))
            .count(),
        0,
        "the refused step never started"
    );
    let dlq = s.reader("dlq").wait_for(1, WAIT).await;
    assert_eq!(
        dlq[0].value["reason"], "unprocessable",
        "{:?}",
        dlq[0].value
    );
    assert!(
        dlq[0].value["message"]
            .as_str()
            .unwrap()
            .contains("refused by Kafka"),
        "{:?}",
        dlq[0].value
    );
    let m = s.metrics().await;
    let failures: f64 = m
        .lines()
        .find_map(|l| {
            l.strip_prefix(r#"stepgate_gate_session_failures_total{reason="record_refused"} "#)
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(failures >= 3.0, "refusals counted: {failures}\n{m}");
}
