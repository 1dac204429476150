//! An outcome: from this gate's invoker, or handed over on `progress` (a
//! call whose partition moved, a pool worker's); the step settled and its
//! callers answered, or the outcome kept as evidence.
//!
//! Anyone who may write `progress` (every gate, every pool's workers) could
//! otherwise settle any step, so a record of it counts only when it proves
//! where it comes from ([`GateCore::refusal`]): a worker's Outcome v1 (JSON)
//! signed with the key of its tool's pool, for a pool tool, `started` or
//! `finished`; a gate's hand-over (codec) for a tool no pool runs; and either
//! with its dispatch's token (`StepRecord::tokens`), which only the call's
//! holder has. Anything else is refused: logged, counted
//! (`stepgate_progress_refused_total{reason}`), dead-lettered — never
//! settling, never evidence, never closing an open dispatch.

use super::{Apply, GateCore, Out, When, at, ms};
use crate::contract::sign::{Signed, verify};
use crate::contract::{
    Call, ErrorBody, Outcome, Progress, ProgressEvent, Rejection, RejectionReason, Texts,
    ToolResult, headers,
};
use crate::kafka::Input;
use crate::state::{Evidence, MAX_EVIDENCE_KEPT, Phase, StateError, StepRecord};
use crate::tools::Category;

/// Error kinds that say the tool did not perform the action.
pub(super) const NOT_PERFORMED_KINDS: &[&str] = &[
    "tool_refused",
    "tool_unreachable",
    "tool_redirected",
    "no_worker",
];

/// Error kinds in which the tool never answered the call's request: they
/// say nothing of another run with the same key.
const UNSENT_KINDS: &[&str] = &["tool_unreachable", "tool_redirected"];

/// The error kind of a keyed step left [`Phase::Unreached`]: this run could
/// not reach the tool, another may have; the step's next call asks again.
pub(crate) const UNREACHED_KIND: &str = "tool_unreachable_unconfirmed";

/// Why a record of `progress` was refused: the `reason` label of
/// `stepgate_progress_refused_total` and the check named in its DLQ copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressRefused {
    /// Neither a gate's hand-over nor an Outcome v1.
    Unreadable,
    /// A worker's record (JSON) without the signature of its tool's pool's key.
    Signature,
    /// A worker's record for a tool no pool runs (or no configured tool).
    NotPoolTool,
    /// A worker's record saying `not_invoked`: only a gate's hand-over says so.
    NotInvoked,
    /// A gate's hand-over for a pool tool, whose calls no gate invokes.
    PoolHandover,
    /// Without its dispatch's token (forged, or of an earlier reading of a
    /// step whose record was made again: its token was never kept).
    Token,
}

impl ProgressRefused {
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressRefused::Unreadable => "unreadable",
            ProgressRefused::Signature => "signature",
            ProgressRefused::NotPoolTool => "not_pool_tool",
            ProgressRefused::NotInvoked => "not_invoked",
            ProgressRefused::PoolHandover => "pool_handover",
            ProgressRefused::Token => "token",
        }
    }

    /// What the dead-letter copy says, for an operator.
    fn explain(self) -> &'static str {
        match self {
            ProgressRefused::Unreadable => {
                "neither a gate's hand-over nor a worker's Outcome v1 (JSON)"
            }
            ProgressRefused::Signature => {
                "a worker's Outcome v1 without a valid `stepgate-signature` under the key of its tool's pool (`[pools.<name>] key`): a writer without the key, a worker of another pool, or a worker whose key differs from the gates'"
            }
            ProgressRefused::NotPoolTool => {
                "a worker's Outcome v1 for a tool no worker pool runs: workers report only on their pool's calls"
            }
            ProgressRefused::NotInvoked => {
                "a worker's Outcome v1 saying `not_invoked`: only a gate's own hand-over may say a call was never invoked"
            }
            ProgressRefused::PoolHandover => {
                "a gate's hand-over for a pool tool: a pool tool's calls run on its workers, never in a gate"
            }
            ProgressRefused::Token => {
                "without its dispatch's token: not written by the holder of that dispatch's call (or of an earlier reading of a re-read step, whose token was never kept)"
            }
        }
    }
}

