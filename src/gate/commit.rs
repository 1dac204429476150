//! A session's commits: its transactional producers, the batch whose
//! transaction is in flight (sent while the next batch is decided, then
//! applied once committed), answers sent at once, the last acknowledged
//! commits, and group commit's one wait ([`Linger`]).

use super::batch::OpenBatch;
use super::linger::Linger;
use super::lost::{self, InputOffset, LastCommits};
use super::ownership::BatchOffsets;
use super::records::{BatchRecords, result_record};
use super::{Env, GateError, Out, now_ms};
use crate::contract::Call;
use crate::executor::Finished;
use crate::hooks;
use crate::kafka::{self, OutRecord, TxnConsumer};
use crate::state::Batch;
use rdkafka::TopicPartitionList;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tracing::{info, warn};

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
    pub(super) input_offsets: Vec<InputOffset>,
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

/// What a committed batch leaves the session to do: move its offsets, start
/// its calls — then, if a test hook lost its marker or its producer must be
/// renewed, end the session.
pub(super) struct AfterCommit {
    pub(super) offsets: BTreeMap<i32, (i64, i64)>,
    pub(super) invokes: Vec<(i32, Call)>,
    pub(super) published: Vec<(i32, Call, String)>,
    pub(super) marker_lost: bool,
    pub(super) renew_producer: bool,
}

/// A session's commits, one in flight at a time.
pub(super) struct Commits<'a> {
    env: Env<'a>,
    consumer: Arc<TxnConsumer>,
    producers: Producers,
    /// The idempotent producer of answers sent outside the transactions
    /// (repeats of committed outcomes).
    answers: FutureProducer,
    in_flight: Option<InFlight>,
    /// The producers' last acknowledged transactions, checked by the next session.
    last_commits: &'a mut LastCommits,
    pub(super) linger: Linger,
}

impl<'a> Commits<'a> {
    pub(super) async fn start(
        env: Env<'a>,
        consumer: Arc<TxnConsumer>,
        last_commits: &'a mut LastCommits,
    ) -> Result<Commits<'a>, GateError> {
        let k = &env.config.kafka;
        let producers = Producers::init(k).await?;
        let answers = kafka::direct_producer_config(k).create()?;
        Ok(Commits {
            env,
            consumer,
            producers,
            answers,
            in_flight: None,
            last_commits,
            linger: Linger::default(),
        })
    }

    pub(super) fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Resolves when the commit in flight returns, with it; never without one.
    pub(super) async fn returned(&mut self) -> (InFlight, Result<Landed, GateError>) {
        let Some(f) = &mut self.in_flight else {
            return std::future::pending().await;
        };
        let r = (&mut f.task).await.map_err(GateError::from).and_then(|r| r);
        let f = self
            .in_flight
            .take()
            .expect("the commit awaited is in flight");
        (f, r)
    }

    pub(super) fn log_if_slow(&mut self) {
        if let Some(f) = self.in_flight.as_mut() {
            f.log_if_slow();
        }
    }

    /// Send answers that rest only on committed state at once, through the
    /// session's idempotent producer, in a task the open batch's commit waits
    /// for (docs/design.md "Repeats answered at once").
    pub(super) fn answer_at_once(&self, open: &mut OpenBatch, outs: Vec<Out>) {
        let topic = &self.env.config.kafka.topics.results;
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
        let (producer, metrics) = (self.answers.clone(), self.env.metrics.clone());
        open.sent_at_once.push(tokio::spawn(async move {
            kafka::send_all(&producer, &records).await?;
            let now = now_ms();
            for (status, deduplicated, since_ms) in results {
                let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
                metrics.result_published(status.as_str(), deduplicated, latency);
            }
            Ok(())
        }));
    }

    /// Send a closed batch — its records, its input offsets — and commit it,
    /// in a task, while the next batch is decided on top of it (returned).
    pub(super) fn send(
        &mut self,
        open: OpenBatch,
        built: BatchRecords,
        offsets: BatchOffsets,
    ) -> Result<Arc<Batch>, GateError> {
        let started = Instant::now();
        let t = &self.env.config.kafka.topics;
        let mut input_offsets = offsets.input_offsets;
        for ((topic, p), next) in &open.others_next {
            input_offsets.push(InputOffset {
                topic: topic.clone(),
                partition: *p,
                offset: *next,
                metadata: None,
            });
        }
        let tpl = InputOffset::list(&input_offsets)?;
        let records = Arc::new(built.records);
        let (slot, producer) = self.producers.next();
        let committer = self.producers.committer(slot);
        let stage = Arc::new(AtomicU8::new(Stage::SENDING));
        // For the test hooks: whether this transaction commits answers — its
        // own, or the offsets of repeats answered at once before it.
        let answers = !built.results.is_empty() || !open.sent_at_once.is_empty();
        hooks::arm_hang_send(answers);
        let task = tokio::spawn(
            Transaction {
                producer,
                consumer: self.consumer.clone(),
                records: records.clone(),
                offsets: tpl,
                limits: kafka::TxnLimits::of(&self.env.config.kafka),
                stage: stage.clone(),
                sent_at_once: open.sent_at_once,
                answers,
                starts_calls: !built.invokes.is_empty(),
                changelog: t.changelog.clone(),
            }
            .run(),
        );
        let batch = Arc::new(open.batch);
        self.in_flight = Some(InFlight {
            task,
            batch: batch.clone(),
            records,
            input_offsets,
            slot,
            committer,
            invokes: built.invokes,
            published: built.published,
            results: built.results,
            outcomes: open.outcomes,
            offsets: offsets.offsets,
            started,
            first_input: open.first_input,
            stage,
            logged: None,
        });
        Ok(batch)
    }

    /// A batch committed: apply it to the local state, keep it as the
    /// producer's last commit, and count its answers; what it leaves the
    /// session to do.
    pub(super) fn landed(&mut self, f: InFlight, landed: Landed) -> Result<AfterCommit, GateError> {
        let (store, metrics) = (self.env.store, self.env.metrics);
        hooks::crash_after_commit(!f.invokes.is_empty());
        let t = Instant::now();
        store.apply(
            &f.batch,
            &crate::state::Landing {
                committer: f.committer,
                tails: landed.changelog,
            },
        )?;
        metrics.state_written(t.elapsed());
        self.last_commits.record(
            f.slot,
            lost::Committed {
                records: f.records,
                landed: landed.landed,
                offsets: f.input_offsets,
                at: Instant::now(),
            },
        );
        self.linger.landed(f.invokes.len(), f.started.elapsed());
        let now = now_ms();
        for (status, deduplicated, since_ms) in &f.results {
            let latency = since_ms.map(|t| Duration::from_millis((now - t).max(0) as u64));
            metrics.result_published(status, *deduplicated, latency);
        }
        metrics.committed(f.started.elapsed());
        Ok(AfterCommit {
            offsets: f.offsets,
            invokes: f.invokes,
            published: f.published,
            marker_lost: landed.marker_lost,
            renew_producer: landed.renew_producer,
        })
    }

    /// At a session's first assignment, before its first committed-offset
    /// lookup: end what a broker crash may have left hanging for this gate's
    /// transactional ids (see `kafka::end_hanging_transactions`), then write
    /// again what a broker lost of this process's last commits in the
    /// partitions `owned` (`lost::mend`). `layout` counts the partitions of
    /// the topics the gate writes; `p` is one of `owned`.
    pub(super) async fn recover(
        &mut self,
        layout: &kafka::Layout,
        p: i32,
        owned: &BTreeSet<i32>,
    ) -> Result<(), GateError> {
        let (config, t) = (self.env.config, &self.env.config.kafka.topics);
        // The topics this gate writes: all but intents and commands.
        let written: Vec<(String, i32)> = [
            (&t.results, layout.results),
            (&t.dlq, layout.dlq),
            (&t.progress, layout.progress),
            (&t.changelog, layout.changelog),
            (&t.approvals, layout.approvals),
        ]
        .into_iter()
        .flat_map(|(name, n)| (0..n as i32).map(move |q| (name.clone(), q)))
        .collect();
        let started = Instant::now();
        let limits = kafka::TxnLimits::of(&config.kafka);
        let ends = self.producers.all.iter().map(|pr| {
            kafka::end_hanging_transactions(pr, &self.consumer, &written, (&t.intents, p), limits)
        });
        let mut renew = false;
        for r in futures::future::join_all(ends).await {
            match r {
                Ok(r) => renew |= r,
                // Not fatal: if something did hang, the offset lookup
                // waits, and a new session tries again.
                Err(e) => {
                    warn!(error = %e, "could not end hanging transactions of this gate's producers")
                }
            }
        }
        if renew {
            return Err(GateError::SlowTransactionEnd);
        }
        info!(
            partitions = written.len(),
            ms = started.elapsed().as_millis() as u64,
            "ended any transaction a broker crash left hanging for this gate's producers"
        );
        lost::mend(
            &config.kafka,
            config.state.retention.0,
            self.last_commits,
            &self.producers.all[0],
            &self.consumer,
            owned,
            self.env.metrics,
        )
        .await
    }

    /// Close the session's producers, each within `limit` and off the async
    /// threads (the future outlives the session).
    pub(super) fn close(self, limit: Duration) -> impl Future<Output = ()> + 'static {
        let (producers, answers) = (self.producers, self.answers);
        async move {
            kafka::close_within("the gate's producers", producers, limit).await;
            kafka::close_within("the gate's answers producer", answers, limit).await;
        }
    }
}

