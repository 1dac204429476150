//! The gate: a consumer group over `intents`, operators' `commands` and the
//! `progress` of calls whose partition moved; the owner of a partition invokes
//! its tools ([`crate::executor::Invoker`]). The path a message takes through
//! it is told in docs/design.md "The path of a message".
//!
//! Its parts: [`GateCore`] decides, free of Kafka (`core.rs`, a file per
//! input kind in `core/`); a session (`session.rs`) reads inputs into the
//! open batch (`batch.rs`), takes the core's decisions, and drives parts that
//! do not know it — its commits (`commit.rs`: the transactional producers,
//! the batch in flight, group commit's wait in `linger.rs`), the partitions
//! it owns with their applied marks (`ownership.rs`, `mark.rs`),
//! backpressure (`backpressure.rs`) and its clocks (`timers.rs`). A batch's
//! records are built in `records.rs`; inputs that keep failing are set aside
//! (`poison.rs`); what a broker lost of an acknowledged commit is written
//! again (`lost.rs`). Partitions newly assigned are taken over together
//! (`restore.rs`), and copies of other gates' partitions are kept warm
//! (`standby.rs`). This file runs sessions, one after another.
//!
//! One transaction per batch, pipelined: while one batch commits, the next is
//! decided; it closes when that commit returns (or at `gate.max_batch`
//! inputs), so at low load an answer waits for about one commit; under load
//! it fills first (`gate.busy_batch_age`: fewer transactions). Only once a
//! batch has committed is it applied to RocksDB. If a commit fails, the batch
//! after it is dropped and the session restarts from what Kafka committed.

mod backpressure;
mod batch;
mod commit;
mod core;
mod gauges;
mod linger;
mod lost;
mod mark;
mod ownership;
mod poison;
mod records;
mod restore;
mod session;
mod standby;
mod timers;

pub use self::core::{GateCore, GateSettings, Input, Out, When, WrongPartition};

use crate::config::Config;
use crate::executor::{Finished, Invoker};
use crate::kafka;
use crate::state::{StateError, StateStore};
use crate::telemetry::{Health, Metrics};
use poison::Poison;
use rdkafka::error::KafkaError;
use session::Session;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// What a session borrows from its process, which outlives it.
#[derive(Clone, Copy)]
struct Env<'a> {
    config: &'a Config,
    store: &'a Arc<StateStore>,
    metrics: &'a Arc<Metrics>,
    health: &'a Health,
    invoker: &'a Invoker,
}

/// What a session leaves to the next one.
#[derive(Default)]
struct Carry {
    /// Outcomes received but not yet committed.
    outcomes: Vec<Finished>,
    /// Inputs that keep failing, counted across sessions.
    poison: Poison,
    /// The producers' last acknowledged transactions, checked by the next
    /// session for what a broker lost of them.
    last_commits: lost::LastCommits,
}

#[derive(Debug, Error)]
pub enum GateError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("state")]
    State(#[from] StateError),
    #[error("partitions were revoked while a batch was open; it is re-read from the last commit")]
    Rebalanced,
    #[error("no partitions assigned for {0:?}: rejoining with a fresh consumer")]
    Unassigned(Duration),
    #[error("restore")]
    Restore(#[from] crate::state::RestoreError),
    #[error("the commit task failed")]
    Join(#[from] tokio::task::JoinError),
    /// librdkafka stops a client for good on a fatal error (e.g. its static
    /// member id was taken by another consumer): only a new one goes on.
    #[error("the gate's consumer failed for good ({0}): starting a new one")]
    FatalConsumer(String),
    /// Another consumer joined the group with this process's static member
    /// id: two processes with one instance id, which fence each other in
    /// turn for as long as both run.
    #[error(
        "the gate's consumer failed for good: another process joined group `{group}` with this process's instance id `{instance}` (kafka.instance_id). Two processes with one instance id take the partitions from each other in turn: give each its own `--instance-id`. Starting a new consumer"
    )]
    InstanceIdTaken { instance: String, group: String },
    /// The topics' layout breaks deduplication (partition counts changed
    /// under running workflows, or unequal): the gate stops rather than
    /// deduplicate in the wrong partition.
    #[error("{0}")]
    Layout(String),
    /// A transaction ended slowly enough that a late copy of its end request
    /// may still reach the coordinator (`kafka::stale_end_possible`): what it
    /// committed is kept, and the next session's producers (a new epoch)
    /// fence that copy before any further transaction begins.
    #[error(
        "a transaction took long enough to end that librdkafka may have sent its end request twice: starting new producers, which fence a late copy"
    )]
    SlowTransactionEnd,
}

