//! How fast a gate restores a partition's state from its changelog.
//!
//! Loads N completed step records into the changelog of a fresh one-partition
//! deployment on the broker at `KAFKA_BROKERS` (default 127.0.0.1:9092), then
//! times [`stepgate::state::restore_partitions`] into an empty RocksDB, and prints
//! records/s and the process's peak RSS.
//!
//! `cargo run --example restore_bench -- 1000000` (add `--release` for
//! optimised RocksDB; the default debug build is several times slower).

use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;
use std::time::Instant;
use stepgate::config::{Config, TopicsConfig};
use stepgate::contract::{Outcome, StepKey, ToolResult};
use stepgate::kafka::OutRecord;
use stepgate::state::{Batch, Phase, StateStore, StepRecord};
use stepgate::tools::Category;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let mut config = Config::default();
    config.kafka.brokers =
        std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let prefix = format!("restore-bench-{}", std::process::id());
    config.kafka.topics = TopicsConfig::with_prefix(&prefix);
    config.kafka.partitions = 1;
    stepgate::kafka::create_topics(&config.kafka, &config.state).await?;

    // Load: synthetic completed steps, written as the gate writes them.
    let scratch = tempfile::tempdir()?;
    let store = StateStore::open(scratch.path())?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "500000")
        .create()?;
    let t = Instant::now();
    let mut sent = 0usize;
    while sent < n {
        let mut batch = Batch::default();
        for i in sent..(sent + 10_000).min(n) {
            batch.put_step(&store, 0, &record(i))?;
        }
        let records: Vec<OutRecord> = batch
            .changelog()
            .into_iter()
            .map(|e| OutRecord {
                topic: config.kafka.topics.changelog.clone(),
                partition: Some(0),
                key: Some(e.key),
                payload: e.value,
                headers: Vec::new(),
                timestamp_ms: None,
            })
            .collect();
        stepgate::kafka::send_all(&producer, &records).await?;
        sent = (sent + 10_000).min(n);
    }
    println!(
        "loaded {n} step records into `{}` in {:.1} s",
        config.kafka.topics.changelog,
        t.elapsed().as_secs_f64()
    );

    // Restore into an empty store.
    let target = tempfile::tempdir()?;
    let fresh = StateStore::open(target.path())?;
    let t = Instant::now();
    let kafka = config.kafka.clone();
    // An empty store: nothing local to trust or not.
    let trust = stepgate::state::Trust::from_delete_retention(None);
    let applied = tokio::task::block_in_place(|| {
        let progress = stepgate::state::Applied::default();
        stepgate::state::restore_partitions(&kafka, &fresh, &[0].into(), &trust, &progress)
    })?
    .values()
    .map(|r| r.records)
    .sum::<usize>();
    let took = t.elapsed().as_secs_f64();
    println!(
        "restored {applied} changelog records ({n} steps) in {took:.1} s: {:.0} records/s, {:.0} steps/s; peak RSS {} MiB",
        applied as f64 / took,
        n as f64 / took,
        peak_rss_mib()
    );
    Ok(())
}

fn record(i: usize) -> StepRecord {
    let step = StepKey {
        workflow_id: format!("wf-{}", i / 10),
        step_index: (i % 10) as u64,
        tool: "send_email".into(),
        attempt: 0,
    };
    let result = ToolResult::from_outcome(
        &step,
        Some(format!("call-{i}")),
        Outcome::Ok {
            output: serde_json::json!({"message_id": format!("m-{i}")}),
        },
        chrono::Utc::now(),
    );
    StepRecord {
        call_id: Some(format!("call-{i}")),
        started_at_ms: Some(1),
        result: Some(result),
        ..StepRecord::new(
            step,
            Category::Keyed,
            Phase::Completed,
            serde_json::from_str(r#"{"to":"a@example.com","subject":"Order confirmed"}"#)
                .expect("valid JSON"),
            0,
            0,
            i64::MAX / 2,
        )
    }
}

fn peak_rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb / 1024)
}
