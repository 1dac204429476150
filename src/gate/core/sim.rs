//! A simulation of the gate: [`GateCore`] over real RocksDB, driven by one
//! seeded random schedule of everything around it — two gate processes with
//! their invokers, a provider that deduplicates by `Idempotency-Key`, agents
//! that repeat and rephrase, an operator, a clock, and Kafka as logs — and
//! checked against a reference model of the contract (`DESIGN.md`).
//!
//! The idea is FoundationDB's simulation and TigerBeetle's VOPR: every choice
//! comes from one seed, so a failing seed replays exactly, and faults come far
//! more often than in life — crashes between commits (a batch dropped, or
//! committed at the broker and never applied), aborted commits and lost commit
//! replies, partitions moving between the two processes, calls left queued or
//! slow while their step is re-dispatched, stale outcomes, and operator
//! commands decided on an old view and re-sent.
//!
//! What it checks (each failure names its seed and how to replay it):
//! - one final answer per `call_id`, and every call answered once all is quiet;
//! - a repeat's answer equals the first but for `call_id` and `deduplicated`
//!   (until an operator settles the step again);
//! - an unkeyed step takes effect at most once (the operator resolves "not
//!   executed" only when the provider shows no effect), and no unkeyed dispatch
//!   is invoked twice;
//! - no answer says "not performed" for a run that did take effect (the
//!   provider's view of the key, for keyed tools);
//! - an outcome that reaches the gate is never dropped without a record: the
//!   step record changes, or already holds it; an outcome of an older dispatch
//!   other than `ok` never settles a re-dispatched step;
//! - when the contract carries them: a "not invoked" hand-over re-dispatches at
//!   once and is never answered `in_doubt`; an operator command bound to a
//!   dispatch never applies to another;
//! - a forger who writes `progress` (a worker's JSON, a gate's hand-over
//!   without the dispatch's token: "not invoked", or a made-up outcome, for
//!   a random step) changes no step record.
//!
//! Hand-overs travel as the gate writes them (codec-encoded, with their
//! call's token); each process's tokens come from the seed. A hand-over of an
//! earlier reading of a re-read (deferred) step carries a token its new
//! record never had: refused, it changes nothing (counted).
//!
//! Runs:
//! - `cargo test --lib gate::core::sim` — the short run (200 seeds × 300 steps);
//! - `STEPGATE_SIM_SEEDS=20000 cargo test --lib gate::core::sim -- --nocapture`
//!   — a long run (`STEPGATE_SIM_STEPS` sets the steps per seed);
//! - `STEPGATE_SIM_SEED=<seed> cargo test --lib gate::core::sim -- --nocapture`
//!   — one seed, exactly as it ran;
//! - `STEPGATE_SIM_KEEP_GOING=1` — go on past a failing seed, printing each;
//!   `STEPGATE_SIM_BASE=<seed>` — the first of the run's consecutive seeds;
//!   `STEPGATE_SIM_SLOW_COMMITS=1` — batches may stay open or committing past
//!   the tools' deadlines (see [`COMMIT_WITHIN_MS`]).
//!
//! The keyed tool (`charge`) takes the one-record path (`core/deferred.rs`):
//! the committed intents offset is held at its unsettled steps and the
//! `applied` mark kept as the offset's metadata, so crashes, session restarts
//! and rebalances re-read its intents (counted in the summary line). Read for
//! the first time, its call is queued at once, before the batch deciding it
//! commits: a crash or a lost partition before that commit leaves a run no
//! committed state knows of. A run that could not reach the provider leaves
//! the step for its next call to ask again (`Phase::Unreached`): the model
//! lets that step's answer change once, to what the provider says.
//!
//! Repeats of committed outcomes are answered at once: those answers are
//! published as they are decided, whatever becomes of their batch, and the
//! model accepts a second answer to a `call_id` only when an earlier one went
//! at once and the two are equal.
//!
//! The configuration is the shipped default's: only the tools and the grace
//! are the simulation's own.
//!
//! Not simulated: fast-path tools (they record nothing), retention purges, a
//! frozen process that writes after it was fenced.

use super::outcome::UNREACHED_KIND;
use super::*;
use crate::contract::{Command, ErrorBody, Outcome, Progress, ProgressEvent, Status};
use crate::state::{Batch, StepRecord};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

const CONFIG: &str = r#"
[state]
retention = "7d"
[gate]
in_doubt_grace = "1s"
[tools.charge]
category = "keyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
[tools.wire]
category = "unkeyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
[tools.payout]
category = "unkeyed"
policy = "approval"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
"#;

const PARTITIONS: i32 = 2;
const WORKFLOWS: usize = 4;
const STEP_INDEXES: u64 = 2;
const TOOLS: [&str; 3] = ["charge", "wire", "payout"];
/// Error kinds whose answer tells the model the action was not performed.
const NOT_PERFORMED: [&str; 2] = ["tool_unreachable", "tool_refused"];
/// Steps of the quiet phase at most, before the run is declared stuck.
const DRAIN_ROUNDS: usize = 400;

/// Most calls started, or inputs read, in one round of the
/// drain: far above any seed's whole run (a few hundred intents).
const DRAIN_SPINS: u32 = 200_000;
/// How long (simulated) a batch may stay open or committing: well under the
/// tools' deadlines (3 s), as the gate's linger and commits are.
/// `STEPGATE_SIM_SLOW_COMMITS=1` lifts it.
const COMMIT_WITHIN_MS: i64 = 1_000;
/// Events kept for a failure's message (all of them when one seed is replayed).
const TRACE: usize = 80;

/// splitmix64: small, fast, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Topic {
    Intents,
    Commands,
    Progress,
}

impl Topic {
    const ALL: [Topic; 3] = [Topic::Intents, Topic::Commands, Topic::Progress];

    fn name(self) -> &'static str {
        match self {
            Topic::Intents => "intents",
            Topic::Commands => "commands",
            Topic::Progress => "progress",
        }
    }
}

/// A changelog record: its key and value (None: a tombstone).
type ChangelogRecord = (Vec<u8>, Option<Vec<u8>>);

/// What the broker holds: input logs, the group's committed offsets, and the
/// changelog (the source of truth every restore reads).
#[derive(Default)]
struct Kafka {
    /// Per partition, changelog offsets of aborted records: they take their
    /// offsets, and a read_committed reader never returns them.
    aborted: BTreeMap<i32, BTreeSet<usize>>,
    logs: BTreeMap<(Topic, i32), Vec<Vec<u8>>>,
    committed: BTreeMap<(Topic, i32), i64>,
    /// Per intents partition, the `applied` mark committed with its offset
    /// (the committed offset is held back at deferred steps).
    applied: BTreeMap<i32, i64>,
    changelog: BTreeMap<i32, Vec<ChangelogRecord>>,
}

impl Kafka {
    fn len(&self, t: Topic, p: i32) -> i64 {
        self.logs.get(&(t, p)).map_or(0, |l| l.len() as i64)
    }

    fn committed(&self, t: Topic, p: i32) -> i64 {
        self.committed.get(&(t, p)).copied().unwrap_or(0)
    }

    fn publish(&mut self, t: Topic, p: i32, payload: Vec<u8>) {
        self.logs.entry((t, p)).or_default().push(payload);
    }
}

/// An outcome (or hand-over) of an invocation, as the invoker reports it.
#[derive(Clone, Debug)]
struct Finished {
    p: i32,
    progress: Progress,
}

/// What a batch decided, in order, for the model to see once it commits.
#[derive(Debug)]
enum Ev {
    Answer {
        result: ToolResult,
        /// The step's dispatch when it was answered (None: no record).
        dispatch: Option<u32>,
        /// Sent at once, before its batch commits.
        at_once: bool,
    },
    Invoke(i32, Call),
    /// An operator settled the step again: later answers follow the new result.
    Resettled(StepKey),
    /// A call handed back as never invoked, known once this batch commits.
    NotInvoked(StepKey, u32),
}

#[derive(Default)]
struct Pending {
    batch: Batch,
    evs: Vec<Ev>,
    /// Input positions this batch commits.
    next: BTreeMap<(Topic, i32), i64>,
    /// Outcomes of partitions owned elsewhere, written to `progress`.
    handover: Vec<Finished>,
    /// Outcomes taken in, delivered again if the batch does not commit.
    outcomes: Vec<Finished>,
}

impl Pending {
    fn on_top_of(below: Option<Arc<Batch>>) -> Pending {
        Pending {
            batch: Batch::on_top_of(below),
            ..Pending::default()
        }
    }

    fn is_empty(&self) -> bool {
        self.batch.is_empty()
            && self.evs.is_empty()
            && self.next.is_empty()
            && self.handover.is_empty()
    }
}

struct Sealed {
    batch: Arc<Batch>,
    committer: crate::state::Committer,
    evs: Vec<Ev>,
    next: BTreeMap<(Topic, i32), i64>,
    /// Per intents partition, the applied mark this batch commits.
    applied: BTreeMap<i32, i64>,
    handover: Vec<Finished>,
    outcomes: Vec<Finished>,
}

/// One gate process: its state store (kept across crashes), its core (lost in
/// a crash), its session's partitions and batches.
struct Proc {
    name: char,
    store: StateStore,
    core: GateCore,
    alive: bool,
    /// SIGTERM received: calls handed back are left for the next owner.
    stopping: bool,
    owned: BTreeSet<i32>,
    pos: BTreeMap<(Topic, i32), i64>,
    /// Per intents partition owned, its applied mark (as the gate's
    /// `Ownership` keeps it: from the committed offset's metadata at the
    /// partition's load, moved by each batch that commits).
    applied: BTreeMap<i32, i64>,
    /// Per partition newly loaded, where its `progress` ended then: its
    /// deadlines wait until it is read that far.
    progress_end: BTreeMap<i32, i64>,
    open: Pending,
    committing: Option<Sealed>,
    /// This session's producers (`state::Committer`), taking turns.
    session: u64,
    turn: usize,
    /// Since when (simulated ms) a batch has been open or committing.
    pending_since: Option<i64>,
    backlog: Vec<Finished>,
}

