//! Scale of state: millions of completed step records written into the changelog
//! the way the gate writes them (`Batch::put_step` + `Batch::changelog`), restored
//! by a stepgate started on an empty state directory, then served.

use crate::report::{Row, ScaleRow, StateMemory};
use crate::systems::{self, GroupWatch};
use crate::workload::{self, Agent, Deliveries, Expect, Kind, Rng, Spec, TOOL};
use crate::{Bench, ScaleOpts};
use anyhow::Context as _;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stepgate::contract::{Outcome, StepKey, ToolResult};
use stepgate::state::{Batch, Phase, StateStore, StepRecord};
use stepgate::tools::Category;

pub async fn run(bench: &Bench, opts: &ScaleOpts) -> anyhow::Result<Vec<ScaleRow>> {
    let mut rows = Vec::new();
    for &n in &opts.scale_sizes {
        eprintln!("== scale: {n} step records");
        let row = one(bench, opts, n).await?;
        eprintln!(
            "   load {:.0} s, ready after {:.1} s ({:.0} records/s), RSS {:.0} MiB after restore (RocksDB {:.0}), {:.0} MiB after the flood (RocksDB {:.0}; peak {:.0}), {} in/s",
            row.load_s,
            row.ready_s,
            row.restore_records_per_s,
            row.rss_after_restore_mib,
            row.state_memory_after_restore.total_mib(),
            row.rss_mib,
            row.state_memory.total_mib(),
            row.rss_peak_mib,
            row.intents_per_s
                .map_or("n/a".into(), |r| format!("{r:.0}"))
        );
        rows.push(row);
    }
    Ok(rows)
}

