//! The invoker: runs the tool calls of the steps the gate owns, in this process.
//!
//! The gate hands a call over only after the transaction recording the step as
//! `started` has committed (fast-path reads excepted: they record nothing). Each
//! call runs as a task, at most `executor.concurrency` at once per process (and at
//! most a tool's own `max_concurrency`, enforced by the tool registry); its
//! outcome goes back to the gate over a channel, which outlives gate sessions, so
//! an outcome whose partition moved while the call ran is still delivered — the
//! gate then hands it to the partition's new owner through `progress`.
//! The invoker never reads gate state.

use crate::config::Config;
use crate::contract::{Call, Progress, ProgressEvent};
use crate::telemetry::Metrics;
use crate::tools::ToolRegistry;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tokio::sync::{Semaphore, mpsc};

/// An invocation's outcome, in the partition of its step.
#[derive(Debug, Clone)]
pub struct Finished {
    pub partition: i32,
    pub progress: Progress,
    /// From the hand-over to the outcome (a wait for a pool slot included).
    pub took: std::time::Duration,
}

/// Starts invocations; their outcomes arrive on the receiver [`Invoker::new`]
/// returns.
#[derive(Clone)]
pub struct Invoker {
    tools: Arc<ToolRegistry>,
    pool: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    tx: mpsc::UnboundedSender<Finished>,
    running: Arc<AtomicUsize>,
}

impl Invoker {
    pub fn new(
        config: &Config,
        metrics: Arc<Metrics>,
    ) -> (Invoker, mpsc::UnboundedReceiver<Finished>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let invoker = Invoker {
            tools: Arc::new(ToolRegistry::new(
                &config.tools,
                config.executor.concurrency,
            )),
            pool: Arc::new(Semaphore::new(config.executor.concurrency.max(1))),
            metrics,
            tx,
            running: Arc::new(AtomicUsize::new(0)),
        };
        (invoker, rx)
    }

    /// Invocations started and not yet finished (queued for a slot included).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Run `call` (of a step in `partition`) as soon as a slot is free.
    pub fn start(&self, partition: i32, call: Call) {
        crash_point::before_invoke();
        self.running.fetch_add(1, Ordering::Relaxed);
        let (tools, pool, metrics, tx, running) = (
            self.tools.clone(),
            self.pool.clone(),
            self.metrics.clone(),
            self.tx.clone(),
            self.running.clone(),
        );
        // The step key (and the caller's trace) on every event of the invocation.
        let span = tracing::info_span!(
            "invoke",
            step = %call.step,
            dispatch = call.dispatch,
            traceparent = call.traceparent.as_deref().unwrap_or("")
        );
        let handed = Instant::now();
        let task = async move {
            // The pool is never closed, so acquiring only waits.
            let _slot = pool.acquire_owned().await;
            let t = Instant::now();
            let outcome = tools.invoke(&call).await;
            metrics.invoked(&call.step, outcome.label(), t.elapsed());
            crash_point::after_invoke();
            let progress = Progress {
                step: call.step,
                dispatch: call.dispatch,
                fast_ref: call.fast_ref,
                at_ms: chrono::Utc::now().timestamp_millis(),
                event: ProgressEvent::Finished { outcome },
            };
            running.fetch_sub(1, Ordering::Relaxed);
            // The receiver lives as long as the gate; after it, nothing to do.
            let _ = tx.send(Finished {
                partition,
                progress,
                took: handed.elapsed(),
            });
        };
        tokio::spawn(tracing::Instrument::instrument(task, span));
    }
}

/// Fault injection for the crash tests (unset in production):
/// `STEPGATE_TEST_CRASH_BEFORE_INVOKE=N` aborts the process when the N-th call is
/// handed over (after its `started` commit, before the tool is called);
/// `STEPGATE_TEST_CRASH_AFTER_INVOKE=N` aborts when the N-th call has returned,
/// before its outcome is committed.
mod crash_point {
    use std::sync::atomic::{AtomicU64, Ordering};

    fn hit(var: &str, count: &AtomicU64) {
        let Some(n) = std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()) else {
            return;
        };
        if count.fetch_add(1, Ordering::SeqCst) + 1 == n {
            eprintln!("{var}={n}: aborting");
            std::process::abort();
        }
    }

    pub fn before_invoke() {
        static N: AtomicU64 = AtomicU64::new(0);
        hit("STEPGATE_TEST_CRASH_BEFORE_INVOKE", &N);
    }

    pub fn after_invoke() {
        static N: AtomicU64 = AtomicU64::new(0);
        hit("STEPGATE_TEST_CRASH_AFTER_INVOKE", &N);
    }
}
