//! `stepgate audit`: what agents did, reconstructed from the intents, results
//! and commands topics alone (replayed, read_committed) — never from, or
//! touching, live state.
//!
//! Per workflow and step: every call, which were repeats, how rephrased repeats
//! differed (a field-level diff of what the model changed), identical-argument
//! calls at distinct steps (what an argument hash would have wrongly refused),
//! in-doubt steps and how operators settled them, and latencies.

use crate::config::KafkaConfig;
use crate::contract::{Action, Command, StepKey, ToolResult};
use crate::kafka;
use rdkafka::Message;
use rdkafka::error::KafkaError;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AuditError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    #[error("Kafka")]
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
    /// An intent the gate re-routed to its workflow's partition: a copy of
    /// one published elsewhere, not a call of its own.
    pub forwarded: bool,
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
    Ok(build(&intents, &results, &commands, query))
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
        out.push(Replayed {
            partition: m.partition(),
            offset: m.offset(),
            timestamp_ms: m.timestamp().to_millis().unwrap_or(0),
            value: m.payload().unwrap_or_default().to_vec(),
            forwarded: kafka::has_header(m, crate::contract::headers::FORWARDED_FROM),
        });
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
    let mut answers: BTreeMap<String, (ToolResult, i64)> = BTreeMap::new();
    for r in results {
        if let Ok(t) = serde_json::from_slice::<ToolResult>(&r.value)
            && let Some(id) = t.call_id.clone()
        {
            answers.entry(id).or_insert((t, r.timestamp_ms));
        }
    }
    let mut steps: BTreeMap<(String, u64, String, u64), StepAudit> = BTreeMap::new();
    for i in intents.iter().filter(|i| !i.forwarded) {
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
        let answer = intent.call_id.as_ref().and_then(|id| answers.get(id));
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
        "{} calls had the same arguments as an earlier step: an argument hash would have wrongly refused them\n",
        s.hash_collisions
    );
    for w in &report.workflows {
        let _ = writeln!(o, "workflow {}", w.workflow_id);
        for st in &w.steps {
            let _ = writeln!(
                o,
                "  step {} {} (attempt {}) → {}{}",
                st.step.step_index,
                st.step.tool,
                st.step.attempt,
                st.outcome.as_deref().unwrap_or("no answer"),
                match (st.in_doubt, st.resolution()) {
                    (true, None) => "  ⚠ in doubt: may have run, needs a person",
                    (true, Some(_)) => "  (in doubt, then settled by an operator)",
                    _ => "",
                }
            );
            for d in &st.decisions {
                let _ = writeln!(
                    o,
                    "    {} by {} at {}{}{}",
                    d.action,
                    d.by,
                    d.at,
                    d.output
                        .as_ref()
                        .map(|v| format!(", output {v}"))
                        .unwrap_or_default(),
                    d.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                );
            }
            for c in &st.calls {
                let _ = writeln!(
                    o,
                    "    {} {:<14} {:<9} {:<8} {}",
                    clock(c.published_at_ms),
                    c.call_id.as_deref().unwrap_or("-"),
                    if c.repeat { "repeat" } else { "first" },
                    c.status.as_deref().unwrap_or("…"),
                    c.latency_ms.map(|l| format!("{l} ms")).unwrap_or_default()
                );
                for ch in &c.changes {
                    let _ = writeln!(
                        o,
                        "        rephrased {}: {} → {}",
                        ch.path,
                        show(&ch.before),
                        show(&ch.after)
                    );
                }
            }
        }
        for h in &w.identical_arguments_at_distinct_steps {
            let steps: Vec<String> = h.steps.iter().map(|k| k.step_index.to_string()).collect();
            let _ = writeln!(
                o,
                "  identical arguments to {} at steps {}: each ran, as it should; a hash would have refused all but the first",
                h.tool,
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
            forwarded: false,
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
