//! What operators do from the command line: look at a workflow's steps, settle
//! in-doubt steps, approve or deny held calls.
//!
//! Reads come from Kafka, never from a gate's disk: a workflow's steps from the
//! compacted changelog (the gate's committed state, wherever the gate runs), the
//! held calls from the approvals topic. Decisions are [`Command`]s written to the
//! `commands` topic in the step's partition; the gate that owns the partition
//! applies them in the same transaction as its other state changes, and the
//! command's author waits until the changelog shows it applied.

use crate::config::{Config, HeaderSpec, KafkaConfig};
use crate::contract::{
    Action, ApprovalEvent, ApprovalKind, Arguments, Command, Outcome, Run, StepKey, ToolResult,
};
use crate::kafka::{self, KafkaSetupError, OutRecord};
use crate::redact::Redactor;
use crate::state::{StepRecord, changelog_step};
use rdkafka::consumer::Consumer as _;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::FutureProducer;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum OperatorError {
    #[error("reading or writing the topics")]
    Kafka(#[from] KafkaError),
    #[error("the topics' layout")]
    Setup(#[from] KafkaSetupError),
    #[error("reading `{topic}` did not reach its end within {limit:?}")]
    ReadTimeout { topic: String, limit: Duration },
    #[error(
        "no recorded steps for workflow `{0}` (read-only tools on the fast path are not recorded; records are purged after the retention period)"
    )]
    UnknownWorkflow(String),
    #[error("workflow `{workflow_id}` has no recorded step {step}")]
    UnknownStep { workflow_id: String, step: StepKey },
    #[error("step {step} is {phase}; `{action}` applies to a step that is {wanted}")]
    WrongPhase {
        step: StepKey,
        phase: &'static str,
        action: &'static str,
        wanted: &'static str,
    },
    #[error(
        "the command was written to `{topic}` but no gate applied it within {waited:?}: is a gate running? It takes effect when one reads it, and only for the run it names (run {run}): if the step is re-run meanwhile, it is refused as stale (DLQ reason `stale_command`), so sending it again later is safe"
    )]
    NotConfirmed {
        topic: String,
        waited: Duration,
        run: u32,
    },
    #[error("the gate refused the command ({reason}): {message}")]
    Refused { reason: String, message: String },
    #[error(
        "step {step} can no longer be decided: nobody decided it within its approval_ttl ({ttl}), so it expired at {expired_at} and was answered `approval_expired`; nothing ran. A new call of the tool asks for approval again."
    )]
    HoldExpired {
        step: StepKey,
        ttl: String,
        expired_at: String,
    },
    #[error(
        "step {step} is at run {current}, not run {asked}: it was re-run since you checked it; look at it again (`stepgate steps show`)"
    )]
    NotThatRun {
        step: StepKey,
        asked: u32,
        current: u32,
    },
}

/// How long reading a topic to its end may take.
const READ_LIMIT: Duration = Duration::from_secs(300);

/// Read partitions of a topic from the beginning to their end (read_committed),
/// handing each record's key and value to `f`. Blocking.
fn read_to_end(
    cfg: &KafkaConfig,
    topic: &str,
    partitions: &[i32],
    mut f: impl FnMut(i32, Option<&[u8]>, Option<&[u8]>),
) -> Result<(), OperatorError> {
    let group = format!("stepgate-operator-{}", std::process::id());
    let deadline = Instant::now() + READ_LIMIT;
    let done = kafka::replay(cfg, &group, topic, partitions, None, Some(deadline), |m| {
        f(m.partition(), m.key(), m.payload());
        Ok::<_, KafkaError>(())
    })?;
    if done != kafka::ReadEnd::Reached {
        return Err(OperatorError::ReadTimeout {
            topic: topic.to_owned(),
            limit: READ_LIMIT,
        });
    }
    Ok(())
}

/// A workflow's recorded steps as the gate last committed them.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowSteps {
    pub workflow_id: String,
    pub partition: i32,
    pub steps: Vec<StepRecord>,
}

/// The committed records of one workflow in one changelog partition.
fn steps_in(
    cfg: &KafkaConfig,
    workflow_id: &str,
    partition: i32,
) -> Result<Vec<StepRecord>, OperatorError> {
    let mut latest: BTreeMap<Vec<u8>, Option<StepRecord>> = BTreeMap::new();
    read_to_end(cfg, &cfg.topics.changelog, &[partition], |_, key, value| {
        let Some(key) = key else { return };
        if let Some((_, step, record)) = changelog_step(key, value)
            && step.workflow_id == workflow_id
        {
            latest.insert(key.to_vec(), record);
        }
    })?;
    // Keys sort by step index, then attempt, then tool.
    Ok(latest.into_values().flatten().collect())
}

