//! Scale of state: millions of completed step records written into the changelog
//! the way the gate writes them (`Batch::put_step` + `Batch::changelog`), restored
//! by a stepgate started on an empty state directory, then served. Then
//! failover at that size (docs/design.md "Restart after a crash", "Standby
//! replicas"), side by side: the gate `kill -9`ed and started again on the
//! same disk (start → ready); and a second gate taking the killed gate's
//! partitions over under a trickle of new steps (kill → first answer there to
//! a step published after the kill), once with a standby copy of them
//! (`gate.standby_replicas`, the default 1) and once without (`0`).

use crate::report::{Failover, Row, ScaleRow, StateMemory};
use crate::systems::{self, GroupWatch, Proc, StepgateSetup};
use crate::workload::{self, Agent, Deliveries, Expect, Kind, Rng, Spec, TOOL};
use crate::{Bench, ScaleOpts};
use anyhow::Context as _;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
        if let Some(f) = &row.failover {
            eprintln!(
                "   failover at {n} steps (session timeout {:.0} s): ready on an empty disk {:.1} s | after kill -9, same disk {:.1} s ({} full restores) | answers resumed on the killed gate's partitions by a second gate with a standby {} | without one {}",
                f.session_timeout_s,
                row.ready_s,
                f.restart_ready_s,
                f.restart_full_restores,
                secs(f.standby_resumed_s),
                secs(f.cold_resumed_s),
            );
        }
        rows.push(row);
    }
    Ok(rows)
}

fn secs(s: Option<f64>) -> String {
    s.map_or("(no answer)".into(), |s| format!("{s:.1} s"))
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
    // The workload's tool calls, before the failover's trickle adds its own.
    let invocations = bench.tool.take();

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
    check.check(Expect::StepLog, new_steps, &invocations);
    let flood_latency = agent.latency(0..specs.len());
    // The workload is checked: the failover's trickle answers on the same
    // results topic match none of its intents.
    drop(agent);
    let failover = match failover(bench, &setup, &dir, proc).await {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("   failover run failed: {e:#}");
            None
        }
    };
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
        failover,
    })
}

async fn failover(
    bench: &Bench,
    setup: &StepgateSetup,
    dir: &Path,
    mut a: Proc,
) -> anyhow::Result<Failover> {
    let c = &bench.common;
    let session_timeout_s = stepgate::config::Config::load(Some(&setup.config), Vec::new())
        .map(|k| k.kafka.session_timeout.0.as_secs_f64())
        .unwrap_or(f64::NAN);
    // 1. kill -9, and start again on the same disk.
    eprintln!("   failover: kill -9 and restart on the same disk");
    a.kill9().await;
    let mut a = setup.spawn(&bench.stepgate, &dir.join("process-restart.log"))?;
    let restart_ready_s = a
        .wait_http_ready(&setup.ready_url(), Duration::from_secs(3600))
        .await?
        .as_secs_f64();
    let restart_full_restores = setup
        .metrics()
        .await
        .map_or(f64::NAN, |m| m.sum("stepgate_state_full_restores_total"));

    let trickle = Trickle::start(
        &c.brokers,
        &setup_topic(setup, "intents")?,
        &setup_topic(setup, "results")?,
        c.partitions,
    )?;

    // 2. A second gate with standby copies (the default) takes over.
    eprintln!("   failover: a second gate joins, keeps standby copies, and takes over");
    let b = other(setup, dir, "b", 1, None)?;
    let (standby_resumed_s, standby_restored_records) =
        take_over(bench, setup, a, &b, &trickle, true).await?;
    // 3. Again without standbys: the victim on its disk, an heir on an empty one.
    eprintln!("   failover: again without standby replicas");
    let a0 = other(setup, dir, "a0", 0, Some(setup))?;
    let a = a0.spawn(&bench.stepgate, &dir.join("process-a0.log"))?;
    let c0 = other(setup, dir, "c0", 2, None)?;
    c0.add_keys("gate", &["standby_replicas = 0".into()])?;
    let (cold_resumed_s, cold_restored_records) =
        take_over(bench, &a0, a, &c0, &trickle, false).await?;
    trickle.stop();
    Ok(Failover {
        session_timeout_s,
        restart_ready_s,
        restart_full_restores,
        standby_resumed_s,
        cold_resumed_s,
        standby_restored_records,
        cold_restored_records,
    })
}

