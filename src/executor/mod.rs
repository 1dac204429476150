//! The invoker: runs the tool calls of the steps the gate owns, in this process.
//!
//! The gate hands a call over once it may run: a recorded step's once the
//! transaction that decided it has committed; a new `keyed` step's and a
//! fast-path read's as soon as they are decided, their intent's offset held
//! until they are answered (docs/design.md "The path of a message"). Each
//! call runs as a task, at most `executor.concurrency` at once per process (and at
//! most a tool's own `max_concurrency`, enforced by the tool registry); its
//! outcome goes back to the gate over a channel, which outlives gate sessions, so
//! an outcome whose partition moved while the call ran is still delivered — the
//! gate then hands it to the partition's new owner through `progress`.
//! The invoker never reads gate state.
//!
//! A call waits for a pool slot, and a partition may move meanwhile, or the
//! process be told to stop: so just before the tool is invoked, the call's
//! partition must still be owned here and the process not stopping
//! ([`Ownership`]). A call that fails the check — at once, when ownership
//! changes while it waits — is never invoked and reports
//! [`ProgressEvent::NotInvoked`]: its step's owner may run it at once, and never
//! answers it `in_doubt`.
//!
//! The calls handed over and not finished are bounded
//! (`executor.max_queued_calls`, `executor.max_queued_bytes` of arguments):
//! [`Invoker::is_full`] tells the gate to pause reading `intents` (Kafka keeps
//! the flood, not this process's memory), [`Invoker::has_room`] to resume.

use crate::config::Config;
use crate::contract::{Call, Progress, ProgressEvent};
use crate::telemetry::Metrics;
use crate::tools::ToolRegistry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tokio::sync::{Semaphore, mpsc, watch};

/// Which partitions this process owns — each with the epoch it was taken in
/// — and whether it is stopping: what a queued call checks just before its
/// tool is invoked. Set by the gate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owned {
    pub partitions: BTreeMap<i32, u64>,
    pub stopping: bool,
    next_epoch: u64,
}

impl Owned {
    /// A call taken in `epoch` may be invoked: its partition has been owned
    /// here without a break since (a partition that moved away and back has
    /// a new epoch), and the process is not stopping.
    fn may_invoke(&self, partition: i32, epoch: Option<u64>) -> bool {
        !self.stopping && epoch.is_some() && self.partitions.get(&partition).copied() == epoch
    }
}

/// The gate's side of [`Owned`]: shared with every queued call, which is woken
/// when it changes.
#[derive(Clone)]
pub struct Ownership(Arc<watch::Sender<Owned>>);

impl Ownership {
    fn new() -> Self {
        Ownership(Arc::new(watch::Sender::new(Owned::default())))
    }

    /// Partitions this process now owns (their calls may be invoked); one
    /// already owned keeps its epoch.
    pub fn add(&self, partitions: impl IntoIterator<Item = i32>) {
        let added: Vec<i32> = partitions.into_iter().collect();
        self.0.send_if_modified(|o| {
            let mut changed = false;
            for p in added {
                if !o.partitions.contains_key(&p) {
                    o.next_epoch += 1;
                    o.partitions.insert(p, o.next_epoch);
                    changed = true;
                }
            }
            changed
        });
    }

    /// Partitions this process no longer owns: their queued calls are not invoked.
    pub fn remove(&self, partitions: impl IntoIterator<Item = i32>) {
        let gone: Vec<i32> = partitions.into_iter().collect();
        self.0.send_if_modified(|o| {
            let before = o.partitions.len();
            o.partitions.retain(|p, _| !gone.contains(p));
            o.partitions.len() != before
        });
    }

    /// Owns nothing (a session ended: its partitions may go elsewhere).
    pub fn clear(&self) {
        self.0.send_if_modified(|o| {
            let had = !o.partitions.is_empty();
            o.partitions.clear();
            had
        });
    }

    /// Stopping (SIGTERM): calls that have not started are not invoked.
    pub fn stop(&self) {
        self.0
            .send_if_modified(|o| !std::mem::replace(&mut o.stopping, true));
    }

    /// A view of what the gate owns, for its standby replicas
    /// (`gate::standby`): a [`watch::Receiver::borrow`] held blocks the
    /// gate's changes until it is dropped.
    pub fn watch(&self) -> watch::Receiver<Owned> {
        self.0.subscribe()
    }