/// Find a workflow's steps in the changelog: partition by partition (all of a
/// workflow's records live in one), stopping at the one that holds them.
/// Blocking; the cost is reading that many partitions of the changelog.
pub fn workflow_steps(
    cfg: &KafkaConfig,
    workflow_id: &str,
) -> Result<WorkflowSteps, OperatorError> {
    let partitions = kafka::check_layout(cfg)? as i32;
    for p in 0..partitions {
        let steps = steps_in(cfg, workflow_id, p)?;
        if !steps.is_empty() {
            return Ok(WorkflowSteps {
                workflow_id: workflow_id.to_owned(),
                partition: p,
                steps,
            });
        }
    }
    Err(OperatorError::UnknownWorkflow(workflow_id.to_owned()))
}

/// Every step no one has settled yet — `in_doubt`, awaiting approval, or
/// `started` — across the changelog, oldest first. They are kept past the
/// retention until resolved. Blocking; reads the whole changelog.
pub fn unresolved_steps(cfg: &KafkaConfig) -> Result<Vec<StepRecord>, OperatorError> {
    let partitions = kafka::check_layout(cfg)? as i32;
    let all: Vec<i32> = (0..partitions).collect();
    let mut latest: BTreeMap<(i32, Vec<u8>), Option<StepRecord>> = BTreeMap::new();
    read_to_end(cfg, &cfg.topics.changelog, &all, |p, key, value| {
        let Some(key) = key else { return };
        if let Some((_, _, record)) = changelog_step(key, value) {
            latest.insert((p, key.to_vec()), record);
        }
    })?;
    let mut out: Vec<StepRecord> = latest
        .into_values()
        .flatten()
        .filter(|r| r.phase.unresolved())
        .collect();
    out.sort_by_key(|r| r.intended_at_ms);
    Ok(out)
}

/// Unresolved steps as a table for people.
pub fn render_unresolved(steps: &[StepRecord]) -> String {
    use std::fmt::Write as _;
    let mut s = format!("{} unresolved step(s)\n", steps.len());
    let _ = writeln!(
        s,
        "{:<24} {:<6} {:<24} {:<8} {:<18} {:<9} {:<8} INTENDED",
        "WORKFLOW", "STEP", "TOOL", "ATTEMPT", "STATE", "PARTITION", "DISPATCH"
    );
    for r in steps {
        let intended = chrono::DateTime::from_timestamp_millis(r.intended_at_ms)
            .map(crate::contract::timestamp)
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "{:<24} {:<6} {:<24} {:<8} {:<18} {:<9} {:<8} {}",
            terminal_safe(&r.step.workflow_id),
            r.step.step_index,
            r.step.tool,
            r.step.attempt,
            r.phase.as_str(),
            r.partition,
            r.dispatch,
            intended
        );
    }
    s
}

/// Write `action` about `step` to the commands topic, bound to the run of the
/// step it decides (`run`, the record's dispatch; by default the current one),
/// then wait (up to `wait`) until a gate applied it — the changelog shows it —
/// or refused it — the DLQ has it; returns the step's record then. The step
/// must be in the phase the action applies to.
pub async fn decide(
    cfg: &KafkaConfig,
    step: StepKey,
    action: Action,
    by: &str,
    reason: Option<String>,
    run: Option<u32>,
    wait: Duration,
) -> Result<StepRecord, OperatorError> {
    let (c, wf) = (cfg.clone(), step.workflow_id.clone());
    let found = kafka::blocking(move || workflow_steps(&c, &wf)).await?;
    let record =
        found
            .steps
            .iter()
            .find(|r| r.step == step)
            .ok_or_else(|| OperatorError::UnknownStep {
                workflow_id: step.workflow_id.clone(),
                step: step.clone(),
            })?;
    let wanted = crate::state::Phase::acted_on_by(&action);
    if let Some(h) = record.hold.as_ref().filter(|h| h.told("expired"))
        && record.phase != wanted
    {
        return Err(OperatorError::HoldExpired {
            step,
            ttl: h.ttl.clone().unwrap_or_default(),
            expired_at: h
                .expires_at_ms
                .and_then(chrono::DateTime::from_timestamp_millis)
                .map(crate::contract::timestamp)
                .unwrap_or_default(),
        });
    }
    if record.phase != wanted {
        return Err(OperatorError::WrongPhase {
            step,
            phase: record.phase.as_str(),
            action: action.as_str(),
            wanted: wanted.as_str(),
        });
    }
    // A run older than the record's is refused here; a newer one cannot be
    // named. The gate checks again when it applies the command.
    if let Some(asked) = run
        && asked > record.dispatch
    {
        return Err(OperatorError::NotThatRun {
            step,
            asked,
            current: record.dispatch,
        });
    }
    let run = Run {
        dispatch: run.unwrap_or(record.dispatch),
        intended_at_ms: record.intended_at_ms,
    };
    // A decision about a held call names the terms it decides (the argument
    // bytes and the tool's policy version of the record read here).
    let terms = record.hold.as_ref().map(HeldTerms::of);
    send_decision(
        cfg,
        found.partition,
        step,
        action,
        by,
        reason,
        run,
        terms,
        wait,
    )
    .await
}

