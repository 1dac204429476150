//! The sections of a gate's process: `[state]` (its RocksDB), `[gate]`,
//! `[executor]` (the invoker), `[http]` (metrics and health) and `[log]`.

use crate::duration::{Dur, dur};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The RocksDB block cache when none is configured (`state.block_cache_mib`).
pub const DEFAULT_BLOCK_CACHE_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Directory of the gate's RocksDB.
    pub path: PathBuf,
    /// How long a step record answers repeats after its last change.
    pub retention: Dur,
    /// How often expired records are purged.
    pub purge_interval: Dur,
    /// How long operators' decisions (the `commands` topic: resolutions,
    /// approvals, denials) are kept, for the audit; unset: forever. Applied by
    /// `stepgate topics create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions_retention: Option<Dur>,
    /// RocksDB block cache, in MiB, shared by every column family: data, index
    /// and filter blocks (so memory does not grow with the records).
    pub block_cache_mib: usize,
    /// Write the changelog's records compact: field names as numbers
    /// (`contract::codec::MSGPACK_NUMBERED_V2`), about half a settled step
    /// record's bytes. Every stepgate reads both forms; a release before the
    /// one that added it cannot read compact records, so turn it on once every
    /// gate, console and operator command reading this changelog runs one
    /// that can (docs/configuration.md).
    pub compact_changelog: bool,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            path: PathBuf::from("./stepgate-state"),
            retention: dur("7d"),
            purge_interval: dur("1m"),
            decisions_retention: None,
            block_cache_mib: DEFAULT_BLOCK_CACHE_BYTES >> 20,
            compact_changelog: false,
        }
    }
}

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
    pub check_partition: bool,
    /// With `check_partition`: an intent found outside its workflow's
    /// partition is re-routed there, in the gate's transaction, and answered in
    /// the partition it reached — whatever partitioner the agent's client used.
    /// `false` refuses it (`wrong_partition`) instead.
    pub forward_wrong_partition: bool,
    /// `/healthz` fails when the gate's loop has made no progress for this
    /// long (a stuck process is restarted by its orchestrator). Above the
    /// longest legitimate wait: a commit retried through a broker outage.
    pub stall_timeout: Dur,
    /// Record a step of a re-runnable recorded tool (`keyed`, or `idempotent`
    /// / `read_only` with `record = true`) as `started` before its call, as
    /// an `unkeyed` one is: two changelog records and two commits a step.
    /// `false` (the default) records it once, settled: its intent is the
    /// durable intent, and the partition's committed offset is held at it
    /// until then (docs/design.md "One record for a re-runnable step").
    pub start_record: bool,
    /// Send a `keyed` step's call as soon as its intent is decided, before
    /// the batch that decided it commits (its outcome then usually settles
    /// in that same batch: one commit a new step instead of two). A re-read
    /// runs the step again only with its one key; the cost is that a call
    /// that never reached its tool (`tool_unreachable`) is answered in doubt,
    /// since a gate that read the intent before this one may have sent it.
    /// Off by default: with it on, the three-node leader-kill test once left
    /// two keyed calls unanswered (a likely cause, in the gate's offsets, is
    /// fixed; docs/design.md "One commit for a keyed step").
    pub invoke_before_commit: bool,
    /// Answer a repeat of a step whose outcome is committed (`ok` or
    /// `error`, never `in_doubt`) at once, through an idempotent producer
    /// outside the batch's transaction, instead of in it: a repeat then takes
    /// one produce (~1 ms) rather than a commit (~4 ms). The repeat's offset
    /// is still committed in a transaction, only after its answer is
    /// acknowledged, so no answer is lost; the price is that a gate that
    /// crashes (or loses the partition) before that commit answers the repeat
    /// again when it is re-read: a second, identical answer to its `call_id`.
    /// Off by default: with it off, every `call_id` is answered exactly once
    /// (docs/design.md "Repeats answered at once").
    pub answer_repeats_at_once: bool,
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
            start_record: false,
            invoke_before_commit: false,
            answer_repeats_at_once: false,
        }
    }
}

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
    pub max_queued_calls: usize,
    /// ... and most bytes of their arguments.
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
