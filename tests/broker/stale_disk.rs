//! A gate that comes back with an old disk (issue #29, "a stale cache is never
//! trusted"), against a real Kafka broker (`KAFKA_BROKERS`, default
//! 127.0.0.1:9092).
//!
//! Gate A stops holding a `started` step on its disk; gate B (another disk)
//! settles the step, its retention purges it, and the changelog's compaction
//! removes the tombstone. A comes back on its old disk. Resuming from its local
//! offset, it would never read that the step was settled and purged: its
//! deadline would run the step again and answer its `call_id` a second time.

use crate::common;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};
use stepgate::contract::Status;

/// The step gate A leaves `started` on its disk.
const STALE_WF: &str = "wf-stale-disk-c1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_back_with_an_old_disk_neither_reruns_nor_answers_again_a_step_purged_meanwhile() {
    let mut s = Stack::new(StackOptions {
        tools: vec![
            ("charge", "keyed", "2s"),
            // Longer than B's drain: B stops with its call running.
            ("wire", "unkeyed", "10s"),
            ("send_email", "keyed", "5s"),
        ],
        grace: "1s",
        configure: |c| {
            // One partition: every step below shares one changelog partition.
            c.kafka.partitions = 1;
            c.state.retention = dur("4s");
            c.state.purge_interval = dur("300ms");
            c.executor.drain_timeout = dur("1s");
        },
        ..StackOptions::default()
    })
    .await;
    // A changelog whose compaction removes tombstones within seconds (the
    // default keeps them 24 h): segments roll at once, any dirt is cleanable.
    let changelog = s.topic("changelog");
    for (name, value) in [
        ("segment.ms", "200"),
        ("delete.retention.ms", "200"),
        ("min.cleanable.dirty.ratio", "0.01"),
        ("min.compaction.lag.ms", "0"),
    ] {
        set_topic_config(&changelog, name, value).await;
    }
    // A's call never returns; B's re-run (with the same key) succeeds.
    s.tools.script(
        "charge",
        vec![Reply::Delay(Duration::from_secs(600)), Reply::Ok],
    );
    s.tools
        .script("wire", vec![Reply::Delay(Duration::from_secs(600))]);

    // Gate A records the step `started` and invokes it; stopped (SIGTERM)
    // with the call still running, it keeps the record `started` on its disk.
    s.start().await;
    let agent = s.agent();
    // Over 4 KiB: a keyed step recorded `started` before its call (a small
    // one's intent is held instead, and re-read), which the stale disk this
    // test needs holds.
    let pad = "x".repeat(5 * 1024);
    agent
        .send(&intent(
            STALE_WF,
            0,
            "charge",
            json!({"amount": 1, "pad": pad}),
            "c1",
        ))
        .await;
    eventually(Duration::from_secs(30), "A invokes the step", || {
        s.tools.count("charge") == 1
    })
    .await;
    let status = s.terminate().await;
    assert!(status.success(), "{status}: {}", s.log_tail(40));

    // Gate B, on another disk, restores the step, re-runs it with its key at
    // its deadline and answers it.
    let b_http = format!("127.0.0.1:{}", free_port());
    let mut gate_b = s.spawn_other("b", &b_http, &[]);
    wait_ready(&b_http).await;
    let first = agent.answer("c1", Duration::from_secs(60)).await;
    assert_eq!(first.status, Status::Ok, "{first:?}");
    assert_eq!(s.tools.count("charge"), 2, "B re-ran it with its key");

    // The step's retention ends: B purges it (a tombstone on the changelog),
    // and compaction removes the tombstone. Other steps keep the partition
    // dirty, so the cleaner comes back to it.
    let brokers = s.config.kafka.brokers.clone();
    let started = Instant::now();
    let mut tombstoned = false;
    let mut n = 0;
    loop {
        let records = changelog_values(&brokers, &changelog, STALE_WF).await;
        tombstoned |= records.iter().any(Option::is_none);
        if tombstoned && records.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "the step's records were not compacted away (tombstoned: {tombstoned}, left: {records:?}):\n{}",
            s.other_log("b")
        );
        n += 1;
        agent
            .send(&intent(
                &format!("wf-stale-disk-fill-{n}"),
                0,
                "send_email",
                json!({"n": n}),
                &format!("fill-{n}"),
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A step B leaves `started` when it stops (its call outlasts B's drain):
    // once A is back, A settles it (`in_doubt`) at its deadline, which is
    // later than the purged step's — the sign that A's deadlines have run.
    agent
        .send(&intent(
            "wf-stale-disk-sentinel",
            0,
            "wire",
            json!({}),
            "s1",
        ))
        .await;
    eventually(Duration::from_secs(30), "B invokes the sentinel", || {
        s.tools.count("wire") == 1
    })
    .await;
    terminate_other(&mut gate_b).await;
    assert!(
        agent.answers("s1").is_empty(),
        "B settled the sentinel itself:\n{}",
        s.other_log("b")
    );

    // Gate A comes back on its old disk.
    s.start().await;
    let sentinel = agent.answer("s1", Duration::from_secs(90)).await;
    assert_eq!(sentinel.status, Status::InDoubt, "{sentinel:?}");
    // One more round trip through A (two commits) after the deadlines that
    // settled the sentinel: a re-run they started has reached the tool.
    let probe = agent
        .call(intent(
            "wf-stale-disk-probe",
            0,
            "send_email",
            json!({}),
            "p1",
        ))
        .await;
    assert_eq!(probe.status, Status::Ok, "{probe:?}");
    assert_eq!(
        s.tools.count("charge"),
        2,
        "the step purged meanwhile was run again by the gate back on its old disk:\n{}",
        s.log_tail(60)
    );
    assert_eq!(
        agent.answers("c1").len(),
        1,
        "c1 answered twice:\n{}",
        s.log_tail(60)
    );
    s.assert_logged(
        "not known to be contiguous with its changelog",
        "the gate did not trust its old disk",
    );
}

/// SIGTERM another gate of the stack and wait for its exit.
async fn terminate_other(child: &mut std::process::Child) {
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no exit 60 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