/// What a decision about a held call approves or denies: the held call's
/// argument digest and policy version, as the decider was shown them. The
/// gate refuses a decision about other terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldTerms {
    pub arguments_sha256: String,
    pub policy_version: String,
}

impl HeldTerms {
    pub fn of(hold: &crate::state::Hold) -> HeldTerms {
        HeldTerms {
            arguments_sha256: hold.arguments_sha256.clone(),
            policy_version: hold.policy_version.clone(),
        }
    }
}

/// Write `action` about `step` (which lives in `partition`) to the commands
/// topic, bound to `run`, and wait (up to `wait`) until a gate applied it or
/// refused it, as [`decide`] does once it has found the step. For a caller
/// that already holds the step's record (the console's cache): the gate checks
/// the phase and the run when it applies the command.
#[allow(clippy::too_many_arguments)]
pub async fn send_decision(
    cfg: &KafkaConfig,
    partition: i32,
    step: StepKey,
    action: Action,
    by: &str,
    reason: Option<String>,
    run: Run,
    terms: Option<HeldTerms>,
    wait: Duration,
) -> Result<StepRecord, OperatorError> {
    let now = chrono::Utc::now();
    let (arguments_sha256, policy_version) = match terms {
        Some(t) => (Some(t.arguments_sha256), Some(t.policy_version)),
        None => (None, None),
    };
    let command = Command {
        id: format!(
            "{}-{}-{}",
            by,
            now.timestamp_nanos_opt().unwrap_or_default(),
            std::process::id()
        ),
        step: step.clone(),
        action,
        by: by.to_owned(),
        at: crate::contract::timestamp(now),
        reason,
        run: Some(run),
        arguments_sha256,
        policy_version,
        evidence: None,
    };
    // Where the changelog and the DLQ end now: the gate's answer to the
    // command is written after it, so only what follows is read.
    let (c, cl, dlq) = (
        cfg.clone(),
        cfg.topics.changelog.clone(),
        cfg.topics.dlq.clone(),
    );
    let watch = kafka::blocking(move || Watch::from_ends(&c, &cl, partition, &dlq)).await?;
    let producer: FutureProducer = kafka::base_config(cfg)
        .set("enable.idempotence", "true")
        .set("linger.ms", "0")
        .create()?;
    let out =
        OutRecord::json_for_workflow(&cfg.topics.commands, partition, &step.workflow_id, &command);
    kafka::send_all(&producer, std::slice::from_ref(&out)).await?;
    drop(producer);
    let deadline = Instant::now() + wait;
    let verdict = kafka::blocking(move || watch.until(&step, &command.id, deadline)).await?;
    match verdict {
        Some(Verdict::Applied(r)) => Ok(*r),
        Some(Verdict::Refused { reason, message }) => {
            Err(OperatorError::Refused { reason, message })
        }
        None => Err(OperatorError::NotConfirmed {
            topic: cfg.topics.commands.clone(),
            waited: wait,
            run: run.dispatch,
        }),
    }
}

/// What became of a command.
enum Verdict {
    Applied(Box<StepRecord>),
    Refused { reason: String, message: String },
}

/// A reader of the step's changelog partition and of the DLQ, positioned at
/// their ends before a command is sent.
struct Watch {
    consumer: kafka::ReadToEndConsumer,
    changelog: String,
}

