//! Running stepgate: the roles of one process, its HTTP endpoints, and shutdown.

pub mod claims;

use crate::config::{Config, ConfigError};
use crate::gate;
use crate::kafka::{self, KafkaSetupError};
use crate::state::{StateError, StateStore};
use crate::telemetry::{self, Health, Metrics};
use std::net::SocketAddr;
use std::sync::Arc;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum AppError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Setup(#[from] KafkaSetupError),
    #[error(
        "cannot open the state at {path} (a local cache of the changelog: if another build of stepgate wrote it, move it aside and the gate restores it from the changelog)"
    )]
    State { path: String, source: StateError },
    #[error("cannot serve metrics on {addr}")]
    Http {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Claim(#[from] claims::ClaimError),
    #[error("gate")]
    Gate(#[from] gate::GateError),
    #[error("a task failed")]
    Join(#[from] tokio::task::JoinError),
    #[error(transparent)]
    Traces(#[from] telemetry::TracesError),
}

/// Refuse a deployment whose records could not be written: the step records
/// and the records derived from the largest intent must fit the producer's
/// `message.max.bytes` and the topics' `max.message.bytes`. `run` and
/// `topics create` check before anything starts.
pub async fn check_record_limits(cfg: &Config) -> Result<(), KafkaSetupError> {
    crate::state::check_record_sizes(cfg)?;
    // First reach the brokers: a refused login or TLS handshake is named here,
    // not left to the size check's DescribeConfigs to time out.
    kafka::check_connection(&cfg.kafka).await?;
    kafka::check_topic_sizes(&cfg.kafka, cfg.gate.max_intent_bytes).await
}

/// A running stepgate, as started by [`start`].
pub struct Running {
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if enabled.
    pub http_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), AppError>>>,
    shutdown: CancellationToken,
    /// Held until the process has stopped (dropped with it).
    _claims: claims::HostClaims,
}

impl Running {
    /// Wait for every role to stop (after `shutdown`, or the first failure, which
    /// stops the others too).
    pub async fn wait(self) -> Result<(), AppError> {
        let mut first_err = None;
        let mut tasks = self.tasks;
        while !tasks.is_empty() {
            let (r, _, rest) = futures::future::select_all(tasks).await;
            tasks = rest;
            let r = r.map_err(AppError::from).and_then(|x| x);
            if let Err(e) = r {
                self.shutdown.cancel();
                first_err.get_or_insert(e);
            }
        }
        // The spans still buffered are sent (off the runtime: it blocks).
        if self.metrics.traces().is_enabled() {
            let metrics = self.metrics.clone();
            tokio::task::spawn_blocking(move || metrics.traces().shutdown()).await?;
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Resolve the tools' credentials, claim this process's share of the host
/// ([`claims`]), then [`start_claimed`].
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, AppError> {
    let mut config = config;
    // Tool headers (credentials) are read once, here, from the environment or
    // their files; a missing one stops the start, naming tool and header.
    config.resolve_tool_headers(|var| std::env::var(var).ok())?;
    // So are the pools' keys, which sign their calls and outcomes.
    config.resolve_pool_keys(None, |var| std::env::var(var).ok())?;
    // And the notifications' key.
    config.resolve_notify_key(|var| std::env::var(var).ok())?;
    let claims = claims::claim(&config)?;
    start_claimed(config, claims, shutdown).await
}

/// Check the topics, open the state, serve the endpoints and start the roles,
/// for a config whose tool credentials are resolved and whose share of the
/// host is `claims`.
pub async fn start_claimed(
    config: Config,
    mut claims: claims::HostClaims,
    shutdown: CancellationToken,
) -> Result<Running, AppError> {
    let config = Arc::new(config);
    let k = config.kafka.clone();
    let partitions = tokio::task::spawn_blocking(move || kafka::check_layout(&k)).await??;
    // The calls topics of the pools this gate publishes to (made if missing).
    let pools: Vec<String> = config
        .tools
        .values()
        .filter_map(|t| t.pool.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    kafka::create_pool_topics(&config.kafka, &config.state, &pools).await?;
    tracing::info!(partitions, instance = %config.kafka.instance_id, "starting stepgate");
    // The `tool` label takes only configured names (bounded cardinality).
    let traces = telemetry::Traces::from_config(&config.traces)?;
    let metrics = Arc::new(Metrics::with_tools(config.tool_names()).with_traces(traces));
    let health = Arc::new(Health::new(config.gate.stall_timeout.0));
    let http_addr = match claims.http.take() {
        None => None,
        Some(listener) => {
            let bound =
                telemetry::serve(listener, metrics.clone(), health.clone(), shutdown.clone())
                    .map_err(|source| AppError::Http {
                        addr: config.http.listen.clone(),
                        source,
                    })?;
            tracing::info!(addr = %bound, "serving /metrics, /healthz, /readyz");
            Some(bound)
        }
    };
    let mut tasks = Vec::new();
    {
        let path = config.state.path.clone();
        let cache = config.state.block_cache_mib.max(1) << 20;
        // A gate runs on the state from here: if the last one did not stop
        // gracefully, the batches it applied last are confirmed against the
        // changelog when each partition is next read (docs/guarantees.md).
        let store = tokio::task::spawn_blocking(move || {
            let store = StateStore::open_with_cache(&path, cache)?;
            if store.begin_gate()? {
                tracing::warn!(
                    "the last gate process on this state did not stop cleanly: the batches it applied last are checked against the changelog when each partition is next read (a partition holding one the changelog does not is restored from the changelog's start)"
                );
            }
            Ok::<_, StateError>(store)
        })
        .await?
        .map_err(|source| AppError::State {
            path: config.state.path.display().to_string(),
            source,
        })?;
        let (c, m, h, s) = (
            config.clone(),
            metrics.clone(),
            health.clone(),
            shutdown.clone(),
        );
        tasks.push(tokio::spawn(async move {
            gate::run(c, Arc::new(store), m, h, s)
                .await
                .map_err(AppError::from)
        }));
    }
    // The approvals webhook, beside the gate that decides its events.
    if config.notify.enabled() {
        let (c, m, s) = (config.clone(), metrics.clone(), shutdown.clone());
        tasks.push(tokio::spawn(async move {
            crate::notify::run(c, m, s).await;
            Ok(())
        }));
    }
    Ok(Running {
        http_addr,
        metrics,
        health,
        tasks,
        shutdown,
        _claims: claims,
    })
}

/// [`start_claimed`], then wait until `shutdown` (or a failure).
pub async fn run(
    config: Config,
    claims: claims::HostClaims,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    start_claimed(config, claims, shutdown).await?.wait().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tool_header_whose_variable_is_missing_stops_the_start() {
        let config = Config::from_toml_str(
            "[kafka]\nbrokers = \"127.0.0.1:1\"\n[tools.pay]\ncategory = \"keyed\"\nurl = \"http://127.0.0.1:1/pay\"\n\
             headers = { Authorization = \"env:STEPGATE_TEST_NEVER_SET_5F2A\" }\n",
            std::iter::empty(),
        )
        .unwrap();
        // Before any Kafka call: the broker address leads nowhere.
        let e = match start(config, CancellationToken::new()).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("started without the tool's credentials"),
        };
        assert!(e.contains("tools.pay.headers.Authorization"), "{e}");
        assert!(e.contains("STEPGATE_TEST_NEVER_SET_5F2A"), "{e}");
    }
}
