//! The console's pages, rendered on the server (maud escapes every value).
//! No inline script or style: htmx and the stylesheet are files this process
//! serves, and the Content-Security-Policy allows nothing else.

use super::auth::Person;
use super::cache::{PartitionLag, StepEntry, ToolFigures};
use super::gates::{GateScrape, GateView, PartitionRestore, RestoreState};
use crate::audit::{Decision, diff};
use crate::config::ConsoleRole;
use crate::contract::{Arguments, StepKey, ToolResult};
use crate::redact::{Redactor, cut, hidden_paths};
use crate::state::{Phase, StepRecord};
use maud::{DOCTYPE, Markup, html};
use std::collections::BTreeMap;

/// How many bytes of a call's arguments a card or a timeline shows; the rest
/// is a link away ([`arguments_href`]).
pub const ARGS_SHOWN: usize = 4096;
/// How many held calls (or in-doubt steps) one page of the Inbox (or In
/// doubt) shows.
pub const PER_PAGE: usize = 20;

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

/// The banner above a page: what became of a person's action. Its text is
/// the console's own (never taken from a link), with a link to the workflow.
pub struct Notice {
    pub ok: bool,
    pub text: String,
    /// The workflow's timeline: (href, its id).
    pub workflow: Option<(String, String)>,
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
                    @if let Some(n) = &c.notice {
                        p.notice.done[n.ok].failed[!n.ok] role=(if n.ok { "status" } else { "alert" }) {
                            (n.text)
                            @if let Some((href, id)) = &n.workflow {
                                " " a.timeline href=(href) { "Open the timeline of " span.mono { (id) } " →" }
                            }
                        }
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
        // A held call: the terms the person is shown (the gate refuses a
        // decision about other argument bytes or another policy version).
        @if let Some(h) = &r.hold {
            input type="hidden" name="arguments_sha256" value=(h.arguments_sha256);
            input type="hidden" name="policy_version" value=(h.policy_version);
        }
    }
}

/// A held call's lifecycle, for the Inbox: when it expires (nothing runs
/// then), whether it was escalated, and the policy it is held under.
fn hold_terms(rec: &StepRecord, now_ms: i64) -> Markup {
    html! {
        @if let Some(h) = &rec.hold {
            p.meta.hold {
                @match h.expires_at_ms {
                    Some(e) if e > now_ms => { b { "expires " (clock(e)) } " (in " (ago(now_ms, e)) "): if nobody decides by then, it is refused as expired and nothing runs" }
                    Some(e) => { b { "expired " (clock(e)) } }
                    None => { "no expiry: it waits until someone decides" }
                }
                @if h.told.iter().any(|t| t == "escalated") { " · " b { "escalated" } }
                " · policy " span.mono { (h.policy_version) }
            }
        }
    }
}

/// An in-doubt step's reconciliation: who settles it, and each lookup's answer.
fn lookups(rec: &StepRecord) -> Markup {
    html! {
        @if let Some(rc) = &rec.reconcile {
            dt { "Asking the tool (reconcile)" }
            dd {
                @if rc.settling == crate::contract::Settler::Reconciler {
                    "stepgate is asking the tool what happened, until " (clock(rc.until_ms)) "; "
                } @else {
                    "the tool's lookups could not tell by " (clock(rc.until_ms)) ": a person decides; "
                }
                (rc.asked) " lookup(s) made"
                @for l in &rc.lookups {
                    p.muted.lookup {
                        "lookup " (l.ask) " at " (l.at) ": " b { (l.answer) }
                        @if let Some(d) = &l.detail { " — " (d) }
                    }
                }
            }
        }
    }
}

/// `/arguments?…`: one step's whole arguments.
pub fn arguments_href(k: &StepKey) -> String {
    format!(
        "/arguments?workflow_id={}&step_index={}&tool={}&attempt={}",
        super::percent(&k.workflow_id),
        k.step_index,
        super::percent(&k.tool),
        k.attempt
    )
}

