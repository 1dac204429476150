//! The console's pages, rendered on the server (maud escapes every value).
//! No inline script or style: htmx and the stylesheet are files this process
//! serves, and the Content-Security-Policy allows nothing else.

use super::auth::Person;
use super::cache::{PartitionLag, StepEntry, ToolFigures};
use super::gates::{GateScrape, GateView, PartitionRestore, RestoreState};
use crate::audit::{Decision, diff};
use crate::config::ConsoleRole;
use crate::contract::{StepKey, ToolResult};
use crate::state::{Phase, StepRecord};
use maud::{DOCTYPE, Markup, html};
use serde_json::Value;
use std::collections::BTreeMap;

/// Replaces secrets in what a page shows: configured tokens and tool header
/// values wherever they appear, and the values of arguments named like
/// credentials.
pub struct Redactor {
    pub secrets: Vec<String>,
}

const REDACTED: &str = crate::redact::REDACTED;

/// Argument names whose values are credentials.
fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "passphrase",
        "secret",
        "token",
        "api_key",
        "apikey",
        "authorization",
        "credential",
        "private_key",
        "access_key",
        "cookie",
    ]
    .iter()
    .any(|w| n.contains(w))
}

impl Redactor {
    pub fn text(&self, s: &str) -> String {
        let mut out = s.to_owned();
        for secret in self.secrets.iter().filter(|s| s.len() >= 4) {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), REDACTED);
            }
        }
        out
    }

    pub fn json(&self, v: &Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .map(|(k, v)| {
                        let shown = if is_secret_name(k) && !v.is_null() {
                            Value::String(REDACTED.into())
                        } else {
                            self.json(v)
                        };
                        (k.clone(), shown)
                    })
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(|v| self.json(v)).collect()),
            Value::String(s) => Value::String(self.text(s)),
            v => v.clone(),
        }
    }

    /// Pretty JSON, redacted.
    pub fn pretty(&self, v: &Value) -> String {
        serde_json::to_string_pretty(&self.json(v)).unwrap_or_default()
    }
}

/// Which tab is open.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    Inbox,
    InDoubt,
    Workflows,
    Overview,
    None,
}

pub struct Chrome<'a> {
    pub person: Option<&'a Person>,
    pub csrf: &'a str,
    pub tab: Tab,
    pub held: usize,
    pub in_doubt: usize,
    pub notice: Option<Notice>,
}

pub enum Notice {
    Done(String),
    Failed(String),
}

/// A whole page around `body`.
pub fn page(title: &str, c: &Chrome, body: Markup) -> Markup {
    let tab = |t: Tab, href: &str, label: String| {
        html! { a.tab.on[c.tab == t] href=(href) { (label) } }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                // htmx adds no <style> of its own (the CSP allows none).
                meta name="htmx-config" content=r#"{"includeIndicatorStyles":false,"allowEval":false}"#;
                title { (title) " · stepgate console" }
                link rel="stylesheet" href="/static/console.css";
                script src="/static/htmx.min.js" {}
            }
            body {
                header.top {
                    span.brand { "stepgate" }
                    @if c.person.is_some() {
                        nav {
                            a.tab.on[c.tab == Tab::Inbox] href="/inbox" { "Inbox (" span #held-count { (c.held) } ")" }
                            a.tab.on[c.tab == Tab::InDoubt] href="/in-doubt" { "In doubt (" span #doubt-count { (c.in_doubt) } ")" }
                            (tab(Tab::Workflows, "/workflows", "Workflows".into()))
                            (tab(Tab::Overview, "/overview", "Overview".into()))
                        }
                    }
                    @if let Some(p) = c.person {
                        span.who {
                            "signed in as " b { (p.name) } " · "
                            (p.role.map(ConsoleRole::as_str).unwrap_or("no role"))
                        }
                        form.inline method="post" action="/logout" {
                            input type="hidden" name="csrf" value=(c.csrf);
                            button.link type="submit" { "sign out" }
                        }
                    }
                }
                main {
                    @match &c.notice {
                        Some(Notice::Done(m)) => p.notice.done role="status" { (m) },
                        Some(Notice::Failed(m)) => p.notice.failed role="alert" { (m) },
                        None => {},
                    }
                    (body)
                }
            }
        }
    }
}