impl Watch {
    fn from_ends(
        cfg: &KafkaConfig,
        changelog: &str,
        partition: i32,
        dlq: &str,
    ) -> Result<Watch, OperatorError> {
        let group = format!("stepgate-operator-{}", std::process::id());
        let consumer = kafka::read_to_end_consumer(cfg, &group)?;
        let limit = Duration::from_secs(30);
        let mut tpl = rdkafka::TopicPartitionList::new();
        let (_, high) = consumer.fetch_watermarks(changelog, partition, limit)?;
        tpl.add_partition_offset(changelog, partition, rdkafka::Offset::Offset(high))?;
        let dlq_partitions = kafka::partition_counts(cfg, &[dlq])?[0] as i32;
        for p in 0..dlq_partitions {
            let (_, high) = consumer.fetch_watermarks(dlq, p, limit)?;
            tpl.add_partition_offset(dlq, p, rdkafka::Offset::Offset(high))?;
        }
        consumer.assign(&tpl)?;
        drop(tpl);
        Ok(Watch {
            consumer,
            changelog: changelog.to_owned(),
        })
    }

    /// Read on until the command `id` shows in the step's record or in the
    /// DLQ; `None` at the deadline.
    fn until(
        self,
        step: &StepKey,
        id: &str,
        deadline: Instant,
    ) -> Result<Option<Verdict>, OperatorError> {
        let mut verdict = None;
        while verdict.is_none() && Instant::now() < deadline {
            let Some(m) = self.consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = match m {
                Ok(m) => m,
                // Partition ends and passing errors: keep reading.
                Err(_) => continue,
            };
            if m.topic() == self.changelog {
                if let Some(key) = m.key()
                    && let Some((_, s, Some(record))) = changelog_step(key, m.payload())
                    && s == *step
                    && record.operator_log.iter().any(|e| e.id == id)
                {
                    verdict = Some(Verdict::Applied(Box::new(record)));
                }
            } else if let Some(v) = m.payload().and_then(|p| refused(p, id)) {
                verdict = Some(v);
            }
        }
        let _ = self.consumer.unassign();
        drop(self.consumer);
        Ok(verdict)
    }
}

/// A DLQ record about the command `id`: why it was refused.
fn refused(dlq_value: &[u8], id: &str) -> Option<Verdict> {
    let v: serde_json::Value = serde_json::from_slice(dlq_value).ok()?;
    let original: Command = serde_json::from_str(v.get("payload")?.as_str()?).ok()?;
    (original.id == id).then(|| Verdict::Refused {
        reason: v["reason"].as_str().unwrap_or_default().to_owned(),
        message: v["message"].as_str().unwrap_or_default().to_owned(),
    })
}

/// A call waiting for approval.
#[derive(Debug, Clone, Serialize)]
pub struct PendingApproval {
    pub partition: i32,
    #[serde(flatten)]
    pub event: ApprovalEvent,
}

/// Calls held for approval and not yet decided, oldest first. Blocking.
pub fn pending_approvals(cfg: &KafkaConfig) -> Result<Vec<PendingApproval>, OperatorError> {
    let partitions = kafka::check_layout(cfg)? as i32;
    let mut pending: BTreeMap<StepKey, (usize, PendingApproval)> = BTreeMap::new();
    let mut n = 0;
    let all: Vec<i32> = (0..partitions).collect();
    read_to_end(cfg, &cfg.topics.approvals, &all, |p, _, value| {
        let Some(event) = value.and_then(|v| serde_json::from_slice::<ApprovalEvent>(v).ok())
        else {
            return;
        };
        match event.event {
            ApprovalKind::Requested { .. } => {
                n += 1;
                pending.insert(
                    event.step.clone(),
                    (
                        n,
                        PendingApproval {
                            partition: p,
                            event,
                        },
                    ),
                );
            }
            ApprovalKind::Approved { .. }
            | ApprovalKind::Denied { .. }
            | ApprovalKind::Expired { .. } => {
                pending.remove(&event.step);
            }
            // Still held: the listing shows when it expires.
            ApprovalKind::Escalated { .. } | ApprovalKind::Expiring { .. } => {}
        }
    })?;
    let mut out: Vec<(usize, PendingApproval)> = pending.into_values().collect();
    out.sort_by_key(|(n, _)| *n);
    Ok(out.into_iter().map(|(_, a)| a).collect())
}