/// Another gate of the deployment: instance `-{instance}`, its own HTTP port
/// and state directory (`name`), or `victim`'s state directory and instance.
fn other(
    setup: &StepgateSetup,
    dir: &Path,
    name: &str,
    instance: usize,
    victim: Option<&StepgateSetup>,
) -> anyhow::Result<StepgateSetup> {
    let text = std::fs::read_to_string(&setup.config)?;
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub)?;
    let http = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port()
    );
    let state = match victim {
        Some(v) => v.state.clone(),
        None => sub.join("state"),
    };
    let mut out = String::new();
    for line in text.lines() {
        let l = line.trim_start();
        if l.starts_with("instance_id = ") && victim.is_none() {
            let id = l.trim_start_matches("instance_id = ").trim_matches('"');
            let base = id.rsplit_once('-').map_or(id, |(b, _)| b);
            out.push_str(&format!("instance_id = \"{base}-{instance}\"\n"));
        } else if l.starts_with("path = ") {
            out.push_str(&format!("path = \"{}\"\n", state.display()));
        } else if l.starts_with("listen = ") {
            out.push_str(&format!("listen = \"{http}\"\n"));
        } else if l.starts_with("level = ") {
            // What a takeover did (fenced, restored, from where) is logged at info.
            out.push_str("level = \"info\"\n");
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    let config = sub.join("stepgate.toml");
    std::fs::write(&config, out)?;
    let s = StepgateSetup {
        config,
        http,
        state,
        remote_executor: false,
        commit_interval: None,
    };
    if victim.is_some() {
        s.add_keys("gate", &["standby_replicas = 0".into()])?;
    }
    Ok(s)
}

fn setup_topic(setup: &StepgateSetup, which: &str) -> anyhow::Result<String> {
    let c = stepgate::config::Config::load(Some(&setup.config), Vec::new())?;
    Ok(match which {
        "intents" => c.kafka.topics.intents,
        _ => c.kafka.topics.results,
    })
}

/// A standby copy this close to its changelog's end (records and markers) is
/// in sync for the takeover: what it reads then is reported beside the time.
const IN_SYNC_LAG: f64 = 100.0;

/// `victim` runs; `heir` joins; once the heir is ready (and, `warm`, holds
/// caught-up standby copies of the victim's partitions) the victim is
/// killed. Returns (kill → first answer on its partitions to a step
/// published after the kill, records the heir restored meanwhile).
async fn take_over(
    bench: &Bench,
    victim_setup: &StepgateSetup,
    mut victim: Proc,
    heir_setup: &StepgateSetup,
    trickle: &Trickle,
    warm: bool,
) -> anyhow::Result<(Option<f64>, f64)> {
    victim
        .wait_http_ready(&victim_setup.ready_url(), Duration::from_secs(3600))
        .await?;
    let log = heir_setup.config.with_file_name("process.log");
    let mut heir = heir_setup.spawn(&bench.stepgate, &log)?;
    heir.wait_http_ready(&heir_setup.ready_url(), Duration::from_secs(3600))
        .await?;
    // Both serve: the victim's partitions are those the heir does not own.
    let deadline = Instant::now() + Duration::from_secs(3600);
    let theirs = loop {
        let (v, h) = (
            gauge(victim_setup, "stepgate_partition_ready").await,
            gauge(heir_setup, "stepgate_partition_ready").await,
        );
        let mine: BTreeSet<i32> = v
            .iter()
            .filter(|(_, r)| **r >= 1.0)
            .map(|(p, _)| *p)
            .collect();
        let heirs: BTreeSet<i32> = h
            .iter()
            .filter(|(_, r)| **r >= 1.0)
            .map(|(p, _)| *p)
            .collect();
        let standby_ok = if warm {
            // In sync: within the trickle's last few transactions of the end.
            // The lag is a snapshot (every 15 s) while the trickle writes, so
            // an exact 0 on every partition at once may never be seen.
            let sb = gauge(heir_setup, "stepgate_partition_standby").await;
            let lag = gauge(heir_setup, "stepgate_partition_standby_lag_records").await;
            mine.iter()
                .all(|p| sb.get(p) == Some(&1.0) && lag.get(p).is_some_and(|l| *l <= IN_SYNC_LAG))
        } else {
            true
        };
        let all =
            mine.union(&heirs).count() == usize::try_from(bench.common.partitions).unwrap_or(0);
        if !mine.is_empty() && !heirs.is_empty() && mine.is_disjoint(&heirs) && all && standby_ok {
            break mine;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the two gates never split the partitions"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let before = heir_setup
        .metrics()
        .await
        .map_or(0.0, |m| m.sum("stepgate_state_restored_records_total"));
    // Steps are flowing to every partition.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed = Instant::now();
    victim.kill9().await;
    let resumed = loop {
        if let Some(d) = trickle.first_answer_after(killed, &theirs) {
            break Some(d.as_secs_f64());
        }
        if killed.elapsed() > Duration::from_secs(600) {
            break None;
        }
        heir.check_alive()?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let after = heir_setup
        .metrics()
        .await
        .map_or(0.0, |m| m.sum("stepgate_state_restored_records_total"));
    heir.stop(Duration::from_secs(60)).await?;
    Ok((resumed, after - before))
}

/// A per-partition gauge of a gate's /metrics.
async fn gauge(setup: &StepgateSetup, name: &str) -> BTreeMap<i32, f64> {
    let Some(m) = setup.metrics().await else {
        return BTreeMap::new();
    };
    let prefix = format!("{name}{{partition=\"");
    m.0.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (p, v) = rest.split_once("\"} ")?;
            Some((p.parse().ok()?, v.trim().parse().ok()?))
        })
        .collect()
}

/// New steps on every partition, a few hundred a second, and when each was
/// answered: a gate's partitions are served again when a step published
/// after it was killed is answered there.
struct Trickle {
    sent: Arc<Mutex<Vec<(Instant, i32)>>>,
    answered: Arc<Mutex<BTreeMap<usize, Instant>>>,
    stop: Arc<AtomicBool>,
}

const TRICKLE_PER_S: u64 = 200;

impl Trickle {
    fn start(
        brokers: &str,
        intents: &str,
        results: &str,
        partitions: i32,
    ) -> anyhow::Result<Trickle> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::message::Message;
        let producer: ThreadedProducer<Deliveries> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("linger.ms", "0")
            .set("acks", "all")
            .create_with_context(Deliveries::default())?;
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("{results}-failover-reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "5")
            .create()?;
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(results, p, rdkafka::Offset::End)?;
        }
        consumer.assign(&tpl)?;
        let t = Trickle {
            sent: Default::default(),
            answered: Default::default(),
            stop: Default::default(),
        };
        let (answered, stop) = (t.answered.clone(), t.stop.clone());
        std::thread::spawn(move || {
            #[derive(serde::Deserialize)]
            struct A<'a> {
                #[serde(borrow)]
                call_id: Option<&'a str>,
            }
            while !stop.load(Ordering::Relaxed) {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                    let at = Instant::now();
                    let n = m
                        .payload()
                        .and_then(|p| serde_json::from_slice::<A>(p).ok())
                        .and_then(|a| a.call_id?.strip_prefix("fo-")?.parse::<usize>().ok());
                    if let Some(n) = n {
                        answered
                            .lock()
                            .expect("not poisoned")
                            .entry(n)
                            .or_insert(at);
                    }
                }
            }
        });
        let (sent, stop, topic) = (t.sent.clone(), t.stop.clone(), intents.to_owned());
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let wf = format!("fo-w{}", n % 1000);
                let p = workload::partition_of(&wf, partitions);
                let body = format!(
                    r#"{{"workflow_id":"{wf}","step_index":{step},"tool":"{TOOL}","arguments":{{"n":{n}}},"call_id":"fo-{n}"}}"#,
                    step = n / 1000
                );
                sent.lock().expect("not poisoned").push((Instant::now(), p));
                let rec = BaseRecord::to(&topic)
                    .key(wf.as_str())
                    .payload(body.as_str())
                    .partition(p);
                if workload::send_waiting(&producer, rec).is_err() {
                    break;
                }
                n += 1;
                let due = started + Duration::from_micros(n as u64 * 1_000_000 / TRICKLE_PER_S);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let _ = producer.flush(Duration::from_secs(10));
        });
        Ok(t)
    }

    /// Kill → the first answer to a step of `parts` published after the kill.
    fn first_answer_after(&self, killed: Instant, parts: &BTreeSet<i32>) -> Option<Duration> {
        let sent = self.sent.lock().expect("not poisoned");
        let answered = self.answered.lock().expect("not poisoned");
        answered
            .iter()
            .filter(|(n, _)| {
                sent.get(**n)
                    .is_some_and(|(at, p)| *at >= killed && parts.contains(p))
            })
            .map(|(_, at)| at.duration_since(killed))
            .min()
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
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
