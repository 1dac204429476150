//! A batch's pipelined transaction: its records and input offsets sent
//! while the next batch is decided, then applied once committed.

use super::batch::Pending;
use super::ownership::applied_metadata;
use super::poison::Poison;
use super::session::Session;
use super::{GateCore, GateError, Out, lost, now_ms, result_record};
use crate::config::Config;
use crate::contract::{Call, Progress, codec};
use crate::executor::Finished;
use crate::hooks;
use crate::kafka::{self, OutRecord, TxnConsumer};
use crate::state::Batch;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tracing::warn;

/// The gate's transactional producers, used in turn: one batch's commit returns
/// before the broker has written its transaction markers, and a transactional
/// producer's next transaction is refused (`CONCURRENT_TRANSACTIONS`, retried by
/// librdkafka after 20 ms) until they are written. With two, back-to-back
/// batches never wait for that: each producer's previous transaction has had a
/// whole commit to complete. Both ids derive from the instance, so a restarted
/// instance fences its predecessor's; the group metadata sent with the offsets
/// fences a zombie member (KIP-447) whichever producer it uses.
pub(super) struct Producers {
    pub(super) all: [FutureProducer; 2],
    pub(super) turn: usize,
    /// Numbers these producers within the process: the local state keeps each
    /// one's last applied batch unconfirmed (`state::Committer`).
    pub(super) session: u64,
}