/// The tabs' counts, swapped in by htmx beside a live fragment.
pub fn counts_oob(held: usize, in_doubt: usize) -> Markup {
    html! {
        span #held-count hx-swap-oob="true" { (held) }
        span #doubt-count hx-swap-oob="true" { (in_doubt) }
    }
}

/// An RFC 3339 time as the pages show times.
pub fn at(rfc3339: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| clock(t.timestamp_millis()))
        .unwrap_or_else(|_| rfc3339.to_owned())
}

pub fn login(error: Option<&str>, csrf: &str) -> Markup {
    html! {
        section.login {
            h1 { "Sign in" }
            p { "Paste your console token. It is kept in an HttpOnly cookie for this site only." }
            @if let Some(e) = error { p.notice.failed role="alert" { (e) } }
            form method="post" action="/login" {
                input type="hidden" name="csrf" value=(csrf);
                label for="token" { "Token" }
                input #token type="password" name="token" autocomplete="current-password" required autofocus;
                button.primary type="submit" { "Sign in" }
            }
        }
    }
}

/// A message page (no role, not found, …).
pub fn message(title: &str, text: &str) -> Markup {
    html! { section { h1 { (title) } p { (text) } } }
}

pub fn ago(ms: i64, now_ms: i64) -> String {
    let s = ((now_ms - ms) / 1000).max(0);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

pub fn clock(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
        .unwrap_or_default()
}

fn step_label(k: &StepKey) -> String {
    format!("{} · step {} · {}", k.workflow_id, k.step_index, k.tool)
        + &if k.attempt > 0 {
            format!(" · attempt {}", k.attempt)
        } else {
            String::new()
        }
}

/// `/workflows/<id>`, with the id escaped for a path.
pub fn workflow_href(id: &str) -> String {
    format!("/workflows/{}", super::percent(id))
}

/// The hidden fields naming a step and the run a decision is about.
fn step_fields(r: &StepRecord, csrf: &str) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(csrf);
        input type="hidden" name="workflow_id" value=(r.step.workflow_id);
        input type="hidden" name="step_index" value=(r.step.step_index);
        input type="hidden" name="tool" value=(r.step.tool);
        input type="hidden" name="attempt" value=(r.step.attempt);
        input type="hidden" name="dispatch" value=(r.dispatch);
        input type="hidden" name="intended_at_ms" value=(r.intended_at_ms);
    }
}

fn phase_badge(phase: Phase, status: Option<&str>) -> Markup {
    let (class, text) = match phase {
        Phase::Completed => match status {
            Some("ok") => ("ok", "ok".to_owned()),
            Some(s) => ("bad", s.to_owned()),
            None => ("ok", "completed".to_owned()),
        },
        Phase::InDoubt => ("doubt", "IN DOUBT".to_owned()),
        Phase::AwaitingApproval => ("held", "WAITING FOR APPROVAL".to_owned()),
        Phase::NotExecuted => ("neutral", "not executed (will re-run)".to_owned()),
        Phase::Unreached => (
            "bad",
            "tool unreachable (its next call asks again)".to_owned(),
        ),
        Phase::Started => ("neutral", "running".to_owned()),
    };
    html! { span.badge.(class) { (text) } }
}

