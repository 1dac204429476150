//! `stepgate audit`: what agents did, reconstructed from the intents, results
//! and commands topics alone (replayed, read_committed) — never from, or
//! touching, live state.
//!
//! Per workflow and step: every call, which were repeats, how rephrased repeats
//! differed (a field-level diff of what the model changed), identical-argument
//! calls at distinct steps (what an argument hash would have wrongly refused),
//! in-doubt steps and how operators settled them, and latencies.
//!
//! Nothing an agent writes can hide a call from it: an intent that says it is
//! a gate's re-routed copy (the `stepgate-forwarded-from` header) is left out
//! only when the original it names is on `intents` byte for byte; otherwise
//! it is reported, flagged as claiming to be forwarded. Answers are paired
//! with calls by the whole step and `call_id` (two workflows' calls may share
//! a `call_id`). What the reports show is redacted by the one rule
//! ([`AuditReport::redacted`]), and the text report escapes every control
//! character an agent could send to a terminal.

use crate::config::KafkaConfig;
use crate::contract::{Action, Command, StepKey, ToolResult};
use crate::kafka;
use crate::operator::terminal_safe;
use crate::redact::Redactor;
use rdkafka::Message;
use rdkafka::error::KafkaError;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AuditError {
    #[error("reading the topics")]
    Kafka(#[from] KafkaError),
    #[error("the topics' layout")]
    Setup(#[from] kafka::KafkaSetupError),
}

/// What to read.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    /// Only this workflow.
    pub workflow: Option<String>,
    /// Only records at or after this time (ms since the epoch).
    pub since_ms: Option<i64>,
}

/// One intent as published.
#[derive(Debug, Clone, Serialize)]
pub struct CallRecord {
    pub call_id: Option<String>,
    pub published_at_ms: i64,
    pub partition: i32,
    pub offset: i64,
    pub arguments: Map<String, Value>,
    /// A later call of the same step (a repeat).
    pub repeat: bool,
    /// What the model changed relative to the first call, for rephrased repeats.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<Change>,
    /// The answer, if one was found.
    pub status: Option<String>,
    pub deduplicated: Option<bool>,
    pub answered_at_ms: Option<i64>,
    pub latency_ms: Option<i64>,
    /// The record says it is a gate's re-routed copy of another, but no
    /// identical original is where it points: reported as a call of its own.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub claims_forwarded: bool,
}

/// One field-level difference between two argument objects.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub path: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepAudit {
    pub step: StepKey,
    pub calls: Vec<CallRecord>,
    pub repeats: usize,
    pub rephrased: usize,
    /// The status of the step's first answer.
    pub outcome: Option<String>,
    pub in_doubt: bool,
    /// Operators' decisions about the step (from `commands`), oldest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<Decision>,
}

/// An operator's decision about a step, as published on `commands`.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub id: String,
    /// `resolve_executed`, `resolve_not_executed`, `approve` or `deny`.
    pub action: String,
    pub by: String,
    pub at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The output an operator recorded for a step resolved as executed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// A settlement by stepgate's reconciler (`by` `stepgate:reconciler`):
    /// the tool's lookups' answers it rests on.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<crate::contract::LookupEvidence>,
}

impl From<Command> for Decision {
    /// The decision as its command states it (the audit and the console's
    /// timeline read `commands` through this).
    fn from(cmd: Command) -> Decision {
        Decision {
            id: cmd.id,
            action: cmd.action.as_str().to_owned(),
            by: cmd.by,
            at: cmd.at,
            reason: cmd.reason,
            output: match cmd.action {
                Action::ResolveExecuted { output } => Some(output),
                _ => None,
            },
            evidence: cmd.evidence.unwrap_or_default(),
        }
    }
}

impl StepAudit {
    /// The operator's decision that settled an in-doubt step, if any.
    pub fn resolution(&self) -> Option<&Decision> {
        self.decisions
            .iter()
            .find(|d| d.action.starts_with("resolve_"))
    }
}

