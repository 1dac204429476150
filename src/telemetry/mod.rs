//! Telemetry as typed events: each method logs and counts together.
//! Metric names follow `stepgate_<noun>_<unit>_total`; labels are bounded (tool,
//! category, status, reason), never a workflow id.

mod lifecycle;
mod server;
mod traces;

pub use server::{Health, serve};
pub use traces::{Decision, ToolSpan, Traces, TracesError};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};
use std::time::Duration;
use tracing::{info, warn};

/// The `tool` label of a tool that is not configured in this process.
pub const UNKNOWN_TOOL: &str = "unknown";

/// Every metric of one stepgate process.
pub struct Metrics {
    registry: Registry,
    /// The configured tools: the only values the `tool` label takes. A step's
    /// tool name comes from a record (an intent, a progress or changelog record
    /// written with another config), so labelling by it unchecked would let
    /// any producer create series without bound.
    tools: std::collections::BTreeSet<String>,
    intents_received: IntCounterVec,
    effectful_calls: IntCounterVec,
    steps_forwarded: IntCounterVec,
    fast_path_calls: IntCounterVec,
    repeats_answered: IntCounterVec,
    rephrased_retries: IntCounterVec,
    repeats_not_waiting: IntCounterVec,
    rejected_inputs: IntCounterVec,
    results_published: IntCounterVec,
    invocations: IntCounterVec,
    in_doubt_steps: IntCounterVec,
    reforwarded: IntCounterVec,
    pool_calls: IntCounterVec,
    pool_unclaimed: IntCounterVec,
    progress_refused: IntCounterVec,
    worker_calls_refused: IntCounterVec,
    late_outcomes: IntCounterVec,
    not_invoked: IntCounterVec,
    identity_conflicts: IntCounterVec,
    intents_forwarded: IntCounterVec,
    session_failures: IntCounterVec,
    operator_commands: IntCounterVec,
    approvals_requested: IntCounterVec,
    steps_purged: IntCounter,
    full_restores: IntCounter,
    outcomes_handed_over: IntCounter,
    restored_records: IntCounter,
    lost_commit_records: IntCounter,
    tool_latency: HistogramVec,
    answer_latency: HistogramVec,
    consumer_lag: prometheus::IntGaugeVec,
    open_steps: prometheus::IntGaugeVec,
    commit_latency: Histogram,
    state_write_latency: Histogram,
    state_records: IntGauge,
    invoker_queued_calls: IntGauge,
    invoker_queued_bytes: IntGauge,
    invoker_paused: IntGauge,
    invoker_pauses: IntCounter,
    invoker_wait: Histogram,
    state_disk_bytes: IntGauge,
    state_memory: prometheus::IntGaugeVec,
    /// Per intents partition: this gate's hold on it and its restore.
    partitions: PartitionGauges,
    /// The spans of each step (`[traces]`): nothing unless configured.
    traces: Traces,
    /// Held calls' lifecycle, reconcile lookups, notifications (`lifecycle.rs`).
    lifecycle: lifecycle::LifecycleMetrics,
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("metric names are valid");
    r.register(Box::new(c.clone()))
        .expect("each metric is registered once");
    c
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("metric names are valid");
    r.register(Box::new(c.clone()))
        .expect("each metric is registered once");
    c
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::IntGaugeVec {
    let g = prometheus::IntGaugeVec::new(Opts::new(name, help), labels)
        .expect("metric names are valid");
    r.register(Box::new(g.clone()))
        .expect("each metric is registered once");
    g
}

fn float_gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::GaugeVec {
    let g =
        prometheus::GaugeVec::new(Opts::new(name, help), labels).expect("metric names are valid");
    r.register(Box::new(g.clone()))
        .expect("each metric is registered once");
    g
}

/// Per intents partition (label `partition`): whether this process's gate
/// holds it and where its restore is. A partition it let go reads 0 in every
/// one of them rather than losing its series: `sum by (partition)
/// (stepgate_partition_owned)` over all gates then reads 0 when no other gate
/// took it (and 2 while a rebalance overlaps), which a missing series would
/// not say. The series are bounded by the partition count.
struct PartitionGauges {
    owned: prometheus::IntGaugeVec,
    ready: prometheus::IntGaugeVec,
    ready_since: prometheus::GaugeVec,
    restore_records: prometheus::IntGaugeVec,
    restore_seconds: prometheus::GaugeVec,
    standby: prometheus::IntGaugeVec,
    standby_lag: prometheus::IntGaugeVec,
    /// The partitions with series (the ones to zero when a session ends).
    seen: std::sync::Mutex<std::collections::BTreeSet<i32>>,
}

impl PartitionGauges {
    fn new(r: &Registry) -> Self {
        let l = &["partition"];
        let float = |name: &str, help: &str| float_gauge_vec(r, name, help, l);
        PartitionGauges {
            owned: gauge_vec(
                r,
                "stepgate_partition_owned",
                "1 while this gate is assigned the intents partition (restoring or ready), else 0.",
                l,
            ),
            ready: gauge_vec(
                r,
                "stepgate_partition_ready",
                "1 once the partition's state is restored and this gate serves it; 0 while it restores or when not owned.",
                l,
            ),
            ready_since: float(
                "stepgate_partition_ready_timestamp_seconds",
                "When the partition became ready here (Unix time); 0 while it restores or when not owned.",
            ),
            restore_records: gauge_vec(
                r,
                "stepgate_partition_restore_records",
                "Changelog records applied by the partition's current restore so far, or by its last one (0 when not owned).",
                l,
            ),
            restore_seconds: float(
                "stepgate_partition_restore_seconds",
                "How long the partition's current restore has run, or how long its last one took (0 when not owned).",
            ),
            standby: gauge_vec(
                r,
                "stepgate_partition_standby",
                "1 while this gate keeps a warm, read-only copy of a partition another gate owns (gate.standby_replicas), else 0.",
                l,
            ),
            standby_lag: gauge_vec(
                r,
                "stepgate_partition_standby_lag_records",
                "How far this gate's standby copy of the partition is behind its changelog's end (records and transaction markers; every 15 s); 0 when caught up or not a standby.",
                l,
            ),
            seen: Default::default(),
        }
    }