impl Producers {
    pub(super) async fn init(k: &crate::config::KafkaConfig) -> Result<Producers, GateError> {
        let [id, id_b] = kafka::gate_transactional_ids(k, &k.instance_id);
        let (a, b) = tokio::try_join!(
            kafka::init_txn_producer(k, &id),
            kafka::init_txn_producer(k, &id_b),
        )?;
        static SESSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Producers {
            all: [a, b],
            turn: 0,
            session: SESSIONS.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The producer of the next batch, and which of them it is.
    pub(super) fn next(&mut self) -> (usize, FutureProducer) {
        self.turn = (self.turn + 1) % self.all.len();
        (self.turn, self.all[self.turn].clone())
    }

    /// Which of them commits as `slot` (`state::Committer`).
    pub(super) fn committer(&self, slot: usize) -> crate::state::Committer {
        crate::state::Committer {
            session: self.session,
            slot,
        }
    }
}

/// What a batch's commit task reports once the broker acknowledged it.
pub(super) struct Landed {
    /// Per partition, its last changelog record (where the local state will
    /// reflect the changelog up to, and what a restart confirms).
    pub(super) changelog: BTreeMap<i32, crate::state::Tail>,
    /// Where each record landed (partition, offset), in order.
    pub(super) landed: Vec<(i32, i64)>,
    /// A test hook aborted it instead (see `hooks::lose_commit_marker`).
    pub(super) marker_lost: bool,
    /// Its producer must not begin another transaction
    /// ([`kafka::Transacted::renew_producer`]).
    pub(super) renew_producer: bool,
}

/// A batch whose transaction is being committed.
pub(super) struct InFlight {
    pub(super) task: JoinHandle<Result<Landed, GateError>>,
    pub(super) batch: Arc<Batch>,
    /// Its records and input offsets, kept once it commits (`lost`).
    pub(super) records: Arc<Vec<OutRecord>>,
    pub(super) input_offsets: Vec<lost::InputOffset>,
    /// Which of the producers commits it.
    pub(super) slot: usize,
    pub(super) committer: crate::state::Committer,
    pub(super) invokes: Vec<(i32, Call)>,
    /// Calls of pool tools published in it (for their pools' workers).
    pub(super) published: Vec<(i32, Call, String)>,
    pub(super) results: Vec<(String, bool, Option<i64>)>,
    pub(super) outcomes: Vec<Finished>,
    /// Per intents partition: (applied, committed) once this batch commits.
    pub(super) offsets: BTreeMap<i32, (i64, i64)>,
    pub(super) started: Instant,
    pub(super) first_input: Option<(String, i32, i64)>,
    /// Where its transaction is ([`Stage`]), for the log of a slow commit.
    pub(super) stage: Arc<AtomicU8>,
    /// When a slow commit was last logged.
    pub(super) logged: Option<Instant>,
}

/// The stages of a batch's transaction, as [`InFlight::stage`] holds them.
pub(super) struct Stage;

impl Stage {
    pub(super) const SENDING: u8 = 0;
    pub(super) const ENDING: u8 = 1;
    pub(super) const DONE: u8 = 2;

    pub(super) fn name(stage: u8) -> &'static str {
        match stage {
            Stage::SENDING => "sending its records and offsets",
            Stage::ENDING => "committing",
            _ => "done",
        }
    }
}

impl InFlight {
    /// A commit in flight for over [`SLOW_COMMIT`] is logged (again every
    /// [`SLOW_COMMIT`]) with where its transaction is: the gate answers
    /// nothing new until it returns.
    pub(super) fn log_if_slow(&mut self) {
        let now = Instant::now();
        if self.started.elapsed() < SLOW_COMMIT
            || self.logged.is_some_and(|t| now - t < SLOW_COMMIT)
        {
            return;
        }
        self.logged = Some(now);
        warn!(
            secs = self.started.elapsed().as_secs(),
            stage = Stage::name(self.stage.load(Ordering::Relaxed)),
            records = self.records.len(),
            "a batch's commit is still in flight: nothing new is answered until it returns"
        );
    }
}

/// How long a commit may take before it is logged as slow.
const SLOW_COMMIT: Duration = Duration::from_secs(10);

/// Resolves when the commit in flight returns; never without one.
pub(super) async fn wait_commit(
    f: &mut Option<InFlight>,
) -> Result<Result<Landed, GateError>, tokio::task::JoinError> {
    match f {
        Some(f) => (&mut f.task).await,
        None => std::future::pending().await,
    }
}

/// An outcome handed to the owner of its partition.
pub(super) fn progress_record(topic: &str, partition: i32, p: &Progress) -> OutRecord {
    OutRecord::for_workflow(
        topic,
        partition,
        &p.step.workflow_id,
        crate::contract::codec::encode(p),
    )
}

/// A pool tool's call as Call v1 on its pool's calls topic (keyed by
/// workflow id, partitioned by the producer: independently of `intents`), or
/// None for a tool this process invokes itself. A worker takes it only
/// before `take_by_ms`, the tool's deadline from now: the gate's deadline for
/// the step is that plus `in_doubt_grace` (docs/design.md "Worker pools").
pub(super) fn pool_call_record(
    config: &Config,
    partition: i32,
    call: &Call,
) -> Option<(String, OutRecord)> {
    let tool = config.tools.get(&call.step.tool)?;
    let pool = tool.pool.as_ref()?;
    let take_by = now_ms() + tool.deadline().as_millis().min(i64::MAX as u128) as i64;
    let message = crate::contract::PoolCall::new(call, partition, tool.category.as_str(), take_by);
    let mut record = OutRecord {
        topic: config.kafka.topics.calls_for(pool),
        partition: None,
        key: Some(call.step.workflow_id.as_bytes().to_vec()),
        payload: Some(message.to_json()),
        headers: Vec::new(),
        timestamp_ms: None,
    };
    if let Some(tp) = &call.traceparent {
        record.headers.push((
            crate::contract::headers::TRACEPARENT.to_owned(),
            Some(tp.as_bytes().to_vec()),
        ));
    }
    Some((pool.clone(), record))
}

impl Session<'_> {
    /// Send answers that rest only on committed state at once, through the
    /// session's idempotent producer, in a task the open batch's commit waits
    /// for (docs/design.md "Repeats answered at once").
    pub(super) fn send_at_once(
        &self,
        producer: &FutureProducer,
        pending: &mut Pending,
        outs: Vec<Out>,
    ) {
        let topic = &self.config.kafka.topics.results;
        let mut records = Vec::with_capacity(outs.len());
        let mut results = Vec::with_capacity(outs.len());
        for o in outs {
            if let Out::Result {
                partition,
                result,
                traceparent,
                since_ms,
                ..
            } = o
            {
                records.push(result_record(
                    topic,
                    partition,
                    &result,
                    traceparent.as_deref(),
                ));
                results.push((result.status, result.deduplicated, since_ms));
            }
        }
        let (producer, metrics) = (producer.clone(), self.metrics.clone());
        pending.sent_at_once.push(tokio::spawn(async move {
            kafka::send_all(&producer, &records).await?;
            let now = now_ms();
            for (status, deduplicated, since_ms) in results {
                let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
                metrics.result_published(status.as_str(), deduplicated, latency);
            }
            Ok(())
        }));
    }

