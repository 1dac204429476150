//! Intent → answer latency through a real broker, one call at a time: new steps
//! of a no-op `keyed` HTTP tool, then repeats of them (answered from the record).
//! Runs stepgate in-process against `KAFKA_BROKERS` (default 127.0.0.1:9092).
//!
//! `cargo run --example latency_probe -- 200` (add `--release` for release figures)

use axum::routing::post;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use std::time::{Duration, Instant};
use stepgate::app;
use stepgate::config::Config;
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(200);
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tool = listener.local_addr()?;
    tokio::spawn(async move {
        let app = axum::Router::new().route("/noop", post(|| async { "{}" }));
        let _ = axum::serve(listener, app).await;
    });
    let p = format!("latency-{}", std::process::id());
    let dir = tempfile::tempdir()?;
    let config = Config::from_toml_str(
        &format!(
            r#"
[kafka]
brokers = "{brokers}"
instance_id = "{p}"
gate_group = "{p}-gate"
partitions = 1
[kafka.topics]
intents = "{p}.intents"
results = "{p}.results"
dlq = "{p}.dlq"
progress = "{p}.progress"
changelog = "{p}.changelog"
commands = "{p}.commands"
approvals = "{p}.approvals"
[state]
path = "{state}"
[http]
listen = ""
[log]
level = "warn"
[tools.noop]
category = "keyed"
url = "http://{tool}/noop"
"#,
            state = dir.path().display()
        ),
        Vec::new(),
    )?;
    stepgate::kafka::create_topics(&config.kafka, &config.state).await?;
    let stop = CancellationToken::new();
    let running = app::start(config.clone(), stop.clone()).await?;

    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "0")
        .create()?;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("{p}-probe"))
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "5")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&config.kafka.topics.results, 0, Offset::End)?;
    consumer.assign(&tpl)?;
    drop(tpl);
    // Warm up: the first call waits for group joins.
    call(
        &producer,
        &consumer,
        &config.kafka.topics.intents,
        "warm",
        0,
        "w",
    )
    .await?;

    for (label, repeat) in [("new steps", false), ("repeats of settled steps", true)] {
        let mut lat = Vec::with_capacity(n);
        for i in 0..n {
            let id = format!("{}{i}", if repeat { "r" } else { "n" });
            let t = Instant::now();
            call(
                &producer,
                &consumer,
                &config.kafka.topics.intents,
                "wf",
                i as u64,
                &id,
            )
            .await?;
            lat.push(t.elapsed());
        }
        lat.sort();
        let pct = |q: f64| {
            lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)].as_secs_f64() * 1000.0
        };
        println!(
            "{label}: p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {n}",
            pct(0.5),
            pct(0.9),
            pct(0.99),
            lat[lat.len() - 1].as_secs_f64() * 1000.0
        );
    }
    stop.cancel();
    running.wait().await?;
    Ok(())
}

async fn call(
    producer: &FutureProducer,
    consumer: &StreamConsumer,
    topic: &str,
    wf: &str,
    step: u64,
    call_id: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let intent = serde_json::json!({"workflow_id": wf, "step_index": step, "tool": "noop", "arguments": {}, "call_id": call_id});
    producer
        .send(
            FutureRecord::to(topic).key(wf).payload(&intent.to_string()),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap_or_default())?;
        if v["call_id"] == call_id {
            return Ok(());
        }
    }
}