/// A workflow's steps as a table for people, redacted by `r` (the one rule)
/// and safe for a terminal.
pub fn render_steps(w: &WorkflowSteps, r: &Redactor) -> String {
    use std::fmt::Write as _;
    let t = terminal_safe;
    let mut s = format!(
        "workflow {} (partition {}): {} recorded step(s)\n",
        t(&w.workflow_id),
        w.partition,
        w.steps.len()
    );
    let _ = writeln!(
        s,
        "{:<6} {:<24} {:<8} {:<18} {:<8} {:<8} {:<25} answer",
        "STEP", "TOOL", "ATTEMPT", "STATE", "DISPATCH", "REPEATS", "INTENDED"
    );
    for rec in &w.steps {
        let answer = match &rec.result {
            Some(res) => match (&res.output, &res.error) {
                (Some(o), _) => format!(
                    "{}: {}",
                    res.status.as_str(),
                    excerpt(&r.json(o).to_string())
                ),
                (_, Some(e)) => format!("{} ({})", res.status.as_str(), e.kind),
                _ => res.status.as_str().to_owned(),
            },
            None => "-".to_owned(),
        };
        let intended = chrono::DateTime::from_timestamp_millis(rec.intended_at_ms)
            .map(crate::contract::timestamp)
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "{:<6} {:<24} {:<8} {:<18} {:<8} {:<8} {:<25} {}",
            rec.step.step_index,
            rec.step.tool,
            rec.step.attempt,
            rec.phase.as_str(),
            rec.dispatch,
            rec.repeats,
            intended,
            t(&answer)
        );
        let _ = writeln!(
            s,
            "       arguments: {}",
            t(&excerpt(&r.json(&rec.arguments.to_value()).to_string()))
        );
        if let Some(late) = &rec.late_outcome {
            let _ = writeln!(
                s,
                "       late outcome (did not settle the step): {}",
                t(&excerpt(
                    &r.json(&serde_json::to_value(late).unwrap_or_default())
                        .to_string()
                ))
            );
        }
        for e in &rec.evidence {
            let _ = writeln!(
                s,
                "       outcome of run {}: {}{} ({})",
                e.dispatch,
                e.status,
                e.kind
                    .as_deref()
                    .map(|k| format!(" {k}"))
                    .unwrap_or_default(),
                t(&r.text(&e.why))
            );
        }
        if !rec.open_dispatches.is_empty() && !rec.phase.in_flight() {
            let _ = writeln!(
                s,
                "       runs started and never reported: {:?} (they may have taken effect)",
                rec.open_dispatches
            );
        }
        for e in &rec.operator_log {
            let reason = e
                .reason
                .as_deref()
                .map(|x| format!(": {}", r.text(x)))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "       {} by {} at {} (was {}){}",
                e.action,
                t(&e.by),
                e.at,
                e.from.as_str(),
                t(&reason)
            );
        }
    }
    s
}

/// Held calls as a table for people, redacted by `r` (the one rule) and
/// safe for a terminal.
pub fn render_approvals(pending: &[PendingApproval], r: &Redactor) -> String {
    use std::fmt::Write as _;
    if pending.is_empty() {
        return "no calls are waiting for approval\n".to_owned();
    }
    let mut s = format!(
        "{:<24} {:<6} {:<24} {:<8} {:<25} {:<25} arguments\n",
        "WORKFLOW", "STEP", "TOOL", "ATTEMPT", "REQUESTED", "EXPIRES"
    );
    for a in pending {
        let (args, expires) = match &a.event.event {
            ApprovalKind::Requested {
                arguments,
                expires_at,
                ..
            } => (
                excerpt(
                    &r.json(&serde_json::Value::Object(arguments.clone()))
                        .to_string(),
                ),
                expires_at.clone().unwrap_or_else(|| "never".into()),
            ),
            _ => (String::new(), String::new()),
        };
        let _ = writeln!(
            s,
            "{:<24} {:<6} {:<24} {:<8} {:<25} {:<25} {}",
            terminal_safe(&a.event.step.workflow_id),
            a.event.step.step_index,
            a.event.step.tool,
            a.event.step.attempt,
            terminal_safe(&a.event.at),
            terminal_safe(&expires),
            terminal_safe(&args)
        );
    }
    s
}

fn excerpt(s: &str) -> String {
    if s.chars().count() > 80 {
        format!("{}…", s.chars().take(80).collect::<String>())
    } else {
        s.to_owned()
    }
}

