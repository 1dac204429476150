//! The agent side of stepgate:
//! exactly-once-effect tool calls for AI agents, on Kafka.
//!
//! [`Client`] publishes a step's intent and awaits its one answer; a
//! [`Workflow`] numbers its steps. [`contract`] is the wire contract (Intent v1,
//! Result v1 and the rest, mirroring the JSON Schemas in `schemas/`), shared
//! with the stepgate server, which depends on this crate. Light on purpose: no
//! RocksDB, no HTTP server — only librdkafka.
//!
//! ```no_run
//! # async fn demo() -> Result<(), stepgate_client::ClientError> {
//! use stepgate_client::{Client, ClientOptions};
//! let client = Client::new(ClientOptions::new("127.0.0.1:9092")).await?;
//! let wf = client.workflow("order-7781");
//! let answer = wf.call("send_email", serde_json::json!({"to": "a@example.com"})).await?;
//! println!("{:?} {:?}", answer.status, answer.output);
//! # Ok(()) }
//! ```

mod client;
pub mod connect;
pub mod contract;
pub mod redact;

pub use client::{Client, ClientError, ClientOptions, StepCall, Workflow};
pub use connect::ConnectError;
