//! The records a batch publishes, built in one place: answers, approval
//! events, re-routed intents, dead letters, hand-overs on `progress`, pool
//! calls and changelog records, from what the core decided.

use super::batch::OpenBatch;
use super::{Out, now_ms};
use crate::config::Config;
use crate::contract::headers::{SIGNATURE, TRACEPARENT};
use crate::contract::sign::{Signed, sign};
use crate::contract::{Call, Progress, ToolResult, codec};
use crate::kafka::OutRecord;
use crate::state::Batch;
use std::collections::BTreeSet;

/// What a closing batch publishes, and what its commit then starts.
#[derive(Default)]
pub(super) struct BatchRecords {
    /// Its records, in the order they are produced.
    pub records: Vec<OutRecord>,
    /// Calls this process invokes once the batch has committed.
    pub invokes: Vec<(i32, Call)>,
    /// Calls of pool tools published in it (for their pools' workers), with
    /// their pool.
    pub published: Vec<(i32, Call, String)>,
    /// Its answers' (status, deduplicated, since_ms), for their metrics once
    /// committed.
    pub results: Vec<(String, bool, Option<i64>)>,
    /// The intents partitions it writes for: their offsets go with it, so a
    /// fenced member's transaction cannot commit.
    pub touched: BTreeSet<i32>,
}

/// The records of a closing batch, from what the core decided for it (taken
/// from it), its hand-overs and its state writes.
pub(super) fn batch_records(config: &Config, open: &mut OpenBatch) -> BatchRecords {
    let t = &config.kafka.topics;
    let mut out = BatchRecords {
        touched: open.batch.partitions(),
        ..BatchRecords::default()
    };
    for o in std::mem::take(&mut open.outs) {
        match o {
            Out::Invoke {
                partition, call, ..
            } => {
                // A pool tool's call goes out in this transaction, with its
                // `started` record: visible to workers once committed.
                match pool_call_record(config, partition, &call) {
                    Some((pool, record)) => {
                        out.records.push(record);
                        out.published.push((partition, call, pool));
                    }
                    None => out.invokes.push((partition, call)),
                }
            }
            Out::Result {
                partition,
                result,
                traceparent,
                since_ms,
                ..
            } => {
                out.touched.insert(partition);
                out.results.push((
                    result.status.as_str().to_owned(),
                    result.deduplicated,
                    since_ms,
                ));
                out.records.push(result_record(
                    &t.results,
                    partition,
                    &result,
                    traceparent.as_deref(),
                ));
            }
            Out::Approval { partition, event } => out.records.push(OutRecord::json_for_workflow(
                &t.approvals,
                partition,
                &event.step.workflow_id,
                &event,
            )),
            Out::Command { partition, command } => out.records.push(OutRecord::json_for_workflow(
                &t.commands,
                partition,
                &command.step.workflow_id,
                &command,
            )),
            Out::Forward {
                partition,
                key,
                payload,
                headers,
                timestamp_ms,
            } => out.records.push(OutRecord {
                topic: t.intents.clone(),
                partition: Some(partition),
                key,
                payload,
                headers,
                timestamp_ms,
            }),
            Out::Dlq {
                key,
                headers,
                record,
            } => out.records.push(OutRecord {
                topic: t.dlq.clone(),
                partition: None,
                key,
                payload: Some(record.to_json()),
                headers,
                timestamp_ms: None,
            }),
        }
    }
    for f in &open.orphans {
        out.records
            .push(progress_record(&t.progress, f.partition, &f.progress));
    }
    out.records
        .extend(changelog_records(&t.changelog, &open.batch));
    out
}

/// A Result v1 record: keyed by workflow id, in the intent's partition number.
pub(super) fn result_record(
    topic: &str,
    partition: i32,
    result: &ToolResult,
    traceparent: Option<&str>,
) -> OutRecord {
    let mut r = OutRecord::for_workflow(topic, partition, &result.workflow_id, result.to_json());
    push_traceparent(&mut r, traceparent);
    r
}

/// An outcome handed to the owner of its partition.
pub(super) fn progress_record(topic: &str, partition: i32, p: &Progress) -> OutRecord {
    OutRecord::for_workflow(topic, partition, &p.step.workflow_id, codec::encode(p))
}

/// A pool tool's call as Call v1 on its pool's calls topic (keyed by
/// workflow id, partitioned by the producer: independently of `intents`), or
/// None for a tool this process invokes itself. A worker takes it only
/// before `take_by_ms`, the tool's deadline from now: the gate's deadline for
/// the step is that plus `in_doubt_grace` (docs/design.md "Worker pools").
/// Signed with the pool's key (read at start): workers run nothing else.
pub(super) fn pool_call_record(
    config: &Config,
    partition: i32,
    call: &Call,
) -> Option<(String, OutRecord)> {
    let tool = config.tools.get(&call.step.tool)?;
    let pool = tool.pool.as_ref()?;
    let take_by = now_ms() + tool.deadline().as_millis().min(i64::MAX as u128) as i64;
    let message = crate::contract::PoolCall::new(call, partition, tool.category.as_str(), take_by);
    let payload = message.to_json();
    // Never unsigned in a running gate (its start reads every pool's key); a
    // record without one is refused by every worker, and the step ends
    // `no_worker` — never run outside the gate.
    let headers = config
        .pools
        .get(pool)
        .and_then(crate::config::PoolConfig::key_bytes)
        .map(|key| {
            let signature = sign(key, Signed::Call, &payload);
            (SIGNATURE.to_owned(), Some(signature.into_bytes()))
        })
        .into_iter()
        .collect();
    let mut record = OutRecord {
        topic: config.kafka.topics.calls_for(pool),
        partition: None,
        key: Some(call.step.workflow_id.as_bytes().to_vec()),
        payload: Some(payload),
        headers,
        timestamp_ms: None,
    };
    push_traceparent(&mut record, call.traceparent.as_deref());
    Some((pool.clone(), record))
}

/// A batch's state writes as changelog records: compact on the changelog;
/// the gate's own RocksDB writes stay named, read without expanding.
fn changelog_records<'a>(topic: &'a str, batch: &Batch) -> impl Iterator<Item = OutRecord> + 'a {
    batch.changelog().into_iter().map(move |e| OutRecord {
        topic: topic.to_owned(),
        partition: Some(e.partition),
        key: Some(e.key),
        payload: e.value.map(|v| codec::compact(&v).unwrap_or(v)),
        headers: Vec::new(),
        timestamp_ms: None,
    })
}

/// The W3C `traceparent` header, when the message has one.
fn push_traceparent(record: &mut OutRecord, traceparent: Option<&str>) {
    if let Some(tp) = traceparent {
        record
            .headers
            .push((TRACEPARENT.to_owned(), Some(tp.as_bytes().to_vec())));
    }
}