impl GateError {
    /// The `reason` label of `stepgate_gate_session_failures_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            e if e.refused_record().is_some() => "record_refused",
            GateError::Kafka(KafkaError::Transaction(_)) => "transaction",
            GateError::Kafka(_) => "kafka",
            GateError::State(_) => "state",
            GateError::Rebalanced => "rebalanced",
            GateError::Unassigned(_) => "unassigned",
            GateError::Restore(_) => "restore",
            GateError::Join(_) => "internal",
            GateError::FatalConsumer(_) => "fatal_consumer",
            GateError::InstanceIdTaken { .. } => "instance_id_taken",
            GateError::Layout(_) => "layout",
            GateError::SlowTransactionEnd => "slow_transaction_end",
        }
    }

    /// The broker (or the producer's own limit) refused a record for what it
    /// is — too large for the topic, a topic this gate may not write, an
    /// invalid record — rather than for its own state: sent again, it fails
    /// again. Its code's name.
    fn refused_record(&self) -> Option<&'static str> {
        use rdkafka::types::RDKafkaErrorCode as C;
        let GateError::Kafka(KafkaError::MessageProduction(code)) = self else {
            return None;
        };
        match code {
            C::MessageSizeTooLarge => Some("message_size_too_large"),
            C::MessageBatchTooLarge => Some("message_batch_too_large"),
            C::TopicAuthorizationFailed => Some("topic_authorization_failed"),
            C::InvalidRecord => Some("invalid_record"),
            C::PolicyViolation => Some("policy_violation"),
            C::InvalidMessage => Some("invalid_message"),
            _ => None,
        }
    }
}

/// Run the gate until `shutdown`; recoverable failures restart the session from
/// the last committed offsets. Calls running when a session ends keep running,
/// and their outcomes are settled by the next session (or handed to the
/// partition's new owner).
pub async fn run(
    config: Arc<Config>,
    store: Arc<StateStore>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), GateError> {
    let mut core = GateCore::new(&config, metrics.clone());
    let (invoker, mut outcomes) = Invoker::new(&config, metrics.clone());
    // Off the gate's way: reading the changelog's retention may take a while.
    tokio::spawn({
        let (config, store, metrics) = (config.clone(), store.clone(), metrics.clone());
        let (owned, shutdown) = (invoker.ownership().watch(), shutdown.clone());
        async move {
            let trust = crate::state::Trust::from_delete_retention(
                kafka::changelog_delete_retention(&config.kafka).await,
            );
            standby::start(config, store, metrics, owned, trust, shutdown);
        }
    });
    let env = Env {
        config: &config,
        store: &store,
        metrics: &metrics,
        health: &health,
        invoker: &invoker,
    };
    let mut carry = Carry::default();
    let mut backoff = RESTART_BACKOFF;
    loop {
        health.beat();
        let began = Instant::now();
        let result = Session::run(env, &mut core, &mut carry, &mut outcomes, &shutdown).await;
        // Its partitions may go to another gate now: calls still queued here
        // are handed back not invoked (settled by the next session or owner).
        invoker.ownership().clear();
        metrics.partitions_released();
        health.set_gate_ready(false);
        core.reset();
        match result {
            // Stopped gracefully (its last batches committed and applied): the
            // next process on this state may trust it.
            Ok(()) => {
                store.end_gate()?;
                return Ok(());
            }
            Err(GateError::Rebalanced) => {
                info!("partitions revoked mid-batch: resuming from the last committed transaction");
            }
            // Not something a new session mends: stop, saying why.
            Err(e @ GateError::Layout(_)) => {
                metrics.session_failed(e.reason());
                return Err(e);
            }
            Err(e) => {
                metrics.session_failed(e.reason());
                error!(error = %crate::telemetry::error_chain(&e), reason = e.reason(), "gate session failed; resuming from the last committed transaction");
                // Failures far apart are not a failing loop: each restarts soon
                // (the partitions it held wait on it).
                if began.elapsed() > STABLE_SESSION {
                    backoff = RESTART_BACKOFF;
                }
                if !kafka::wait_before_restart(&shutdown, &mut backoff).await {
                    return Ok(());
                }
            }
        }
    }
}

/// The first wait before a failed session restarts (doubling to 5 s while
/// sessions keep failing within [`STABLE_SESSION`]).
const RESTART_BACKOFF: Duration = Duration::from_millis(250);

const STABLE_SESSION: Duration = Duration::from_secs(60);

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