async fn one(bench: &Bench, opts: &ScaleOpts, n: usize) -> anyhow::Result<ScaleRow> {
    let c = &bench.common;
    let slug = format!("scale-{n}");
    let dir = bench.work.join(&slug);
    let prefix = format!("{}-{slug}", bench.run_id);
    let setup = bench.stepgate_setup(&dir, &prefix, "keyed", bench.concurrency())?;
    setup.create_topics(&bench.stepgate).await?;
    bench.tool.take();

    let t = Instant::now();
    let (brokers, topic, parts, scratch) = (
        c.brokers.clone(),
        format!("{prefix}.changelog"),
        c.partitions,
        dir.join("scratch"),
    );
    let records =
        tokio::task::spawn_blocking(move || load(&brokers, &topic, parts, n, &scratch)).await??;
    let load_s = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(dir.join("scratch"));

    let mut proc = setup.spawn(&bench.stepgate, &dir.join("process.log"))?;
    let ready_s = proc
        .wait_http_ready(&setup.ready_url(), Duration::from_secs(3600))
        .await?
        .as_secs_f64();
    let metrics = setup.metrics().await;
    let restored_records = metrics
        .as_ref()
        .map_or(f64::NAN, |m| m.sum("stepgate_state_restored_records_total"));
    let state_memory_after_restore = StateMemory::read(metrics.as_ref());
    let (rss_after_restore_mib, peak_rss_after_restore_mib) = proc.rss_mib();

    // Half repeats of loaded steps, half new steps.
    let mut rng = Rng::new(n as u64);
    let specs: Vec<Spec> = (0..opts.scale_intents)
        .map(|k| {
            if k % 2 == 0 {
                let i = rng.below(n as u64) as usize;
                let (workflow, step) = loaded_step(i);
                Spec {
                    workflow,
                    step,
                    kind: Kind::Loaded,
                }
            } else {
                let j = k / 2;
                Spec {
                    workflow: format!("s-w{}", j % c.workflows.max(1)),
                    step: (j / c.workflows.max(1)) as u64,
                    kind: Kind::First,
                }
            }
        })
        .collect();
    let specs = Arc::new(specs);
    let (input, output) = (format!("{prefix}.intents"), format!("{prefix}.results"));
    let agent = Arc::new(Agent::start(
        &c.brokers,
        &input,
        &output,
        c.partitions,
        Expect::StepLog,
        specs.iter().map(|s| s.kind).collect(),
        "1",
    )?);
    let watch = GroupWatch::new(&c.brokers, &format!("{prefix}-gate"), &input, c.partitions)?;
    let cpu0 = proc.cpu_secs();
    let (a, s) = (agent.clone(), specs.clone());
    let publish = tokio::task::spawn_blocking(move || a.publish(&s, 0, None));
    let end = crate::wait_answers(&agent, &watch, 0..specs.len(), &mut proc, bench.stall()).await;
    publish.await??;
    let cpu = proc.cpu_secs() - cpu0;
    let (through, last) = end?;
    let (rss_mib, rss_peak_mib) = proc.rss_mib();
    // The state-size gauges refresh every 5 s.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let state_memory = StateMemory::read(setup.metrics().await.as_ref());
    let state_disk_mib = dir_bytes(&setup.state) as f64 / (1024.0 * 1024.0);
    proc.stop(Duration::from_secs(60)).await?;

    let t0 = agent.first_sent(0..specs.len()).context("nothing sent")?;
    let flood_s = last.duration_since(t0).as_secs_f64();
    let mut check = Row {
        system: "stepgate".into(),
        mode: "scale".into(),
        slug: "sg-scale".into(),
        eos: true,
        flood_intents: specs.len(),
        intents_per_s: None,
        results_per_s: 0.0,
        flood_latency: Default::default(),
        paced_intents: 0,
        paced_rate: 0.0,
        latency: Default::default(),
        cpu_flood_s: 0.0,
        bench_cpu_flood_s: 0.0,
        broker_cpu_flood_s: 0.0,
        broker_jit_cpu_flood_s: 0.0,
        broker_gc_cpu_flood_s: 0.0,
        flood_s: 0.0,
        cpu_total_s: 0.0,
        rss_mib: 0.0,
        rss_peak_mib: 0.0,
        ready_s: 0.0,
        tool_invocations: Default::default(),
        records_per_intent: Default::default(),
        broker_per_intent: Default::default(),
        gate: None,
        gate_paced: None,
        verdict: agent.verdict(0..specs.len()),
        problems: Vec::new(),
    };
    let new_steps = specs.iter().filter(|s| s.kind == Kind::First).count();
    check.check(Expect::StepLog, new_steps, &bench.tool.take());
    let flood_latency = agent.latency(0..specs.len());
    drop(agent);
    if !c.keep {
        systems::delete_topics(&c.brokers, &setup.topics()).await;
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(ScaleRow {
        steps: n,
        changelog_records: records,
        load_s,
        ready_s,
        restored_records,
        restore_records_per_s: restored_records / ready_s,
        rss_after_restore_mib,
        peak_rss_after_restore_mib,
        state_memory_after_restore,
        intents: specs.len(),
        intents_per_s: through.map(|t| specs.len() as f64 / t.duration_since(t0).as_secs_f64()),
        results_per_s: specs.len() as f64 / flood_s,
        cpu_us_per_intent: cpu * 1e6 / specs.len() as f64,
        flood_latency,
        rss_mib,
        rss_peak_mib,
        state_memory,
        state_disk_mib,
        problems: check.problems,
    })
}

/// The step key of loaded record `i`: ten steps per workflow.
fn loaded_step(i: usize) -> (String, u64) {
    (format!("L-w{}", i / 10), (i % 10) as u64)
}

/// Write `n` completed step records into the changelog, partitioned as their
/// intents are. Returns the number of changelog records.
fn load(
    brokers: &str,
    topic: &str,
    partitions: i32,
    n: usize,
    scratch: &Path,
) -> anyhow::Result<usize> {
    // `put_step` reads the previous record through a store: an empty scratch one.
    let store = StateStore::open(scratch)?;
    let producer: ThreadedProducer<Deliveries> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "50")
        .set("batch.size", "1000000")
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "1000000")
        .create_with_context(Deliveries::default())?;
    let completed_at = chrono::Utc::now();
    let mut records = 0;
    let started = Instant::now();
    for chunk in (0..n).step_by(10_000) {
        let mut batch = Batch::default();
        for i in chunk..(chunk + 10_000).min(n) {
            let (workflow_id, step_index) = loaded_step(i);
            let partition = workload::partition_of(&workflow_id, partitions);
            let step = StepKey {
                workflow_id,
                step_index,
                tool: TOOL.into(),
                attempt: 0,
            };
            batch.put_step(&store, partition, &record(step, i, completed_at))?;
        }
        for e in batch.changelog() {
            let mut rec: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic)
                .key(e.key.as_slice())
                .partition(e.partition);
            if let Some(v) = &e.value {
                rec = rec.payload(v.as_slice());
            }
            workload::send_waiting(&producer, rec).context("loading the changelog")?;
            records += 1;
        }
        let done = (chunk + 10_000).min(n);
        if done % 1_000_000 == 0 {
            eprintln!(
                "   loaded {done} steps ({records} changelog records) in {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
    }
    producer.flush(Duration::from_secs(300))?;
    let failed = producer.context().failed();
    anyhow::ensure!(failed == 0, "{failed} changelog records were not delivered");
    Ok(records)
}

fn record(step: StepKey, i: usize, at: chrono::DateTime<chrono::Utc>) -> StepRecord {
    let call_id = Some(format!("L-call-{i}"));
    let result = ToolResult::from_outcome(
        &step,
        call_id.clone(),
        Outcome::Ok {
            output: serde_json::json!({}),
        },
        at,
    );
    let arguments = serde_json::json!({"to": format!("{}@example.com", step.workflow_id), "subject": format!("Order {} confirmed", step.step_index)});
    let at_ms = at.timestamp_millis();
    StepRecord {
        call_id,
        started_at_ms: Some(at_ms),
        result: Some(result),
        ..StepRecord::new(
            step,
            Category::Keyed,
            Phase::Completed,
            stepgate::contract::Arguments::try_from(arguments).expect("an object"),
            0,
            at_ms,
            // Far beyond the run: nothing is purged while it is measured.
            at_ms + 30 * 86_400_000,
        )
    }
}

fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