/// One batch's transaction, run as a task.
struct Transaction {
    producer: FutureProducer,
    consumer: Arc<TxnConsumer>,
    records: Arc<Vec<OutRecord>>,
    offsets: TopicPartitionList,
    limits: kafka::TxnLimits,
    stage: Arc<AtomicU8>,
    /// The open batch's answers sent at once.
    sent_at_once: Vec<JoinHandle<Result<(), KafkaError>>>,
    /// Whether it carries answers, and starts calls (for the test hooks).
    answers: bool,
    starts_calls: bool,
    changelog: String,
}

impl Transaction {
    async fn run(self) -> Result<Landed, GateError> {
        let Transaction {
            producer,
            consumer,
            records,
            offsets,
            limits,
            stage,
            sent_at_once,
            answers,
            starts_calls,
            changelog,
        } = self;
        // Answers sent at once first: their intents' offsets are in this
        // transaction, and none may be committed past a lost answer. They
        // get the transaction's own bound (a broker gone away).
        let acked = tokio::time::timeout(limits.send, futures::future::try_join_all(sent_at_once))
            .await
            .map_err(|_| {
                KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::MessageTimedOut)
            })??;
        acked.into_iter().collect::<Result<(), KafkaError>>()?;
        hooks::delay_commit().await;
        let t0 = Instant::now();
        let (mut t1, mut marker_lost) = (t0, false);
        let done = kafka::transact(&producer, &consumer, &records, offsets, limits, || {
            stage.store(Stage::ENDING, Ordering::Relaxed);
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
        stage.store(Stage::DONE, Ordering::Relaxed);
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
                (
                    p,
                    crate::state::Tail::of(o, r.key.as_deref(), r.payload.as_deref()),
                )
            })
            .collect();
        Ok(Landed {
            changelog: tails,
            landed,
            marker_lost,
            renew_producer,
        })
    }
}
