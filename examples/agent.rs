//! An agent on stepgate, in Rust: a workflow whose steps the runtime numbers,
//! a rephrased retry of a step, and a deliberate re-execution.
//!
//! Needs a running stepgate with a `send_email` tool, e.g.
//! `stepgate run --config deploy/stepgate.example.toml`; then
//! `cargo run --example agent -- 127.0.0.1:9092 order-7781`
//! (two more arguments name other intents and results topics).

use serde_json::json;
use stepgate_client::{Client, ClientOptions, StepCall};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9092".into());
    let workflow = std::env::args()
        .nth(2)
        .unwrap_or_else(|| format!("order-{}", std::process::id()));
    let mut options = ClientOptions::new(&brokers);
    if let (Some(intents), Some(results)) = (std::env::args().nth(3), std::env::args().nth(4)) {
        options.intents_topic = intents;
        options.results_topic = results;
    }
    let client = Client::new(options).await?;

    // The workflow id is the run's identity (a thread, a job); the runtime — not
    // the model — numbers the tool calls.
    let wf = client.workflow(&workflow);
    let sent = wf
        .call(
            "send_email",
            json!({"to": "a@example.com", "subject": "Order confirmed"}),
        )
        .await?;
    println!(
        "step 0: {:?} {}",
        sent.status,
        sent.output.unwrap_or_default()
    );

    // The model regenerated step 0 after a timeout and rephrased it: the runtime
    // knows it is still step 0, so the email is not sent again.
    let retry = client
        .call(StepCall::new(
            &workflow,
            0,
            "send_email",
            json!({"to": "a@example.com", "subject": "Your order is confirmed"}),
        )?)
        .await?;
    println!(
        "step 0 again: deduplicated={} (the original answer)",
        retry.deduplicated
    );

    // Only an explicit retry runs a step again.
    let resent = wf
        .retry_step(
            0,
            "send_email",
            json!({"to": "a@example.com", "subject": "Order confirmed (resent)"}),
        )
        .await?;
    println!("step 0, attempt {}: {:?}", resent.attempt, resent.status);
    Ok(())
}