/// The earlier steps of a held call's workflow.
fn earlier_steps(steps: &[(StepKey, StepEntry)], before: u64) -> Markup {
    let earlier: Vec<&(StepKey, StepEntry)> = steps
        .iter()
        .filter(|(k, _)| k.step_index < before)
        .collect();
    html! {
        @if earlier.is_empty() {
            p.muted { "No earlier recorded steps in this workflow." }
        } @else {
            table.compact {
                thead { tr { th { "step" } th { "tool" } th { "state" } th { "when" } } }
                tbody {
                    @for (k, e) in earlier.iter().rev().take(8).rev() {
                        tr {
                            td { (k.step_index) }
                            td.mono { (k.tool) }
                            td { (phase_badge(e.phase, e.status.map(|s| s.as_str()))) }
                            td.muted { (clock(e.intended_at_ms)) }
                        }
                    }
                }
            }
            @if earlier.len() > 8 { p.muted { "… and " (earlier.len() - 8) " before them." } }
        }
    }
}

pub struct Held {
    pub record: StepRecord,
    pub requested_at: Option<String>,
    pub earlier: Vec<(StepKey, StepEntry)>,
}

/// The Inbox's live part: every held call, oldest first.
pub fn inbox_list(
    refresh_ms: u128,
    held: &[Held],
    person: &Person,
    csrf: &str,
    r: &Redactor,
    now_ms: i64,
    version: u64,
) -> Markup {
    let may = person.may(ConsoleRole::Approver);
    html! {
        div #live hx-get=(format!("/live/inbox?v={version}")) hx-trigger=(format!("every {refresh_ms}ms")) hx-swap="outerHTML" {
            @if held.is_empty() {
                p.empty { "Nothing is waiting for approval." }
            }
            @for h in held {
                @let rec = &h.record;
                article.card.held data-step=(step_label(&rec.step)) data-held-at-ms=(rec.intended_at_ms) {
                    div.head {
                        span.tool { (rec.step.tool) }
                        span.waited title="how long it has waited" { "waiting " (ago(rec.intended_at_ms, now_ms)) }
                    }
                    p.meta {
                        "workflow " a.mono href=(workflow_href(&rec.step.workflow_id)) { (rec.step.workflow_id) }
                        " · step " (rec.step.step_index)
                        @if rec.step.attempt > 0 { " · attempt " (rec.step.attempt) }
                        " · requested " (h.requested_at.as_deref().map(at).unwrap_or_else(|| clock(rec.intended_at_ms)))
                        @if rec.repeats > 0 { " · the agent asked " (rec.repeats + 1) " times" }
                    }
                    div.cols {
                        div {
                            h3 { "Arguments" }
                            pre.args { (r.pretty(&rec.arguments.to_value())) }
                        }
                        div {
                            h3 { "Earlier steps of this workflow" }
                            (earlier_steps(&h.earlier, rec.step.step_index))
                        }
                    }
                    @if may {
                        div.actions {
                            form method="post" action="/approve" {
                                (step_fields(rec, csrf))
                                button.approve type="submit" { "Approve — run it" }
                            }
                            form.deny method="post" action="/deny" {
                                (step_fields(rec, csrf))
                                input type="text" name="reason" placeholder="Reason (the agent is told)" required aria-label="reason for denying";
                                button.deny type="submit" { "Deny" }
                            }
                        }
                    } @else {
                        p.muted { "You can view this call; approving needs the approver or operator role." }
                    }
                }
            }
        }
    }
}

pub struct Doubt {
    pub record: StepRecord,
}

/// What the tool last said about a step: its answer's error, or a late outcome.
fn last_said(rec: &StepRecord, r: &Redactor) -> Markup {
    html! {
        @if let Some(res) = &rec.result {
            @if let Some(e) = &res.error {
                p { b { (e.kind) } ": " (r.text(&e.message)) }
            }
        }
        @if let Some(late) = &rec.late_outcome {
            p { "A late outcome arrived after the step was declared in doubt: " }
            pre.args { (r.pretty(&serde_json::to_value(late).unwrap_or_default())) }
        }
        @for e in &rec.evidence {
            p.muted {
                "run " (e.dispatch) ": " (e.status)
                @if let Some(k) = &e.kind { " (" (k) ")" }
                " — " (e.why) " at " (clock(e.at_ms))
            }
        }
    }
}

