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
//! - [`gate`]: intents decided — a new step run (a keyed one's call sent at
//!   once, another recorded step's once it is committed `started`), a repeat
//!   answered from its record or waiting on it; outcomes settled and
//!   answered. One transaction per batch, pipelined; a session composed of
//!   parts around a decision core free of Kafka. Standby replicas of other
//!   gates' partitions.
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
//! - [`notify`]: the approvals webhook: held calls' lifecycle events, read
//!   back from `stepgate.approvals`, posted signed (`[notify]`).
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
//! Told in docs/design.md "The path of a message". Through the modules: an
//! intent is parsed by [`contract`] and decided by the [`gate`], which commits
//! a batch's records, answers and input offsets in one Kafka transaction
//! ([`kafka`]) and only then applies them to [`state`]; a call runs in the
//! [`executor`] (through [`tools`]) or on a pool's [`worker`], and its outcome
//! comes back to the [`gate`], which settles the step and answers its callers
//! on `stepgate.results`.

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
pub mod notify;
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