    /// The epoch in which `partition` is owned now, if it is.
    fn epoch(&self, partition: i32) -> Option<u64> {
        self.0.borrow().partitions.get(&partition).copied()
    }
}

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
    /// Bytes of the arguments of the calls counted in `running`.
    queued_bytes: Arc<AtomicUsize>,
    max_calls: usize,
    max_bytes: usize,
    ownership: Ownership,
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
            queued_bytes: Arc::new(AtomicUsize::new(0)),
            max_calls: config.executor.max_queued_calls.max(1),
            max_bytes: config.executor.max_queued_bytes.max(1),
            ownership: Ownership::new(),
        };
        (invoker, rx)
    }

    /// What the gate tells its calls about ownership.
    pub fn ownership(&self) -> &Ownership {
        &self.ownership
    }

    /// Invocations started whose outcome is not yet on the channel (queued
    /// for a slot included).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// At its bound of queued calls or bytes: take no more intents in.
    pub fn is_full(&self) -> bool {
        self.running() >= self.max_calls
            || self.queued_bytes.load(Ordering::Acquire) >= self.max_bytes
    }

    /// Drained to three quarters of both bounds: take intents in again (the
    /// gap keeps a full invoker from pausing and resuming on every call).
    pub fn has_room(&self) -> bool {
        self.running() <= self.max_calls / 4 * 3
            && self.queued_bytes.load(Ordering::Acquire) <= self.max_bytes / 4 * 3
    }

    /// Run `call` (of a step in `partition`) as soon as a slot is free.
    pub fn start(&self, partition: i32, call: Call) {
        if !call.is_lookup() {
            crate::hooks::crash_before_invoke();
        }
        let bytes = call.arguments.text_len();
        self.running.fetch_add(1, Ordering::AcqRel);
        self.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.metrics.invoker_queue(1, bytes);
        let (tools, pool, metrics, tx, running, all_bytes) = (
            self.tools.clone(),
            self.pool.clone(),
            self.metrics.clone(),
            self.tx.clone(),
            self.running.clone(),
            self.queued_bytes.clone(),
        );
        let mut owned = self.ownership.0.subscribe();
        // Taken now: a call handed over before its partition is owned here
        // (or after it left) is never invoked.
        let epoch = self.ownership.epoch(partition);
        // The step key (and the caller's trace) on every event of the invocation.
        let span = tracing::info_span!(
            "invoke",
            step = %call.step,
            dispatch = call.dispatch,
            traceparent = call.traceparent.as_deref().unwrap_or("")
        );
        let handed = Instant::now();
        let task = async move {
            let mut call = call;
            // Wait for a slot, unless the call may no longer be invoked here
            // (the pool is never closed, so acquiring only waits).
            let slot = tokio::select! {
                biased;
                _ = owned.wait_for(|o| !o.may_invoke(partition, epoch)) => None,
                slot = pool.acquire_owned() => slot.ok(),
            };
            metrics.invoker_waited(handed.elapsed());
            // Checked again with the slot held: nothing is invoked for a
            // partition this process no longer owns, or while it stops.
            // (A tool's own slots are waited for inside the registry: the
            // check is made again there, until a try is sent.)
            let t = Instant::now();
            // The `execute_tool` span (when traced), under the decision that
            // started the call; the tool is sent its traceparent.
            // A reconcile lookup is no run of its tool: neither a span nor
            // an invocation of it (it is counted where it is settled).
            let span = match slot {
                Some(_) if !call.is_lookup() => metrics.traces().execute_tool(&call),
                _ => crate::telemetry::ToolSpan::none(),
            };
            if let Some(tp) = span.traceparent() {
                call.traceparent = Some(tp);
            }
            let invoked = match slot {
                Some(_slot) => {
                    tools
                        .invoke_if(&call, &|| owned.borrow().may_invoke(partition, epoch))
                        .await
                }
                None => None,
            };
            let event = match invoked {
                Some(outcome) if call.is_lookup() => ProgressEvent::Finished { outcome },
                Some(outcome) => {
                    span.finished(&outcome);
                    metrics.invoked(&call.step, outcome.label(), t.elapsed());
                    crate::hooks::crash_after_invoke();
                    ProgressEvent::Finished { outcome }
                }
                None => {
                    let why = if owned.borrow().stopping {
                        "stopping"
                    } else {
                        "partition_moved"
                    };
                    span.not_invoked(why);
                    metrics.not_invoked(&call.step, why);
                    ProgressEvent::NotInvoked
                }
            };
            let progress = Progress {
                step: call.step,
                dispatch: call.dispatch,
                fast_ref: call.fast_ref,
                at_ms: chrono::Utc::now().timestamp_millis(),
                token: call.token,
                event,
            };
            // The receiver lives as long as the gate; after it, nothing to do.
            let _ = tx.send(Finished {
                partition,
                progress,
                took: handed.elapsed(),
            });
            // After the send: once `running()` reads 0, every outcome is on
            // the channel (a drain that stops then misses none).
            all_bytes.fetch_sub(bytes, Ordering::AcqRel);
            running.fetch_sub(1, Ordering::AcqRel);
            metrics.invoker_queue(-1, bytes);
        };
        tokio::spawn(tracing::Instrument::instrument(task, span));
    }
}
