//! `/metrics`, `/healthz` (alive) and `/readyz` (the gate is consuming, with its
//! partitions' state restored).

use super::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Readiness of this process's gate (consuming, with its partitions' state
/// restored) and its liveness: the gate's loop beats as it goes; `/healthz`
/// fails when it has not for `stall_after`, so an orchestrator restarts a
/// process whose gate is stuck rather than leave its partitions unserved.
#[derive(Debug)]
pub struct Health {
    gate: AtomicBool,
    started: Instant,
    /// Milliseconds after `started` of the gate loop's last beat.
    beat_ms: AtomicU64,
    stall_after: Duration,
}

impl Health {
    pub fn new(stall_after: Duration) -> Self {
        Health {
            gate: AtomicBool::new(false),
            started: Instant::now(),
            beat_ms: AtomicU64::new(0),
            stall_after,
        }
    }

    pub fn set_gate_ready(&self, ready: bool) {
        self.gate.store(ready, Ordering::SeqCst);
    }

    pub fn ready(&self) -> bool {
        self.gate.load(Ordering::SeqCst)
    }

    /// The gate made progress (its loop went round, or a restore is running).
    pub fn beat(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.beat_ms.store(ms, Ordering::Relaxed);
    }

    /// How long since the last beat, when that is past `stall_after`.
    pub fn stalled(&self) -> Option<Duration> {
        let since = self
            .started
            .elapsed()
            .saturating_sub(Duration::from_millis(self.beat_ms.load(Ordering::Relaxed)));
        (since > self.stall_after).then_some(since)
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// Serve on `listener` until `shutdown`. Returns its address (port 0 picked one).
/// The server runs on a thread and runtime of its own: a gate stuck in a
/// blocking call occupies one of the main runtime's few workers, and
/// `/healthz` must still answer that it is stuck.
pub fn serve(
    listener: std::net::TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(health_handler))
        .route("/readyz", get(ready_handler))
        .with_state(AppState { metrics, health });
    std::thread::Builder::new()
        .name("stepgate-http".into())
        .spawn(move || {
            runtime.block_on(async move {
                let r = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => {
                        axum::serve(l, app)
                            .with_graceful_shutdown(shutdown.cancelled_owned())
                            .await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    tracing::error!(error = %e, "metrics server stopped");
                }
            })
        })?;
    Ok(addr)
}

async fn metrics_handler(
    State(s): State<AppState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        s.metrics.render(),
    )
}

async fn health_handler(State(s): State<AppState>) -> (StatusCode, String) {
    match s.health.stalled() {
        None => (StatusCode::OK, "ok\n".into()),
        Some(since) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "stalled: the gate has made no progress for {} s\n",
                since.as_secs()
            ),
        ),
    }
}

async fn ready_handler(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.health.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
