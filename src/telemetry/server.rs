//! `/metrics`, `/healthz` (alive) and `/readyz` (the gate is consuming, with its
//! partitions' state restored).

use super::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio_util::sync::CancellationToken;

/// Readiness of this process's gate: consuming, with its partitions' state
/// restored.
#[derive(Debug, Default)]
pub struct Health {
    gate: AtomicBool,
}

impl Health {
    pub fn new() -> Self {
        Health::default()
    }

    pub fn set_gate_ready(&self, ready: bool) {
        self.gate.store(ready, Ordering::SeqCst);
    }

    pub fn ready(&self) -> bool {
        self.gate.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// Serve until `shutdown`. Returns the bound address (port 0 picks one).
pub async fn serve(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(AppState { metrics, health });
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
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

async fn ready_handler(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.health.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