/// How an unkeyed invocation goes (decided when it leaves the queue).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    Ok,
    Refused,
    InDoubt,
    /// Keyed: the provider was never reached (connection refused).
    Unreachable,
    /// Keyed: the provider was reached with the step's key.
    Reached,
}

#[derive(Clone)]
struct Job {
    id: u64,
    proc: usize,
    p: i32,
    call: Call,
    /// None while queued for a slot.
    fate: Option<Fate>,
}

/// The provider's view of one idempotency key.
#[derive(Debug, Clone, PartialEq)]
enum Key {
    /// A request with this key is being processed (by job id).
    InProgress(u64),
    Done(Outcome),
}

#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    seeds: u64,
    steps: u64,
    intents: u64,
    invocations: u64,
    outcomes: u64,
    stale_outcomes: u64,
    /// Outcomes of a deferred step whose record was lost with its process's
    /// memory (its intent re-read later).
    outcomes_before_reread: u64,
    /// Reports on `progress` that reached a deferred step (refused: of
    /// another reading).
    handed_to_deferred: u64,
    /// Hand-overs of an earlier reading of a re-read step, refused by the
    /// step's newer record (its token was never kept).
    earlier_reading: u64,
    /// Forged reports on `progress`, refused.
    forged: u64,
    /// Intents of deferred steps decided again (re-read below the mark).
    reread: u64,
    not_invoked: u64,
    answers: u64,
    /// Of them, sent at once (repeats of committed outcomes).
    at_once: u64,
    commands: u64,
    crashes: u64,
    rebalances: u64,
    failed_commits: u64,
    /// Commits the broker acknowledged and lost (aborted after they were
    /// applied locally).
    lost_markers: u64,
    /// Restores that resumed from the local offset (their tails confirmed),
    /// and those that found a tail not on the changelog (and started over).
    resumed: u64,
    refuted: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.seeds += o.seeds;
        self.steps += o.steps;
        self.intents += o.intents;
        self.invocations += o.invocations;
        self.outcomes += o.outcomes;
        self.stale_outcomes += o.stale_outcomes;
        self.outcomes_before_reread += o.outcomes_before_reread;
        self.handed_to_deferred += o.handed_to_deferred;
        self.earlier_reading += o.earlier_reading;
        self.forged += o.forged;
        self.reread += o.reread;
        self.not_invoked += o.not_invoked;
        self.answers += o.answers;
        self.at_once += o.at_once;
        self.commands += o.commands;
        self.crashes += o.crashes;
        self.rebalances += o.rebalances;
        self.failed_commits += o.failed_commits;
        self.lost_markers += o.lost_markers;
        self.resumed += o.resumed;
        self.refuted += o.refuted;
    }
}

/// What the contract under test carries (probed at run time, so the
/// simulation drives what exists).
#[derive(Debug, Clone, Copy)]
struct Support {
    /// `ProgressEvent::NotInvoked`: a queued call whose partition moved is
    /// handed over, not invoked.
    not_invoked: bool,
    /// `Command.run`: a command names the run it decides.
    command_run: bool,
}

impl Support {
    fn probe() -> Support {
        let step = json!({"workflow_id": "w", "step_index": 0, "tool": "wire", "attempt": 0});
        let not_invoked = serde_json::from_value::<Progress>(
            json!({"step": step, "dispatch": 1, "at_ms": 0, "event": "not_invoked"}),
        )
        .is_ok();
        let run = json!({"dispatch": 7, "intended_at_ms": 5});
        let command = json!({"id": "x", "workflow_id": "w", "step_index": 0, "tool": "wire",
            "attempt": 0, "action": "approve", "by": "sim", "at": "2026-01-01T00:00:00.000Z",
            "run": run});
        let command_run = serde_json::from_value::<Command>(command)
            .ok()
            .and_then(|c| serde_json::to_value(c).ok())
            .is_some_and(|v| v.get("run") == Some(&run));
        Support {
            not_invoked,
            command_run,
        }
    }
}

/// The reference model: what agents were told, and what really happened.
#[derive(Default)]
struct Model {
    /// call_id → its step, for every intent published.
    sent: BTreeMap<String, StepKey>,
    /// call_id → its answer, as published.
    answers: BTreeMap<String, ToolResult>,
    /// call_ids answered at once, outside a batch: read again after a crash,
    /// such a call may be answered again, identically.
    at_once: BTreeSet<String>,
    /// Per step, the answer every call gets (call_id and deduplicated aside).
    canonical: BTreeMap<StepKey, ToolResult>,
    /// The latest committed record of each step (from the changelog).
    records: BTreeMap<StepKey, StepRecord>,
    /// Unkeyed: invocations per (step, dispatch) and effects per step/dispatch.
    invoked: BTreeMap<(StepKey, u32), u32>,
    effects: BTreeMap<(StepKey, u32), u32>,
    /// Keyed: the provider, by step (the key is a function of the step).
    keys: BTreeMap<StepKey, Key>,
    /// Runs answered "not performed": (step, dispatch) for unkeyed, (step, 0)
    /// for keyed (every dispatch shares the key).
    not_performed: BTreeSet<(StepKey, u32)>,
    /// Runs handed back as not invoked, committed (on `progress` or in the
    /// step's record): (step, dispatch).
    handed_over: BTreeSet<(StepKey, u32)>,
}

impl Model {
    fn effects_of(&self, step: &StepKey) -> u32 {
        self.effects
            .range((step.clone(), 0)..=(step.clone(), u32::MAX))
            .map(|(_, n)| n)
            .sum()
    }
}

/// A violation of the contract, or of the simulation's own expectations.
type Check = Result<(), String>;

struct World {
    rng: Rng,
    now: i64,
    step: u64,
    config: Config,
    kafka: Kafka,
    procs: Vec<Proc>,
    owner: BTreeMap<i32, usize>,
    jobs: Vec<Job>,
    next_job: u64,
    next_call: u64,
    next_command: u64,
    /// Operator commands decided, published later: (at step, partition, payload).
    outbox: Vec<(u64, i32, Vec<u8>)>,
    model: Model,
    support: Support,
    knobs: Knobs,
    /// Payloads of forged reports published on `progress`.
    forged: BTreeSet<Vec<u8>>,
    /// Batches may stay open or committing past the tools' deadlines.
    slow_commits: bool,
    trace_cap: usize,
    counts: Counts,
    trace: std::collections::VecDeque<String>,
    workflows: Vec<(String, i32)>,
}

/// A gate core whose dispatch tokens come from `seed`.
fn seeded_core(config: &Config, seed: u64) -> GateCore {
    let mut core = GateCore::new(config, Arc::new(Metrics::new()));
    core.seed_tokens(seed);
    core
}

fn new_proc(name: char, store: StateStore, config: &Config, seed: u64) -> Proc {
    Proc {
        name,
        store,
        core: seeded_core(config, seed),
        alive: true,
        stopping: false,
        owned: BTreeSet::new(),
        pos: BTreeMap::new(),
        applied: BTreeMap::new(),
        progress_end: BTreeMap::new(),
        open: Pending::default(),
        committing: None,
        session: next_session(),
        turn: 0,
        pending_since: None,
        backlog: Vec::new(),
    }
}

