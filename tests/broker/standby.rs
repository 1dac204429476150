//! Standby replicas (`gate.standby_replicas`, docs/design.md "Standby
//! replicas"): two gates, each keeping a warm copy of the other's
//! partitions; one is killed mid-flood, and the other takes its partitions
//! over from its copies — reading only the changelog's tail, not restoring
//! from the start — with nothing lost and no effect twice, counted at the
//! tool.

use crate::common;

use common::load::*;
use common::processes::*;
use common::*;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use stepgate::contract::partition_for;

fn options(replicas: usize) -> StackOptions {
    StackOptions {
        tools: vec![(UNKEYED, "unkeyed", "3s"), (KEYED, "keyed", "3s")],
        // The broker's group.min.session.timeout.ms is 6 s.
        session_timeout: "6s",
        grace: "2s",
        configure: if replicas == 0 { none } else { one },
        ..StackOptions::default()
    }
}

fn none(c: &mut stepgate::config::Config) {
    c.gate.standby_replicas = 0;
}

fn one(c: &mut stepgate::config::Config) {
    c.gate.standby_replicas = 1;
}

/// The partitions a gate keeps a standby copy of, caught up (lag 0).
async fn warm(g: &Gate) -> BTreeSet<i32> {
    let standby = g.per_partition("stepgate_partition_standby").await;
    let lag = g
        .per_partition("stepgate_partition_standby_lag_records")
        .await;
    standby
        .into_iter()
        .filter(|(p, v)| *v >= 1.0 && lag.get(p) == Some(&0.0))
        .map(|(p, _)| p)
        .collect()
}

/// What [`kill_one_of_two`] saw.
struct Takeover {
    /// The heir's full restores after the kill.
    full: f64,
    /// Changelog records the heir restored after the kill.
    restored: f64,
    /// Seconds from the kill to answers on the moved partitions.
    resumed: f64,
    /// The heir's log lines about partitions, restores and standbys.
    log: String,
}

/// Two gates under a steady flood; the one owning more partitions is
/// SIGKILLed.
async fn kill_one_of_two(replicas: usize) -> Takeover {
    let _serial = common::FAULTS.lock().await;
    let s = Stack::new(options(replicas)).await;
    tool_delay(&s);
    let mut gates: Vec<Gate> = ["a", "b"].iter().map(|n| Gate::start(&s, n)).collect();
    for g in &gates {
        wait_ready(&g.http).await;
    }
    let results = s.agent().results;
    let mut load = Load::start(&s.config.kafka.brokers, &s.topic("intents"), "sb");
    warm_up(&load, &results).await;
    let all: BTreeSet<i32> = (0..PARTITIONS).collect();
    assert!(
        wait_until(WAIT, || {
            gates.iter().flat_map(Gate::owned).collect::<BTreeSet<_>>() == all
        })
        .await,
        "every partition owned:\n{}",
        partition_lines(&gates)
    );
    let victim = (0..gates.len())
        .max_by_key(|i| gates[*i].owned().len())
        .unwrap();
    let heir = 1 - victim;
    let moved = gates[victim].owned();
    if replicas > 0 {
        // The heir holds the victim's partitions warm before the kill.
        let deadline = Instant::now() + WAIT;
        loop {
            let w = warm(&gates[heir]).await;
            if moved.is_subset(&w) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "gate {} keeps no caught-up copy of {moved:?} (has {w:?}):\n{}",
                gates[heir].name,
                partition_lines(&gates)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let full_before = gates[heir]
        .metric("stepgate_state_full_restores_total")
        .await
        .unwrap_or(0.0);
    let restored_before = gates[heir]
        .metric("stepgate_state_restored_records_total")
        .await
        .unwrap_or(0.0);
    let in_flight_at_fault = in_flight(&load, &results);
    let killed_at = Instant::now();
    gates[victim].sigkill();
    assert!(
        answered_after(&load, &results, killed_at, 20, |c| moved
            .contains(&partition_for(&c.wf, PARTITIONS))
            && c.sent >= killed_at)
        .await,
        "the moved partitions are served again:\n{}",
        partition_lines(&gates)
    );
    let resumed_after = killed_at.elapsed().as_secs_f64();
    assert_eq!(gates[heir].owned(), all, "the heir owns every partition");
    let full_after = gates[heir]
        .metric("stepgate_state_full_restores_total")
        .await
        .unwrap_or(0.0);
    let restored_after = gates[heir]
        .metric("stepgate_state_restored_records_total")
        .await
        .unwrap_or(0.0);
    let mut sum = settle(
        &format!("one of two gates SIGKILLed mid-flood, standby_replicas = {replicas}"),
        &s,
        &mut load,
        &results,
        in_flight_at_fault,
        killed_at,
    )
    .await;
    sum.running = gates[heir].alive();
    sum.extra = format!(
        "{}; partitions {moved:?} answered again {resumed_after:.1} s after the kill; on the heir: {} full restores, {} changelog records restored",
        sum.extra,
        full_after - full_before,
        restored_after - restored_before
    );
    sum.print_and_assert();
    let heir_log: Vec<String> = gates[heir]
        .log()
        .lines()
        .map(strip_ansi)
        .filter(|l| !connection_noise(l))
        .filter(|l| {
            [
                "partition",
                "fence",
                "standby",
                "restor",
                "committed",
                "session",
                "hanging",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect();
    Takeover {
        full: full_after - full_before,
        restored: restored_after - restored_before,
        resumed: resumed_after,
        log: heir_log[heir_log.len().saturating_sub(40)..].join("\n"),
    }
}

/// With a standby on the other gate, the killed gate's partitions are taken
/// over from the copies: no restore from the changelog's start, answers
/// again within the session timeout (6 s) and a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_killed_mid_flood_is_taken_over_from_its_standby() {
    let t = kill_one_of_two(1).await;
    assert_eq!(
        t.full, 0.0,
        "taken over from the standby copies, not restored from the start:\n{}",
        t.log
    );
    assert!(
        t.resumed < 6.0 + 5.0,
        "answers resumed {:.1} s after the kill (session timeout 6 s):\n{}",
        t.resumed,
        t.log
    );
}

/// Without standbys the same kill makes the heir read the moved partitions'
/// changelog before serving them: from its start, or from where the heir's
/// own copy stopped when it last held them (the gates start together, so
/// either may have owned every partition for a moment). The comparison for
/// the test above; nothing lost or doubled either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_standby_the_takeover_restores_from_the_changelog() {
    let t = kill_one_of_two(0).await;
    assert!(
        t.restored >= 1.0,
        "the heir restored {} records ({} full restores):\n{}",
        t.restored,
        t.full,
        t.log
    );
}