impl GateCore {
    /// A record of `progress`: the outcome of a call whose partition moved
    /// while it ran, or a pool worker's Outcome v1.
    pub(super) fn apply_progress(
        &mut self,
        ax: &mut Apply<'_>,
        input: &Input,
    ) -> Result<(), StateError> {
        // The records `kafka::end_hanging_transactions` writes are aborted, so
        // read_committed never sees them on a broker; librdkafka's mock cluster
        // (the demo) fakes transactions and delivers them: not an input.
        if input.payload.is_none() && input.key.as_deref() == Some(crate::kafka::HANGING_PROBE_KEY)
        {
            return Ok(());
        }
        let payload = input.payload.as_deref().unwrap_or_default();
        let progress = match Progress::decode(payload) {
            Ok(pr) => pr,
            Err(e) => {
                let why = format!("{}: {e}", ProgressRefused::Unreadable.explain());
                self.refuse_progress(input, None, ProgressRefused::Unreadable, &why, ax.now_ms);
                return Ok(());
            }
        };
        if let Some(refused) = self.refusal(input, &progress) {
            let why = refused.explain();
            self.refuse_progress(input, Some(&progress), refused, why, ax.now_ms);
            return Ok(());
        }
        // Fast-path outcomes are never handed over: their intent is re-read.
        if progress.fast_ref.is_some() {
            return Ok(());
        }
        // A deferred step's runs are numbered afresh each time its intent is
        // re-read (`core/deferred.rs`): a report handed over on `progress` is
        // of a run of another reading, whatever its number — evidence (an
        // outcome it had), never this run's end, and it closes no run.
        if let Some(mut record) = ax.deferred_step(input.partition, &progress.step) {
            if !record.token_matches(progress.dispatch, progress.token.as_deref()) {
                let refused = ProgressRefused::Token;
                self.refuse_progress(
                    input,
                    Some(&progress),
                    refused,
                    refused.explain(),
                    ax.now_ms,
                );
                return Ok(());
            }
            if let ProgressEvent::Finished { outcome } = progress.event {
                self.keep_evidence(
                    &mut record,
                    progress.dispatch,
                    outcome,
                    "earlier_reading",
                    ax.now_ms,
                );
                ax.put_step(input.partition, &record)?;
            }
            return Ok(());
        }
        // Only the holder of the dispatch's call has its token. (A step with
        // no record has nothing to settle: each handler says so.)
        if let Some(record) = ax.step(input.partition, &progress.step)?
            && !record.token_matches(progress.dispatch, progress.token.as_deref())
        {
            let refused = ProgressRefused::Token;
            self.refuse_progress(
                input,
                Some(&progress),
                refused,
                refused.explain(),
                ax.now_ms,
            );
            return Ok(());
        }
        self.apply_outcome(ax, input.partition, progress)
    }