/// The one redaction of everything shown to people ([`Redactor`]): the
/// configured secrets it can read here — every tool header value (already
/// resolved, or read now through `env`), the console's tokens and key, the
/// MCP front's static tokens — and, for each tool header it cannot read, a
/// line saying so (that value cannot be recognised in what is shown).
pub fn display_redactor(
    cfg: &Config,
    env: &dyn Fn(&str) -> Option<String>,
) -> (Redactor, Vec<String>) {
    let mut values = Vec::new();
    let mut unread = Vec::new();
    let mut take = |spec: &HeaderSpec| -> Result<(), String> {
        if let Some(v) = spec.value() {
            values.push(v.to_owned());
            return Ok(());
        }
        let mut s = spec.clone();
        s.resolve(env)?;
        values.extend(s.value().map(str::to_owned));
        Ok(())
    };
    for (name, t) in &cfg.tools {
        for (header, spec) in &t.headers {
            if let Err(e) = take(spec) {
                unread.push(format!(
                    "tools.{name} header `{header}`: {e}, so its value is not recognised (not redacted) in what is shown"
                ));
            }
        }
    }
    // Tokens this process may not be given: redacted when readable.
    for t in &cfg.console.tokens {
        let _ = take(&t.token);
    }
    if let Some(k) = &cfg.console.session_key {
        let _ = take(k);
    }
    for t in &cfg.mcp.auth.tokens {
        let _ = take(&t.token);
    }
    (Redactor::new(values), unread)
}

/// An answer as people are shown it.
pub fn redacted_result(res: &ToolResult, r: &Redactor) -> ToolResult {
    let mut res = res.clone();
    res.output = res.output.as_ref().map(|o| r.json(o));
    if let Some(e) = &mut res.error {
        e.message = r.text(&e.message);
    }
    res
}

fn redacted_arguments(a: &Arguments, r: &Redactor) -> Arguments {
    match r.json(&a.to_value()) {
        serde_json::Value::Object(m) => Arguments::from(m),
        _ => Arguments::empty(),
    }
}

/// A step record as people are shown it (`steps show --json`): its
/// arguments, rephrasings, answers, metadata and reasons redacted by the one
/// rule.
pub fn redacted_record(rec: &StepRecord, r: &Redactor) -> StepRecord {
    let mut rec = rec.clone();
    rec.arguments = redacted_arguments(&rec.arguments, r);
    for re in &mut rec.rephrased {
        re.arguments = redacted_arguments(&re.arguments, r);
    }
    rec.result = rec.result.as_ref().map(|x| redacted_result(x, r));
    rec.late_outcome = rec.late_outcome.as_ref().map(|o| match o {
        Outcome::Ok { output } => Outcome::Ok {
            output: r.json(output),
        },
        Outcome::Error { error } => Outcome::Error {
            error: crate::contract::ErrorBody {
                kind: error.kind.clone(),
                message: r.text(&error.message),
            },
        },
        Outcome::InDoubt { error } => Outcome::InDoubt {
            error: crate::contract::ErrorBody {
                kind: error.kind.clone(),
                message: r.text(&error.message),
            },
        },
    });
    rec.metadata = rec.metadata.as_ref().map(|m| redacted_map(m, r));
    for e in &mut rec.operator_log {
        e.reason = e.reason.as_deref().map(|x| r.text(x));
    }
    rec
}

fn redacted_map(
    m: &serde_json::Map<String, serde_json::Value>,
    r: &Redactor,
) -> serde_json::Map<String, serde_json::Value> {
    match r.json(&serde_json::Value::Object(m.clone())) {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

/// A held call as people are shown it (`approvals list --json`).
pub fn redacted_approval(a: &PendingApproval, r: &Redactor) -> PendingApproval {
    let mut a = a.clone();
    match &mut a.event.event {
        ApprovalKind::Requested {
            arguments,
            metadata,
            ..
        } => {
            *arguments = redacted_map(arguments, r);
            *metadata = metadata.as_ref().map(|m| redacted_map(m, r));
        }
        ApprovalKind::Approved { reason, .. } | ApprovalKind::Denied { reason, .. } => {
            *reason = reason.as_deref().map(|x| r.text(x));
        }
        ApprovalKind::Escalated { .. }
        | ApprovalKind::Expiring { .. }
        | ApprovalKind::Expired { .. } => {}
    }
    a
}

/// Control characters (terminal escapes) in a text from an agent, escaped
/// for a terminal (`\u{1b}`), and the bidirectional overrides too, so that
/// nothing an agent sent can move the cursor, clear the screen, set the
/// clipboard or reorder what is shown.
pub fn terminal_safe(s: &str) -> String {
    let unsafe_char =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !s.chars().any(unsafe_char) {
        return s.to_owned();
    }
    s.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}
