//! `stepgate demo`: the whole path on an in-process Kafka (librdkafka's mock
//! cluster), with demo tools on a local HTTP server and a scripted agent.
//!
//! The mock cluster fakes transactions; that is fine for a tour, and is why no
//! test relies on it.

use crate::app;
use crate::client::{Client, ClientError, StepCall};
use crate::config::Config;
use crate::contract::{Status, ToolResult};
use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum DemoError {
    #[error("Kafka mock")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error(transparent)]
    App(#[from] app::AppError),
    #[error("demo config")]
    Config(#[from] crate::config::ConfigError),
    #[error("demo I/O")]
    Io(#[from] std::io::Error),
    #[error("the demo's agent")]
    Client(#[from] ClientError),
}

/// What the demo tools did, for the tour's commentary.
#[derive(Default)]
struct Ledger {
    counts: HashMap<&'static str, u32>,
    last_key: HashMap<&'static str, String>,
}

fn demo_tools(ledger: Arc<Mutex<Ledger>>) -> Router {
    let hit = move |name: &'static str| {
        let ledger = ledger.clone();
        move |headers: HeaderMap, body: axum::Json<Value>| {
            let ledger = ledger.clone();
            async move {
                let n = {
                    let mut l = ledger.lock().expect("demo ledger");
                    let n = l.counts.entry(name).or_default();
                    *n += 1;
                    let n = *n;
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-")
                        .to_owned();
                    l.last_key.insert(name, key);
                    n
                };
                let out = match name {
                    "send_email" => {
                        json!({"message_id": format!("m-{n}"), "subject": body.0.get("subject")})
                    }
                    "create_ticket" => {
                        json!({"ticket_id": format!("T-{n}"), "title": body.0.get("title")})
                    }
                    "wire_transfer" => {
                        // Slower than its 1 s timeout: the bank may have moved the money.
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        json!({"transfer_id": format!("X-{n}")})
                    }
                    _ => json!({"orders": [{"id": "order-7781", "status": "paid"}]}),
                };
                axum::Json(out)
            }
        }
    };
    Router::new()
        .route("/send_email", post(hit("send_email")))
        .route("/create_ticket", post(hit("create_ticket")))
        .route("/wire_transfer", post(hit("wire_transfer")))
        .route("/search_orders", post(hit("search_orders")))
}

/// The scripted agent: stepgate's own [`Client`], with call ids the tour can
/// print.
struct Agent {
    client: Client,
    next_call: u32,
}

impl Agent {
    async fn call(
        &mut self,
        workflow: &str,
        step: u64,
        tool: &str,
        attempt: u64,
        args: Value,
    ) -> Result<ToolResult, DemoError> {
        self.next_call += 1;
        let call_id = format!("call_{:03}", self.next_call);
        let call = StepCall::new(workflow, step, tool, args)?
            .attempt(attempt)
            .call_id(&call_id);
        Ok(self.client.call(call).await?)
    }
}

fn show(label: &str, r: &ToolResult) {
    let body = match r.status {
        Status::Ok => r.output.clone().unwrap_or(Value::Null).to_string(),
        _ => r
            .error
            .as_ref()
            .map(|e| format!("[{}] {}", e.kind, e.message))
            .unwrap_or_default(),
    };
    println!(
        "    {label:<9} {:<8} status={:<8} deduplicated={:<5} {body}",
        r.call_id.as_deref().unwrap_or("-"),
        r.status.as_str(),
        r.deduplicated
    );
}

/// Run the tour. `metrics_addr` serves /metrics meanwhile.
pub async fn run(
    metrics_addr: &str,
    keep_running: bool,
    shutdown: CancellationToken,
) -> Result<(), DemoError> {
    println!(
        "stepgate demo — in-process Kafka (librdkafka mock cluster), the gate (which calls the \
         tools itself), demo tools and a scripted agent\n"
    );
    let mock = MockCluster::new(1)?;
    let brokers = mock.bootstrap_servers();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tools_addr = listener.local_addr()?;
    let app_router = demo_tools(ledger.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app_router).await;
    });
    let state_dir = std::env::temp_dir().join(format!("stepgate-demo-{}", std::process::id()));
    let toml = format!(
        r#"
[kafka]
brokers = "{brokers}"
partitions = 4
[state]
path = "{state}"
[gate]
in_doubt_grace = "1s"
[http]
listen = "{metrics_addr}"
[log]
level = "warn"
[tools.send_email]
category = "keyed"
url = "http://{tools_addr}/send_email"
[tools.create_ticket]
category = "unkeyed"
url = "http://{tools_addr}/create_ticket"
[tools.wire_transfer]
category = "unkeyed"
url = "http://{tools_addr}/wire_transfer"
timeout = "1s"
[tools.search_orders]
category = "read_only"
url = "http://{tools_addr}/search_orders"
"#,
        state = state_dir.display()
    );
    let config = Config::from_toml_str(&toml, Vec::new())?;
    for t in config.kafka.topics.all() {
        mock.create_topic(t, 4, 1)?;
    }
    let stop = CancellationToken::new();
    let running = app::start(config.clone(), stop.clone()).await?;
    if let Some(a) = running.http_addr {
        println!("metrics: http://{a}/metrics\n");
    }

    let mut options = crate::client::options_from_config(&config);
    options.timeout = Duration::from_secs(30);
    let mut agent = Agent {
        client: Client::new(options).await?,
        next_call: 0,
    };
    let count = |name: &'static str| {
        ledger
            .lock()
            .expect("demo ledger")
            .counts
            .get(name)
            .copied()
            .unwrap_or(0)
    };
    let key = |name: &'static str| {
        ledger
            .lock()
            .expect("demo ledger")
            .last_key
            .get(name)
            .cloned()
            .unwrap_or_default()
    };

    println!("1. A rephrased retry is the same call (workflow order-7781, step 1, send_email)");
    let r1 = agent
        .call(
            "order-7781",
            1,
            "send_email",
            0,
            json!({"to": "a@example.com", "subject": "Order confirmed"}),
        )
        .await?;
    show("first", &r1);
    println!("    … the agent timed out; the model retries and rephrases the subject:");
    let r2 = agent
        .call(
            "order-7781",
            1,
            "send_email",
            0,
            json!({"to": "a@example.com", "subject": "Your order is confirmed"}),
        )
        .await?;
    show("retry", &r2);
    println!(
        "    send_email ran {} time(s); the retry got the original answer (an argument hash would have sent a second email)\n",
        count("send_email")
    );

    println!("2. Identical arguments at two steps are two calls (create_ticket, steps 2 and 3)");
    let t1 = agent
        .call(
            "order-7781",
            2,
            "create_ticket",
            0,
            json!({"title": "Refund request"}),
        )
        .await?;
    show("step 2", &t1);
    let t2 = agent
        .call(
            "order-7781",
            3,
            "create_ticket",
            0,
            json!({"title": "Refund request"}),
        )
        .await?;
    show("step 3", &t2);
    println!(
        "    create_ticket ran {} times (an argument hash would have refused the second)\n",
        count("create_ticket")
    );

    println!("3. A deliberate re-execution says so: attempt 1 of step 1");
    let k0 = key("send_email");
    let r3 = agent
        .call(
            "order-7781",
            1,
            "send_email",
            1,
            json!({"to": "a@example.com", "subject": "Order confirmed (again)"}),
        )
        .await?;
    show("attempt 1", &r3);
    println!(
        "    send_email ran {} times; Idempotency-Key {} → {}\n",
        count("send_email"),
        short(&k0),
        short(&key("send_email"))
    );

    println!(
        "4. An unkeyed call whose outcome is unknown is in doubt, never blindly re-run (wire_transfer times out)"
    );
    let w1 = agent
        .call(
            "order-7781",
            4,
            "wire_transfer",
            0,
            json!({"amount_eur": 120}),
        )
        .await?;
    show("first", &w1);
    let w2 = agent
        .call(
            "order-7781",
            4,
            "wire_transfer",
            0,
            json!({"amount_eur": 120}),
        )
        .await?;
    show("retry", &w2);
    println!("    wire_transfer ran {} time(s)\n", count("wire_transfer"));

    println!("5. Bad input is answered, not crashed on");
    let b = agent
        .call("order-7781", 5, "send_mail", 0, json!({}))
        .await?;
    show("typo", &b);
    // Not through the client (it writes only valid intents): a producer of
    // garbage.
    let garbage: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    garbage
        .send(
            FutureRecord::to(&config.kafka.topics.intents)
                .key("order-7781")
                .payload("{not json"),
            Duration::from_secs(5),
        )
        .await
        .map_err(|(e, _)| e)?;
    // Say it went to the dead-letter topic once the gate has sent it there.
    let malformed = || {
        running
            .metrics
            .render()
            .lines()
            .find_map(|l| {
                l.strip_prefix("stepgate_rejected_inputs_total{reason=\"malformed_json\"} ")
            })
            .and_then(|n| n.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let waited = Instant::now();
    while malformed() < 1.0 && waited.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if malformed() >= 1.0 {
        println!(
            "    (and a malformed record went to the dead-letter topic `{}`)\n",
            config.kafka.topics.dlq
        );
    } else {
        println!(
            "    (a malformed record was sent; the gate had not dead-lettered it after 30 s)\n"
        );
    }

    let text = running.metrics.render();
    println!("metrics (excerpt):");
    for line in text.lines().filter(|l| {
        !l.starts_with('#')
            && (l.starts_with("stepgate_repeats_total")
                || l.starts_with("stepgate_rephrased_retries_total")
                || l.starts_with("stepgate_steps_forwarded_total")
                || l.starts_with("stepgate_in_doubt_steps_total")
                || l.starts_with("stepgate_rejected_inputs_total"))
    }) {
        println!("    {line}");
    }
    if keep_running {
        println!("\nserving /metrics until Ctrl-C …");
        shutdown.cancelled().await;
    }
    stop.cancel();
    running.wait().await?;
    let _ = std::fs::remove_dir_all(&state_dir);
    drop(agent);
    // Kept until the process exits: librdkafka's clients wind down on threads
    // of their own after they are dropped, and each would log a refused
    // connection in red if the cluster went first.
    std::mem::forget(mock);
    Ok(())
}

fn short(k: &str) -> String {
    k.chars().take(16).collect::<String>() + "…"
}
