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
//! - [`duration`]: a leaf value type of the config — a duration as written
//!   (`"10s"`).
//! - [`redact`]: what is a secret and how it is shown — the config's rules,
//!   and the one rule for arguments and answers shown to people (the console,
//!   the CLI, the audit).
//! - [`retired`]: the config keys stepgate no longer takes, each refused
//!   with what it does now.
//! - [`state`]: the only owner of RocksDB, a cache of the changelog topic: step
//!   records, deadlines, retention, restore, the changelog followers of
//!   restores and standby replicas, and what a restart confirms.
//! - [`gate`]: intents → dedup → `started` committed → invoke, or answers from
//!   the record; outcomes → answers. One transaction per batch, pipelined.
//!   Standby replicas of other gates' partitions.
//! - [`executor`]: the in-process invoker pool that runs the gate's calls.
//! - [`worker`]: `stepgate worker --pool <name>`: runs a pool's calls
//!   (published by the gate on the pool's calls topic) where its tools are.
//! - [`tools`]: what a tool is (`tools::tool`: category, policy, annotations,
//!   its config), the tool registry and the HTTP tool protocol.
//! - [`kafka`]: client configs, rebalance signalling, topics, transactions.
//! - [`telemetry`]: typed events → logs + Prometheus; `/metrics`, health.
//! - [`audit`]: reports of what agents did, replayed from the topics.
//! - [`app`]: one process's roles, started together and shut down together.
//! - [`demo`]: the zero-setup demo on an in-process Kafka mock.
//! - [`client`]: the agent-side library: publish a step, await its answer.
//! - [`mcp`]: the MCP front (`stepgate mcp`): each `tools/call` a step,
//!   through the [`client`].
//! - [`operator`]: steps of a workflow, resolutions and approvals, for operators.
//! - [`console`]: the web console (`stepgate console`): held calls, in-doubt
//!   steps and timelines from a cache of the topics (and of the listed gates'
//!   `/metrics`: who owns each partition); decisions through [`operator`].
//! - [`provider`]: for people who write tools (the provider side of the
//!   protocol): the step's headers and key, and a ledger that stores the key
//!   with the effect in one database transaction.
//! - [`cli`]: the command line: its clap structs, and a function per command
//!   (`main.rs` only parses, runs one and prints its error).
//! - [`hooks`]: the fault-injection hooks of the crash and liveness tests, read
//!   only in builds with the `test-hooks` feature.
//!
//! ## The path of a message
//! An agent publishes an intent to `stepgate.intents` (keyed by workflow id).
//! The gate that owns the partition validates it ([`contract::parse_intent`]); a
//! bad one goes to `stepgate.dlq` and, when addressable, a `rejected` result. For
//! a new step it commits the step as `started` (a changelog record, in the
//! transaction that also commits the intent's offset), then — the commit
//! returned — applies it to RocksDB and invokes the tool in this process
//! ([`executor::Invoker`]). The outcome joins the next batch: the step record is
//! settled and every waiting caller answered on `stepgate.results`, in the
//! intent's partition, in one more transaction. A known step is answered from its
//! record, or its caller waits for the outcome. A read (`read_only`/`idempotent`
//! tool) records nothing: intent in, answer out. An outcome whose partition moved
//! while the call ran goes to the new owner through `stepgate.progress`. A
//! started step with no outcome past its tool's deadline is re-run where that is
//! safe, and `in_doubt` otherwise. A tool declared `pool = "…"` is not invoked
//! by the gate: its call (Call v1) is published in the transaction that records
//! it `started`, a [`worker`] of the pool runs it, and the outcome comes back on
//! `stepgate.progress` (Outcome v1).

pub mod app;
pub mod audit;
pub mod cli;
pub mod client;
pub mod config;
pub mod console;
pub mod demo;
pub mod duration;
pub mod executor;
pub mod gate;
pub mod hooks;
pub mod kafka;
pub mod mcp;
pub mod operator;
pub mod provider;
pub mod redact;
pub mod retired;
pub mod state;
pub mod telemetry;
pub mod tools;
pub mod worker;

/// The wire contract lives in the `stepgate-client` crate, which agents depend
/// on alone; here under its usual path (as the config's secret rules do, in
/// [`redact`]).
pub use stepgate_client::contract;
