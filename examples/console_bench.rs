//! The console's cost: its memory and start time with N steps in the
//! changelog (default 1 000 000), against a real broker (`KAFKA_BROKERS`,
//! default 127.0.0.1:9092).
//!
//! It writes N step records to a fresh changelog topic as a gate would
//! (through `state::Batch`, so the keys and encoding are the gate's): 10 steps
//! per workflow, three tools, a few in doubt and held for approval. Then it
//! starts the `stepgate` binary beside this example (`stepgate console`),
//! times it until `/readyz` (every topic read to its end), and reads the
//! process's resident memory (VmRSS, and its peak VmHWM) and the time of an
//! overview, an Inbox and a timeline page.
//!
//! ```sh
//! bash deploy/local/kafka.sh start
//! cargo build --release --bin stepgate --example console_bench
//! target/release/examples/console_bench 1000000
//! ```

use anyhow::Context as _;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use std::time::{Duration, Instant};
use stepgate::config::{Config, TopicsConfig};
use stepgate::contract::{Outcome, StepKey, ToolResult};
use stepgate::state::{Batch, Phase, StateStore, StepRecord};
use stepgate::tools::Category;

const TOKEN: &str = "console-bench-token-0001";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.replace('_', "").parse())
        .transpose()
        .context("the number of steps")?
        .unwrap_or(1_000_000);
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let prefix = format!("cbench{}", chrono::Utc::now().timestamp());
    let mut cfg = Config::default();
    cfg.kafka.brokers = brokers;
    cfg.kafka.topics = TopicsConfig::with_prefix(&prefix);
    cfg.kafka.gate_group = format!("{prefix}-gate");
    cfg.console = toml::from_str(&format!(
        "roles = {{ bench = \"viewer\" }}\ntokens = [{{ name = \"bench\", token = \"{TOKEN}\" }}]\n"
    ))?;
    stepgate::kafka::create_topics(&cfg.kafka, &cfg.state)
        .await
        .context("creating the topics")?;
    let partitions = cfg.kafka.partitions;

    // The changelog, as a gate writes it.
    let dir = tempfile_dir()?;
    let store = StateStore::open(&dir.join("state"))?;
    let producer: FutureProducer = stepgate::kafka::base_config(&cfg.kafka)
        .set("compression.type", "lz4")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let t0 = Instant::now();
    let now = chrono::Utc::now();
    let now_ms = now.timestamp_millis();
    let tools = ["send_email", "create_ticket", "wire_money"];
    let mut bytes = 0usize;
    let chunk = 10_000;
    for start in (0..n).step_by(chunk) {
        let mut batch = Batch::on_top_of(None);
        for i in start..(start + chunk).min(n) {
            let workflow_id = format!("wf-{:07}", i / 10);
            let partition = stepgate::contract::partition_for(&workflow_id, partitions);
            let step = StepKey {
                workflow_id,
                step_index: (i % 10) as u64,
                tool: tools[i % 3].to_owned(),
                attempt: 0,
            };
            let phase = if i % 100_000 == 7 {
                Phase::InDoubt
            } else if i % 100_000 == 8 {
                Phase::AwaitingApproval
            } else {
                Phase::Completed
            };
            let at = now_ms - (n - i) as i64;
            let arguments = serde_json::Map::from_iter([
                ("to".to_owned(), json!(format!("customer-{i}@example.com"))),
                ("amount".to_owned(), json!(i % 1000)),
                ("note".to_owned(), json!("order confirmed")),
            ]);
            let result = (phase == Phase::Completed).then(|| {
                ToolResult::from_outcome(
                    &step,
                    Some(format!("call-{i}")),
                    Outcome::Ok {
                        output: json!({"id": format!("T-{i}")}),
                    },
                    now,
                )
            });
            let record = StepRecord {
                call_id: Some(format!("call-{i}")),
                result,
                intent_ts_ms: Some(at),
                started_at_ms: Some(at + 1),
                repeats: (i % 7 == 0) as u64,
                ..StepRecord::new(
                    step,
                    Category::Keyed,
                    phase,
                    arguments.into(),
                    partition,
                    at,
                    now_ms + 86_400_000,
                )
            };
            batch.put_step(&store, partition, &record)?;
        }
        let mut sends = Vec::new();
        for e in batch.changelog() {
            bytes += e.key.len() + e.value.as_ref().map_or(0, Vec::len);
            let p = producer.clone();
            let topic = cfg.kafka.topics.changelog.clone();
            sends.push(async move {
                let mut r = FutureRecord::to(&topic).partition(e.partition).key(&e.key);
                if let Some(v) = &e.value {
                    r = r.payload(v);
                }
                p.send(r, Duration::from_secs(30))
                    .await
                    .map(|_| ())
                    .map_err(|(e, _)| e)
            });
        }
        for r in futures::future::join_all(sends).await {
            r?;
        }
    }
    drop(producer);
    println!(
        "wrote {n} step records ({:.0} MB of keys and values) to {} in {:.1} s",
        bytes as f64 / 1e6,
        cfg.kafka.topics.changelog,
        t0.elapsed().as_secs_f64()
    );

    // The console, as a process of its own.
    let config_path = dir.join("stepgate.toml");
    std::fs::write(&config_path, toml::to_string(&cfg)?)?;
    // `STEPGATE_BIN` measures another build (a release binary from a debug
    // example: the writer's speed does not matter).
    let bin = match std::env::var_os("STEPGATE_BIN") {
        Some(b) => std::path::PathBuf::from(b),
        None => std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("stepgate"))
            .context("the stepgate binary beside this example")?,
    };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let base = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    let mut child = std::process::Command::new(&bin)
        .args(["console", "--config"])
        .arg(&config_path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(std::fs::File::create(dir.join("console.log"))?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let http = reqwest::Client::new();
    let mut idle_rss = None;
    loop {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await
            && r.status().is_success()
        {
            break;
        }
        if idle_rss.is_none()
            && let Ok(r) = http.get(format!("{base}/healthz")).send().await
            && r.status().is_success()
        {
            idle_rss = memory(pid, "VmRSS");
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(1800),
            "the console did not read the topics in 30 minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ready = started.elapsed();
    let rss = memory(pid, "VmRSS");
    let peak = memory(pid, "VmHWM");
    let page = |path: &'static str| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let t = Instant::now();
            let r = http
                .get(format!("{base}{path}"))
                .bearer_auth(TOKEN)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "{path}: {}", r.status());
            let len = r.text().await?.len();
            Ok::<_, anyhow::Error>((t.elapsed(), len))
        }
    };
    let overview = page("/overview").await?;
    let inbox = page("/inbox").await?;
    let timeline = page("/workflows/wf-0000042").await?;
    let after = memory(pid, "VmRSS");
    let _ = child.kill();
    let _ = child.wait();
    let mb = |kb: Option<u64>| {
        kb.map(|k| format!("{:.0} MB", k as f64 / 1024.0))
            .unwrap_or("?".into())
    };
    println!(
        "console with {n} steps in the changelog ({}): ready (every topic read) in {:.1} s; resident memory {} (peak {}, {} before the read, {} after the pages)",
        bin.display(),
        ready.as_secs_f64(),
        mb(rss),
        mb(peak),
        mb(idle_rss),
        mb(after)
    );
    for (name, (t, len)) in [
        ("overview", overview),
        ("inbox", inbox),
        ("timeline of one workflow", timeline),
    ] {
        println!("  {name}: {} ms ({len} bytes)", t.as_millis());
    }
    std::fs::remove_dir_all(&dir).ok();
    // The run's topics go (the changelog alone holds ~0.5 GB at 1 M steps).
    let admin: rdkafka::admin::AdminClient<_> =
        stepgate::kafka::base_config(&cfg.kafka).create()?;
    let names = cfg.kafka.topics.all();
    let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let opts = rdkafka::admin::AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    if let Err(e) = admin.delete_topics(&refs, &opts).await {
        eprintln!("note: deleting the run's topics {refs:?}: {e}");
    }
    Ok(())
}

/// A line of /proc/PID/status, in kB.
fn memory(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A directory of its own under the system's temporary directory.
fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("console-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
