//! `/metrics`, `/healthz` (alive) and `/readyz` (every role of this process is
//! consuming, with its partitions' state reconciled).

use super::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio_util::sync::CancellationToken;

/// Readiness of the roles running in this process.
#[derive(Debug, Default)]
pub struct Health {
    gate: Option<AtomicBool>,
    executor: Option<AtomicBool>,
}

impl Health {
    pub fn new(gate: bool, executor: bool) -> Self {
        Health {
            gate: gate.then(|| AtomicBool::new(false)),
            executor: executor.then(|| AtomicBool::new(false)),
        }
    }

    pub fn set_gate_ready(&self, ready: bool) {
        if let Some(g) = &self.gate {
            g.store(ready, Ordering::SeqCst);
        }
    }

    pub fn set_executor_ready(&self, ready: bool) {
        if let Some(e) = &self.executor {
            e.store(ready, Ordering::SeqCst);
        }
    }

    pub fn ready(&self) -> bool {
        [&self.gate, &self.executor]
            .into_iter()
            .flatten()
            .all(|f| f.load(Ordering::SeqCst))
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