pub fn in_doubt_list(
    refresh_ms: u128,
    steps: &[Doubt],
    person: &Person,
    csrf: &str,
    r: &Redactor,
    now_ms: i64,
    version: u64,
) -> Markup {
    let may = person.may(ConsoleRole::Operator);
    html! {
        div #live hx-get=(format!("/live/in-doubt?v={version}")) hx-trigger=(format!("every {refresh_ms}ms")) hx-swap="outerHTML" {
            @if steps.is_empty() {
                p.empty { "No step is in doubt." }
            }
            @for d in steps {
                @let rec = &d.record;
                article.card.doubt data-step=(step_label(&rec.step)) {
                    div.head {
                        span.tool { (rec.step.tool) }
                        (phase_badge(rec.phase, None))
                        span.waited { "in doubt for " (ago(rec.result.as_ref().and_then(|x| chrono::DateTime::parse_from_rfc3339(&x.completed_at).ok()).map(|t| t.timestamp_millis()).unwrap_or(rec.intended_at_ms), now_ms)) }
                    }
                    p.meta {
                        "workflow " a.mono href=(workflow_href(&rec.step.workflow_id)) { (rec.step.workflow_id) }
                        " · step " (rec.step.step_index)
                        @if rec.step.attempt > 0 { " · attempt " (rec.step.attempt) }
                        " · partition " (rec.partition)
                    }
                    p.question { "It may or may not have taken effect. Check at the provider, then say which." }
                    dl.facts {
                        dt { "Idempotency-Key (look it up at the provider)" }
                        dd.mono.key { (rec.step.idempotency_key()) }
                        dt { "Dispatches" }
                        dd {
                            "run " (rec.dispatch) " is the current one"
                            @if let Some(t) = rec.started_at_ms { ", started " (clock(t)) }
                            @if !rec.open_dispatches.is_empty() {
                                "; started and never reported: runs " (format!("{:?}", rec.open_dispatches))
                            }
                        }
                        dt { "What the tool last said" }
                        dd { (last_said(rec, r)) }
                    }
                    h3 { "Arguments" }
                    pre.args { (r.pretty(&rec.arguments.to_value())) }
                    @if may {
                        div.actions.resolve {
                            form method="post" action="/resolve" {
                                (step_fields(rec, csrf))
                                input type="hidden" name="outcome" value="not_executed";
                                button.approve type="submit" { "It did NOT happen — run it again" }
                                span.muted { " the agent's next call of this step runs the tool (same Idempotency-Key)" }
                            }
                            form method="post" action="/resolve" {
                                (step_fields(rec, csrf))
                                input type="hidden" name="outcome" value="executed";
                                label { "It DID happen — the output the agent receives (JSON):" }
                                textarea name="output" rows="2" required { "{}" }
                                input type="text" name="reason" placeholder="How you know (recorded)";
                                button.deny type="submit" { "Mark as executed" }
                            }
                            form method="post" action="/resolve" {
                                (step_fields(rec, csrf))
                                input type="hidden" name="outcome" value="failed";
                                label { "It ran and FAILED, without effect — what you found (the agent is told):" }
                                input type="text" name="reason" required placeholder="e.g. the bank rejected it: account closed";
                                button.deny type="submit" { "Mark as failed" }
                            }
                        }
                    } @else {
                        p.muted { "Resolving needs the operator role." }
                    }
                }
            }
        }
    }
}

/// One step of a timeline, with its whole record when it could be read.
pub struct TimelineStep {
    pub key: StepKey,
    pub entry: StepEntry,
    pub record: Option<StepRecord>,
    pub decisions: Vec<Decision>,
    pub approval: Option<super::cache::ApprovalTrail>,
}