    /// `ready_since`: Unix milliseconds.
    fn set(&self, p: i32, owned: bool, ready_since: Option<i64>, records: usize, took: Duration) {
        let label = p.to_string();
        let l = &[label.as_str()];
        self.owned.with_label_values(l).set(i64::from(owned));
        self.ready
            .with_label_values(l)
            .set(i64::from(ready_since.is_some()));
        self.ready_since
            .with_label_values(l)
            .set(ready_since.map_or(0.0, |ms| ms as f64 / 1000.0));
        self.restore_records
            .with_label_values(l)
            .set(i64::try_from(records).unwrap_or(i64::MAX));
        self.restore_seconds
            .with_label_values(l)
            .set(took.as_secs_f64());
        self.seen.lock().expect("not poisoned").insert(p);
    }
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("metric names are valid");
    r.register(Box::new(g.clone()))
        .expect("each metric is registered once");
    g
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics with no configured tools: every `tool` label is [`UNKNOWN_TOOL`].
    pub fn new() -> Self {
        Self::with_tools(std::iter::empty::<String>())
    }

    /// Metrics whose `tool` label is one of `tools` (the configured names) or
    /// [`UNKNOWN_TOOL`].
    pub fn with_tools(tools: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let tools: std::collections::BTreeSet<String> = tools.into_iter().map(Into::into).collect();
        let r = Registry::new();
        let buckets = vec![
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        let tool_latency = HistogramVec::new(
            HistogramOpts::new(
                "stepgate_tool_latency_seconds",
                "Duration of one tool invocation, retries included.",
            )
            .buckets(buckets.clone()),
            &["tool"],
        )
        .expect("metric names are valid");
        r.register(Box::new(tool_latency.clone()))
            .expect("registered once");
        let answer_latency = HistogramVec::new(
            HistogramOpts::new(
                "stepgate_answer_latency_seconds",
                "From an intent's publication (its Kafka timestamp) to the commit of its answer.",
            )
            .buckets(buckets.clone()),
            &["deduplicated"],
        )
        .expect("metric names are valid");
        r.register(Box::new(answer_latency.clone()))
            .expect("registered once");
        // The running version, as a constant 1 (joined on in queries and
        // dashboards: which version is where during a rollout).
        let build_info = gauge_vec(
            &r,
            "stepgate_build_info",
            "The running stepgate's version (always 1).",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let open_steps = gauge_vec(
            &r,
            "stepgate_open_steps",
            "Steps waiting for a person in the partitions this process owns: phase=\"in_doubt\" (settle with `stepgate resolve`) or \"awaiting_approval\" (`stepgate approvals`).",
            &["phase"],
        );
        for phase in ["in_doubt", "awaiting_approval"] {
            open_steps.with_label_values(&[phase]).set(0);
        }
        let consumer_lag = gauge_vec(
            &r,
            "stepgate_consumer_lag",
            "Records not yet consumed, per group and partition (librdkafka statistics).",
            &["group", "topic", "partition"],
        );
        let state_memory = gauge_vec(
            &r,
            "stepgate_state_memory_bytes",
            "Memory held by the local state, by RocksDB's estimates: memtables, table_readers (index and filter blocks outside the cache), block_cache, block_cache_pinned.",
            &["part"],
        );
        let commit_latency = Histogram::with_opts(
            HistogramOpts::new(
                "stepgate_commit_latency_seconds",
                "Duration of committing one batch: synced state write and Kafka transaction.",
            )
            .buckets(buckets.clone()),
        )
        .expect("metric names are valid");
        r.register(Box::new(commit_latency.clone()))
            .expect("registered once");
        let invoker_wait = Histogram::with_opts(
            HistogramOpts::new(
                "stepgate_invoker_wait_seconds",
                "From a call's hand-over to the invoker to its pool slot (or to its not being invoked).",
            )
            .buckets(buckets.clone()),
        )
        .expect("metric names are valid");
        r.register(Box::new(invoker_wait.clone()))
            .expect("registered once");
        let state_write_latency = Histogram::with_opts(
            HistogramOpts::new(
                "stepgate_state_write_seconds",
                "Duration of one batch's synced RocksDB write (part of the commit; the rest is the Kafka transaction).",
            )
            .buckets(buckets),
        )
        .expect("metric names are valid");
        r.register(Box::new(state_write_latency.clone()))
            .expect("registered once");
        let intents_received = counter_vec(
            &r,
            "stepgate_intents_received_total",
            "Intents read from the intents topic, valid or not, by the tool they name (unknown when the intent names no configured tool or cannot be read); each counted once, by the gate that decides it (an intent re-routed to its workflow's partition there).",
            &["tool"],
        );
        let effectful_calls = counter_vec(
            &r,
            "stepgate_effectful_calls_total",
            "Calls of recorded tools (keyed, unkeyed, approval; read_only/idempotent with record = true) decided as a step: a new step, a re-run an operator allowed, or a repeat. Not fast-path calls, not refused ones. The dedup rate is stepgate_repeats_total / this, per tool.",
            &["tool"],
        );
        let repeats_answered = counter_vec(
            &r,
            "stepgate_repeats_total",
            "Repeats of a known step, by the step's state when the repeat arrived (completed or in_flight).",
            &["tool", "state"],
        );
        // Every configured tool's series of the dedup rate exist from the
        // start at 0: a series that first appears at 1 loses that first
        // increase to rate(), and a tool without repeats reads 0, not nothing.
        for tool in &tools {
            effectful_calls
                .with_label_values(&[tool.as_str()])
                .inc_by(0);
            for state in ["completed", "in_flight"] {
                repeats_answered
                    .with_label_values(&[tool.as_str(), state])
                    .inc_by(0);
            }
        }
        Metrics {
            intents_received,
            effectful_calls,
            steps_forwarded: counter_vec(
                &r,
                "stepgate_steps_forwarded_total",
                "New steps recorded and forwarded to executors.",
                &["tool", "category"],
            ),
            fast_path_calls: counter_vec(
                &r,
                "stepgate_fast_path_calls_total",
                "Calls of read-only/idempotent tools forwarded without a step record.",
                &["tool"],
            ),
            repeats_answered,
            rephrased_retries: counter_vec(
                &r,
                "stepgate_rephrased_retries_total",
                "Repeats whose arguments differ from the first call's.",
                &["tool"],
            ),
            repeats_not_waiting: counter_vec(
                &r,
                "stepgate_repeats_not_waiting_total",
                "Repeats of an in-flight step not added to its waiters: already_waiting (its call_id will be answered once) or over_budget (too many waiting: asked again, it is answered from the record).",
                &["why"],
            ),
            rejected_inputs: counter_vec(
                &r,
                "stepgate_rejected_inputs_total",
                "Inputs sent to the dead-letter topic, by reason.",
                &["reason"],
            ),
            results_published: counter_vec(
                &r,
                "stepgate_results_total",
                "Final answers published, by status and whether they were deduplicated.",
                &["status", "deduplicated"],
            ),
            invocations: counter_vec(
                &r,
                "stepgate_invocations_total",
                "Tool invocations by executors, by outcome.",
                &["tool", "outcome"],
            ),
            in_doubt_steps: counter_vec(
                &r,
                "stepgate_in_doubt_steps_total",
                "Steps declared in doubt (may have run, outcome unknown).",
                &["tool"],
            ),
            reforwarded: counter_vec(
                &r,
                "stepgate_reforwarded_total",
                "Calls forwarded again after their deadline, where re-running is safe.",
                &["tool"],
            ),
            pool_calls: counter_vec(
                &r,
                "stepgate_pool_calls_total",
                "Calls published for a worker pool (docs/design.md \"Worker pools\").",
                &["pool", "tool"],
            ),
            pool_unclaimed: counter_vec(
                &r,
                "stepgate_pool_unclaimed_total",
                "Pool calls no worker took before their deadline (answered `no_worker`): the pool has no live worker, or too few.",
                &["pool", "tool"],
            ),
            progress_refused: counter_vec(
                &r,
                "stepgate_progress_refused_total",
                "Records of `progress` that settle nothing, dead-lettered: reason is unreadable, signature (a worker's outcome not signed with its tool's pool key), not_pool_tool, not_invoked (a worker saying not_invoked), pool_handover (a gate's hand-over for a pool tool) or token (not its dispatch's token). Any but a rare token after a rebalance means someone writes `progress` who should not.",
                &["reason"],
            ),
            worker_calls_refused: counter_vec(
                &r,
                "stepgate_worker_calls_refused_total",
                "Records of a pool's calls topic a worker did not run: reason is signature (not signed with the pool's key: not written by a gate) or unreadable.",
                &["pool", "reason"],
            ),
            late_outcomes: counter_vec(
                &r,
                "stepgate_late_outcomes_total",
                "Outcomes that did not settle their step, kept as evidence: why is stale_dispatch (an older dispatch than the step's current one), after_in_doubt or after_settled.",
                &["tool", "why"],
            ),
            not_invoked: counter_vec(
                &r,
                "stepgate_calls_not_invoked_total",
                "Calls never invoked because, while they waited for a slot, their partition moved (partition_moved) or the process began to stop (stopping): handed to the step's owner, which runs them at once.",
                &["tool", "why"],
            ),
            session_failures: counter_vec(
                &r,
                "stepgate_gate_session_failures_total",
                "Gate sessions that failed and started over from the last commit, by reason (record_refused: Kafka refused a record for what it is; transaction, kafka, state, restore, unassigned, fatal_consumer, internal).",
                &["reason"],
            ),
            intents_forwarded: counter_vec(
                &r,
                "stepgate_intents_forwarded_total",
                "Intents found outside their workflow's partition (a client on another partitioner), re-routed to it and answered where they were published.",
                &["tool"],
            ),
            identity_conflicts: counter_vec(
                &r,
                "stepgate_identity_conflicts_total",
                "Repeats of a recorded step whose identity arguments differ (another call, not a retry): refused as identity_conflict, not run.",
                &["tool"],
            ),
            operator_commands: counter_vec(
                &r,
                "stepgate_operator_commands_total",
                "Operator commands (resolve, approve, deny) read by the gate, by action and whether they applied.",
                &["action", "applied"],
            ),
            approvals_requested: counter_vec(
                &r,
                "stepgate_approvals_requested_total",
                "Calls held for a person's approval.",
                &["tool"],
            ),
            steps_purged: counter(
                &r,
                "stepgate_steps_purged_total",
                "Step records removed at the end of their retention.",
            ),
            full_restores: counter(
                &r,
                "stepgate_state_full_restores_total",
                "Partitions restored from the start of their changelog (a new or lost disk, a local state older than the changelog's delete.retention.ms, a local batch the changelog does not show committed, or a recreated changelog) rather than from the offset the local state reflected.",
            ),
            outcomes_handed_over: counter(
                &r,
                "stepgate_outcomes_handed_over_total",
                "Outcomes of calls whose partition moved to another gate while they ran, handed to it through `progress`.",
            ),
            lost_commit_records: counter(
                &r,
                "stepgate_lost_commit_records_rewritten_total",
                "Records of transactions the broker acknowledged and then lost (a commit marker lost in a broker crash), written again by the gate.",
            ),
            restored_records: counter(
                &r,
                "stepgate_state_restored_records_total",
                "Changelog records applied while restoring partitions.",
            ),
            invoker_queued_calls: gauge(
                &r,
                "stepgate_invoker_queued_calls",
                "Calls handed to the invoker and not finished (running or waiting for a slot); bounded by executor.max_queued_calls.",
            ),
            invoker_queued_bytes: gauge(
                &r,
                "stepgate_invoker_queued_bytes",
                "Bytes of arguments of those calls; bounded by executor.max_queued_bytes.",
            ),
            invoker_paused: gauge(
                &r,
                "stepgate_intents_paused",
                "1 while the gate has paused reading intents because the invoker is full (backpressure), else 0.",
            ),
            invoker_pauses: counter(
                &r,
                "stepgate_intents_pauses_total",
                "Times the gate paused reading intents because the invoker was full.",
            ),
            invoker_wait,
            state_records: gauge(
                &r,
                "stepgate_state_records",
                "Estimated step records in the local state.",
            ),
            state_disk_bytes: gauge(
                &r,
                "stepgate_state_disk_bytes",
                "Live on-disk size of the local state.",
            ),
            state_memory,
            partitions: PartitionGauges::new(&r),
            tool_latency,
            answer_latency,
            consumer_lag,
            open_steps,
            commit_latency,
            state_write_latency,
            lifecycle: lifecycle::LifecycleMetrics::new(&r),
            registry: r,
            tools,
            traces: Traces::disabled(),
        }
    }

    /// The same, exporting the spans of each step through `traces`.
    pub fn with_traces(self, traces: Traces) -> Self {
        Metrics { traces, ..self }
    }

    /// The spans of each step (disabled unless `[traces]` is configured).
    pub fn traces(&self) -> &Traces {
        &self.traces
    }

    /// The `tool` label of `name`: itself when configured, else [`UNKNOWN_TOOL`].
    pub fn tool_label<'a>(&self, name: &'a str) -> &'a str {
        if self.tools.contains(name) {
            name
        } else {
            UNKNOWN_TOOL
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding into memory cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }

    /// An intent read (not a re-read, not a re-routed copy), naming `tool`
    /// (`None` when it could not be read or names no configured tool).
    pub fn intent_received(&self, tool: Option<&str>) {
        let tool = tool.map_or(UNKNOWN_TOOL, |t| self.tool_label(t));
        self.intents_received.with_label_values(&[tool]).inc();
    }

    /// A call of a recorded tool decided as a step (new, re-run or repeat):
    /// the denominator of the dedup rate.
    pub fn effectful_call(&self, step: &crate::contract::StepKey) {
        self.effectful_calls
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    pub fn step_forwarded(&self, step: &crate::contract::StepKey, category: &str) {
        tracing::debug!(step = %step, category, "new step recorded and forwarded");
        self.steps_forwarded
            .with_label_values(&[self.tool_label(&step.tool), category])
            .inc();
    }

    pub fn fast_path_call(&self, step: &crate::contract::StepKey) {
        tracing::debug!(step = %step, "fast-path call forwarded");
        self.fast_path_calls
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    pub fn repeat(&self, step: &crate::contract::StepKey, in_flight: bool, rephrased: bool) {
        let state = if in_flight { "in_flight" } else { "completed" };
        tracing::debug!(step = %step, state, rephrased, "repeat of a known step: not forwarded");
        self.repeats_answered
            .with_label_values(&[self.tool_label(&step.tool), state])
            .inc();
        if rephrased {
            self.rephrased_retries
                .with_label_values(&[self.tool_label(&step.tool)])
                .inc();
        }
    }

    /// A repeat of an in-flight step not kept waiting for its answer, and why
    /// (`already_waiting`, `over_budget`).
    pub fn repeat_not_waiting(&self, why: &'static str) {
        self.repeats_not_waiting.with_label_values(&[why]).inc();
    }

    pub fn rejected(&self, reason: &str, message: &str, partition: i32, offset: i64) {
        warn!(
            reason,
            partition, offset, message, "input refused: sent to the dead-letter topic"
        );
        self.rejected_inputs.with_label_values(&[reason]).inc();
    }

    pub fn result_published(&self, status: &str, deduplicated: bool, latency: Option<Duration>) {
        let dedup = if deduplicated { "true" } else { "false" };
        self.results_published
            .with_label_values(&[status, dedup])
            .inc();
        if let Some(l) = latency {
            self.answer_latency
                .with_label_values(&[dedup])
                .observe(l.as_secs_f64());
        }
    }

    /// Consumer lag of one partition, from librdkafka's statistics.
    pub fn consumer_lag(&self, group: &str, topic: &str, partition: i32, lag: i64) {
        self.consumer_lag
            .with_label_values(&[group, topic, &partition.to_string()])
            .set(lag);
    }

    /// Forget the lag of a partition this process no longer consumes: its
    /// last value would otherwise stay exported (and summed) forever.
    pub fn forget_consumer_lag(&self, group: &str, topic: &str, partition: i32) {
        let _ = self
            .consumer_lag
            .remove_label_values(&[group, topic, &partition.to_string()]);
    }

    pub fn invoked(&self, step: &crate::contract::StepKey, outcome: &str, took: Duration) {
        tracing::debug!(step = %step, outcome, took_ms = took.as_millis() as u64, "tool invoked");
        self.invocations
            .with_label_values(&[self.tool_label(&step.tool), outcome])
            .inc();
        self.tool_latency
            .with_label_values(&[self.tool_label(&step.tool)])
            .observe(took.as_secs_f64());
    }

    pub fn in_doubt(&self, step: &crate::contract::StepKey, why: &str) {
        warn!(step = %step, why, "step is in doubt: it may have run, its outcome is unknown");
        self.in_doubt_steps
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    pub fn reforwarded(&self, step: &crate::contract::StepKey, dispatch: u32) {
        warn!(step = %step, dispatch, "no outcome by the deadline: forwarded again (safe for this tool)");
        self.reforwarded
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    /// A call published on its pool's calls topic (with its `started` record).
    pub fn pool_call(&self, pool: &str, step: &crate::contract::StepKey) {
        self.pool_calls
            .with_label_values(&[pool, self.tool_label(&step.tool)])
            .inc();
    }

    /// A pool call no worker took before its deadline.
    pub fn pool_unclaimed(&self, pool: &str, step: &crate::contract::StepKey) {
        warn!(step = %step, pool, "no worker of the pool took the call before its deadline: answered no_worker (nothing was invoked)");
        self.pool_unclaimed
            .with_label_values(&[pool, self.tool_label(&step.tool)])
            .inc();
    }

    /// A record of `progress` refused (its log line is its DLQ copy's).
    pub fn progress_refused(&self, reason: &str) {
        self.progress_refused.with_label_values(&[reason]).inc();
    }

    /// A record of a pool's calls topic its worker did not run.
    pub fn worker_call_refused(&self, pool: &str, reason: &str, partition: i32, offset: i64) {
        warn!(
            pool,
            reason,
            partition,
            offset,
            "a record of the pool's calls topic was not run: not a Call v1 signed with the pool's key (only gates write it); its offset is committed past"
        );
        self.worker_calls_refused
            .with_label_values(&[pool, reason])
            .inc();
    }

    /// An outcome that did not settle its step (`why`: see the metric's help),
    /// kept on the step record as evidence.
    pub fn late_outcome(
        &self,
        step: &crate::contract::StepKey,
        dispatch: u32,
        current: u32,
        outcome: &str,
        why: &str,
    ) {
        warn!(step = %step, dispatch, current, outcome, why, "an outcome that does not settle its step: kept on the step record for the operator");
        self.late_outcomes
            .with_label_values(&[self.tool_label(&step.tool), why])
            .inc();
    }

    pub fn operator_command(
        &self,
        step: &crate::contract::StepKey,
        action: &str,
        by: &str,
        problem: Option<&str>,
    ) {
        match problem {
            None => info!(step = %step, action, by, "operator command applied"),
            Some(p) => {
                warn!(step = %step, action, by, problem = p, "operator command not applicable: sent to the DLQ")
            }
        }
        let applied = if problem.is_none() { "true" } else { "false" };
        self.operator_commands
            .with_label_values(&[action, applied])
            .inc();
    }

    pub fn approval_requested(&self, step: &crate::contract::StepKey) {
        info!(step = %step, "call held for approval");
        self.approvals_requested
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    pub fn purged(&self, n: usize) {
        if n > 0 {
            info!(records = n, "expired step records purged");
            self.steps_purged.inc_by(n as u64);
        }
    }

    /// A partition restored from its changelog's start, and why
    /// (`state::FullReason::label`).
    pub fn full_restore(&self, partition: i32, reason: &str) {
        info!(
            partition,
            reason, "the partition's state was restored from its changelog's start"
        );
        self.full_restores.inc();
    }

    /// A call of `bytes` of arguments handed to the invoker (`+1`) or
    /// finished there (`-1`).
    pub fn invoker_queue(&self, delta: i64, bytes: usize) {
        self.invoker_queued_calls.add(delta);
        self.invoker_queued_bytes.add(delta * bytes as i64);
    }

    pub fn invoker_waited(&self, waited: Duration) {
        self.invoker_wait.observe(waited.as_secs_f64());
    }

    pub fn intents_paused(&self, paused: bool) {
        if paused {
            self.invoker_pauses.inc();
        }
        self.invoker_paused.set(i64::from(paused));
    }

    pub fn session_failed(&self, reason: &str) {
        self.session_failures.with_label_values(&[reason]).inc();
    }

    pub fn intent_forwarded(&self, tool: &str) {
        self.intents_forwarded
            .with_label_values(&[self.tool_label(tool)])
            .inc();
    }

    pub fn identity_conflict(&self, step: &crate::contract::StepKey) {
        info!(step = %step, "a repeat of a recorded step names another call (its identity arguments differ): refused, not run");
        self.identity_conflicts
            .with_label_values(&[self.tool_label(&step.tool)])
            .inc();
    }

    pub fn not_invoked(&self, step: &crate::contract::StepKey, why: &str) {
        info!(step = %step, why, "a queued call is not invoked here: handed to its step's owner as not invoked");
        self.not_invoked
            .with_label_values(&[self.tool_label(&step.tool), why])
            .inc();
    }

    pub fn outcome_handed_over(&self, partition: i32, step: &crate::contract::StepKey) {
        info!(partition, step = %step, "a call finished after its partition moved: its outcome is handed to the partition's owner through progress");
        self.outcomes_handed_over.inc();
    }

    pub fn restored(&self, partition: i32, records: usize, took: Duration) {
        info!(
            partition,
            records,
            took_ms = took.as_millis() as u64,
            "partition state restored from the changelog"
        );
        self.restored_records.inc_by(records as u64);
    }

    /// A partition assigned to this gate whose state is being brought up
    /// (its committed offset looked up, its changelog read): owned, not ready.
    pub fn partition_restoring(&self, partition: i32) {
        self.partitions
            .set(partition, true, None, 0, Duration::ZERO);
    }

    /// How far a running restore of `partition` has got.
    pub fn partition_restore_progress(&self, partition: i32, records: usize, took: Duration) {
        self.partitions.set(partition, true, None, records, took);
    }

    /// The partition's state is restored (`records` applied in `took`): the
    /// gate serves it from now on.
    pub fn partition_ready(&self, partition: i32, records: usize, took: Duration) {
        let now = chrono::Utc::now().timestamp_millis();
        self.partitions
            .set(partition, true, Some(now), records, took);
    }

    /// This gate keeps a standby copy of `partition` this far behind its
    /// changelog's end (`Some`), or no longer keeps one (`None`).
    pub fn standby(&self, partition: i32, lag: Option<i64>) {
        let label = partition.to_string();
        let l = &[label.as_str()];
        self.partitions
            .standby
            .with_label_values(l)
            .set(i64::from(lag.is_some()));
        self.partitions
            .standby_lag
            .with_label_values(l)
            .set(lag.unwrap_or(0).max(0));
    }

    /// The partition was revoked from this gate.
    pub fn partition_released(&self, partition: i32) {
        self.partitions
            .set(partition, false, None, 0, Duration::ZERO);
    }

    /// The gate's session ended: it holds no partition until the next one is
    /// assigned its own.
    pub fn partitions_released(&self) {
        let seen: Vec<i32> = self
            .partitions
            .seen
            .lock()
            .expect("not poisoned")
            .iter()
            .copied()
            .collect();
        for p in seen {
            self.partition_released(p);
        }
    }

    pub fn lost_commit_rewritten(&self, records: usize) {
        self.lost_commit_records.inc_by(records as u64);
    }

    pub fn committed(&self, took: Duration) {
        self.commit_latency.observe(took.as_secs_f64());
    }

    pub fn state_written(&self, took: Duration) {
        self.state_write_latency.observe(took.as_secs_f64());
    }

    /// Steps waiting for a person, over the partitions this process owns.
    pub fn open_steps(&self, in_doubt: u64, awaiting_approval: u64) {
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.open_steps
            .with_label_values(&["in_doubt"])
            .set(g(in_doubt));
        self.open_steps
            .with_label_values(&["awaiting_approval"])
            .set(g(awaiting_approval));
    }

    /// The state's size: step records, bytes on disk, and memory by where it
    /// is held (`memtables`, `block_cache`, …).
    pub fn state_size(&self, steps: u64, disk_bytes: u64, memory: &[(&'static str, u64)]) {
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.state_records.set(g(steps));
        self.state_disk_bytes.set(g(disk_bytes));
        for (part, v) in memory {
            self.state_memory.with_label_values(&[part]).set(g(*v));
        }
    }
}

/// Structured logs to stderr, `pretty` or `json`; `RUST_LOG` overrides the level.
pub fn init_logging(cfg: &crate::config::LogConfig) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if cfg.format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// An error with its causes, `outer: inner: …`, for log lines.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::StepKey;

    fn step(tool: &str) -> StepKey {
        StepKey {
            workflow_id: "w".into(),
            step_index: 0,
            tool: tool.into(),
            attempt: 0,
        }
    }

    #[test]
    fn the_tool_label_takes_only_configured_names() {
        let m = Metrics::with_tools(["send_email"]);
        m.step_forwarded(&step("send_email"), "keyed");
        // Names no one configured, as records from elsewhere may carry them.
        for n in 0..50 {
            m.step_forwarded(&step(&format!("made-up-{n}")), "keyed");
            m.invoked(&step(&format!("made-up-{n}")), "ok", Duration::ZERO);
            m.late_outcome(&step(&format!("made-up-{n}")), 1, 1, "ok", "after_in_doubt");
        }
        let out = m.render();
        assert!(!out.contains("made-up"), "{out}");
        assert!(
            out.contains(r#"stepgate_steps_forwarded_total{category="keyed",tool="send_email"} 1"#),
            "{out}"
        );
        assert!(
            out.contains(r#"stepgate_steps_forwarded_total{category="keyed",tool="unknown"} 50"#),
            "{out}"
        );
        assert!(
            out.contains(r#"stepgate_late_outcomes_total{tool="unknown",why="after_in_doubt"} 50"#),
            "{out}"
        );
        // Without configured tools, every name is unknown.
        assert_eq!(Metrics::new().tool_label("send_email"), UNKNOWN_TOOL);
    }

    #[test]
    fn a_partitions_gauges_follow_its_assignment_restore_and_release() {
        let m = Metrics::new();
        let has = |line: &str| {
            let out = m.render();
            assert!(out.lines().any(|l| l == line), "no `{line}` in:\n{out}");
        };
        m.partition_restoring(0);
        m.partition_restoring(1);
        has(r#"stepgate_partition_owned{partition="0"} 1"#);
        has(r#"stepgate_partition_ready{partition="0"} 0"#);
        m.partition_restore_progress(0, 20_000, Duration::from_millis(1500));
        has(r#"stepgate_partition_restore_records{partition="0"} 20000"#);
        has(r#"stepgate_partition_restore_seconds{partition="0"} 1.5"#);
        has(r#"stepgate_partition_ready_timestamp_seconds{partition="0"} 0"#);
        let before = chrono::Utc::now().timestamp() as f64;
        m.partition_ready(0, 25_000, Duration::from_secs(2));
        has(r#"stepgate_partition_ready{partition="0"} 1"#);
        has(r#"stepgate_partition_restore_records{partition="0"} 25000"#);
        has(r#"stepgate_partition_restore_seconds{partition="0"} 2"#);
        let out = m.render();
        let since: f64 = out
            .lines()
            .find_map(|l| {
                l.strip_prefix(r#"stepgate_partition_ready_timestamp_seconds{partition="0"} "#)
            })
            .expect("ready since")
            .parse()
            .unwrap();
        assert!(since >= before && since < before + 60.0, "{since}");
        // Revoked: every gauge of the partition reads 0; the other is untouched.
        m.partition_released(0);
        has(r#"stepgate_partition_owned{partition="0"} 0"#);
        has(r#"stepgate_partition_ready{partition="0"} 0"#);
        has(r#"stepgate_partition_restore_records{partition="0"} 0"#);
        has(r#"stepgate_partition_ready_timestamp_seconds{partition="0"} 0"#);
        has(r#"stepgate_partition_owned{partition="1"} 1"#);
        // A session's end lets go of all.
        m.partition_ready(1, 0, Duration::ZERO);
        m.partitions_released();
        has(r#"stepgate_partition_owned{partition="1"} 0"#);
        has(r#"stepgate_partition_ready{partition="1"} 0"#);
    }

    #[test]
    fn the_build_is_exported_and_a_revoked_partitions_lag_is_forgotten() {
        let m = Metrics::new();
        let version = env!("CARGO_PKG_VERSION");
        assert!(
            m.render()
                .contains(&format!(r#"stepgate_build_info{{version="{version}"}} 1"#))
        );
        m.consumer_lag("g", "t", 0, 5);
        m.consumer_lag("g", "t", 1, 7);
        m.forget_consumer_lag("g", "t", 0);
        let out = m.render();
        assert!(!out.contains(r#"partition="0""#), "{out}");
        assert!(out.contains(r#"partition="1",topic="t"} 7"#), "{out}");
    }
}