/// Two calls at distinct steps with identical arguments: both legitimately
/// ran, and an argument hash would have refused the second.
#[derive(Debug, Clone, Serialize)]
pub struct HashCollision {
    pub tool: String,
    pub steps: Vec<StepKey>,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkflowAudit {
    pub workflow_id: String,
    pub steps: Vec<StepAudit>,
    pub identical_arguments_at_distinct_steps: Vec<HashCollision>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub workflows: usize,
    pub steps: usize,
    pub calls: usize,
    pub repeats: usize,
    pub rephrased: usize,
    pub in_doubt: usize,
    /// In-doubt steps an operator resolved (executed or not).
    pub in_doubt_resolved: usize,
    pub unanswered: usize,
    pub hash_collisions: usize,
    /// Calls whose record claims to be a forwarded copy without an identical
    /// original (an agent setting the gate's header itself).
    pub claimed_forwarded: usize,
    /// Repeats / calls.
    pub dedup_rate: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    pub summary: Summary,
    pub workflows: Vec<WorkflowAudit>,
}

/// A record read back from a topic.
#[derive(Debug, Clone)]
pub struct Replayed {
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: i64,
    pub value: Vec<u8>,
    /// The `stepgate-forwarded-from` header (`<partition>:<offset>`): the
    /// record says it is the gate's copy of one published elsewhere. Believed
    /// only when that original is there, identical.
    pub forwarded_from: Option<Vec<u8>>,
}

impl Replayed {
    /// Where the original of a claimed copy is, when the claim is readable.
    fn claimed_original(&self) -> Option<(i32, i64)> {
        let text = std::str::from_utf8(self.forwarded_from.as_deref()?).ok()?;
        let mut parts = text.split(':');
        Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
    }
}

/// `stepgate audit`: replay the intents, results and commands topics (from
/// `query.since_ms`, or their beginning) and build the report. `progress` is
/// told (topic, records read so far) now and then. Blocking.
pub fn report(
    cfg: &KafkaConfig,
    query: &AuditQuery,
    mut progress: impl FnMut(&str, usize),
) -> Result<AuditReport, AuditError> {
    let t = &cfg.topics;
    let mut read = |topic: &str| replay_topic(cfg, topic, query.since_ms, |n| progress(topic, n));
    let intents = read(&t.intents)?;
    let results = read(&t.results)?;
    let commands = read(&t.commands)?;
    // The originals claimed copies name that the replay did not read (before
    // `--since`): read one by one, to check the copies against them.
    let have: std::collections::HashSet<(i32, i64)> =
        intents.iter().map(|i| (i.partition, i.offset)).collect();
    let mut originals = Vec::new();
    for (p, o) in intents.iter().filter_map(Replayed::claimed_original) {
        if !have.contains(&(p, o))
            && let Some(r) = read_one(cfg, &t.intents, p, o)?
        {
            originals.push(r);
        }
    }
    Ok(build_with_originals(
        &intents, &originals, &results, &commands, query,
    ))
}

/// The record at `offset` of one partition of `topic`, if there is one.
fn read_one(
    cfg: &KafkaConfig,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<Option<Replayed>, AuditError> {
    use rdkafka::consumer::Consumer as _;
    let n = kafka::partition_counts(cfg, &[topic])?[0] as i32;
    if !(0..n).contains(&partition) || offset < 0 {
        return Ok(None);
    }
    let group = format!("stepgate-audit-{}", std::process::id());
    let consumer = kafka::read_to_end_consumer(cfg, &group)?;
    let (low, high) =
        consumer.fetch_watermarks(topic, partition, std::time::Duration::from_secs(30))?;
    if offset < low || offset >= high {
        return Ok(None);
    }
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, rdkafka::Offset::Offset(offset))?;
    consumer.assign(&tpl)?;
    drop(tpl);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut found = None;
    while found.is_none() && std::time::Instant::now() < deadline {
        match consumer.poll(std::time::Duration::from_millis(200)) {
            Some(Ok(m)) if m.offset() == offset => found = Some(replayed(&m)),
            // Past it (a transaction marker or a compacted gap): not there.
            Some(Ok(m)) if m.offset() > offset => break,
            Some(Err(KafkaError::PartitionEOF(_))) => break,
            _ => {}
        }
    }
    let _ = consumer.unassign();
    Ok(found)
}

fn replayed(m: &rdkafka::message::BorrowedMessage<'_>) -> Replayed {
    Replayed {
        partition: m.partition(),
        offset: m.offset(),
        timestamp_ms: m.timestamp().to_millis().unwrap_or(0),
        value: m.payload().unwrap_or_default().to_vec(),
        forwarded_from: kafka::header_value(m, crate::contract::headers::FORWARDED_FROM),
    }
}

/// Read a topic from the beginning (or `since_ms`) to its end as of now.
/// `progress` is told the number of records read so far, now and then.
pub fn replay_topic(
    cfg: &KafkaConfig,
    topic: &str,
    since_ms: Option<i64>,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Replayed>, AuditError> {
    let n = kafka::partition_counts(cfg, &[topic])?[0] as i32;
    let partitions: Vec<i32> = (0..n).collect();
    let group = format!("stepgate-audit-{}", std::process::id());
    let mut out = Vec::new();
    kafka::replay(cfg, &group, topic, &partitions, since_ms, None, |m| {
        out.push(replayed(m));
        if out.len() % 10_000 == 0 {
            progress(out.len());
        }
        Ok::<_, KafkaError>(())
    })?;
    progress(out.len());
    Ok(out)
}

/// Build the report from replayed intents and results.
pub fn build(
    intents: &[Replayed],
    results: &[Replayed],
    commands: &[Replayed],
    query: &AuditQuery,
) -> AuditReport {
    build_with_originals(intents, &[], results, commands, query)
}

/// [`build`], with the originals of claimed copies read beyond the replay
/// (`originals`: checked against, never audited themselves).
pub fn build_with_originals(
    intents: &[Replayed],
    originals: &[Replayed],
    results: &[Replayed],
    commands: &[Replayed],
    query: &AuditQuery,
) -> AuditReport {
    let by_place: std::collections::HashMap<(i32, i64), &Replayed> = intents
        .iter()
        .chain(originals)
        .map(|i| ((i.partition, i.offset), i))
        .collect();
    // A gate's copy: the original it names is there, published elsewhere,
    // not itself a copy, and identical byte for byte.
    let faithful_copy = |i: &Replayed| {
        i.claimed_original()
            .and_then(|at| by_place.get(&at))
            .is_some_and(|o| {
                o.partition != i.partition && o.forwarded_from.is_none() && o.value == i.value
            })
    };
    // Each decision once (a command re-sent by its author has the same id).
    let mut decisions: BTreeMap<StepKey, Vec<Decision>> = BTreeMap::new();
    for c in commands {
        let Ok(cmd) = serde_json::from_slice::<Command>(&c.value) else {
            continue;
        };
        let list = decisions.entry(cmd.step.clone()).or_default();
        if list.iter().any(|d| d.id == cmd.id) {
            continue;
        }
        list.push(Decision::from(cmd));
    }
    // Answers by their whole step and `call_id` (a `call_id` alone is not
    // unique: two workflows may use the same), in the order they were written;
    // each call takes the next answer to its step and `call_id`.
    type AnswerKey = (String, u64, String, u64, String);
    let mut answers: BTreeMap<AnswerKey, std::collections::VecDeque<(ToolResult, i64)>> =
        BTreeMap::new();
    for r in results {
        if let Ok(t) = serde_json::from_slice::<ToolResult>(&r.value)
            && let Some(id) = t.call_id.clone()
        {
            answers
                .entry((
                    t.workflow_id.clone(),
                    t.step_index,
                    t.tool.clone(),
                    t.attempt,
                    id,
                ))
                .or_default()
                .push_back((t, r.timestamp_ms));
        }
    }
    let mut steps: BTreeMap<(String, u64, String, u64), StepAudit> = BTreeMap::new();
    for i in intents.iter().filter(|i| !faithful_copy(i)) {
        // Invalid intents were answered `rejected` and are in the DLQ; an
        // intent for a tool no longer configured is still audited.
        let Some(intent) = lenient(&i.value) else {
            continue;
        };
        if query
            .workflow
            .as_ref()
            .is_some_and(|w| *w != intent.workflow_id)
        {
            continue;
        }
        let key = intent.step_key();
        let entry = steps
            .entry((
                key.workflow_id.clone(),
                key.step_index,
                key.tool.clone(),
                key.attempt,
            ))
            .or_insert_with(|| StepAudit {
                step: key,
                calls: Vec::new(),
                repeats: 0,
                rephrased: 0,
                outcome: None,
                in_doubt: false,
                decisions: Vec::new(),
            });
        let repeat = !entry.calls.is_empty();
        let arguments = intent.arguments.to_map();
        let changes = match entry.calls.first() {
            Some(first) if repeat => diff(
                "",
                &Value::Object(first.arguments.clone()),
                &Value::Object(arguments.clone()),
            ),
            _ => Vec::new(),
        };
        let answer = intent.call_id.as_ref().and_then(|id| {
            answers
                .get_mut(&(
                    entry.step.workflow_id.clone(),
                    entry.step.step_index,
                    entry.step.tool.clone(),
                    entry.step.attempt,
                    id.clone(),
                ))
                .and_then(|q| q.pop_front())
        });
        let answer = answer.as_ref();
        entry.repeats += usize::from(repeat);
        entry.rephrased += usize::from(!changes.is_empty());
        entry.calls.push(CallRecord {
            call_id: intent.call_id.clone(),
            published_at_ms: i.timestamp_ms,
            partition: i.partition,
            offset: i.offset,
            arguments,
            repeat,
            changes,
            status: answer.map(|(a, _)| a.status.as_str().to_owned()),
            deduplicated: answer.map(|(a, _)| a.deduplicated),
            answered_at_ms: answer.map(|(_, t)| *t),
            latency_ms: answer.map(|(_, t)| t - i.timestamp_ms),
            claims_forwarded: i.forwarded_from.is_some(),
        });
    }
    let mut by_wf: BTreeMap<String, Vec<StepAudit>> = BTreeMap::new();
    for (_, mut s) in steps {
        s.outcome = s
            .calls
            .iter()
            .find(|c| c.deduplicated == Some(false))
            .or(s.calls.iter().find(|c| c.status.is_some()))
            .and_then(|c| c.status.clone());
        s.in_doubt = s.outcome.as_deref() == Some("in_doubt");
        s.decisions = decisions.remove(&s.step).unwrap_or_default();
        by_wf.entry(s.step.workflow_id.clone()).or_default().push(s);
    }
    let mut summary = Summary::default();
    let workflows: Vec<WorkflowAudit> = by_wf
        .into_iter()
        .map(|(workflow_id, steps)| {
            let mut same: BTreeMap<(String, String), Vec<StepKey>> = BTreeMap::new();
            for s in &steps {
                if let Some(first) = s.calls.first() {
                    let canonical = Value::Object(first.arguments.clone()).to_string();
                    same.entry((s.step.tool.clone(), canonical))
                        .or_default()
                        .push(s.step.clone());
                }
            }
            let collisions: Vec<HashCollision> = same
                .into_iter()
                .filter(|(_, v)| v.len() > 1)
                .map(|((tool, _), steps)| HashCollision { tool, steps })
                .collect();
            summary.workflows += 1;
            summary.steps += steps.len();
            summary.calls += steps.iter().map(|s| s.calls.len()).sum::<usize>();
            summary.repeats += steps.iter().map(|s| s.repeats).sum::<usize>();
            summary.rephrased += steps.iter().map(|s| s.rephrased).sum::<usize>();
            summary.in_doubt += steps.iter().filter(|s| s.in_doubt).count();
            summary.in_doubt_resolved += steps
                .iter()
                .filter(|s| s.in_doubt && s.resolution().is_some())
                .count();
            summary.unanswered += steps
                .iter()
                .flat_map(|s| &s.calls)
                .filter(|c| c.status.is_none())
                .count();
            summary.hash_collisions += collisions.iter().map(|c| c.steps.len() - 1).sum::<usize>();
            summary.claimed_forwarded += steps
                .iter()
                .flat_map(|s| &s.calls)
                .filter(|c| c.claims_forwarded)
                .count();
            WorkflowAudit {
                workflow_id,
                steps,
                identical_arguments_at_distinct_steps: collisions,
            }
        })
        .collect();
    if summary.calls > 0 {
        summary.dedup_rate = summary.repeats as f64 / summary.calls as f64;
    }
    AuditReport { summary, workflows }
}

impl AuditReport {
    /// The report as people are shown it: every argument, rephrasing (by
    /// its path), recorded output and reason redacted by the one rule — the
    /// console's and the CLI's.
    pub fn redacted(&self, r: &Redactor) -> AuditReport {
        let mut out = self.clone();
        for w in &mut out.workflows {
            for s in &mut w.steps {
                for c in &mut s.calls {
                    if let Value::Object(m) =
                        r.json(&Value::Object(std::mem::take(&mut c.arguments)))
                    {
                        c.arguments = m;
                    }
                    for ch in &mut c.changes {
                        ch.before = ch.before.as_ref().map(|v| r.at_path(&ch.path, v));
                        ch.after = ch.after.as_ref().map(|v| r.at_path(&ch.path, v));
                    }
                }
                for d in &mut s.decisions {
                    d.output = d.output.as_ref().map(|o| r.json(o));
                    d.reason = d.reason.as_deref().map(|x| r.text(x));
                }
            }
        }
        out
    }
}

/// The intent's structure, whatever its tool.
fn lenient(bytes: &[u8]) -> Option<crate::contract::Intent> {
    serde_json::from_slice(bytes).ok()
}

/// Field-level differences between two JSON values (objects are walked).
pub fn diff(path: &str, before: &Value, after: &Value) -> Vec<Change> {
    match (before, after) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .flat_map(|k| {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    match (a.get(k), b.get(k)) {
                        (Some(x), Some(y)) => diff(&p, x, y),
                        (x, y) => vec![Change {
                            path: p,
                            before: x.cloned(),
                            after: y.cloned(),
                        }],
                    }
                })
                .collect()
        }
        (a, b) if a == b => Vec::new(),
        (a, b) => vec![Change {
            path: path.to_owned(),
            before: Some(a.clone()),
            after: Some(b.clone()),
        }],
    }
}

