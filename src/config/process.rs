//! The sections of a gate's process: `[state]` (its RocksDB), `[gate]`,
//! `[executor]` (the invoker), `[http]` (metrics and health) and `[log]`.

use crate::duration::{Dur, dur};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The RocksDB block cache when none is configured (`state.block_cache_mib`).
pub const DEFAULT_BLOCK_CACHE_BYTES: usize = 64 << 20;

/// `[state]`: the gate's local state, a RocksDB that caches what its
/// partitions' changelog holds, and how long step records answer repeats.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Directory of the gate's RocksDB.
    pub path: PathBuf,
    /// How long a step record answers repeats after its last change.
    pub retention: Dur,
    /// How often expired records are purged.
    ///
    /// Advanced: a purge only frees space; records past `retention` are never
    /// used to answer, whenever they are purged.
    pub purge_interval: Dur,
    /// How long operators' decisions (the `commands` topic: resolutions,
    /// approvals, denials) are kept, for the audit; unset: forever. Applied by
    /// `stepgate topics create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions_retention: Option<Dur>,
    /// RocksDB block cache, in MiB, shared by every column family: data, index
    /// and filter blocks (so memory does not grow with the records).
    pub block_cache_mib: usize,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            path: PathBuf::from("./stepgate-state"),
            retention: dur("7d"),
            purge_interval: dur("1m"),
            decisions_retention: None,
            block_cache_mib: DEFAULT_BLOCK_CACHE_BYTES >> 20,
        }
    }
}

/// `[gate]`: how the gate batches its inputs into transactions, when it
/// declares a call in doubt, and which intents it accepts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateConfig {
    /// Most inputs in one batch (one Kafka transaction). A batch closes when the
    /// previous one's commit returns, or when it holds this many.
    pub max_batch: usize,
    /// Under load, a batch fills before it closes: when the previous commit
    /// returns and the open batch already holds an eighth of `max_batch`
    /// inputs and outcomes (they arrive faster than one commit takes them;
    /// behind a full invoker, only outcomes do), it stays
    /// open until it holds `max_batch` or is this old. Fewer, larger
    /// transactions: each costs the broker 1–2 ms of CPU whatever it
    /// holds. A busy gate's answers wait up to this much longer; an idle
    /// one's never do. `0s` closes every batch as soon as the commit before
    /// it returns.
    ///
    /// Advanced: it changes how a busy gate groups its inputs into
    /// transactions, never what it decides.
    pub busy_batch_age: Dur,
    /// Added to a tool's own deadline before a started call with no outcome is
    /// declared in doubt (or re-run, when re-running is safe).
    pub in_doubt_grace: Dur,
    /// Largest accepted intent, in bytes.
    pub max_intent_bytes: usize,
    /// Refuse an intent found outside its workflow's partition (murmur2 of the
    /// `workflow_id`, as Kafka's Java client and stepgate's clients partition):
    /// a step is deduplicated only within one partition, so a retry published
    /// elsewhere could run again. `false` accepts any partition — only for
    /// producers with a partitioner of their own that never changes.
    ///
    /// Advanced: with `false`, a producer that ever publishes a workflow's
    /// steps to two partitions can have a step run twice.
    pub check_partition: bool,
    /// With `check_partition`: an intent found outside its workflow's
    /// partition is re-routed there, in the gate's transaction, and answered in
    /// the partition it reached — whatever partitioner the agent's client used.
    /// `false` refuses it (`wrong_partition`) instead.
    ///
    /// Advanced: `false` only when every producer is known to partition as
    /// stepgate does.
    pub forward_wrong_partition: bool,
    /// `/healthz` fails when the gate's loop has made no progress for this
    /// long (a stuck process is restarted by its orchestrator). Above the
    /// longest legitimate wait: a commit retried through a broker outage.
    pub stall_timeout: Dur,
    /// How many other gates of the group keep a warm, read-only copy of each
    /// partition (following its changelog), placed where the group's range
    /// assignment moves the partition when a gate leaves: a gate taking a
    /// partition over then reads only the tail of its changelog, not all of
    /// it. Each copy costs its gate the partition's disk and the reading of
    /// its changelog. `0`: none (a takeover restores from the changelog's
    /// start); a one-gate group keeps none whatever this says.
    pub standby_replicas: usize,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            max_batch: 2000,
            busy_batch_age: dur("100ms"),
            in_doubt_grace: dur("30s"),
            max_intent_bytes: 1024 * 1024,
            check_partition: true,
            forward_wrong_partition: true,
            stall_timeout: dur("5m"),
            standby_replicas: 1,
        }
    }
}

/// `[executor]`: the invoker, which calls the tools: how many calls run at
/// once, how many may wait, and how long a stopping process lets them finish.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutorConfig {
    /// Most tool calls running at once in this process (the invoker pool); a
    /// tool's `max_concurrency` bounds it further for that tool.
    pub concurrency: usize,
    /// On shutdown, how long in-flight calls may finish before the process exits
    /// (unfinished ones stay `started` and the gate's deadline settles them).
    pub drain_timeout: Dur,
    /// Most calls handed to the invoker and not finished (running, or queued
    /// for a slot). At this, the gate pauses reading `intents` until a quarter
    /// has drained: a flood behind a slow tool waits in Kafka, not in memory.
    ///
    /// Advanced: it bounds memory, not throughput; keep it well above
    /// `concurrency`.
    pub max_queued_calls: usize,
    /// Most bytes of arguments of the calls handed to the invoker and not
    /// finished; at this, as at `max_queued_calls`, the gate pauses reading
    /// `intents`.
    ///
    /// Advanced: it bounds memory, not throughput.
    pub max_queued_bytes: usize,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            concurrency: 64,
            drain_timeout: dur("20s"),
            max_queued_calls: 1024,
            max_queued_bytes: 64 << 20,
        }
    }
}

/// `[http]`: where the gate serves its metrics and health checks.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz` and `/readyz`; empty to disable.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

/// `[log]`: the process's log lines, on standard error.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `pretty` or `json`.
    pub format: String,
    /// A tracing filter, e.g. `info` or `stepgate=debug,rdkafka=warn`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: "pretty".into(),
            level: "info".into(),
        }
    }
}
