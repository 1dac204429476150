//! The sequential mode: one agent, one call at a time, nothing else running.
//! Each system gets a fresh deployment; after a few warm-up calls (group joins,
//! first transactions), `n` new steps one after the other, then `n` repeats of
//! them (settled, answered from the record), each timed publish → answer (the
//! agent's read_committed consume). For stepgate it also counts the commits
//! between a call's publish and its answer, from /metrics, and the Kafka records
//! each call wrote.

use crate::report::{self, SeqRow};
use crate::systems::{self, Metrics};
use crate::workload::{Agent, Kind, Spec};
use crate::{Bench, CompareOpts, System};
use anyhow::{Context as _, bail};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Calls before the timed ones, not counted.
const WARMUP: usize = 10;

/// /metrics series counting the gate's commits (one per batch).
const COMMITS: &str = "stepgate_commit_latency_seconds_count";

pub async fn run(
    bench: &Bench,
    opts: &CompareOpts,
    systems: &[System],
) -> anyhow::Result<Vec<SeqRow>> {
    let mut rows = Vec::new();
    for system in systems {
        eprintln!("== sequential: {system:?}");
        let row = one(bench, opts, system).await?;
        eprintln!(
            "   new step p50 {:.1} ms p99 {:.1} ms, repeat p50 {:.1} ms p99 {:.1} ms{}, {}",
            row.new.p50,
            row.new.p99,
            row.repeat.p50,
            row.repeat.p99,
            row.commits_per_new
                .map_or(String::new(), |c| format!(", {c:.2} commits per new step")),
            row.check_text()
        );
        rows.push(row);
    }
    Ok(rows)
}

async fn one(bench: &Bench, opts: &CompareOpts, system: &System) -> anyhow::Result<SeqRow> {
    let c = &bench.common;
    let n = opts.sequential;
    let slug = format!("{}-seq", system.slug());
    bench.tool.take();
    let mut d = crate::deploy(bench, opts, system, &slug).await?;

    // Warm-up steps, n new steps over 16 workflows (so every partition takes
    // some), then n repeats of the new steps in the same order.
    let first = |i: usize| Spec {
        workflow: format!("q-w{}", i % 16),
        step: (i / 16) as u64,
        kind: Kind::First,
    };
    let mut specs: Vec<Spec> = (0..WARMUP)
        .map(|i| Spec {
            workflow: format!("q-warm{i}"),
            step: 0,
            kind: Kind::First,
        })
        .collect();
    specs.extend((0..n).map(first));
    specs.extend((0..n).map(|i| Spec {
        kind: Kind::Repeat,
        ..first(i)
    }));
    let new = WARMUP..WARMUP + n;
    let repeats = WARMUP + n..WARMUP + 2 * n;
    let expect = system.expect();
    let agent = Agent::start(
        &c.brokers,
        &d.input,
        &d.output,
        c.partitions,
        expect,
        specs.iter().map(|s| s.kind).collect(),
        "0",
    )?;

    let records = |topics: &[String]| {
        tokio::task::block_in_place(|| systems::topic_records(&c.brokers, topics))
    };
    let mut snapshots = Vec::new();
    let mut commits_new = Some(0.0);
    let mut commits_repeat = Some(0.0);
    for (i, spec) in specs.iter().enumerate() {
        if i == new.start || i == repeats.start {
            snapshots.push(records(&d.topics));
        }
        let before = commits(&d).await;
        tokio::task::block_in_place(|| agent.publish(std::slice::from_ref(spec), i, None))?;
        wait_one(&agent, i, &mut d.proc, bench.stall()).await?;
        let after = commits(&d).await;
        let sum = if new.contains(&i) {
            &mut commits_new
        } else if repeats.contains(&i) {
            &mut commits_repeat
        } else {
            continue;
        };
        *sum = match (*sum, before, after) {
            (Some(s), Some(b), Some(a)) => Some(s + a - b),
            _ => None,
        };
    }
    snapshots.push(records(&d.topics));
    // Late duplicates, if any, still arrive briefly.
    tokio::time::sleep(Duration::from_millis(500)).await;
    d.proc.stop(Duration::from_secs(60)).await?;

    let per_step = |from: &BTreeMap<String, i64>, to: &BTreeMap<String, i64>| {
        to.iter()
            .map(|(t, end)| {
                let short = t
                    .strip_prefix(&format!("{}-{slug}", bench.run_id))
                    .unwrap_or(t)
                    .trim_start_matches(['.', '-'])
                    .to_owned();
                let delta = end - from.get(t).copied().unwrap_or(0);
                (short, delta as f64 / n as f64)
            })
            .collect::<BTreeMap<_, _>>()
    };
    let verdict = agent.verdict(0..specs.len());
    let tool = bench.tool.take();
    let distinct = specs.iter().filter(|s| s.kind == Kind::First).count();
    let eos = !matches!(
        system,
        System::Passthrough { eos: false, .. } | System::KStreams { eos: false, .. }
    );
    let problems = report::problems(&verdict, eos, &slug, expect, distinct, &tool);
    let row = SeqRow {
        system: system.name(),
        mode: system.mode(),
        slug: slug.clone(),
        steps: n,
        warmup: WARMUP,
        new: agent.latency(new),
        repeat: agent.latency(repeats),
        commits_per_new: commits_new.map(|s| s / n as f64),
        commits_per_repeat: commits_repeat.map(|s| s / n as f64),
        commits_counted: d.stepgate.as_ref().map(|s| {
            if s.remote_executor {
                "the gate's transactions only: this build's executor commits its own (started, then the outcome), which /metrics does not count".into()
            } else {
                "every transaction of the gate".into()
            }
        }),
        commit_interval: d.stepgate.as_ref().map(|s| {
            s.commit_interval
                .clone()
                .unwrap_or_else(|| "none (pipelined)".into())
        }),
        records_per_new: per_step(&snapshots[0], &snapshots[1]),
        records_per_repeat: per_step(&snapshots[1], &snapshots[2]),
        tool_invocations: tool,
        verdict,
        problems,
    };
    drop(agent);
    if !c.keep {
        systems::delete_topics(&c.brokers, &d.topics).await;
    }
    Ok(row)
}

/// stepgate's commits so far (None for the other systems).
async fn commits(d: &crate::Deployed) -> Option<f64> {
    let m: Metrics = d.stepgate.as_ref()?.metrics().await?;
    Some(m.sum(COMMITS))
}

/// Wait for the answer to intent `i`.
async fn wait_one(
    agent: &Agent,
    i: usize,
    proc: &mut systems::Proc,
    stall: Duration,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if agent.progress(i..i + 1).0 == 1 {
            return Ok(());
        }
        if start.elapsed() > stall {
            bail!(
                "{}: intent c{i} not answered after {stall:?} (sequential mode); log {}:\n{}",
                proc.name,
                proc.log.display(),
                systems::tail(&proc.log, 20)
            );
        }
        proc.check_alive()
            .with_context(|| format!("waiting for the answer to c{i}"))?;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