    /// Whether a decoded record of `progress` is refused before its step is
    /// read: who may write it, for which tool, saying what.
    fn refusal(&self, input: &Input, progress: &Progress) -> Option<ProgressRefused> {
        let pool = self
            .tools
            .get(&progress.step.tool)
            .and_then(|t| t.pool.as_deref());
        let from_worker = input.payload.as_deref().and_then(<[u8]>::first) == Some(&b'{');
        if !from_worker {
            return pool.is_some().then_some(ProgressRefused::PoolHandover);
        }
        let Some(pool) = pool else {
            return Some(ProgressRefused::NotPoolTool);
        };
        let signature = input
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::SIGNATURE))
            .and_then(|(_, v)| v.as_deref());
        let signed = match (self.pool_keys.get(pool), signature) {
            (Some(key), Some(sig)) => verify(
                key,
                Signed::Outcome,
                input.payload.as_deref().unwrap_or_default(),
                sig,
            ),
            _ => false,
        };
        if !signed {
            return Some(ProgressRefused::Signature);
        }
        if progress.event == ProgressEvent::NotInvoked {
            return Some(ProgressRefused::NotInvoked);
        }
        None
    }

    /// A record of `progress` that counts for nothing: logged and counted
    /// (never its payload), and copied to the DLQ with why.
    fn refuse_progress(
        &mut self,
        input: &Input,
        progress: Option<&Progress>,
        refused: ProgressRefused,
        why: &str,
        now_ms: i64,
    ) {
        self.metrics.progress_refused(refused.as_str());
        let of = progress.map_or_else(String::new, |p| {
            format!(" of {} dispatch {}", p.step, p.dispatch)
        });
        // One log line (`reject`'s), naming the step and the check.
        let rejection = Rejection::new(
            RejectionReason::RefusedProgress,
            format!("progress record{of} refused ({}): {why}", refused.as_str()),
        );
        self.reject(input, rejection, now_ms);
    }

    /// An invocation's outcome, for a partition this gate owns: answer a
    /// fast-path call, or settle a step — once: a step no longer in flight
    /// keeps its first outcome (a late one after `in_doubt` is kept for the
    /// operator).
    pub(super) fn apply_outcome(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        progress: Progress,
    ) -> Result<(), StateError> {
        let outcome = match progress.event {
            ProgressEvent::Finished { outcome } => outcome,
            ProgressEvent::NotInvoked => {
                return self.on_not_invoked(ax, p, &progress);
            }
            // A pool's worker took the call.
            ProgressEvent::Started => return self.on_taken(ax, p, &progress),
        };
        if let Some(fast_ref) = progress.fast_ref {
            if let Some(entry) = self.fast.remove(&(p, fast_ref)) {
                let result =
                    ToolResult::from_outcome(&entry.step, entry.call_id, outcome, at(ax.now_ms));
                self.outs.push(Out::Result {
                    partition: entry.reply_partition,
                    result,
                    traceparent: entry.traceparent,
                    since_ms: entry.intent_ts_ms,
                    when: When::WithBatch,
                });
            }
            return Ok(());
        }
        let Some(mut record) = ax.step(p, &progress.step)? else {
            tracing::warn!(step = %progress.step, dispatch = progress.dispatch, outcome = outcome.label(), "an outcome for a step with no record (purged after its retention, or a re-runnable step recorded only once settled, whose re-read intent runs it again with its key): nothing to settle");
            return Ok(());
        };
        record.open_dispatches.retain(|d| *d != progress.dispatch);
        let settles = record.phase.in_flight() && record.phase != Phase::AwaitingApproval;
        // sim: stale-dispatch check. Only the step's current dispatch settles
        // it: an older one's "not performed" must not answer a step whose
        // re-run may have charged, and its `ok` is kept as evidence (the
        // current dispatch, with the same key, reports the same effect).
        if settles && progress.dispatch == record.dispatch {
            let (outcome, phase) = match self.unreached(&record, &outcome) {
                Some(unreached) => (unreached, Phase::Unreached),
                None => {
                    let outcome = self.unless_earlier_may_have_run(&record, outcome);
                    let phase = Phase::settled_by(&outcome);
                    (outcome, phase)
                }
            };
            return self.settle(ax, p, record, outcome, phase);
        }
        let why = if progress.dispatch != record.dispatch {
            "stale_dispatch"
        } else if record.phase == Phase::InDoubt {
            "after_in_doubt"
        } else {
            "after_settled"
        };
        self.keep_evidence(&mut record, progress.dispatch, outcome, why, ax.now_ms);
        ax.put_step(p, &record)
    }

    /// A pool's worker says it took the current dispatch of a step (before
    /// invoking it): the dispatch was claimed, and its deadline is moved to a
    /// whole tool deadline (and the grace) from now, as for a call running
    /// here. Anything else (a stale dispatch, a settled step) changes nothing.
    pub(super) fn on_taken(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        progress: &Progress,
    ) -> Result<(), StateError> {
        let in_pool = self
            .tools
            .get(&progress.step.tool)
            .is_some_and(|t| t.pool.is_some());
        if !in_pool || progress.fast_ref.is_some() {
            return Ok(());
        }
        let Some(mut record) = ax.step(p, &progress.step)? else {
            return Ok(());
        };
        if record.phase != Phase::Started
            || record.dispatch != progress.dispatch
            || record.taken == Some(progress.dispatch)
        {
            return Ok(());
        }
        record.taken = Some(progress.dispatch);
        let later =
            ax.now_ms + ms(self.tool_deadline(&record.step.tool) + self.settings.in_doubt_grace);
        if record.deadline_ms.is_none_or(|d| d < later) {
            record.deadline_ms = Some(later);
            self.due.insert((later, p, record.step.clone()));
        }
        ax.put_step(p, &record)
    }

    /// A call that never left its process (its partition moved, or the
    /// process stopped, while it waited for a slot): run its step again at
    /// once — safe for every category, since nothing was invoked — or, while
    /// this process stops, leave it due at once for the next owner.
    pub(super) fn on_not_invoked(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        progress: &Progress,
    ) -> Result<(), StateError> {
        if let Some(fast_ref) = progress.fast_ref {
            // A read: run it again here, or leave it to the owner, which
            // re-reads its intent (the offset is held back for it).
            if !self.stopping
                && let Some(entry) = self.fast.get_mut(&(p, fast_ref))
            {
                entry.dispatch += 1;
                self.outs.push(Out::Invoke {
                    partition: p,
                    call: Call {
                        step: entry.step.clone(),
                        arguments: entry.arguments.clone(),
                        dispatch: entry.dispatch,
                        fast_ref: Some(fast_ref),
                        traceparent: entry.traceparent.clone(),
                        call_id: entry.call_id.clone(),
                        token: None,
                    },
                    when: When::Now,
                });
            }
            return Ok(());
        }
        let Some(mut record) = ax.step(p, &progress.step)? else {
            tracing::warn!(step = %progress.step, dispatch = progress.dispatch, "a call handed back not invoked, for a step with no record (purged after its retention, or a re-runnable step recorded only once settled, whose re-read intent runs it): nothing to run here");
            return Ok(());
        };
        record.open_dispatches.retain(|d| *d != progress.dispatch);
        let current = progress.dispatch == record.dispatch && record.phase == Phase::Started;
        if !current {
            // Settled or re-run meanwhile: evidence that this run never ran.
            self.note_evidence(
                &mut record,
                progress.dispatch,
                "not_invoked",
                None,
                "stale_dispatch",
                ax.now_ms,
            );
        } else if self.stopping {
            record.not_invoked = Some(record.dispatch);
            record.deadline_ms = Some(ax.now_ms);
            self.due.insert((ax.now_ms, p, record.step.clone()));
        } else {
            self.rerun_not_invoked(p, &mut record, ax.now_ms);
        }
        ax.put_step(p, &record)
    }

    /// Dispatch again a step whose current dispatch was never invoked.
    pub(super) fn rerun_not_invoked(&mut self, p: i32, record: &mut StepRecord, now_ms: i64) {
        record.not_invoked = None;
        record.dispatch += 1;
        tracing::info!(step = %record.step, dispatch = record.dispatch, "its last run was never invoked (its call queued where the partition or the process went away): run now");
        self.start(p, record, now_ms, None);
    }

    /// Keep an outcome that does not settle its step on the step's record:
    /// whole (the first such), in brief (the newest few), logged and counted.
    pub(super) fn keep_evidence(
        &self,
        record: &mut StepRecord,
        dispatch: u32,
        outcome: Outcome,
        why: &str,
        now_ms: i64,
    ) {
        let kind = match &outcome {
            Outcome::Ok { .. } => None,
            Outcome::Error { error } | Outcome::InDoubt { error } => Some(error.kind.clone()),
        };
        self.note_evidence(record, dispatch, outcome.label(), kind, why, now_ms);
        if record.late_outcome.is_none() {
            record.late_outcome = Some(outcome);
        }
    }

    /// Log, count and keep in brief (the newest [`MAX_EVIDENCE_KEPT`]) what a
    /// dispatch reported that did not settle its step.
    pub(super) fn note_evidence(
        &self,
        record: &mut StepRecord,
        dispatch: u32,
        status: &str,
        kind: Option<String>,
        why: &str,
        now_ms: i64,
    ) {
        self.metrics
            .late_outcome(&record.step, dispatch, record.dispatch, status, why);
        record.evidence.push(Evidence {
            dispatch,
            status: status.to_owned(),
            kind,
            why: why.to_owned(),
            at_ms: now_ms,
        });
        if let Some(over) = record.evidence.len().checked_sub(MAX_EVIDENCE_KEPT) {
            record.evidence.drain(..over);
        }
    }

    /// A `keyed` step's run that never reached its tool, while another run
    /// may have (one an unseen reader sent before any commit, or an earlier
    /// dispatch never heard from): not in doubt — asking again with the same
    /// key is safe and tells what happened — so the step is left for its
    /// next call to ask again ([`Phase::Unreached`]), with this answer.
    fn unreached(&self, record: &StepRecord, outcome: &Outcome) -> Option<Outcome> {
        let Outcome::Error { error } = outcome else {
            return None;
        };
        let unsent = UNSENT_KINDS.contains(&error.kind.as_str());
        let other_run =
            record.unseen_reader || record.open_dispatches.iter().any(|d| *d != record.dispatch);
        (record.category == Category::Keyed && unsent && other_run).then(|| Outcome::Error {
            error: ErrorBody {
                kind: UNREACHED_KIND.into(),
                message: Texts::unreached_keyed(&record.step.tool, &error.message),
            },
        })
    }

    /// An outcome that says the action was not performed is told as such only
    /// when no other dispatch of the step may have run: for an effectful tool
    /// whose earlier dispatch is still unaccounted for (re-run after its
    /// deadline), it is in doubt.
    pub(super) fn unless_earlier_may_have_run(
        &self,
        record: &StepRecord,
        outcome: Outcome,
    ) -> Outcome {
        let Outcome::Error { error } = &outcome else {
            return outcome;
        };
        let effectful = matches!(record.category, Category::Keyed | Category::Unkeyed);
        let not_performed = |status: &str, kind: Option<&str>| {
            status == "not_invoked"
                || (status == "error" && kind.is_some_and(|k| NOT_PERFORMED_KINDS.contains(&k)))
        };
        // An earlier run never heard from, or one that reported anything but
        // "not performed" (an `ok` of the same key, say), may have acted.
        let earlier_may_have_acted = record.open_dispatches.iter().any(|d| *d != record.dispatch)
            || record.evidence.iter().any(|e| {
                e.dispatch > record.settled_through
                    && e.dispatch < record.dispatch
                    && !not_performed(&e.status, e.kind.as_deref())
            });
        if !effectful
            || !earlier_may_have_acted
            || !NOT_PERFORMED_KINDS.contains(&error.kind.as_str())
        {
            return outcome;
        }
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "outcome_unknown".into(),
                message: Texts::in_doubt_earlier_try(&record.step.tool, &error.message),
            },
        }
    }

    /// Store an outcome, leaving the step in `phase`, and answer the first
    /// caller and every waiting repeat.
    pub(super) fn settle(
        &mut self,
        ax: &mut Apply<'_>,
        p: i32,
        mut record: StepRecord,
        outcome: Outcome,
        phase: Phase,
    ) -> Result<(), StateError> {
        if let Outcome::InDoubt { error } = &outcome {
            self.metrics.in_doubt(&record.step, &error.kind);
        }
        // A step settled a second time (an operator resolving it) already gave
        // its first caller a final answer: one final answer per call_id. The
        // new result answers the step's later calls.
        let answer_caller = record.result.is_none();
        record.phase = phase;
        let result =
            ToolResult::from_outcome(&record.step, record.call_id.clone(), outcome, at(ax.now_ms));
        if answer_caller {
            self.outs.push(Out::Result {
                partition: record.reply_partition.unwrap_or(p),
                result: result.clone(),
                traceparent: record.traceparent.clone(),
                since_ms: record.intent_ts_ms,
                when: When::WithBatch,
            });
        }
        for w in record.waiters.drain(..) {
            self.outs.push(Out::Result {
                partition: w.reply_partition.unwrap_or(p),
                result: result.for_repeat(w.call_id),
                traceparent: w.traceparent,
                since_ms: w.intent_ts_ms,
                when: When::WithBatch,
            });
        }
        record.result = Some(result);
        record.deadline_ms = None;
        record.expires_at_ms = ax.now_ms + ms(self.settings.retention);
        ax.put_step(p, &record)
    }
}