    /// Close a batch: produce its messages and changelog records, its input
    /// offsets, and commit — in a task, while the next batch is decided.
    pub(super) fn send(
        &mut self,
        core: &mut GateCore,
        consumer: &Arc<TxnConsumer>,
        producer: &mut Producers,
        mut pending: Pending,
    ) -> Result<InFlight, GateError> {
        let started = Instant::now();
        pending.batch.detach();
        let t = &self.config.kafka.topics;
        let mut invokes = Vec::new();
        let mut published = Vec::new();
        let mut records = Vec::new();
        let mut results = Vec::new();
        let mut touched: BTreeSet<i32> = pending.batch.partitions();
        for o in core.take_outs() {
            match o {
                Out::Invoke { partition, call } => {
                    // A pool tool's call goes out in this transaction, with
                    // its `started` record: visible to workers once committed.
                    match pool_call_record(self.config, partition, &call) {
                        Some((pool, record)) => {
                            records.push(record);
                            published.push((partition, call, pool));
                        }
                        None => invokes.push((partition, call)),
                    }
                }
                Out::Result {
                    partition,
                    result,
                    traceparent,
                    since_ms,
                } => {
                    touched.insert(partition);
                    results.push((
                        result.status.as_str().to_owned(),
                        result.deduplicated,
                        since_ms,
                    ));
                    records.push(result_record(
                        &t.results,
                        partition,
                        &result,
                        traceparent.as_deref(),
                    ));
                }
                Out::Approval { partition, event } => records.push(OutRecord::json_for_workflow(
                    &t.approvals,
                    partition,
                    &event.step.workflow_id,
                    &event,
                )),
                Out::Forward {
                    partition,
                    key,
                    payload,
                    headers,
                    timestamp_ms,
                } => records.push(OutRecord {
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
                } => records.push(OutRecord {
                    topic: t.dlq.clone(),
                    partition: None,
                    key,
                    payload: Some(record.to_json()),
                    headers,
                    timestamp_ms: None,
                }),
            }
        }
        for f in &pending.orphans {
            records.push(progress_record(&t.progress, f.partition, &f.progress));
        }
        records.extend(pending.batch.changelog().into_iter().map(|e| OutRecord {
            topic: t.changelog.clone(),
            partition: Some(e.partition),
            key: Some(e.key),
            // Compact on the changelog; RocksDB keeps the named form, which
            // the gate reads without expanding.
            payload: e.value.map(|v| codec::compact(&v).unwrap_or(v)),
            headers: Vec::new(),
            timestamp_ms: None,
        }));
        // Offsets: every intents partition this batch consumed from or writes
        // for (so a fenced member's transaction cannot commit), and any whose
        // committed offset may move now that a fast-path call was answered.
        let mut offsets = BTreeMap::new();
        let mut input_offsets = Vec::new();
        for (p, o) in self.owned.iter_mut() {
            let (applied, commit) = o.batch_offsets(
                pending.intents_next.get(p).copied(),
                core.first_unanswered(*p),
            );
            if commit == o.committed && applied == o.applied && !touched.contains(p) {
                continue;
            }
            offsets.insert(*p, (applied, commit));
            input_offsets.push(lost::InputOffset {
                topic: t.intents.clone(),
                partition: *p,
                offset: commit,
                metadata: Some(applied_metadata(applied, core.intent_partitions())),
            });
        }
        for ((topic, p), next) in &pending.others_next {
            input_offsets.push(lost::InputOffset {
                topic: topic.clone(),
                partition: *p,
                offset: *next,
                metadata: None,
            });
        }
        let tpl = lost::InputOffset::list(&input_offsets)?;
        let batch = Arc::new(pending.batch);
        let changelog = t.changelog.clone();
        let starts_calls = !invokes.is_empty();
        let answers = !results.is_empty();
        let records = Arc::new(records);
        let (slot, producer_now) = producer.next();
        let committer = producer.committer(slot);
        let producer = producer_now;
        let (consumer, sent_records) = (consumer.clone(), records.clone());
        let limits = kafka::TxnLimits::of(&self.config.kafka);
        let stage = Arc::new(AtomicU8::new(Stage::SENDING));
        let at = stage.clone();
        hooks::arm_hang_send(answers);
        let sent_at_once = pending.sent_at_once;
        let task = tokio::spawn(async move {
            let records = sent_records;
            // Answers sent at once first: their intents' offsets are in this
            // transaction, and none may be committed past a lost answer. They
            // get the transaction's own bound (a broker gone away).
            let acked =
                tokio::time::timeout(limits.send, futures::future::try_join_all(sent_at_once))
                    .await
                    .map_err(|_| {
                        KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::MessageTimedOut,
                        )
                    })??;
            acked.into_iter().collect::<Result<(), KafkaError>>()?;
            hooks::delay_commit().await;
            let t0 = Instant::now();
            let (mut t1, mut marker_lost) = (t0, false);
            let done = kafka::transact(&producer, &consumer, &records, tpl, limits, || {
                at.store(Stage::ENDING, Ordering::Relaxed);
                t1 = Instant::now();
                hooks::crash_before_commit();
                marker_lost = hooks::lose_commit_marker(answers);
                Ok::<_, GateError>(if marker_lost {
                    kafka::Ending::Abort
                } else {
                    kafka::Ending::Commit
                })
            })
            .await;
            at.store(Stage::DONE, Ordering::Relaxed);
            let kafka::Transacted {
                landed,
                renew_producer,
            } = done?;
            hooks::lose_commit_reply(starts_calls)?;
            let renew_producer = renew_producer || hooks::slow_transaction_end(starts_calls);
            tracing::debug!(
                records = records.len(),
                send_us = (t1 - t0).as_micros() as u64,
                commit_us = t1.elapsed().as_micros() as u64,
                "batch committed"
            );
            // Where the changelog records landed: the local state will
            // reflect each partition's changelog up to its last record there.
            let mut last: BTreeMap<i32, (i64, usize)> = BTreeMap::new();
            for (i, (r, &(p, o))) in records.iter().zip(&landed).enumerate() {
                if r.topic == changelog && last.get(&p).is_none_or(|&(l, _)| o > l) {
                    last.insert(p, (o, i));
                }
            }
            let tails = last
                .into_iter()
                .map(|(p, (o, i))| {
                    let r = &records[i];
                    let tail = crate::state::Tail::of(o, r.key.as_deref(), r.payload.as_deref());
                    (p, tail)
                })
                .collect();
            Ok::<_, GateError>(Landed {
                changelog: tails,
                landed,
                marker_lost,
                renew_producer,
            })
        });
        Ok(InFlight {
            task,
            batch,
            records,
            input_offsets,
            slot,
            committer,
            invokes,
            published,
            results,
            outcomes: pending.outcomes,
            offsets,
            started,
            first_input: pending.first_input,
            stage,
            logged: None,
        })
    }