fn trace_id(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.split('-');
    let (_, id) = (parts.next()?, parts.next()?);
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

fn answer(res: &ToolResult, r: &Redactor) -> Markup {
    html! {
        span.badge.(if res.status.as_str() == "ok" { "ok" } else if res.status.as_str() == "in_doubt" { "doubt" } else { "bad" }) { (res.status.as_str()) }
        " at " (at(&res.completed_at))
        @if let Some(o) = &res.output { pre.args { (r.pretty(o)) } }
        @if let Some(e) = &res.error { p { b { (e.kind) } ": " (r.text(&e.message)) } }
    }
}

pub fn timeline(
    workflow_id: &str,
    steps: &[TimelineStep],
    trace_url: Option<&str>,
    r: &Redactor,
) -> Markup {
    html! {
        h1 { "Workflow " span.mono { (workflow_id) } }
        @if steps.is_empty() { p.empty { "No recorded steps for this workflow (read-only calls on the fast path are not recorded; settled steps expire after the retention)." } }
        ol.timeline {
            @for s in steps {
                li.step data-step=(step_label(&s.key)) {
                    div.head {
                        span.idx { "step " (s.key.step_index) }
                        span.tool { (s.key.tool) }
                        @if s.key.attempt > 0 { span.muted { "attempt " (s.key.attempt) } }
                        (phase_badge(s.entry.phase, s.entry.status.map(|x| x.as_str())))
                        @if let Some(l) = s.entry.latency_ms { span.muted { (l) " ms" } }
                        @if let (Some(rec), Some(url)) = (&s.record, trace_url) {
                            @if let Some(id) = rec.traceparent.as_deref().and_then(trace_id) {
                                a.trace href=(url.replace("{trace_id}", id)) rel="noopener" { "trace ↗" }
                            }
                        }
                    }
                    @if let Some(rec) = &s.record {
                        dl.facts {
                            dt { "Called" }
                            dd {
                                (rec.intent_ts_ms.map(clock).unwrap_or_else(|| clock(rec.intended_at_ms)))
                                @if let Some(c) = &rec.call_id { " · call " span.mono { (c) } }
                                " · " (rec.repeats + 1) " call(s)"
                                @if rec.repeats > 0 { " (" (rec.repeats) " repeat(s), " (rec.rephrased_count) " rephrased — answered from the record)" }
                            }
                            dt { "Arguments" }
                            dd { pre.args { (r.pretty(&rec.arguments.to_value())) } }
                            @for re in &rec.rephrased {
                                dt { "Rephrased at " (clock(re.at_ms)) }
                                dd {
                                    @if let Some(c) = &re.call_id { "call " span.mono { (c) } " " }
                                    ul.diff {
                                        @for ch in diff("", &rec.arguments.to_value(), &re.arguments.to_value()) {
                                            li {
                                                span.mono { (ch.path) } ": "
                                                del { (ch.before.as_ref().map(|v| r.json(v).to_string()).unwrap_or("∅".into())) }
                                                " → "
                                                ins { (ch.after.as_ref().map(|v| r.json(v).to_string()).unwrap_or("∅".into())) }
                                            }
                                        }
                                    }
                                }
                            }
                            dt { "Dispatches" }
                            dd {
                                (rec.dispatch) " run(s)"
                                @if let Some(t) = rec.started_at_ms { " · last started " (clock(t)) }
                                @if !rec.open_dispatches.is_empty() { " · never reported: " (format!("{:?}", rec.open_dispatches)) }
                                @for e in &rec.evidence {
                                    br; span.muted { "run " (e.dispatch) ": " (e.status) @if let Some(k) = &e.kind { " (" (k) ")" } " — " (e.why) }
                                }
                            }
                            dt { "Answer" }
                            dd {
                                @match &rec.result {
                                    Some(res) => (answer(res, r)),
                                    None => span.muted { "none yet" },
                                }
                            }
                        }
                    }
                    @if let Some(a) = &s.approval {
                        @if let Some(t) = &a.requested_at { p.decision { "Held for approval at " (at(t)) } }
                    }
                    @if let Some(rec) = &s.record {
                        @for e in &rec.operator_log {
                            p.decision {
                                b { (e.action) } " by " b.by { (e.by) } " at " (at(&e.at))
                                " (was " (e.from.as_str()) ")"
                                @if let Some(reason) = &e.reason { " — “" (r.text(reason)) "”" }
                                @if let Some(d) = s.decisions.iter().find(|d| d.id == e.id) {
                                    @if let Some(o) = &d.output { " · output " span.mono { (r.json(o).to_string()) } }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

pub fn workflow_search(query: &str, found: &[String]) -> Markup {
    html! {
        h1 { "Workflows" }
        form.search method="get" action="/workflows" {
            input type="search" name="id" value=(query) placeholder="workflow id (or its beginning)" autofocus aria-label="workflow id";
            button.primary type="submit" { "Search" }
        }
        @if !query.is_empty() {
            @if found.is_empty() { p.empty { "No recorded workflow starts with “" (query) "”." } }
            ul { @for w in found { li { a.mono href=(workflow_href(w)) { (w) } } } }
        }
    }
}

pub fn overview(
    tools: &BTreeMap<String, ToolFigures>,
    lag: &[PartitionLag],
    restore: Option<&[PartitionRestore]>,
    gates: &[GateView],
    steps: usize,
    caught_up: Option<std::time::Duration>,
) -> Markup {
    let pct = |x: Option<f64>| {
        x.map(|v| format!("{:.1}%", v * 100.0))
            .unwrap_or("–".into())
    };
    let ms = |x: Option<u32>| x.map(|v| format!("{v} ms")).unwrap_or("–".into());
    // Every partition the lag or a gate names, in order.
    let mut partitions: Vec<i32> = lag.iter().map(|l| l.partition).collect();
    partitions.extend(restore.unwrap_or_default().iter().map(|r| r.partition));
    partitions.sort_unstable();
    partitions.dedup();
    html! {
        h1 { "Overview" }
        p.muted {
            (steps) " recorded steps in the cache"
            @match caught_up {
                Some(d) => { " · topics read to their end in " (format!("{:.1}", d.as_secs_f64())) " s" },
                None => { " · still reading the topics…" },
            }
        }
        h2 { "Per tool" }
        table {
            thead { tr {
                th { "tool" } th.n { "calls" } th.n { "steps" } th.n { "repeats" }
                th.n title="repeats ÷ effectful calls (recorded steps' calls)" { "dedup rate" }
                th.n { "in flight" } th.n { "held" } th.n { "in doubt" } th.n { "p50" } th.n { "p99" } th { "answers" }
            } }
            tbody {
                @for (name, f) in tools {
                    tr {
                        td.mono { (name) }
                        td.n { (f.calls) } td.n { (f.steps) } td.n { (f.repeats) }
                        td.n { (pct(f.dedup_rate())) }
                        td.n { (f.in_flight) } td.n { (f.awaiting_approval) }
                        td.n.(if f.in_doubt > 0 { "alarm" } else { "" }) { (f.in_doubt) }
                        td.n { (ms(f.p50_ms)) } td.n { (ms(f.p99_ms)) }
                        td.muted { @for (s, n) in &f.answers { (s) " " (n) " " } }
                    }
                }
            }
        }
        p.muted { "Calls: intents published (fast-path reads too). Dedup rate: repeats ÷ the calls of recorded steps. Latency: a step's first call to its answer." }
        h2 { "Per partition (the gate's group on intents)" }
        table.partitions {
            thead { tr {
                th.n { "partition" } th.n { "end" } th.n { "committed" } th.n { "lag" }
                @if restore.is_some() { th { "owner" } th { "state" } th { "last restore" } }
            } }
            tbody {
                @for p in &partitions {
                    @let l = lag.iter().find(|l| l.partition == *p);
                    @let r = restore.and_then(|rs| rs.iter().find(|r| r.partition == *p));
                    tr data-partition=(p)
                        data-state=[r.map(|r| state_name(&r.state))]
                        data-owner=[r.map(|r| r.owners.join(" "))] {
                        td.n { (p) }
                        @match l {
                            Some(l) => {
                                td.n { (l.end) }
                                td.n { (l.committed.map(|c| c.to_string()).unwrap_or("–".into())) }
                                td.n.(if l.lag() > 1000 { "alarm" } else { "" }) { (l.lag()) }
                            },
                            None => { td.n { "–" } td.n { "–" } td.n { "–" } },
                        }
                        @if restore.is_some() {
                            @match r {
                                Some(r) => {
                                    td.mono {
                                        (r.owners.join(", "))
                                        @if r.owners.len() > 1 { span.muted { " (moving)" } }
                                        @if r.owners.is_empty() { "–" }
                                    }
                                    td { (restore_state(&r.state)) }
                                    td {
                                        @match r.last_restore {
                                            Some((n, took)) => { (n) " records in " (format!("{:.1}", took.as_secs_f64())) " s" },
                                            None => { "–" },
                                        }
                                    }
                                },
                                None => { td { "–" } td { "–" } td { "–" } },
                            }
                        }
                    }
                }
            }
        }
        @match restore {
            None => p.muted { "Which gate owns each partition, and whether its state is restored: list the gates' HTTP addresses in " code { "console.gates" } " (e.g. " code { r#"gates = ["http://127.0.0.1:9464"]"# } " under " code { "[console]" } ")." },
            Some(_) => ul.gates {
                @for g in gates {
                    li {
                        span.mono { (g.name) } ": "
                        @match &g.scrape {
                            None => span.muted { "not read yet" },
                            Some(GateScrape::Reached(ps)) => {
                                @let owned: Vec<String> = ps.iter().filter(|(_, s)| s.owned).map(|(p, _)| p.to_string()).collect();
                                @if owned.is_empty() { "reached, owns no partition" } @else { "reached, owns partitions " (owned.join(", ")) }
                            },
                            Some(GateScrape::Unreachable(why)) => span.alarm { "unreachable: " (why) },
                        }
                    }
                }
            },
        }
    }
}

/// A partition's state as its row's `data-state` says it.
fn state_name(s: &RestoreState) -> &'static str {
    match s {
        RestoreState::Ready { .. } => "ready",
        RestoreState::Restoring { .. } => "restoring",
        RestoreState::NotOwned => "not_owned",
        RestoreState::Unknown { .. } => "unknown",
        RestoreState::Pending => "pending",
    }
}

fn restore_state(s: &RestoreState) -> Markup {
    html! {
        @match s {
            RestoreState::Ready { since_ms } => {
                span.badge.ok { "ready" }
                @if let Some(t) = since_ms { " since " (clock(*t)) }
            },
            RestoreState::Restoring { records, took } => {
                span.badge.held { "restoring" }
                " " (records) " records so far (" (format!("{:.0}", took.as_secs_f64())) " s)"
            },
            RestoreState::NotOwned => span.badge.bad { "not owned by any listed gate" },
            RestoreState::Unknown { unreachable } => {
                span.badge.doubt { "unknown" }
                " " (unreachable.join(", ")) " unreachable"
            },
            RestoreState::Pending => span.muted { "reading the gates…" },
        }
    }
}

/// The stylesheet, served as a file (the CSP allows no inline style).
pub const CSS: &str = include_str!("../../assets/console/console.css");
/// htmx, vendored from npm (`htmx.org`), served as a file.
pub const HTMX: &str = include_str!("../../assets/console/htmx-2.0.11.min.js");