/// A process-wide session number: the simulation's stores outlive a seed,
/// and a store's producers of one session must never be taken for another's.
fn next_session() -> u64 {
    static SESSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    SESSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn state_err(e: StateError) -> String {
    format!("state error: {e:?}")
}

/// Whether `needle` appears anywhere in `hay` (an outcome kept in a record).
fn json_contains(hay: &Value, needle: &Value) -> bool {
    hay == needle
        || match hay {
            Value::Object(m) => m.values().any(|v| json_contains(v, needle)),
            Value::Array(a) => a.iter().any(|v| json_contains(v, needle)),
            _ => false,
        }
}

/// Whether a step record already holds an outcome: as its answer, or kept
/// anywhere in it (a late or stale outcome).
fn holds(record: &StepRecord, outcome: &Outcome) -> bool {
    if let Some(r) = &record.result {
        let fresh = ToolResult::from_outcome(&record.step, None, outcome.clone(), at(0));
        if (r.status, &r.output, &r.error) == (fresh.status, &fresh.output, &fresh.error) {
            return true;
        }
    }
    let (Ok(hay), Ok(needle)) = (serde_json::to_value(record), serde_json::to_value(outcome))
    else {
        return false;
    };
    json_contains(&hay, &needle)
}

fn progress_of(
    step: &StepKey,
    dispatch: u32,
    token: Option<&str>,
    now: i64,
    event: Value,
) -> Progress {
    let mut v = json!({"step": step, "dispatch": dispatch, "at_ms": now, "token": token});
    if let (Value::Object(m), Value::Object(e)) = (&mut v, event) {
        m.extend(e);
    }
    serde_json::from_value(v).expect("a progress record the contract reads")
}

fn is_not_invoked(p: &Progress) -> bool {
    serde_json::to_value(p).is_ok_and(|v| v.get("event") == Some(&json!("not_invoked")))
}

/// The step an answer is for.
fn step_of(r: &ToolResult) -> StepKey {
    StepKey {
        workflow_id: r.workflow_id.clone(),
        step_index: r.step_index,
        tool: r.tool.clone(),
        attempt: r.attempt,
    }
}

fn outcome_of(p: &Progress) -> Option<&Outcome> {
    match &p.event {
        ProgressEvent::Finished { outcome } => Some(outcome),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

impl World {
    fn new(seed: u64, stores: [StateStore; 2]) -> Result<World, String> {
        let config = Config::from_toml_str(CONFIG, Vec::new()).map_err(|e| format!("{e:?}"))?;
        for store in &stores {
            for p in 0..PARTITIONS {
                store.wipe_partition(p).map_err(state_err)?;
            }
        }
        let [a, b] = stores;
        let procs = vec![
            new_proc('A', a, &config, seed.wrapping_mul(2)),
            new_proc('B', b, &config, seed.wrapping_mul(2) + 1),
        ];
        let workflows = (0..WORKFLOWS)
            .map(|i| {
                let wf = format!("wf-{i}");
                let p = crate::contract::partition_for(&wf, PARTITIONS);
                (wf, p)
            })
            .collect();
        let mut rng = Rng(seed);
        let knobs = Knobs::draw(&mut rng);
        Ok(World {
            rng,
            knobs,
            slow_commits: std::env::var_os("STEPGATE_SIM_SLOW_COMMITS").is_some(),
            trace_cap: if env_u64("STEPGATE_SIM_SEED").is_some() {
                usize::MAX
            } else {
                TRACE
            },
            now: 1_000_000,
            step: 0,
            config,
            kafka: Kafka::default(),
            procs,
            owner: BTreeMap::new(),
            jobs: Vec::new(),
            next_job: 0,
            next_call: 0,
            next_command: 0,
            outbox: Vec::new(),
            model: Model::default(),
            support: Support::probe(),
            forged: BTreeSet::new(),
            counts: Counts::default(),
            trace: std::collections::VecDeque::new(),
            workflows,
        })
    }

    fn into_stores(self) -> [StateStore; 2] {
        let mut it = self.procs.into_iter().map(|p| p.store);
        let a = it.next().expect("two processes");
        let b = it.next().expect("two processes");
        [a, b]
    }

    fn note(&mut self, what: String) {
        if self.trace.len() >= self.trace_cap {
            self.trace.pop_front();
        }
        self.trace
            .push_back(format!("#{} t={} {what}", self.step, self.now));
    }

    fn run(&mut self, steps: u64) -> Check {
        for p in 0..PARTITIONS {
            let x = self.rng.index(self.procs.len());
            self.assign(x, p)?;
        }
        for i in 0..steps {
            self.step = i;
            self.counts.steps += 1;
            self.event()?;
        }
        self.drain()?;
        self.final_checks()
    }

    /// One random event, drawn by the seed's weights.
    fn event(&mut self) -> Check {
        self.publish_due(false);
        let k = self.knobs;
        let weights = [
            (Event::Intent, 20),
            (Event::Poll, 20),
            (Event::Seal, 10),
            (Event::Land, 8),
            (Event::JobStart, 10),
            (Event::JobFinish, 12),
            (Event::Tick, 8),
            (Event::Operator, k.operator),
            (Event::Rebalance, k.rebalance),
            (Event::Crash, k.crash),
            (Event::SessionLost, k.session_lost),
            (Event::Forge, 2),
        ];
        let total: u64 = weights.iter().map(|(_, w)| w).sum();
        let mut roll = self.rng.below(total);
        let mut event = Event::Intent;
        for (e, w) in weights {
            if roll < w {
                event = e;
                break;
            }
            roll -= w;
        }
        let x = self.rng.index(self.procs.len());
        match event {
            Event::Intent => self.intent(),
            Event::Poll => self.poll(x).map(|_| ()),
            Event::Seal => {
                self.seal(x);
                Ok(())
            }
            Event::Land => {
                let roll = self.rng.below(100);
                let fate = if roll < k.failed_commit_pct / 2 {
                    Land::Abort
                } else if roll < k.failed_commit_pct {
                    Land::LostReply
                } else if roll < k.failed_commit_pct + k.lost_marker_pct {
                    Land::LostMarker
                } else {
                    Land::Ok
                };
                self.land(x, fate)
            }
            Event::JobStart => self.job_start(None),
            Event::JobFinish => self.job_finish(None),
            Event::Tick => {
                let dt = if self.rng.chance(k.long_tick_pct) {
                    5_000 + self.rng.below(30_000) as i64
                } else {
                    self.rng.below(1_500) as i64
                };
                self.tick(dt)
            }
            Event::Operator => self.operator(true),
            Event::Rebalance => self.rebalance(),
            Event::Crash if self.procs[x].alive => {
                if self.support.not_invoked && self.rng.chance(50) {
                    self.stop(x)
                } else {
                    self.kill(x)
                }
            }
            Event::Crash => {
                self.restart(x);
                Ok(())
            }
            Event::SessionLost => self.restart_session(x),
            Event::Forge => {
                self.forge();
                Ok(())
            }
        }
    }

    /// Someone who may write `progress` (a worker of another pool, say) and
    /// holds no call: reports on a random recorded step, as a worker's JSON
    /// or as a gate's hand-over with a made-up token.
    fn forge(&mut self) {
        let steps: Vec<StepRecord> = self.model.records.values().cloned().collect();
        if steps.is_empty() {
            return;
        }
        let r = &steps[self.rng.index(steps.len())];
        let dispatch = r.dispatch.saturating_sub(self.rng.below(2) as u32).max(1);
        let event = if self.rng.chance(50) {
            json!({"event": "not_invoked"})
        } else {
            json!({"event": "finished", "outcome": {"status": "ok", "output": {"forged": true}}})
        };
        let token = (self.rng.chance(50)).then(|| format!("{:032x}", self.rng.next()));
        let progress = progress_of(&r.step, dispatch, token.as_deref(), self.now, event);
        let payload = if self.rng.chance(50) {
            serde_json::to_vec(&progress).expect("a progress record serialises")
        } else {
            crate::contract::codec::encode(&progress)
        };
        self.note(format!(
            "forger: {} #{dispatch} {} → p{}",
            r.step,
            describe(&progress),
            r.partition
        ));
        self.forged.insert(payload.clone());
        self.kafka.publish(Topic::Progress, r.partition, payload);
    }

    // --- agents -----------------------------------------------------------

    fn intent(&mut self) -> Check {
        let (wf, p) = self.workflows[self.rng.index(self.workflows.len())].clone();
        let step_index = self.rng.below(STEP_INDEXES);
        let tool = TOOLS[self.rng.index(TOOLS.len())];
        let attempt = u64::from(self.rng.chance(10));
        let v = self.rng.below(3);
        self.next_call += 1;
        let call_id = format!("c{}", self.next_call);
        let step = StepKey {
            workflow_id: wf.clone(),
            step_index,
            tool: tool.into(),
            attempt,
        };
        self.model.sent.insert(call_id.clone(), step.clone());
        let body = json!({"workflow_id": wf, "step_index": step_index, "tool": tool,
            "attempt": attempt, "arguments": {"v": v}, "call_id": call_id});
        self.kafka
            .publish(Topic::Intents, p, body.to_string().into_bytes());
        self.counts.intents += 1;
        self.note(format!("agent: intent {call_id} {step} v={v} → p{p}"));
        Ok(())
    }

    // --- the operator -----------------------------------------------------

    /// Decide one step waiting for a person, from its latest committed record
    /// (what the CLI shows). `chaos`: publish late, and sometimes twice.
    fn operator(&mut self, chaos: bool) -> Check {
        let open: Vec<StepRecord> = self
            .model
            .records
            .values()
            .filter(|r| matches!(r.phase, Phase::InDoubt | Phase::AwaitingApproval))
            .cloned()
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        let r = open[self.rng.index(open.len())].clone();
        self.decide(&r, chaos);
        Ok(())
    }

    fn decide(&mut self, r: &StepRecord, chaos: bool) {
        let action = match r.phase {
            // An honest operator: the provider shows whether it took effect.
            Phase::InDoubt if self.effect_known(&r.step) => {
                json!({"action": "resolve_executed", "output": {"resolved_by": "operator"}})
            }
            Phase::InDoubt => json!({"action": "resolve_not_executed"}),
            _ if self.rng.chance(75) => json!({"action": "approve"}),
            _ => json!({"action": "deny"}),
        };
        let copies = if chaos && self.rng.chance(25) { 2 } else { 1 };
        let mut delay = 0;
        for _ in 0..copies {
            self.next_command += 1;
            let mut cmd = json!({"id": format!("op-{}", self.next_command),
                "workflow_id": r.step.workflow_id, "step_index": r.step.step_index,
                "tool": r.step.tool, "attempt": r.step.attempt,
                "by": "sim", "at": "2026-12-01T00:00:00.000Z",
                "run": {"dispatch": r.dispatch, "intended_at_ms": r.intended_at_ms}});
            if let (Value::Object(m), Value::Object(a)) = (&mut cmd, action.clone()) {
                m.extend(a);
            }
            if chaos {
                delay += self.rng.below(60);
            }
            self.note(format!(
                "operator: {} {} (dispatch {}), published in {delay} steps",
                cmd["action"], r.step, r.dispatch
            ));
            self.outbox
                .push((self.step + delay, r.partition, cmd.to_string().into_bytes()));
        }
        self.publish_due(false);
    }

    fn effect_known(&self, step: &StepKey) -> bool {
        match self.model.keys.get(step) {
            Some(Key::Done(Outcome::Ok { .. })) => true,
            _ => self.model.effects_of(step) > 0,
        }
    }

    fn publish_due(&mut self, all: bool) {
        let now = self.step;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.outbox)
            .into_iter()
            .partition(|(at, _, _)| all || *at <= now);
        self.outbox = later;
        for (_, p, payload) in due {
            self.counts.commands += 1;
            self.kafka.publish(Topic::Commands, p, payload);
        }
    }

    // --- the gate processes ----------------------------------------------

    /// Take the core's decisions into the process's open batch.
    fn collect(&mut self, x: usize) -> Check {
        let outs = self.procs[x].core.take_outs();
        let (now, with_batch): (Vec<Out>, Vec<Out>) =
            outs.into_iter().partition(|o| o.when() == When::Now);
        let mut calls = Vec::new();
        // Answers sent at once are published now, whatever becomes of the batch.
        for o in now {
            match o {
                Out::Result {
                    partition, result, ..
                } => {
                    let step = step_of(&result);
                    let pr = &self.procs[x];
                    let dispatch = pr
                        .store
                        .step(partition, &step)
                        .map_err(state_err)?
                        .map(|r| r.dispatch);
                    self.note(format!(
                        "{}: answers {:?} of {step} at once",
                        pr.name, result.call_id
                    ));
                    self.observe(&Ev::Answer {
                        result,
                        dispatch,
                        at_once: true,
                    })?;
                }
                Out::Invoke {
                    partition, call, ..
                } => calls.push((partition, call)),
                Out::Approval { .. }
                | Out::Command { .. }
                | Out::Dlq { .. }
                | Out::Forward { .. } => {}
            }
        }
        let pr = &mut self.procs[x];
        for o in with_batch {
            match o {
                Out::Result {
                    partition, result, ..
                } => {
                    let step = step_of(&result);
                    let dispatch = pr
                        .open
                        .batch
                        .step(&pr.store, partition, &step)
                        .map_err(state_err)?
                        .map(|r| r.dispatch);
                    pr.open.evs.push(Ev::Answer {
                        result,
                        dispatch,
                        at_once: false,
                    });
                }
                Out::Invoke {
                    partition, call, ..
                } => pr.open.evs.push(Ev::Invoke(partition, call)),
                Out::Approval { .. }
                | Out::Command { .. }
                | Out::Dlq { .. }
                | Out::Forward { .. } => {}
            }
        }
        // Calls started at once: a first-read keyed step's, and those whose
        // commit was reported failed and had landed (found at a partition's
        // load), already marked running.
        for (p, call) in calls {
            self.note(format!(
                "{}: invokes {} #{} at once",
                self.procs[x].name, call.step, call.dispatch
            ));
            self.queue(x, p, call);
        }
        Ok(())
    }

    /// Bring a partition's state up to the changelog's end and load it: as
    /// `state::restore_partitions` reads, from the local offset once the
    /// tails of the batches applied last are confirmed on the changelog (as
    /// a read_committed reader sees it), from the start otherwise.
    fn restore(&mut self, x: usize, p: i32) -> Check {
        let log = self.kafka.changelog.entry(p).or_default();
        let aborted = self.kafka.aborted.entry(p).or_default();
        let visible = |from: usize| -> Vec<ChangelogRecord> {
            (from..log.len())
                .filter(|o| !aborted.contains(o))
                .map(|o| log[o].clone())
                .collect()
        };
        let pr = &mut self.procs[x];
        let trust = crate::state::Trust {
            max_age: std::time::Duration::from_secs(86_400),
        };
        let resume = pr
            .store
            .resume_point(p, chrono::Utc::now().timestamp_millis(), &trust)
            .map_err(state_err)?;
        let mut refuted = None;
        let from = match resume {
            crate::state::Resume::From { next, check }
                if next >= 0 && next as usize <= log.len() =>
            {
                let mut c = crate::state::Confirming::new(&check);
                let start = c.start(next).max(0) as usize;
                for (o, (key, value)) in log.iter().enumerate().skip(start) {
                    if !aborted.contains(&o) {
                        c.record(o as i64, Some(key), value.as_deref());
                    }
                }
                match c.verdict(log.len() as i64) {
                    crate::state::Verdict::Confirmed => {
                        self.counts.resumed += 1;
                        Some(next as usize)
                    }
                    v => {
                        self.counts.refuted += 1;
                        refuted = Some(format!(
                            "{}: p{p} holds a batch the changelog does not ({v:?}): restored from the start",
                            pr.name
                        ));
                        None
                    }
                }
            }
            _ => None,
        };
        let start = match from {
            Some(n) => n,
            None => {
                pr.store.wipe_partition(p).map_err(state_err)?;
                0
            }
        };
        pr.store
            .apply_changelog(&visible(start))
            .map_err(state_err)?;
        pr.store
            .finish_restore(p, Some(log.len() as i64))
            .map_err(state_err)?;
        // Invariant 3: the restored state is exactly the changelog's committed
        // records, folded — never ahead, never holding an aborted batch.
        let mut folded: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (k, v) in visible(0) {
            match v {
                Some(v) => folded.insert(k, v),
                None => folded.remove(&k),
            };
        }
        let held: BTreeMap<Vec<u8>, Vec<u8>> = pr
            .store
            .logged_records(p)
            .map_err(state_err)?
            .into_iter()
            .collect();
        if held != folded {
            let extra = held.keys().filter(|k| !folded.contains_key(*k)).count();
            return Err(format!(
                "{}: p{p}'s restored state is not its changelog's committed records ({} held, {} on the changelog, {extra} held that the changelog does not have)",
                pr.name,
                held.len(),
                folded.len(),
            ));
        }
        if let Some(what) = refuted {
            self.note(what);
        }
        let pr = &mut self.procs[x];
        pr.core.set_intent_partitions(PARTITIONS);
        let applied = self
            .kafka
            .applied
            .get(&p)
            .copied()
            .unwrap_or(0)
            .max(self.kafka.committed(Topic::Intents, p));
        pr.applied.insert(p, applied);
        pr.core
            .load_partition(&pr.store, p, self.now)
            .map_err(state_err)?;
        for t in Topic::ALL {
            pr.pos.insert((t, p), self.kafka.committed(t, p));
        }
        pr.progress_end
            .insert(p, self.kafka.len(Topic::Progress, p));
        self.progress_caught_up(x, p);
        self.collect(x)
    }

    /// Tell the core once a partition's `progress` is read as far as it went
    /// at the partition's load.
    fn progress_caught_up(&mut self, x: usize, p: i32) {
        let pr = &mut self.procs[x];
        let at = pr.pos.get(&(Topic::Progress, p)).copied().unwrap_or(0);
        if pr.progress_end.get(&p).is_some_and(|end| at >= *end) {
            pr.progress_end.remove(&p);
            pr.core.progress_read(p);
        }
    }

    fn assign(&mut self, x: usize, p: i32) -> Check {
        self.owner.insert(p, x);
        self.procs[x].owned.insert(p);
        self.note(format!("{}: assigned p{p}", self.procs[x].name));
        self.restore(x, p)
    }

    /// Move a partition to a live process (or give an orphan one an owner).
    fn rebalance(&mut self) -> Check {
        let p = self.rng.below(PARTITIONS as u64) as i32;
        let live: Vec<usize> = (0..self.procs.len())
            .filter(|&x| self.procs[x].alive)
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        let to = live[self.rng.index(live.len())];
        match self.owner.get(&p).copied() {
            Some(from) if from == to => return Ok(()),
            Some(from) => self.revoke(from, p)?,
            None => {}
        }
        self.counts.rebalances += 1;
        self.assign(to, p)
    }

    fn revoke(&mut self, x: usize, p: i32) -> Check {
        self.note(format!("{}: revoked p{p}", self.procs[x].name));
        // The batch committing finishes first; an open one is dropped and the
        // session restarts (as the gate does when revoked with a batch open).
        self.land(x, Land::Ok)?;
        let dropped = !self.procs[x].open.is_empty();
        self.owner.remove(&p);
        let pr = &mut self.procs[x];
        pr.owned.remove(&p);
        pr.core.drop_partition(p);
        pr.applied.remove(&p);
        for t in Topic::ALL {
            pr.pos.remove(&(t, p));
        }
        pr.progress_end.remove(&p);
        if dropped {
            self.restart_session(x)?;
        }
        if self.support.not_invoked {
            // Queued calls of the partition are handed over at once.
            let queued: Vec<usize> = (0..self.jobs.len())
                .filter(|&j| {
                    let job = &self.jobs[j];
                    job.proc == x && job.p == p && job.fate.is_none()
                })
                .collect();
            for j in queued.into_iter().rev() {
                let job = self.jobs.remove(j);
                self.hand_over_not_invoked(job)?;
            }
            // Written to `progress` before the partition's next owner reads
            // it (the gate commits them at once).
            for _ in 0..2 {
                self.seal(x);
                self.land(x, Land::Ok)?;
            }
        }
        Ok(())
    }

    /// A commit failed (or the session was lost): forget the batches, restore
    /// the partitions still owned, and deliver the outcomes taken in again.
    fn restart_session(&mut self, x: usize) -> Check {
        if !self.procs[x].alive {
            return Ok(());
        }
        self.note(format!("{}: session restarts", self.procs[x].name));
        let pr = &mut self.procs[x];
        pr.session = next_session();
        pr.core.reset();
        let open = std::mem::take(&mut pr.open);
        pr.backlog.extend(open.outcomes);
        if let Some(s) = pr.committing.take() {
            pr.backlog.extend(s.outcomes);
        }
        pr.pos.clear();
        pr.applied.clear();
        // The invoker is told the session ended: calls still queued are not
        // invoked, and come back as such.
        let mut queued = Vec::new();
        if self.support.not_invoked {
            let jobs = std::mem::take(&mut self.jobs);
            for job in jobs {
                if job.proc == x && job.fate.is_none() {
                    queued.push(job);
                } else {
                    self.jobs.push(job);
                }
            }
        }
        for p in self.procs[x].owned.clone() {
            self.restore(x, p)?;
        }
        for f in std::mem::take(&mut self.procs[x].backlog) {
            self.deliver(x, f)?;
        }
        for job in queued {
            self.hand_over_not_invoked(job)?;
        }
        Ok(())
    }

    /// kill -9: memory, batches and invoker gone; the store stays.
    fn kill(&mut self, x: usize) -> Check {
        self.counts.crashes += 1;
        let name = self.procs[x].name;
        // The crash came after the broker committed the batch, or before.
        if let Some(s) = self.procs[x].committing.take() {
            if self.rng.chance(50) {
                self.note(format!("{name}: crashes after its batch committed"));
                self.broker_commit(&s)?;
            } else {
                self.note(format!("{name}: crashes before its batch committed"));
            }
        } else {
            self.note(format!("{name}: crashes"));
        }
        self.teardown(x)
    }

    /// SIGTERM: queued calls are handed back not invoked (left due at once
    /// for the next owner), running ones get the drain to finish, what is
    /// decided is committed, and the process exits.
    fn stop(&mut self, x: usize) -> Check {
        self.note(format!("{}: SIGTERM", self.procs[x].name));
        self.procs[x].core.set_stopping();
        self.procs[x].stopping = true;
        let queued: Vec<usize> = (0..self.jobs.len())
            .filter(|&j| self.jobs[j].proc == x && self.jobs[j].fate.is_none())
            .collect();
        for j in queued.into_iter().rev() {
            let job = self.jobs.remove(j);
            self.hand_over_not_invoked(job)?;
        }
        let running: Vec<usize> = (0..self.jobs.len())
            .filter(|&j| self.jobs[j].proc == x && self.jobs[j].fate.is_some())
            .collect();
        for j in running.into_iter().rev() {
            if self.rng.chance(70) {
                self.job_finish(Some(j))?;
            }
        }
        for _ in 0..2 {
            self.seal(x);
            self.land(x, Land::Ok)?;
        }
        self.note(format!("{}: exits", self.procs[x].name));
        self.teardown(x)
    }

    /// The process is gone: its memory, batches and calls with it.
    fn teardown(&mut self, x: usize) -> Check {
        let pr = &mut self.procs[x];
        pr.alive = false;
        pr.committing = None;
        pr.open = Pending::default();
        pr.backlog.clear();
        pr.pos.clear();
        pr.applied.clear();
        pr.progress_end.clear();
        for p in std::mem::take(&mut pr.owned) {
            self.owner.remove(&p);
        }
        // Queued calls never ran; a running one's provider work completes.
        let jobs = std::mem::take(&mut self.jobs);
        for job in jobs {
            if job.proc != x {
                self.jobs.push(job);
                continue;
            }
            if job.fate == Some(Fate::Reached)
                && self.model.keys.get(&job.call.step) == Some(&Key::InProgress(job.id))
            {
                self.provider_decides(&job)?;
            }
        }
        Ok(())
    }

    fn restart(&mut self, x: usize) {
        if self.procs[x].alive {
            return;
        }
        self.note(format!("{}: restarts", self.procs[x].name));
        let seed = self.rng.next();
        let pr = &mut self.procs[x];
        pr.core = seeded_core(&self.config, seed);
        pr.session = next_session();
        pr.alive = true;
        pr.stopping = false;
        pr.open = Pending::default();
        pr.committing = None;
    }

    /// Read one input of an owned partition into the open batch.
    fn poll(&mut self, x: usize) -> Result<bool, String> {
        if !self.procs[x].alive {
            return Ok(false);
        }
        let mut ready = Vec::new();
        for &p in &self.procs[x].owned {
            for t in Topic::ALL {
                let at = self.procs[x].pos.get(&(t, p)).copied().unwrap_or(0);
                if at < self.kafka.len(t, p) {
                    ready.push((t, p, at));
                }
            }
        }
        if ready.is_empty() {
            return Ok(false);
        }
        let (t, p, offset) = ready[self.rng.index(ready.len())];
        let payload = self.kafka.logs[&(t, p)][offset as usize].clone();
        let input = Input {
            topic: t.name().into(),
            partition: p,
            offset,
            key: Some(b"wf".to_vec()),
            payload: Some(payload.clone()),
            headers: vec![],
            timestamp_ms: None,
        };
        let now = self.now;
        {
            let pr = &mut self.procs[x];
            pr.pos.insert((t, p), offset + 1);
            pr.open.next.insert((t, p), offset + 1);
        }
        match t {
            Topic::Intents => {
                self.note(format!(
                    "{}: reads intent p{p}@{offset}",
                    self.procs[x].name
                ));
                if self.kafka.applied.get(&p).is_some_and(|a| offset < *a) {
                    self.counts.reread += 1;
                }
                let pr = &mut self.procs[x];
                let applied = pr.applied.get(&p).copied().unwrap_or(0);
                pr.core
                    .on_intent(&pr.store, &mut pr.open.batch, &input, applied, now)
                    .map_err(state_err)?;
            }
            Topic::Commands => self.on_command(x, &input, &payload)?,
            Topic::Progress => {
                let progress = Progress::decode(&payload).map_err(|e| e.to_string())?;
                let forged = self.forged.contains(&payload);
                self.note(format!(
                    "{}: reads progress p{p}@{offset}: {} #{} {}",
                    self.procs[x].name,
                    progress.step,
                    progress.dispatch,
                    describe(&progress)
                ));
                let pr = &mut self.procs[x];
                let before = pr
                    .core
                    .step_view(&pr.store, &pr.open.batch, p, &progress.step)
                    .map_err(state_err)?;
                // A deferred step takes a handed-over report as evidence of
                // another reading's run only (its runs are numbered afresh).
                let deferred = pr.core.is_deferred(p, &progress.step);
                pr.core
                    .on_progress(&pr.store, &mut pr.open.batch, &input, now)
                    .map_err(state_err)?;
                let refused_token = before.as_ref().is_some_and(|b| {
                    !b.token_matches(progress.dispatch, progress.token.as_deref())
                });
                // Only a re-read (deferred) step's record is made again.
                let earlier_reading = refused_token && progress.step.tool == "charge";
                if forged || earlier_reading {
                    let after = pr
                        .core
                        .step_view(&pr.store, &pr.open.batch, p, &progress.step)
                        .map_err(state_err)?;
                    if after != before {
                        return Err(format!(
                            "a refused report on progress ({}) changed the record of {} #{}: {before:?} → {after:?}",
                            if forged {
                                "forged"
                            } else {
                                "of another reading"
                            },
                            progress.step,
                            progress.dispatch
                        ));
                    }
                }
                if forged {
                    self.counts.forged += 1;
                } else if earlier_reading && !deferred {
                    self.counts.outcomes += 1;
                    self.counts.earlier_reading += 1;
                } else if deferred {
                    self.counts.outcomes += 1;
                    self.counts.handed_to_deferred += 1;
                } else {
                    self.outcome_taken(x, p, &progress, before)?;
                }
                self.progress_caught_up(x, p);
            }
        }
        self.collect(x)?;
        Ok(true)
    }

    fn on_command(&mut self, x: usize, input: &Input, payload: &[u8]) -> Check {
        let cmd: Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
        let step: StepKey = serde_json::from_value(cmd.clone()).map_err(|e| e.to_string())?;
        let id = cmd["id"].as_str().unwrap_or_default().to_owned();
        let seen = (
            cmd["run"]["dispatch"].as_u64(),
            cmd["run"]["intended_at_ms"].as_i64(),
        );
        let now = self.now;
        let p = input.partition;
        let pr = &mut self.procs[x];
        let before = pr.open.batch.step(&pr.store, p, &step).map_err(state_err)?;
        pr.core
            .on_command(&pr.store, &mut pr.open.batch, input, now)
            .map_err(state_err)?;
        let after = pr.open.batch.step(&pr.store, p, &step).map_err(state_err)?;
        let name = pr.name;
        let applied = after
            .as_ref()
            .is_some_and(|a| a.operator_log.iter().any(|e| e.id == id))
            && !before
                .as_ref()
                .is_some_and(|b| b.operator_log.iter().any(|e| e.id == id));
        self.note(format!(
            "{name}: reads command {id} {} {step} (seen at run {seen:?}, now {:?} {:?}): {}",
            cmd["action"],
            before.as_ref().map(|b| b.dispatch),
            before.as_ref().map(|b| b.phase),
            if applied { "applied" } else { "not applied" }
        ));
        if applied {
            let before = before.expect("a command applies to a recorded step");
            let now_run = (
                Some(u64::from(before.dispatch)),
                Some(before.intended_at_ms),
            );
            if self.support.command_run && seen != now_run {
                return Err(format!(
                    "operator command {id} decided on run {seen:?} of {step} was applied to run {now_run:?}"
                ));
            }
            if cmd["action"]
                .as_str()
                .is_some_and(|a| a.starts_with("resolve"))
            {
                self.procs[x].open.evs.push(Ev::Resettled(step));
            }
        }
        Ok(())
    }

    /// Check what an outcome (or hand-over) did to its step's record.
    fn outcome_taken(
        &mut self,
        x: usize,
        p: i32,
        progress: &Progress,
        before: Option<StepRecord>,
    ) -> Check {
        self.counts.outcomes += 1;
        let pr = &mut self.procs[x];
        let after = pr
            .core
            .step_view(&pr.store, &pr.open.batch, p, &progress.step)
            .map_err(state_err)?;
        // A deferred step's record was in memory only: after a crash, a
        // session restart or the partition moving, its intent is re-read and
        // its step run again with the same key — the outcome has nothing to
        // settle until then.
        if before.is_none() && after.is_none() && progress.step.tool == "charge" {
            self.counts.outcomes_before_reread += 1;
            return Ok(());
        }
        let (Some(before), Some(after)) = (before, after) else {
            return Err(format!(
                "an outcome of {} #{} found no step record (records are never purged here)",
                progress.step, progress.dispatch
            ));
        };
        let stale = progress.dispatch != before.dispatch;
        if stale {
            self.counts.stale_outcomes += 1;
        }
        if is_not_invoked(progress) {
            self.counts.not_invoked += 1;
            let current = !stale && before.phase.in_flight();
            let stopping = self.procs[x].stopping;
            if current && stopping && after == before {
                return Err(format!(
                    "a \"not invoked\" hand-over of {} #{} by a stopping gate left no record",
                    progress.step, progress.dispatch
                ));
            }
            if current && !stopping && after.dispatch <= before.dispatch {
                return Err(format!(
                    "a \"not invoked\" hand-over of {} #{} was not re-dispatched (record {:?} #{})",
                    progress.step, progress.dispatch, after.phase, after.dispatch
                ));
            }
            return Ok(());
        }
        let Some(outcome) = outcome_of(progress) else {
            return Ok(());
        };
        if stale
            && before.phase.in_flight()
            && !after.phase.in_flight()
            && !matches!(outcome, Outcome::Ok { .. })
        {
            return Err(format!(
                "a stale dispatch's outcome settled a re-dispatched step: {} `{}` from dispatch {} settled the step at dispatch {} ({:?} → {:?})",
                progress.step,
                outcome_label(outcome),
                progress.dispatch,
                before.dispatch,
                before.phase,
                after.phase
            ));
        }
        if after == before && !holds(&after, outcome) {
            return Err(format!(
                "an outcome was dropped without a record: {} `{}` from dispatch {} reached a {:?} record at dispatch {} and nothing of it was kept",
                progress.step,
                outcome_label(outcome),
                progress.dispatch,
                before.phase,
                before.dispatch
            ));
        }
        Ok(())
    }

    /// An invocation's report reaches its process: settled here when the
    /// process owns the partition, handed over through `progress` otherwise.
    fn deliver(&mut self, x: usize, f: Finished) -> Check {
        let now = self.now;
        let owns = self.procs[x].owned.contains(&f.p);
        self.note(format!(
            "{}: {} #{} reports {}{}",
            self.procs[x].name,
            f.progress.step,
            f.progress.dispatch,
            describe(&f.progress),
            if owns { "" } else { " (handed over)" }
        ));
        let pr = &mut self.procs[x];
        pr.core.finished(f.p, &f.progress.step, f.progress.dispatch);
        pr.open.outcomes.push(f.clone());
        if is_not_invoked(&f.progress) {
            pr.open
                .evs
                .push(Ev::NotInvoked(f.progress.step.clone(), f.progress.dispatch));
        }
        if !owns {
            pr.open.handover.push(f);
            return Ok(());
        }
        let before = pr
            .core
            .step_view(&pr.store, &pr.open.batch, f.p, &f.progress.step)
            .map_err(state_err)?;
        pr.core
            .on_outcome(&pr.store, &mut pr.open.batch, f.p, f.progress.clone(), now)
            .map_err(state_err)?;
        self.outcome_taken(x, f.p, &f.progress, before)?;
        self.collect(x)
    }

    /// Close the open batch (when none is committing): the next one is
    /// decided on top of it while it commits.
    fn seal(&mut self, x: usize) {
        let pr = &mut self.procs[x];
        if !pr.alive || pr.committing.is_some() || pr.open.is_empty() {
            return;
        }
        let mut o = std::mem::take(&mut pr.open);
        // As `Ownership::batch_offsets`: every intent read is decided (applied); the
        // committed offset stops at the first deferred step not settled.
        let mut applied = BTreeMap::new();
        for &p in &pr.owned {
            let read = pr.pos.get(&(Topic::Intents, p)).copied().unwrap_or(0);
            let commit = pr.core.first_unanswered(p).map_or(read, |f| f.min(read));
            applied.insert(p, read);
            o.next.insert((Topic::Intents, p), commit);
        }
        let batch = Arc::new(o.batch);
        pr.open = Pending::on_top_of(Some(batch.clone()));
        // As `gate::commit::Producers`: a session's two producers take turns.
        pr.turn = (pr.turn + 1) % 2;
        let committer = crate::state::Committer {
            session: pr.session,
            slot: pr.turn,
        };
        pr.committing = Some(Sealed {
            batch,
            committer,
            evs: o.evs,
            next: o.next,
            applied,
            handover: o.handover,
            outcomes: o.outcomes,
        });
    }

    /// The changelog records of a transaction whose commit marker the broker
    /// lost: they take their offsets, aborted (the next session ends the
    /// hanging transaction by aborting it); nothing else of it is kept.
    /// Returns the tails the gate, told it committed, applies it with.
    fn broker_loses(&mut self, s: &Sealed) -> BTreeMap<i32, crate::state::Tail> {
        let mut tails = BTreeMap::new();
        for e in s.batch.changelog() {
            let log = self.kafka.changelog.entry(e.partition).or_default();
            let o = log.len();
            tails.insert(
                e.partition,
                crate::state::Tail::of(o as i64, Some(&e.key), e.value.as_deref()),
            );
            log.push((e.key, e.value));
            self.kafka.aborted.entry(e.partition).or_default().insert(o);
        }
        tails
    }

    /// What the broker keeps of a committed transaction, and what the agents
    /// and the model see of it. Returns its last changelog record in each
    /// partition.
    fn broker_commit(&mut self, s: &Sealed) -> Result<BTreeMap<i32, crate::state::Tail>, String> {
        let mut next = BTreeMap::new();
        for e in s.batch.changelog() {
            if let Some((_, step, record)) =
                crate::state::changelog_step(&e.key, e.value.as_deref())
            {
                match record {
                    Some(r) => self.model.records.insert(step, r),
                    None => self.model.records.remove(&step),
                };
            }
            let log = self.kafka.changelog.entry(e.partition).or_default();
            next.insert(
                e.partition,
                crate::state::Tail::of(log.len() as i64, Some(&e.key), e.value.as_deref()),
            );
            log.push((e.key, e.value));
        }
        for (&k, &o) in &s.next {
            let c = self.kafka.committed.entry(k).or_insert(0);
            *c = (*c).max(o);
        }
        for (&p, &a) in &s.applied {
            let c = self.kafka.applied.entry(p).or_insert(0);
            *c = (*c).max(a);
        }
        for f in &s.handover {
            // As a gate writes it (`records::progress_record`).
            let payload = crate::contract::codec::encode(&f.progress);
            self.kafka.publish(Topic::Progress, f.p, payload);
        }
        for ev in &s.evs {
            self.observe(ev)?;
        }
        Ok(next)
    }

    fn land(&mut self, x: usize, fate: Land) -> Check {
        let Some(s) = self.procs[x].committing.take() else {
            return Ok(());
        };
        let name = self.procs[x].name;
        let invokes: Vec<(i32, Call)> = s
            .evs
            .iter()
            .filter_map(|e| match e {
                Ev::Invoke(p, c) => Some((*p, c.clone())),
                _ => None,
            })
            .collect();
        if fate == Land::LostMarker {
            // Acknowledged, so applied, and then aborted. What the gate does
            // next is mend it in the process (`gate::lost`, not simulated:
            // the simulation starts none of its calls, which a lost
            // `started` would leave unguarded) — unless it crashes first, or
            // the mend gives up: either way this state must not be trusted.
            self.counts.lost_markers += 1;
            let tails = self.broker_loses(&s);
            let pr = &mut self.procs[x];
            let landing = crate::state::Landing {
                committer: s.committer,
                tails,
            };
            pr.store.apply(&s.batch, &landing).map_err(state_err)?;
            pr.core.commit_unknown(invokes);
            pr.backlog.extend(s.outcomes);
            if self.rng.chance(50) {
                self.note(format!(
                    "{name}: batch acknowledged, applied, its marker lost; crashes before mending it"
                ));
                return self.kill(x);
            }
            self.note(format!(
                "{name}: batch acknowledged, applied, its marker lost; the mend gives up"
            ));
            return self.restart_session(x);
        }
        if fate != Land::Abort {
            let next = self.broker_commit(&s)?;
            if fate == Land::Ok {
                self.note(format!("{name}: batch committed"));
                let pr = &mut self.procs[x];
                let landing = crate::state::Landing {
                    committer: s.committer,
                    tails: next,
                };
                pr.store.apply(&s.batch, &landing).map_err(state_err)?;
                pr.open.batch.detach();
                for (&p, &a) in &s.applied {
                    if let Some(mark) = pr.applied.get_mut(&p) {
                        *mark = (*mark).max(a);
                    }
                }
                for (p, call) in invokes {
                    self.procs[x].core.invoked(p, &call);
                    self.queue(x, p, call);
                }
                return Ok(());
            }
        }
        self.counts.failed_commits += 1;
        self.note(format!(
            "{name}: commit reported failed ({})",
            if fate == Land::Abort {
                "aborted"
            } else {
                "it had landed"
            }
        ));
        let pr = &mut self.procs[x];
        pr.core.commit_unknown(invokes);
        pr.backlog.extend(s.outcomes);
        self.restart_session(x)
    }

    /// The model sees what a committed batch published.
    fn observe(&mut self, ev: &Ev) -> Check {
        match ev {
            Ev::Invoke(..) => Ok(()),
            Ev::NotInvoked(step, d) => {
                self.model.handed_over.insert((step.clone(), *d));
                Ok(())
            }
            Ev::Resettled(step) => {
                self.model.canonical.remove(step);
                Ok(())
            }
            Ev::Answer {
                result,
                dispatch,
                at_once,
            } => {
                self.counts.answers += 1;
                self.counts.at_once += u64::from(*at_once);
                let step = step_of(result);
                let call_id = result.call_id.clone().unwrap_or_default();
                if let Some(first) = self.model.answers.get(&call_id) {
                    // Answered at once, then read again (its batch lost): the
                    // same answer again is the setting's price, any other a bug.
                    if self.model.at_once.contains(&call_id) && first == result {
                        return Ok(());
                    }
                    return Err(format!(
                        "call {call_id} got a second final answer: first {:?} {:?}, then {:?} {:?}",
                        first.status, first.error, result.status, result.error
                    ));
                }
                if self.model.sent.get(&call_id) != Some(&step) {
                    return Err(format!(
                        "an answer to {step} for call {call_id}, which asked for {:?}",
                        self.model.sent.get(&call_id)
                    ));
                }
                self.model.answers.insert(call_id.clone(), result.clone());
                if *at_once {
                    self.model.at_once.insert(call_id.clone());
                }
                if result.status == Status::Rejected {
                    return Err(format!("call {call_id} was rejected: {:?}", result.error));
                }
                let norm = result.for_repeat(None);
                match self.model.canonical.get(&step) {
                    // Could not reach the provider: the step's next call asked
                    // again, and the provider's answer is the step's now.
                    Some(c)
                        if *c != norm
                            && c.error.as_ref().is_some_and(|e| e.kind == UNREACHED_KIND) =>
                    {
                        self.model.canonical.insert(step.clone(), norm);
                    }
                    Some(c) if *c != norm => {
                        return Err(format!(
                            "a repeat's answer differs from the first: call {call_id} of {step} got {:?} {:?} {:?}, the step's answer is {:?} {:?} {:?}",
                            norm.status, norm.output, norm.error, c.status, c.output, c.error
                        ));
                    }
                    Some(_) => {}
                    None => {
                        self.model.canonical.insert(step.clone(), norm);
                    }
                }
                let not_performed = result.status == Status::Error
                    && result
                        .error
                        .as_ref()
                        .is_some_and(|e| NOT_PERFORMED.contains(&e.kind.as_str()));
                if not_performed {
                    let keyed = step.tool == "charge";
                    let run = (step.clone(), if keyed { 0 } else { dispatch.unwrap_or(0) });
                    let took_effect = if keyed {
                        matches!(
                            self.model.keys.get(&step),
                            Some(Key::Done(Outcome::Ok { .. }) | Key::InProgress(_))
                        )
                    } else {
                        self.model.effects.get(&run).copied().unwrap_or(0) > 0
                    };
                    if took_effect {
                        return Err(format!(
                            "call {call_id} of {step} was told the action was not performed ({:?}), but its run (dispatch {dispatch:?}) took effect at the provider",
                            result.error.as_ref().map(|e| &e.kind)
                        ));
                    }
                    self.model.not_performed.insert(run);
                }
                // A deferred step (`charge`) has no record until settled: its
                // dispatch numbers start again each time its intent is re-read,
                // so one number can name a run handed back and a later one; a
                // re-read step assumes a run before it (in doubt rather than
                // "not performed"), which this precision check cannot tell.
                if result.status == Status::InDoubt
                    && step.tool != "charge"
                    && let Some(d) = dispatch
                    && self.model.handed_over.contains(&(step.clone(), *d))
                {
                    return Err(format!(
                        "call {call_id} of {step} was answered in_doubt though dispatch {d} was handed over as never invoked"
                    ));
                }
                Ok(())
            }
        }
    }

    // --- the invokers and the provider ------------------------------------

    fn queue(&mut self, x: usize, p: i32, call: Call) {
        self.next_job += 1;
        self.jobs.push(Job {
            id: self.next_job,
            proc: x,
            p,
            call,
            fate: None,
        });
    }

    fn hand_over_not_invoked(&mut self, job: Job) -> Check {
        self.note(format!(
            "{}: hands over {} #{} as not invoked",
            self.procs[job.proc].name, job.call.step, job.call.dispatch
        ));
        let progress = progress_of(
            &job.call.step,
            job.call.dispatch,
            job.call.token.as_deref(),
            self.now,
            json!({"event": "not_invoked"}),
        );
        self.deliver(job.proc, Finished { p: job.p, progress })
    }

    /// A queued call gets its slot (`only`: that job; else a random one).
    fn job_start(&mut self, only: Option<usize>) -> Check {
        let queued: Vec<usize> = (0..self.jobs.len())
            .filter(|&j| self.jobs[j].fate.is_none())
            .collect();
        let j = match only {
            Some(j) => j,
            None if queued.is_empty() => return Ok(()),
            None => queued[self.rng.index(queued.len())],
        };
        let x = self.jobs[j].proc;
        if self.support.not_invoked && !self.procs[x].owned.contains(&self.jobs[j].p) {
            let job = self.jobs.remove(j);
            return self.hand_over_not_invoked(job);
        }
        self.counts.invocations += 1;
        let call = self.jobs[j].call.clone();
        let step = call.step.clone();
        let fate = if step.tool == "charge" {
            if self.rng.chance(25) {
                Fate::Unreachable
            } else {
                if !self.model.keys.contains_key(&step) {
                    self.model
                        .keys
                        .insert(step.clone(), Key::InProgress(self.jobs[j].id));
                }
                Fate::Reached
            }
        } else {
            let run = (step.clone(), call.dispatch);
            let n = self.model.invoked.entry(run.clone()).or_insert(0);
            *n += 1;
            if *n > 1 {
                return Err(format!(
                    "unkeyed {step} dispatch {} was invoked twice",
                    call.dispatch
                ));
            }
            let fate = match self.rng.below(100) {
                0..=64 => Fate::Ok,
                65..=84 => Fate::Refused,
                _ => Fate::InDoubt,
            };
            let effect = fate == Fate::Ok || (fate == Fate::InDoubt && self.rng.chance(50));
            if effect {
                *self.model.effects.entry(run.clone()).or_insert(0) += 1;
                let total = self.model.effects_of(&step);
                if total > 1 {
                    return Err(format!(
                        "unkeyed {step} took effect {total} times (dispatch {} just now), never resolved \"not executed\" after an effect",
                        call.dispatch
                    ));
                }
                if self.model.not_performed.contains(&run) {
                    return Err(format!(
                        "unkeyed {step} dispatch {} took effect after its run was answered \"not performed\"",
                        call.dispatch
                    ));
                }
            }
            fate
        };
        self.note(format!(
            "{}: invokes {} #{} → {fate:?}",
            self.procs[x].name, step, call.dispatch
        ));
        self.jobs[j].fate = Some(fate);
        Ok(())
    }

    /// The provider settles a key being processed (ok or declined, for good).
    fn provider_decides(&mut self, job: &Job) -> Result<Outcome, String> {
        let step = &job.call.step;
        let outcome = if self.rng.chance(85) {
            Outcome::Ok {
                output: json!({"charge": step.idempotency_key()}),
            }
        } else {
            Outcome::Error {
                error: ErrorBody {
                    kind: "declined".into(),
                    message: "the provider declined it".into(),
                },
            }
        };
        if matches!(outcome, Outcome::Ok { .. })
            && self.model.not_performed.contains(&(step.clone(), 0))
        {
            return Err(format!(
                "keyed {step} took effect at the provider after it was answered \"not performed\""
            ));
        }
        self.model
            .keys
            .insert(step.clone(), Key::Done(outcome.clone()));
        Ok(outcome)
    }

    /// A running call finishes and reports (`only`: that job; else a random one).
    fn job_finish(&mut self, only: Option<usize>) -> Check {
        let running: Vec<usize> = (0..self.jobs.len())
            .filter(|&j| self.jobs[j].fate.is_some())
            .collect();
        let j = match only {
            Some(j) => j,
            None if running.is_empty() => return Ok(()),
            None => running[self.rng.index(running.len())],
        };
        let fate = self.jobs[j].fate.expect("a running job");
        let err = |kind: &str, message: &str| ErrorBody {
            kind: kind.into(),
            message: message.into(),
        };
        let outcome = match fate {
            Fate::Ok => Outcome::Ok {
                output: json!({"effect": format!("{}#{}", self.jobs[j].call.step, self.jobs[j].call.dispatch)}),
            },
            Fate::Refused => Outcome::Error {
                error: err("tool_refused", "refused"),
            },
            Fate::InDoubt => Outcome::InDoubt {
                error: err("timeout", "timed out"),
            },
            Fate::Unreachable => Outcome::Error {
                error: err("tool_unreachable", "unreachable"),
            },
            Fate::Reached => {
                let id = self.jobs[j].id;
                match self.model.keys.get(&self.jobs[j].call.step).cloned() {
                    Some(Key::Done(o)) => o,
                    Some(Key::InProgress(other)) if other != id => {
                        // 409: processing elsewhere; retried with the same key.
                        return Ok(());
                    }
                    _ => {
                        let job = self.jobs[j].clone();
                        self.provider_decides(&job)?
                    }
                }
            }
        };
        let job = self.jobs.remove(j);
        let progress = progress_of(
            &job.call.step,
            job.call.dispatch,
            job.call.token.as_deref(),
            self.now,
            json!({"event": "finished", "outcome": outcome}),
        );
        self.deliver(job.proc, Finished { p: job.p, progress })
    }

    // --- time ---------------------------------------------------------------

    fn tick(&mut self, dt: i64) -> Check {
        // A batch is decided within the gate's linger and committed in well
        // under a tool's deadline: one pending longer lands first (unless
        // slow commits are asked for).
        for x in 0..self.procs.len() {
            let pending = self.procs[x].alive
                && (!self.procs[x].open.is_empty() || self.procs[x].committing.is_some());
            if !pending {
                self.procs[x].pending_since = None;
                continue;
            }
            let since = *self.procs[x].pending_since.get_or_insert(self.now);
            if !self.slow_commits && self.now + dt - since > COMMIT_WITHIN_MS {
                for _ in 0..2 {
                    self.seal(x);
                    self.land(x, Land::Ok)?;
                }
                self.procs[x].pending_since = None;
            }
        }
        self.now += dt;
        self.note(format!("clock +{dt} ms"));
        let now = self.now;
        for x in 0..self.procs.len() {
            let pr = &mut self.procs[x];
            if !pr.alive || pr.owned.is_empty() {
                continue;
            }
            pr.core
                .on_deadlines(&pr.store, &mut pr.open.batch, now)
                .map_err(state_err)?;
            self.collect(x)?;
        }
        Ok(())
    }

    // --- the end ------------------------------------------------------------

    /// No more faults: every process up, every partition owned, every call
    /// run and reported, every input read, every batch committed, every
    /// approval decided — until nothing changes.
    fn drain(&mut self) -> Check {
        self.note("drain: no more faults".into());
        for x in 0..self.procs.len() {
            self.restart(x);
        }
        for p in 0..PARTITIONS {
            if !self.owner.contains_key(&p) {
                let x = self.rng.index(self.procs.len());
                self.assign(x, p)?;
            }
        }
        self.publish_due(true);
        for round in 0..DRAIN_ROUNDS {
            self.step += 1;
            let mut busy = !self.jobs.is_empty();
            // Bounded, so that a loop (calls handed back and queued again for
            // ever, a process that never runs out of input) fails its seed,
            // with its trace, instead of hanging the run.
            let mut spins = 0u32;
            let mut spin = |what: &str| {
                spins += 1;
                if spins > DRAIN_SPINS {
                    Err(format!(
                        "drain: {what} more than {DRAIN_SPINS} times in one round: a loop"
                    ))
                } else {
                    Ok(())
                }
            };
            while let Some(j) = (0..self.jobs.len()).find(|&j| self.jobs[j].fate.is_none()) {
                spin("calls started")?;
                self.job_start(Some(j))?;
            }
            let n = self.jobs.len();
            for j in (0..n).rev() {
                if j < self.jobs.len() {
                    self.job_finish(Some(j))?;
                }
            }
            for x in 0..self.procs.len() {
                while self.poll(x)? {
                    spin("inputs read")?;
                    busy = true;
                }
                for _ in 0..2 {
                    if !self.procs[x].open.is_empty() || self.procs[x].committing.is_some() {
                        busy = true;
                    }
                    self.seal(x);
                    self.land(x, Land::Ok)?;
                }
            }
            let waiting: Vec<StepRecord> = self
                .model
                .records
                .values()
                .filter(|r| r.phase == Phase::AwaitingApproval)
                .cloned()
                .collect();
            if round % 4 == 0 {
                for r in &waiting {
                    self.decide(r, false);
                }
            }
            let in_flight = self.model.records.values().any(|r| r.phase.in_flight());
            if !busy && !in_flight && self.outbox.is_empty() {
                return Ok(());
            }
            self.tick(5_000)?;
        }
        Err(format!(
            "the run did not settle in {DRAIN_ROUNDS} quiet rounds: {} calls running, steps in flight: {:?}",
            self.jobs.len(),
            self.model
                .records
                .values()
                .filter(|r| r.phase.in_flight())
                .map(|r| format!("{} {:?} #{}", r.step, r.phase, r.dispatch))
                .collect::<Vec<_>>()
        ))
    }

    fn final_checks(&mut self) -> Check {
        for (call_id, step) in &self.model.sent {
            if !self.model.answers.contains_key(call_id) {
                let record = self.model.records.get(step);
                return Err(format!(
                    "call {call_id} of {step} never got an answer (its step: {:?} #{:?})",
                    record.map(|r| r.phase),
                    record.map(|r| r.dispatch)
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Intent,
    Poll,
    Seal,
    Land,
    JobStart,
    JobFinish,
    Tick,
    Operator,
    Rebalance,
    Crash,
    SessionLost,
    Forge,
}

/// How often each fault comes, drawn once per seed (as FoundationDB's
/// simulation turns its fault sites on per run): some runs calm, some
/// stormy, each in its own way.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    /// Weights of the events (among ~88 for the ordinary ones).
    operator: u64,
    rebalance: u64,
    crash: u64,
    session_lost: u64,
    /// Percent of commits that fail (half aborted, half landed unbeknown).
    failed_commit_pct: u64,
    /// Percent of commits the broker acknowledges and then loses.
    lost_marker_pct: u64,
    /// Percent of clock ticks that jump 5–35 s (past every deadline).
    long_tick_pct: u64,
}

impl Knobs {
    fn draw(rng: &mut Rng) -> Knobs {
        Knobs {
            operator: 1 + rng.below(8),
            rebalance: 1 + rng.below(8),
            crash: rng.below(4),
            session_lost: rng.below(3),
            failed_commit_pct: rng.below(16),
            long_tick_pct: 2 + rng.below(20),
            lost_marker_pct: rng.below(6),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Land {
    Ok,
    /// The transaction aborted: nothing of it is kept.
    Abort,
    /// Committed, but the reply was lost: the process takes it for failed.
    LostReply,
    /// Acknowledged, then lost by the broker (its marker): the process
    /// applied it, Kafka aborted it.
    LostMarker,
}

fn outcome_label(o: &Outcome) -> String {
    match o {
        Outcome::Ok { .. } => "ok".into(),
        Outcome::Error { error } | Outcome::InDoubt { error } => {
            format!("{} {}", o.label(), error.kind)
        }
    }
}

fn describe(p: &Progress) -> String {
    match outcome_of(p) {
        Some(o) => outcome_label(o),
        None if is_not_invoked(p) => "not invoked".into(),
        None => "another event".into(),
    }
}

struct Failure {
    seed: u64,
    message: String,
    trace: Vec<String>,
}

fn open_stores(dirs: &[tempfile::TempDir; 2]) -> [StateStore; 2] {
    let open = |d: &tempfile::TempDir| StateStore::open(d.path()).expect("a state store opens");
    [open(&dirs[0]), open(&dirs[1])]
}

/// A directory for a state store: in memory where there is a tmpfs.
fn temp_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .expect("a temporary directory")
}

/// Run `seeds`; the first failure stops the run (unless `keep_going`: then
/// every failure is printed, and the first returned).
fn run_seeds(
    seeds: impl Iterator<Item = u64>,
    steps: u64,
    keep_going: bool,
) -> (Counts, Option<Failure>) {
    let dirs = [temp_dir(), temp_dir()];
    let mut stores = Some(open_stores(&dirs));
    let mut total = Counts::default();
    let mut first = None;
    for seed in seeds {
        let mut world = match World::new(seed, stores.take().expect("stores")) {
            Ok(w) => w,
            Err(message) => {
                return (
                    total,
                    Some(Failure {
                        seed,
                        message,
                        trace: vec![],
                    }),
                );
            }
        };
        let r = world.run(steps);
        world.counts.seeds = 1;
        total.add(&world.counts);
        if let Err(message) = r {
            let message = format!("{message}\n(the seed's fault rates: {:?})", world.knobs);
            let trace = world.trace.iter().cloned().collect();
            let failure = Failure {
                seed,
                message,
                trace,
            };
            if !keep_going {
                return (total, Some(failure));
            }
            eprintln!("seed {seed:#x}: {}", failure.message);
            first.get_or_insert(failure);
        }
        stores = Some(world.into_stores());
    }
    (total, first)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// The seeds of a run: `STEPGATE_SIM_SEED` alone, or `STEPGATE_SIM_SEEDS`
/// (default `short`) consecutive seeds from a fixed base.
fn seeds(short: u64) -> Vec<u64> {
    if let Some(one) = env_u64("STEPGATE_SIM_SEED") {
        return vec![one];
    }
    let n = env_u64("STEPGATE_SIM_SEEDS").unwrap_or(short);
    let base = env_u64("STEPGATE_SIM_BASE").unwrap_or(0x5EED_0000);
    (0..n).map(|i| base + i).collect()
}

#[test]
fn the_gate_keeps_the_contract_under_random_schedules() {
    let seeds = seeds(200);
    let steps = env_u64("STEPGATE_SIM_STEPS").unwrap_or(300);
    let support = Support::probe();
    let started = std::time::Instant::now();
    let keep_going = std::env::var_os("STEPGATE_SIM_KEEP_GOING").is_some();
    let (counts, failure) = run_seeds(seeds.iter().copied(), steps, keep_going);
    let summary = format!(
        "gate simulation: {} seeds × {steps} steps ({} steps in all) in {:.1?}: {} intents, {} invocations, {} outcomes ({} of an older dispatch, {} not invoked, {} before their deferred step's intent was re-read, {} handed over to a deferred step, {} of an earlier reading refused), {} forged reports refused, {} intents re-read below the applied mark, {} answers ({} at once), {} operator commands, {} crashes, {} rebalances, {} failed commits, {} commits acknowledged and lost; {} restores resumed from the local offset, {} started over for a batch not on the changelog; contract carries not_invoked: {}, command run: {}",
        counts.seeds,
        counts.steps,
        started.elapsed(),
        counts.intents,
        counts.invocations,
        counts.outcomes,
        counts.stale_outcomes,
        counts.not_invoked,
        counts.outcomes_before_reread,
        counts.handed_to_deferred,
        counts.earlier_reading,
        counts.forged,
        counts.reread,
        counts.answers,
        counts.at_once,
        counts.commands,
        counts.crashes,
        counts.rebalances,
        counts.failed_commits,
        counts.lost_markers,
        counts.resumed,
        counts.refuted,
        support.not_invoked,
        support.command_run,
    );
    // Written to the process's stderr itself, past the test harness's
    // capture: the counts show in every `cargo test` run, passing or not.
    let _ = writeln!(std::io::stderr(), "{summary}");
    if let Some(f) = failure {
        panic!(
            "gate simulation failed at seed {seed:#x}: {}\n\nlast events:\n  {}\n\nreplay it: STEPGATE_SIM_SEED={seed:#x} STEPGATE_SIM_STEPS={steps} cargo test --lib gate::core::sim -- --nocapture",
            f.message,
            f.trace.join("\n  "),
            seed = f.seed,
        );
    }
}

/// Every event of one seed's run, and how it ended.
fn full_trace(seed: u64, steps: u64) -> (Vec<String>, Check) {
    let dirs = [temp_dir(), temp_dir()];
    let mut world = World::new(seed, open_stores(&dirs)).expect("a world");
    world.trace_cap = usize::MAX;
    let r = world.run(steps);
    (world.trace.into_iter().collect(), r)
}

#[test]
fn a_seed_replays_exactly() {
    let (a, ra) = full_trace(0x5EED_0007, 300);
    let (b, rb) = full_trace(0x5EED_0007, 300);
    assert!(a.len() > 100, "{} events", a.len());
    if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
        panic!(
            "the same seed ran two ways, from event {i}:\n  {:?}\n  {:?}",
            a.get(i),
            b.get(i)
        );
    }
    assert_eq!(ra, rb);
}