/// Who may see the values hidden in a call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reveal {
    /// This person may decide the call (it waits for them): a control shows
    /// the hidden values, and the exact text the tool receives.
    Shown,
    /// The call waits for a decision this person may not make: they are told
    /// who can show them.
    Deciders,
    /// The call is settled: nothing is revealed any more.
    Nobody,
}

impl Reveal {
    /// For `person` looking at a step in `phase`.
    pub fn of(person: &Person, phase: Phase) -> Reveal {
        let decider = match phase {
            Phase::AwaitingApproval => ConsoleRole::Approver,
            Phase::InDoubt => ConsoleRole::Operator,
            _ => return Reveal::Nobody,
        };
        if person.may(decider) {
            Reveal::Shown
        } else {
            Reveal::Deciders
        }
    }
}

/// A call's arguments as a person sees them: redacted by the one rule
/// ([`Redactor`]), never silently — each value hidden by its field's name is
/// listed, and a person who may decide the call gets a control that shows
/// it, and the exact text the tool receives ([`Reveal`]). `more` caps what is
/// shown at [`ARGS_SHOWN`] bytes, with a link to the rest.
pub fn arguments(args: &Arguments, r: &Redactor, reveal: Reveal, more: Option<&StepKey>) -> Markup {
    let value = args.to_value();
    let cap = if more.is_some() {
        ARGS_SHOWN
    } else {
        usize::MAX
    };
    let shown = r.pretty(&value);
    let (head, left) = cut(&shown, cap);
    let hidden = hidden_paths(&value);
    let raw = r.text(args.as_str());
    let configured = raw != args.as_str();
    html! {
        pre.args { (head) @if left > 0 { "\n…" } }
        @if left > 0 {
            @if let Some(k) = more {
                p.more { (left) " more bytes not shown here. " a href=(arguments_href(k)) { "Show all the arguments" } }
            }
        }
        @if !hidden.is_empty() {
            p.hidden data-hidden=(hidden.len()) {
                (hidden.len()) " value(s) hidden because the field is named like a credential: "
                span.mono { (hidden.join(", ")) } "."
                @if reveal == Reveal::Deciders { " The person who decides this call can show them on its card." }
            }
            @if reveal == Reveal::Shown {
                details.reveal {
                    summary { "Show the hidden values (you may decide this call)" }
                    @let (all, left) = cut_owned(serde_json::to_string_pretty(&r.reveal(&value)).unwrap_or_default(), cap);
                    pre.args.revealed { (all) @if left > 0 { "\n…" } }
                }
            }
        }
        @if reveal == Reveal::Shown {
            details.raw {
                summary { "The exact text the tool receives" }
                @let (text, left) = cut_owned(raw.clone(), cap);
                pre.args.raw { (text) @if left > 0 { "\n…" } }
            }
        }
        @if configured {
            p.muted { "“<redacted>” also stands for a credential configured for this console's tools or sign-in: it is never shown." }
        }
    }
}