fn show(v: &Option<Value>) -> String {
    match v {
        None => "∅".into(),
        Some(Value::String(s)) => format!("{s:?}"),
        Some(v) => v.to_string(),
    }
}

fn clock(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_default()
}

/// The readable terminal report.
pub fn render_text(report: &AuditReport) -> String {
    use std::fmt::Write as _;
    let s = &report.summary;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{} workflows, {} steps, {} calls: {} repeats ({:.1}% deduplicated), {} rephrased by the model, {} in doubt ({} resolved by an operator), {} unanswered",
        s.workflows,
        s.steps,
        s.calls,
        s.repeats,
        s.dedup_rate * 100.0,
        s.rephrased,
        s.in_doubt,
        s.in_doubt_resolved,
        s.unanswered
    );
    let _ = writeln!(
        o,
        "{} calls had the same arguments as an earlier step: an argument hash would have wrongly refused them",
        s.hash_collisions
    );
    if s.claimed_forwarded > 0 {
        let _ = writeln!(
            o,
            "⚠ {} call(s) claim to be a gate's forwarded copy, but no identical original is where they point: each is reported as a call of its own (an agent may have set the header to hide it)",
            s.claimed_forwarded
        );
    }
    let _ = writeln!(o);
    // Every text an agent chose is escaped: nothing it sent reaches the
    // terminal as a control sequence.
    let t = terminal_safe;
    for w in &report.workflows {
        let _ = writeln!(o, "workflow {}", t(&w.workflow_id));
        for st in &w.steps {
            let _ = writeln!(
                o,
                "  step {} {} (attempt {}) → {}{}",
                st.step.step_index,
                t(&st.step.tool),
                st.step.attempt,
                st.outcome.as_deref().unwrap_or("no answer"),
                match (st.in_doubt, st.resolution()) {
                    (true, None) => "  ⚠ in doubt: may have run, needs a person",
                    (true, Some(d)) if d.by == crate::contract::RECONCILER_BY =>
                        "  (in doubt, then settled by asking the tool)",
                    (true, Some(_)) => "  (in doubt, then settled by an operator)",
                    _ => "",
                }
            );
            for d in &st.decisions {
                let _ = writeln!(
                    o,
                    "    {} by {} at {}{}{}",
                    t(&d.action),
                    t(&d.by),
                    t(&d.at),
                    t(&d.output
                        .as_ref()
                        .map(|v| format!(", output {v}"))
                        .unwrap_or_default()),
                    t(&d.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default())
                );
                for e in &d.evidence {
                    let _ = writeln!(
                        o,
                        "      lookup {} at {}: {}{}",
                        e.ask,
                        t(&e.at),
                        t(&e.answer),
                        t(&e.detail
                            .as_deref()
                            .map(|x| format!(" ({x})"))
                            .unwrap_or_default())
                    );
                }
            }
            for c in &st.calls {
                let _ = writeln!(
                    o,
                    "    {} {:<14} {:<9} {:<8} {}{}",
                    clock(c.published_at_ms),
                    t(c.call_id.as_deref().unwrap_or("-")),
                    if c.repeat { "repeat" } else { "first" },
                    t(c.status.as_deref().unwrap_or("…")),
                    c.latency_ms.map(|l| format!("{l} ms")).unwrap_or_default(),
                    if c.claims_forwarded {
                        format!(
                            "  ⚠ claims to be forwarded (partition {} offset {}), but no identical original is there",
                            c.partition, c.offset
                        )
                    } else {
                        String::new()
                    }
                );
                for ch in &c.changes {
                    let _ = writeln!(
                        o,
                        "        rephrased {}: {} → {}",
                        t(&ch.path),
                        t(&show(&ch.before)),
                        t(&show(&ch.after))
                    );
                }
            }
        }
        for h in &w.identical_arguments_at_distinct_steps {
            let steps: Vec<String> = h.steps.iter().map(|k| k.step_index.to_string()).collect();
            let _ = writeln!(
                o,
                "  identical arguments to {} at steps {}: each ran, as it should; a hash would have refused all but the first",
                t(&h.tool),
                steps.join(", ")
            );
        }
        let _ = writeln!(o);
    }
    o
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A self-contained HTML page with a timeline per workflow.
pub fn render_html(report: &AuditReport) -> String {
    use std::fmt::Write as _;
    let s = &report.summary;
    let mut o = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>stepgate audit</title><style>\
body{font:14px system-ui,sans-serif;margin:2em;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:2em}\
.sum{background:#f4f6f8;padding:1em;border-radius:6px}.step{margin:.6em 0}.lane{position:relative;height:22px;background:#fafafa;border:1px solid #eee}\
.call{position:absolute;top:3px;height:16px;border-radius:3px;min-width:6px;opacity:.9}.ok{background:#3c9}.error{background:#e66}\
.in_doubt{background:#f90}.rejected{background:#999}.none{background:#ccc}.repeat{border:2px solid #357;box-sizing:border-box}\
.lbl{font-family:monospace}.chg{color:#a40;font-family:monospace;margin-left:2em}.warn{color:#c60;font-weight:bold}\
</style></head><body><h1>stepgate audit</h1>",
    );
    let _ = write!(
        o,
        "<div class=\"sum\">{} workflows · {} steps · {} calls · <b>{} repeats ({:.1}% deduplicated)</b> · {} rephrased by the model · <span class=\"warn\">{} in doubt</span> · {} unanswered · {} identical-argument calls at distinct steps (an argument hash would have refused them)</div>",
        s.workflows,
        s.steps,
        s.calls,
        s.repeats,
        s.dedup_rate * 100.0,
        s.rephrased,
        s.in_doubt,
        s.unanswered,
        s.hash_collisions
    );
    for w in &report.workflows {
        let calls = w.steps.iter().flat_map(|s| &s.calls);
        let t0 = calls.clone().map(|c| c.published_at_ms).min().unwrap_or(0);
        let t1 = calls
            .map(|c| c.answered_at_ms.unwrap_or(c.published_at_ms))
            .max()
            .unwrap_or(t0)
            .max(t0 + 1);
        let x = |t: i64| (t - t0) as f64 * 100.0 / (t1 - t0) as f64;
        let _ = write!(
            o,
            "<h2>workflow <span class=\"lbl\">{}</span></h2>",
            esc(&w.workflow_id)
        );
        for st in &w.steps {
            let _ = write!(
                o,
                "<div class=\"step\"><span class=\"lbl\">step {} · {} · attempt {}</span> → <b>{}</b>{}<div class=\"lane\">",
                st.step.step_index,
                esc(&st.step.tool),
                st.step.attempt,
                esc(st.outcome.as_deref().unwrap_or("no answer")),
                if st.in_doubt {
                    " <span class=\"warn\">in doubt: may have run, needs a person</span>"
                } else {
                    ""
                }
            );
            for c in &st.calls {
                let end = c.answered_at_ms.unwrap_or(c.published_at_ms);
                let _ = write!(
                    o,
                    "<div class=\"call {} {}\" style=\"left:{:.2}%;width:{:.2}%\" title=\"{} · {} · {}\"></div>",
                    c.status.as_deref().unwrap_or("none"),
                    if c.repeat { "repeat" } else { "" },
                    x(c.published_at_ms),
                    (x(end) - x(c.published_at_ms)).max(0.5),
                    esc(c.call_id.as_deref().unwrap_or("-")),
                    esc(c.status.as_deref().unwrap_or("no answer")),
                    c.latency_ms.map(|l| format!("{l} ms")).unwrap_or_default()
                );
            }
            o.push_str("</div>");
            for c in st.calls.iter().filter(|c| c.claims_forwarded) {
                let _ = write!(
                    o,
                    "<div class=\"warn\">{} claims to be a forwarded copy (partition {} offset {}), but no identical original is there: reported as a call of its own</div>",
                    esc(c.call_id.as_deref().unwrap_or("-")),
                    c.partition,
                    c.offset
                );
            }
            for c in st.calls.iter().filter(|c| !c.changes.is_empty()) {
                for ch in &c.changes {
                    let _ = write!(
                        o,
                        "<div class=\"chg\">{} rephrased {}: {} → {}</div>",
                        esc(c.call_id.as_deref().unwrap_or("-")),
                        esc(&ch.path),
                        esc(&show(&ch.before)),
                        esc(&show(&ch.after))
                    );
                }
            }
            o.push_str("</div>");
        }
        for h in &w.identical_arguments_at_distinct_steps {
            let steps: Vec<String> = h.steps.iter().map(|k| k.step_index.to_string()).collect();
            let _ = write!(
                o,
                "<p>Identical arguments to <b>{}</b> at steps {}: each ran, as it should — an argument hash would have refused all but the first.</p>",
                esc(&h.tool),
                steps.join(", ")
            );
        }
    }
    o.push_str("</body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(offset: i64, ts: i64, v: Value) -> Replayed {
        Replayed {
            partition: 0,
            offset,
            timestamp_ms: ts,
            value: v.to_string().into_bytes(),
            forwarded_from: None,
        }
    }

    fn result(call_id: &str, step: u64, status: &str, dedup: bool) -> Value {
        json!({"workflow_id": "w", "step_index": step, "tool": "t", "attempt": 0, "call_id": call_id,
            "status": status, "output": {}, "deduplicated": dedup, "completed_at": "2026-11-29T00:00:00.000Z"})
    }

    #[test]
    fn a_recorded_workload_is_reported() {
        let intents = vec![
            rec(
                0,
                1000,
                json!({"workflow_id": "w", "step_index": 1, "tool": "t", "arguments": {"s": "Order confirmed", "to": "a"}, "call_id": "c1"}),
            ),
            rec(
                1,
                1100,
                json!({"workflow_id": "w", "step_index": 1, "tool": "t", "arguments": {"s": "Your order is confirmed", "to": "a"}, "call_id": "c2"}),
            ),
            rec(
                2,
                1200,
                json!({"workflow_id": "w", "step_index": 2, "tool": "t", "arguments": {"s": "Order confirmed", "to": "a"}, "call_id": "c3"}),
            ),
            rec(
                3,
                1300,
                json!({"workflow_id": "w", "step_index": 3, "tool": "t", "arguments": {}, "call_id": "c4"}),
            ),
            rec(
                4,
                1300,
                json!({"workflow_id": "other", "step_index": 0, "tool": "t", "arguments": {}, "call_id": "c5"}),
            ),
        ];
        let results = vec![
            rec(0, 1050, result("c1", 1, "ok", false)),
            rec(1, 1150, result("c2", 1, "ok", true)),
            rec(2, 1250, result("c3", 2, "ok", false)),
            rec(
                3,
                1400,
                json!({"workflow_id": "w", "step_index": 3, "tool": "t", "attempt": 0, "call_id": "c4",
                "status": "in_doubt", "error": {"kind": "executor_lost", "message": "m"}, "deduplicated": false,
                "completed_at": "2026-11-29T00:00:00.000Z"}),
            ),
        ];
        let query = AuditQuery {
            workflow: Some("w".into()),
            since_ms: None,
        };
        let r = build(&intents, &results, &[], &query);
        assert_eq!(
            (r.summary.workflows, r.summary.steps, r.summary.calls),
            (1, 3, 4)
        );
        assert_eq!(
            (r.summary.repeats, r.summary.rephrased, r.summary.in_doubt),
            (1, 1, 1)
        );
        assert_eq!(r.summary.hash_collisions, 1);
        let step1 = &r.workflows[0].steps[0];
        assert_eq!(
            step1.calls[1].changes,
            vec![Change {
                path: "s".into(),
                before: Some(json!("Order confirmed")),
                after: Some(json!("Your order is confirmed"))
            }]
        );
        assert_eq!(step1.calls[0].latency_ms, Some(50));
        let text = render_text(&r);
        assert!(
            text.contains(r#"rephrased s: "Order confirmed" → "Your order is confirmed""#),
            "{text}"
        );
        assert!(
            text.contains("identical arguments to t at steps 1, 2"),
            "{text}"
        );
        assert!(text.contains("⚠ in doubt"), "{text}");
        let html = render_html(&r);
        assert!(
            html.starts_with("<!doctype html>")
                && html.contains("workflow <span class=\"lbl\">w</span>")
        );
        assert!(html.contains("class=\"call in_doubt"), "{html}");

        // An operator's resolution (sent twice by its author) shows how the
        // in-doubt step was settled.
        let resolve = json!({"id": "cmd-1", "workflow_id": "w", "step_index": 3, "tool": "t", "attempt": 0,
            "action": "resolve_executed", "output": {"confirmation": "B-7"}, "by": "carol",
            "at": "2026-11-29T08:41:07.118Z", "reason": "seen in the statement"});
        let commands = vec![rec(0, 2000, resolve.clone()), rec(1, 2001, resolve)];
        let r = build(&intents, &results, &commands, &query);
        assert_eq!((r.summary.in_doubt, r.summary.in_doubt_resolved), (1, 1));
        let step3 = &r.workflows[0].steps[2];
        assert_eq!(step3.decisions.len(), 1, "one decision, however often sent");
        let text = render_text(&r);
        assert!(!text.contains("⚠ in doubt"), "{text}");
        assert!(
            text.contains(r#"resolve_executed by carol at 2026-11-29T08:41:07.118Z, output {"confirmation":"B-7"}: seen in the statement"#),
            "{text}"
        );
    }

    fn at(partition: i32, offset: i64, ts: i64, v: Value, from: Option<&str>) -> Replayed {
        Replayed {
            partition,
            offset,
            timestamp_ms: ts,
            value: v.to_string().into_bytes(),
            forwarded_from: from.map(|f| f.as_bytes().to_vec()),
        }
    }

    fn answer(wf: &str, call_id: &str) -> Value {
        json!({"workflow_id": wf, "step_index": 0, "tool": "t", "attempt": 0, "call_id": call_id,
            "status": "ok", "output": {}, "deduplicated": false, "completed_at": "2026-11-29T00:00:00.000Z"})
    }

    #[test]
    fn answers_pair_by_workflow_and_call_id() {
        // Two workflows use `call_0`; B is called after A was answered.
        let call = |wf: &str| json!({"workflow_id": wf, "step_index": 0, "tool": "t", "arguments": {}, "call_id": "call_0"});
        let intents = vec![
            at(0, 0, 1_000, call("A"), None),
            at(1, 0, 9_000, call("B"), None),
        ];
        let results = vec![
            at(0, 0, 1_050, answer("A", "call_0"), None),
            at(1, 0, 9_070, answer("B", "call_0"), None),
        ];
        let r = build(&intents, &results, &[], &AuditQuery::default());
        let latency: Vec<Option<i64>> = r
            .workflows
            .iter()
            .map(|w| w.steps[0].calls[0].latency_ms)
            .collect();
        assert_eq!(latency, vec![Some(50), Some(70)]);
    }

    #[test]
    fn a_claimed_copy_is_left_out_only_when_its_original_is_identical() {
        let call = |wf: &str| json!({"workflow_id": wf, "step_index": 0, "tool": "t", "arguments": {}, "call_id": wf});
        let intents = vec![
            // Published to the wrong partition, and the gate's copy of it.
            at(1, 7, 1_000, call("moved"), None),
            at(0, 3, 1_010, call("moved"), Some("1:7")),
            // An agent's record naming one that is not its original.
            at(0, 4, 1_020, call("hidden"), Some("1:7")),
            // Naming a place with no record, or nothing readable.
            at(0, 5, 1_030, call("nowhere"), Some("3:99")),
            at(0, 6, 1_040, call("garbled"), Some("x")),
        ];
        let r = build(&intents, &[], &[], &AuditQuery::default());
        let calls = |w: &str| {
            r.workflows
                .iter()
                .find(|x| x.workflow_id == w)
                .map(|x| x.steps[0].calls.clone())
                .unwrap_or_default()
        };
        assert_eq!(calls("moved").len(), 1);
        assert!(!calls("moved")[0].claims_forwarded);
        for w in ["hidden", "nowhere", "garbled"] {
            let c = calls(w);
            assert_eq!(c.len(), 1, "{w} is reported");
            assert!(c[0].claims_forwarded, "{w} is flagged");
        }
        assert_eq!(r.summary.claimed_forwarded, 3);
        assert!(render_text(&r).contains("claims to be forwarded"));
        // The original read beyond the replay (before `--since`) counts too.
        let r = build_with_originals(
            &intents[1..2],
            &intents[..1],
            &[],
            &[],
            &AuditQuery::default(),
        );
        assert_eq!(
            r.summary.calls, 0,
            "a faithful copy, its original elsewhere"
        );
    }

    #[test]
    fn the_text_report_escapes_what_agents_chose() {
        let v = json!({"workflow_id": "w\u{1b}]0;x\u{7}", "step_index": 0, "tool": "t",
            "arguments": {"k\u{1b}[2J": "v"}, "call_id": "c\u{1b}[H\u{202e}"});
        let mut second = v.clone();
        second["arguments"] = json!({"k\u{1b}[2J": "w"});
        let intents = vec![at(0, 0, 1, v, None), at(0, 1, 2, second, None)];
        let text = render_text(&build(&intents, &[], &[], &AuditQuery::default()));
        assert!(
            !text
                .chars()
                .any(|c| c.is_control() && c != '\n' || c == '\u{202e}'),
            "{text:?}"
        );
        assert!(text.contains("\\u{1b}"), "{text}");
    }

    #[test]
    fn the_report_is_redacted_by_the_one_rule() {
        let v = |pw: &str| {
            json!({"workflow_id": "w", "step_index": 0, "tool": "t",
            "arguments": {"password": pw, "memo": "Bearer abcdefgh12345"}})
        };
        let intents = vec![
            at(0, 0, 1, v("hunter2-a"), None),
            at(0, 1, 2, v("hunter2-b"), None),
        ];
        let r = build(&intents, &[], &[], &AuditQuery::default())
            .redacted(&Redactor::new(["Bearer abcdefgh12345".to_owned()]));
        let out = serde_json::to_string(&r).unwrap() + &render_text(&r) + &render_html(&r);
        assert!(!out.contains("hunter2"), "{out}");
        assert!(!out.contains("abcdefgh12345"), "{out}");
        let c = &r.workflows[0].steps[0].calls[1].changes[0];
        assert_eq!(
            (c.path.as_str(), c.before.clone(), c.after.clone()),
            (
                "password",
                Some(json!("<redacted>")),
                Some(json!("<redacted>"))
            )
        );
    }

    #[test]
    fn diff_walks_objects() {
        let d = diff(
            "",
            &json!({"a": {"b": 1, "c": 2}, "x": 1}),
            &json!({"a": {"b": 1, "c": 3}, "y": 2}),
        );
        let paths: Vec<&str> = d.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, vec!["a.c", "x", "y"]);
    }
}
