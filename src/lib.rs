//! # stepgate — exactly-once-effect tool calls for AI agents, on Kafka
//!
//! A call's identity is its step key `(workflow_id, step_index, tool, attempt)`,
//! never a hash of its arguments: a model's rephrased retry is the same call.
//!
//! ## Layout
//! - [`contract`]: the wire contract (Intent v1, Result v1, DLQ records, the
//!   internal call/progress records), validation, and every text a model reads.
//!   Mirrors `schemas/`; depends on nothing else of ours.
//! - [`config`]: the TOML config with `STEPGATE_*` overrides and validation.
//! - [`state`]: the only owner of RocksDB: step records, deadlines, retention,
//!   and crash reconciliation with Kafka's committed transactions.
//! - [`gate`]: intents → dedup → calls to executors, or answers from the record.
//! - [`executor`]: calls → `started` → invoke → outcome.
//! - [`tools`]: the tool registry and the HTTP tool protocol.
//! - [`kafka`]: client configs, rebalance signalling, topics, transactions.
//! - [`telemetry`]: typed events → logs + Prometheus; `/metrics`, health.
//! - [`audit`]: reports of what agents did, replayed from the topics.
//! - [`app`]: one process's roles, started together and shut down together.
//! - [`demo`]: the zero-setup demo on an in-process Kafka mock.
//! - [`client`]: the agent-side library: publish a step, await its answer.
//! - [`operator`]: steps of a workflow, resolutions and approvals, for operators.
//! - [`tool`]: for people who write tools: the step's key, and a ledger that
//!   stores it with the effect in one database transaction.
//! - [`cli`]: the command line.
//!
//! ## The path of a message
//! An agent publishes an intent to `stepgate.intents` (keyed by workflow id).
//! The gate validates it ([`contract::parse_intent`]); a bad one goes to
//! `stepgate.dlq` and, when addressable, a `rejected` result. For a new step the
//! gate records `intended` in RocksDB and forwards a [`contract::Call`] to
//! `stepgate.calls`; for a known step it answers from the record, or remembers the
//! caller until the outcome arrives. An executor commits `started` to
//! `stepgate.progress`, invokes the tool, and publishes the outcome there. The gate
//! stores the outcome and answers every waiting caller on `stepgate.results`, in
//! the intent's partition. A started step with no outcome past its tool's deadline
//! is re-run where that is safe, and `in_doubt` otherwise.

pub mod app;
pub mod audit;
pub mod cli;
pub mod client;
pub mod config;
pub mod contract;
pub mod demo;
pub mod executor;
pub mod gate;
pub mod kafka;
pub mod operator;
pub mod state;
pub mod telemetry;
pub mod tool;
pub mod tools;