fn cut_owned(s: String, max: usize) -> (String, usize) {
    let (head, left) = cut(&s, max);
    (head.to_owned(), left)
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

/// Which page of a list, and how long the list is.
#[derive(Debug, Clone, Copy)]
pub struct Page {
    /// From 1.
    pub number: usize,
    pub total: usize,
}

impl Page {
    pub fn skip(&self) -> usize {
        (self.number - 1) * PER_PAGE
    }

    pub fn pages(&self) -> usize {
        self.total.div_ceil(PER_PAGE).max(1)
    }
}

/// "Showing 21–40 of 345", and links to the pages beside this one.
fn pager(path: &str, page: Page, shown: usize) -> Markup {
    let first = page.skip() + 1;
    html! {
        @if page.total > PER_PAGE || page.number > 1 {
            nav.pager {
                @if shown > 0 { "Showing " (first) "–" (first + shown - 1) " of " (page.total) ", oldest first. " }
                @else { "Nothing on page " (page.number) " of " (page.pages()) ". " }
                @if page.number > 1 { a.prev href=(format!("{path}?page={}", page.number - 1)) { "← older" } " " }
                @if page.number < page.pages() { a.next href=(format!("{path}?page={}", page.number + 1)) { "newer →" } }
            }
        }
    }
}

/// The Inbox's live part: one page of the held calls, oldest first.
#[allow(clippy::too_many_arguments)]
pub fn inbox_list(
    refresh_ms: u128,
    held: &[Held],
    page: Page,
    person: &Person,
    csrf: &str,
    r: &Redactor,
    now_ms: i64,
    version: u64,
) -> Markup {
    let may = person.may(ConsoleRole::Approver);
    html! {
        div #live hx-get=(format!("/live/inbox?page={}&v={version}", page.number)) hx-trigger=(format!("every {refresh_ms}ms")) hx-swap="outerHTML" {
            @if page.total == 0 {
                p.empty { "Nothing is waiting for approval." }
            }
            (pager("/inbox", page, held.len()))
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
                    (hold_terms(rec, now_ms))
                    div.cols {
                        div {
                            h3 { "Arguments" }
                            (arguments(&rec.arguments, r, Reveal::of(person, rec.phase), Some(&rec.step)))
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
            (capped(&r.pretty(&serde_json::to_value(late).unwrap_or_default())))
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

#[allow(clippy::too_many_arguments)]
pub fn in_doubt_list(
    refresh_ms: u128,
    steps: &[Doubt],
    page: Page,
    person: &Person,
    csrf: &str,
    r: &Redactor,
    now_ms: i64,
    version: u64,
) -> Markup {
    let may = person.may(ConsoleRole::Operator);
    html! {
        div #live hx-get=(format!("/live/in-doubt?page={}&v={version}", page.number)) hx-trigger=(format!("every {refresh_ms}ms")) hx-swap="outerHTML" {
            @if page.total == 0 {
                p.empty { "No step is in doubt." }
            }
            (pager("/in-doubt", page, steps.len()))
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
                        (lookups(rec))
                    }
                    h3 { "Arguments" }
                    (arguments(&rec.arguments, r, Reveal::of(person, rec.phase), Some(&rec.step)))
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

/// A long text in a `pre`, cut at [`ARGS_SHOWN`] bytes.
fn capped(text: &str) -> Markup {
    let (head, left) = cut(text, ARGS_SHOWN);
    html! {
        pre.args { (head) @if left > 0 { "\n…" } }
        @if left > 0 { p.more { (left) " more bytes not shown (" code { "stepgate steps show --json" } " prints them)." } }
    }
}

/// What happened to a step's calls, in plain words: how many there were and
/// how the repeats were (or will be) answered.
fn calls_said(rec: &StepRecord) -> String {
    let mut s = format!("{} call(s)", rec.repeats + 1);
    if rec.repeats > 0 {
        let rephrased = if rec.rephrased_count > 0 {
            format!(", {} rephrased", rec.rephrased_count)
        } else {
            String::new()
        };
        let how = match (rec.phase, &rec.result) {
            (Phase::AwaitingApproval, _) => "waiting for the decision, like the first",
            (_, Some(res)) if res.error.as_ref().is_some_and(|e| e.kind == "denied") => {
                "answered with the same denial"
            }
            (_, Some(_)) => "answered from the record, the tool not run again",
            (_, None) => "waiting for the run's outcome, not run again",
        };
        s += &format!(" ({} repeat(s){rephrased} — {how})", rec.repeats);
    }
    s
}

/// Whether and how often the step's tool ran, in plain words.
fn runs_said(rec: &StepRecord) -> String {
    let denied = rec
        .result
        .as_ref()
        .and_then(|r| r.error.as_ref())
        .is_some_and(|e| e.kind == "denied");
    match (rec.phase, rec.started_at_ms) {
        (Phase::AwaitingApproval, None) => "held for approval, not run".into(),
        (_, None) if denied => "denied, never run".into(),
        (_, None) => "never run".into(),
        (_, Some(t)) => format!("{} run(s), the last started {}", rec.dispatch, clock(t)),
    }
}

fn answer(res: &ToolResult, r: &Redactor) -> Markup {
    html! {
        span.badge.(if res.status.as_str() == "ok" { "ok" } else if res.status.as_str() == "in_doubt" { "doubt" } else { "bad" }) { (res.status.as_str()) }
        " at " (at(&res.completed_at))
        @if let Some(o) = &res.output { (capped(&r.pretty(o))) }
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
                            dd.calls {
                                (rec.intent_ts_ms.map(clock).unwrap_or_else(|| clock(rec.intended_at_ms)))
                                @if let Some(c) = &rec.call_id { " · call " span.mono { (c) } }
                                " · " (calls_said(rec))
                            }
                            dt { "Arguments" }
                            // Revealed on its card only, while it waits.
                            dd { (arguments(&rec.arguments, r, if matches!(rec.phase, Phase::AwaitingApproval | Phase::InDoubt) { Reveal::Deciders } else { Reveal::Nobody }, Some(&rec.step))) }
                            @for re in &rec.rephrased {
                                dt { "Rephrased at " (clock(re.at_ms)) }
                                dd {
                                    @if let Some(c) = &re.call_id { "call " span.mono { (c) } " " }
                                    ul.diff {
                                        @for ch in diff("", &rec.arguments.to_value(), &re.arguments.to_value()) {
                                            li {
                                                span.mono { (ch.path) } ": "
                                                del { (ch.before.as_ref().map(|v| r.at_path(&ch.path, v).to_string()).unwrap_or("∅".into())) }
                                                " → "
                                                ins { (ch.after.as_ref().map(|v| r.at_path(&ch.path, v).to_string()).unwrap_or("∅".into())) }
                                            }
                                        }
                                    }
                                }
                            }
                            dt { "Runs" }
                            dd.runs {
                                (runs_said(rec))
                                @if !rec.open_dispatches.is_empty() { " · started and never reported: runs " (format!("{:?}", rec.open_dispatches)) " (they may have taken effect)" }
                                @for e in &rec.evidence {
                                    br; span.muted { "run " (e.dispatch) ": " (e.status) @if let Some(k) = &e.kind { " (" (k) ")" } " — " (e.why) }
                                }
                            }
                            dt { "Answer" }
                            dd {
                                @match &rec.result {
                                    Some(res) => (answer(res, r)),
                                    None if rec.phase == Phase::AwaitingApproval => span.muted { "none yet: the agent waits for the decision" },
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

/// `/arguments`: one step's whole arguments.
pub fn arguments_page(rec: &StepRecord, r: &Redactor, reveal: Reveal) -> Markup {
    html! {
        h1 { "Arguments of " span.mono { (step_label(&rec.step)) } }
        p { a href=(workflow_href(&rec.step.workflow_id)) { "← the workflow's timeline" } }
        (arguments(&rec.arguments, r, reveal, None))
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
                    tr.tool data-tool=(name) {
                        @if name == super::cache::OTHER_TOOLS {
                            td.muted title="calls and answers naming a tool that is not configured (each refused)" { (name) }
                        } @else {
                            td.mono { (name) }
                        }
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
                @if restore.is_some() { th { "owner" } th { "state" } th { "last restore" } th { "standby" } }
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
                                    td.mono title="gates keeping a warm copy (gate.standby_replicas), each with how many records it is behind" {
                                        @for (i, (g, lag)) in r.standbys.iter().enumerate() {
                                            @if i > 0 { ", " }
                                            (g) " (lag " (lag) ")"
                                        }
                                        @if r.standbys.is_empty() { "–" }
                                    }
                                },
                                None => { td { "–" } td { "–" } td { "–" } td { "–" } },
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