    /// Wait for a batch's commit and act on it.
    pub(super) async fn land(
        &mut self,
        core: &mut GateCore,
        mut f: InFlight,
    ) -> Result<(), GateError> {
        let r = (&mut f.task).await;
        self.landed(core, f, r.map_err(GateError::from).and_then(|r| r))
    }

    /// A batch's commit returned: on success apply it to the local state, move
    /// the offsets and start its calls; on failure keep its outcomes for the next
    /// session, which re-reads its inputs.
    pub(super) fn landed(
        &mut self,
        core: &mut GateCore,
        f: InFlight,
        r: Result<Landed, GateError>,
    ) -> Result<(), GateError> {
        let landed = match r {
            Ok(l) => l,
            Err(e) => {
                self.backlog.extend(f.outcomes);
                core.commit_unknown(f.invokes);
                // Published or not with their records, nothing more to do:
                // workers see them only if that commit landed after all.
                for (p, call, _) in &f.published {
                    core.published(*p, call);
                }
                if let (Some(code), Some(first)) = (e.refused_record(), f.first_input) {
                    warn!(topic = %first.0, partition = first.1, offset = first.2, code, "Kafka refused a record of a batch: the next batches take one input each, and an input whose records are refused {} times is set aside", Poison::SET_ASIDE_AFTER);
                    self.poison.refused(first, &e);
                }
                return Err(e);
            }
        };
        self.poison.committed(f.first_input.as_ref());
        hooks::crash_after_commit(!f.invokes.is_empty());
        let t = Instant::now();
        self.store.apply(
            &f.batch,
            &crate::state::Landing {
                committer: f.committer,
                tails: landed.changelog,
            },
        )?;
        self.metrics.state_written(t.elapsed());
        self.last_commits.record(
            f.slot,
            lost::Committed {
                records: f.records,
                landed: landed.landed,
                offsets: f.input_offsets,
                at: Instant::now(),
            },
        );
        for (p, (applied, committed)) in f.offsets {
            if let Some(o) = self.owned.get_mut(&p) {
                o.applied = applied;
                o.committed = committed;
            }
        }
        self.linger.landed(f.invokes.len(), f.started.elapsed());
        for (p, call) in f.invokes {
            core.invoked(p, &call);
            self.invoker.start(p, call);
        }
        for (p, call, pool) in &f.published {
            core.published(*p, call);
            self.metrics.pool_call(pool, &call.step);
        }
        let now = now_ms();
        for (status, deduplicated, since_ms) in &f.results {
            let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
            self.metrics
                .result_published(status, *deduplicated, latency);
        }
        self.metrics.committed(f.started.elapsed());
        if landed.marker_lost {
            return Err(hooks::session_lost().into());
        }
        // Committed and honoured above; the session's producers are then
        // replaced (a new session's, with a new epoch) before another begins.
        if landed.renew_producer {
            return Err(GateError::SlowTransactionEnd);
        }
        Ok(())
    }
}
