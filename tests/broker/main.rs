//! The tests against a real broker (`KAFKA_BROKERS`, started by
//! `deploy/local/kafka.sh`), one test binary: RocksDB and librdkafka are linked
//! once. `cargo test --test broker <module>::` runs one file's tests.
//!
//! The fault tests (gates killed, frozen, restarted; a broker of their own) run
//! one at a time across modules: they hold [`common::FAULTS`].

mod common;

mod acls;
mod approvals_lifecycle;
mod broker_restart;
mod client;
mod cluster_faults;
mod console;
mod crash_matrix;
mod dedup;
mod edges;
mod faults;
mod interop;
mod mcp;
mod mcp_sessions;
mod mcp_tool;
// The crash points and recovery paths they drive through the hooks
// (`STEPGATE_TEST_*`), which only a `test-hooks` build has.
mod one_host;
#[cfg(feature = "test-hooks")]
mod one_pass;
mod operations;
mod operators;
mod python_client;
mod readme;
mod reconcile;
#[cfg(feature = "test-hooks")]
mod recovery;
#[cfg(feature = "test-hooks")]
mod resume;
mod secured;
mod stale_disk;
mod standby;
mod tool_ledger;
mod traces;
mod trust;
mod workers;
