//! MCP tasks (protocol 2025-11-25, `tasks/get`, `tasks/result`, `tasks/list`,
//! `tasks/cancel`): a `tools/call` the client asks to run as a task (its
//! `params.task`) is answered at once with a task, as soon as its step is on
//! the intents topic — a step stepgate has durably accepted. The client then
//! polls `tasks/get` and reads the answer with `tasks/result`, however long
//! the tool takes: a host that gives up on a request after 60 s (the MCP
//! TypeScript SDK's default) no longer loses an answer that takes longer.
//!
//! A task is its step's: a task-augmented call naming a step (`_meta`) that
//! already has a live task of the same principal gets that task again, so a
//! call re-issued after a broken stream attaches to it. Tasks belong to the
//! principal that made them (another's reads as unknown, the same text as one
//! that never was) and live in this process: one made elsewhere, or before a
//! restart, is unknown here — its step is not, and repeating the call returns
//! the step's answer.
//!
//! rmcp (3.11) speaks only the later tasks extension, so these requests are
//! answered here, in front of it, and its `initialize` and `tools/list`
//! results are amended to announce them (`capabilities.tasks`,
//! `execution.taskSupport`).

use super::auth::Principal;
use super::{McpFront, Pending, Prepared};
use crate::client::StepCall;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

/// The `_meta` key naming the task a result belongs to.
pub const RELATED_TASK: &str = "io.modelcontextprotocol/related-task";
/// The protocol revision whose tasks these are.
pub const TASKS_PROTOCOL: &str = "2025-11-25";
/// How often a client is asked to poll `tasks/get`.
const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// A completed task is kept at least this long after it completed, even
/// beyond its ttl, so that a client polling slowly still reads its answer.
const KEPT_AFTER_DONE: Duration = Duration::from_secs(600);
/// The longest a task's creation waits for its step to be published.
const PUBLISH_WAIT: Duration = Duration::from_secs(30);

/// JSON-RPC error codes.
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;

/// Where a task is.
#[derive(Debug, Clone)]
enum State {
    Working,
    /// The call's result (a `CallToolResult`), whatever it says: a tool's
    /// error is a completed task too.
    Completed(Value),
    Cancelled,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Working => "working",
            State::Completed(_) => "completed",
            State::Cancelled => "cancelled",
        }
    }
}

pub(super) struct Task {
    pub(super) id: String,
    /// The principal's key: only it sees the task.
    owner: String,
    /// The step's key, for a call that named its step.
    step: Option<String>,
    tool: String,
    created: SystemTime,
    ttl: Duration,
    state: watch::Sender<State>,
    updated: Mutex<SystemTime>,
    /// Cancels the task's wait (`tasks/cancel`).
    cancel: CancellationToken,
}

impl Task {
    fn set(&self, state: State) -> bool {
        let changed = self.state.send_if_modified(|s| {
            if matches!(s, State::Working) {
                *s = state;
                true
            } else {
                false
            }
        });
        if changed {
            *self.updated.lock().expect("task lock") = SystemTime::now();
        }
        changed
    }

    /// Whether the task may be forgotten at `now`.
    fn expired(&self, now: SystemTime) -> bool {
        if matches!(*self.state.borrow(), State::Working) {
            return false;
        }
        let updated = *self.updated.lock().expect("task lock");
        now >= self.created + self.ttl && now >= updated + KEPT_AFTER_DONE
    }

    /// The task as the protocol shows it.
    fn wire(&self) -> Value {
        let state = self.state.borrow().clone();
        json!({
            "taskId": self.id,
            "status": state.name(),
            "statusMessage": self.status_message(&state),
            "createdAt": rfc3339(self.created),
            "lastUpdatedAt": rfc3339(*self.updated.lock().expect("task lock")),
            "ttl": millis(self.ttl),
            "pollInterval": millis(POLL_INTERVAL),
        })
    }

    /// What the task's status tells the client (and the model).
    fn status_message(&self, state: &State) -> String {
        match state {
            State::Working => format!(
                "The call to `{}` is a step stepgate has accepted; its answer is not in yet.",
                self.tool
            ),
            State::Completed(_) => format!(
                "The call to `{}` has its answer: read it with tasks/result.",
                self.tool
            ),
            State::Cancelled => format!(
                "This task was cancelled at the client's request: it no longer waits for the \
                 answer. The call to `{}` had been handed to stepgate and may still take effect; \
                 repeating the call for the same step returns that step's answer.",
                self.tool
            ),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Task {
    /// The task as the 2026-07-28 tasks extension shows it.
    pub(super) fn detailed(&self) -> rmcp::model::DetailedTask {
        use rmcp::model::{TaskPayload, TaskStatus};
        let state = self.state.borrow().clone();
        let message = self.status_message(&state);
        let (status, payload) = match state {
            State::Working => (TaskStatus::Working, TaskPayload::Working),
            State::Completed(result) => (
                TaskStatus::Completed,
                TaskPayload::Completed {
                    result: match result {
                        Value::Object(o) => o,
                        other => Map::from_iter([("content".to_owned(), other)]),
                    },
                },
            ),
            State::Cancelled => (TaskStatus::Cancelled, TaskPayload::Cancelled),
        };
        let task = rmcp::model::Task::new(
            self.id.clone(),
            status,
            rfc3339(self.created),
            rfc3339(*self.updated.lock().expect("task lock")),
        )
        .with_status_message(message)
        .with_ttl_ms(millis(self.ttl))
        .with_poll_interval_ms(millis(POLL_INTERVAL));
        rmcp::model::DetailedTask::new(task, payload)
    }

    /// Whether the task still stands for its step (it was not cancelled).
    pub(super) fn live(&self) -> bool {
        !matches!(*self.state.borrow(), State::Cancelled)
    }

    /// The call's result, if the task has it.
    pub(super) fn completed(&self) -> Option<Value> {
        match &*self.state.borrow() {
            State::Completed(result) => Some(result.clone()),
            _ => None,
        }
    }

    /// Wait until the task is no longer working.
    pub(super) async fn finished(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|s| !matches!(s, State::Working)).await;
    }

    /// `tasks/cancel` (either revision); `Err` with a text when it is over.
    pub(super) fn cancel_wait(&self) -> Result<(), String> {
        cancel(self).map(|_| ()).map_err(|(_, text)| text)
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// The tasks of one front.
pub struct Tasks {
    table: Mutex<Table>,
    /// The most tasks kept at once.
    max: usize,
    /// The most working tasks of one principal.
    per_principal: usize,
    /// The longest a task lives: its call waits this long for the answer.
    ttl: Duration,
    /// The shortest: the front's own wait for an answer.
    min_ttl: Duration,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<String, Arc<Task>>,
    /// (owner, step key) → task id, for calls that named their step.
    by_step: HashMap<(String, String), String>,
    made: u64,
}

/// Why a task could not be made.
#[derive(Debug)]
pub(super) enum Full {
    /// `mcp.max_tasks` are held, every one working.
    Full(usize),
    /// The principal has `mcp.max_tasks_per_principal` working.
    Principal(usize),
}

impl Tasks {
    pub fn new(max: usize, per_principal: usize, ttl: Duration, min_ttl: Duration) -> Tasks {
        Tasks {
            table: Mutex::new(Table::default()),
            max: max.max(1),
            per_principal: per_principal.max(1),
            ttl: ttl.max(min_ttl),
            min_ttl,
        }
    }

    /// Tasks held now.
    pub fn len(&self) -> usize {
        self.table.lock().expect("tasks lock").by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn get(&self, owner: &str, id: &str) -> Option<Arc<Task>> {
        let t = self.table.lock().expect("tasks lock");
        t.by_id.get(id).filter(|task| task.owner == owner).cloned()
    }

    /// The live task of `owner`'s step, if there is one.
    pub(super) fn of_step(&self, owner: &str, step: &str) -> Option<Arc<Task>> {
        let t = self.table.lock().expect("tasks lock");
        let id = t.by_step.get(&(owner.to_owned(), step.to_owned()))?;
        t.by_id.get(id).cloned()
    }

    /// A new task, making room by forgetting expired ones (and then the
    /// oldest finished one); never a working one.
    fn insert(
        &self,
        owner: &str,
        step: Option<String>,
        tool: &str,
        ttl: Duration,
        cancel: CancellationToken,
    ) -> Result<Arc<Task>, Full> {
        let now = SystemTime::now();
        let mut t = self.table.lock().expect("tasks lock");
        // One principal's calls held for a person's approval, say, must not
        // take every place from the others.
        let working = t
            .by_id
            .values()
            .filter(|task| task.owner == owner && matches!(*task.state.borrow(), State::Working))
            .count();
        if working >= self.per_principal {
            return Err(Full::Principal(self.per_principal));
        }
        if t.by_id.len() >= self.max {
            t.forget(|task| task.expired(now));
        }
        if t.by_id.len() >= self.max {
            let oldest = t
                .by_id
                .values()
                .filter(|task| !matches!(*task.state.borrow(), State::Working))
                .min_by_key(|task| *task.updated.lock().expect("task lock"))
                .map(|task| task.id.clone());
            match oldest {
                Some(id) => t.forget(|task| task.id == id),
                None => return Err(Full::Full(self.max)),
            }
        }
        t.made += 1;
        let id = format!("sg-{}-{:x}", super::random_id(), t.made);
        let task = Arc::new(Task {
            id: id.clone(),
            owner: owner.to_owned(),
            step: step.clone(),
            tool: tool.to_owned(),
            created: now,
            ttl,
            state: watch::channel(State::Working).0,
            updated: Mutex::new(now),
            cancel,
        });
        if let Some(step) = step {
            t.by_step.insert((owner.to_owned(), step), id.clone());
        }
        t.by_id.insert(id, task.clone());
        Ok(task)
    }

    /// The ttl of a task the client asked `requested` milliseconds for.
    pub(super) fn ttl_for(&self, requested: Option<u64>) -> Duration {
        requested
            .map(Duration::from_millis)
            .unwrap_or(self.ttl)
            .clamp(self.min_ttl, self.ttl)
    }
}

impl Table {
    fn forget(&mut self, which: impl Fn(&Task) -> bool) {
        let gone: Vec<String> = self
            .by_id
            .values()
            .filter(|task| which(task))
            .map(|task| task.id.clone())
            .collect();
        for id in gone {
            if let Some(task) = self.by_id.remove(&id)
                && let Some(step) = &task.step
            {
                let key = (task.owner.clone(), step.clone());
                if self.by_step.get(&key) == Some(&id) {
                    self.by_step.remove(&key);
                }
            }
        }
    }
}

/// The first revision whose tasks are rmcp's (the extension): requests that
/// name it or a later one in `MCP-Protocol-Version` go to rmcp.
const EXTENSION_PROTOCOL: &str = "2026-07-28";

/// Whether `message` (one JSON-RPC request, sent under the protocol
/// `revision` its `MCP-Protocol-Version` header names, if any) is answered
/// here: a 2025-11-25 task method, or a `tools/call` asking for a task.
pub fn is_ours(message: &Value, revision: Option<&str>) -> bool {
    // ISO dates compare as strings.
    if revision.is_some_and(|r| r >= EXTENSION_PROTOCOL) {
        return false;
    }
    match message.get("method").and_then(Value::as_str) {
        Some("tasks/get" | "tasks/result" | "tasks/list" | "tasks/cancel") => true,
        Some("tools/call") => message
            .get("params")
            .and_then(|p| p.get("task"))
            .is_some_and(Value::is_object),
        _ => false,
    }
}

/// The answer to `message` (see [`is_ours`]) from `principal`, in `session`.
pub async fn answer(
    front: &McpFront,
    principal: &Principal,
    session: Option<&str>,
    message: &Value,
) -> Response {
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let params = message.get("params").cloned().unwrap_or(json!({}));
    let tasks = &front.shared.tasks;
    let owner = principal.key();
    let outcome = match message.get("method").and_then(Value::as_str) {
        Some("tools/call") => create(front, principal, session, &params).await,
        Some("tasks/list") => {
            let t = tasks.table.lock().expect("tasks lock");
            let mut mine: Vec<&Arc<Task>> = t
                .by_id
                .values()
                .filter(|task| task.owner == owner)
                .collect();
            mine.sort_by_key(|task| task.created);
            Ok(json!({ "tasks": mine.iter().map(|task| task.wire()).collect::<Vec<_>>() }))
        }
        Some(method) => match params.get("taskId").and_then(Value::as_str) {
            None => Err((INVALID_PARAMS, format!("{method} needs `params.taskId`"))),
            Some(task_id) => match tasks.get(&owner, task_id) {
                None => Err((INVALID_PARAMS, unknown_task(task_id))),
                Some(task) => match method {
                    "tasks/get" => Ok(task.wire()),
                    "tasks/cancel" => cancel(&task),
                    _ => result(&task).await,
                },
            },
        },
        None => Err((INVALID_PARAMS, "a request needs a `method`".to_owned())),
    };
    let body = match outcome {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err((code, message)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
        }
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

pub(super) fn unknown_task(id: &str) -> String {
    format!(
        "There is no task `{id}` here: it was made by another client or on another stepgate \
         MCP server (or before this one restarted), or it ended long enough ago to be \
         forgotten. If its call named its step in `_meta`, repeat that call (same tool, same \
         `_meta`): a repeated step returns its answer and does not run again."
    )
}

type Outcome = Result<Value, (i64, String)>;

/// `tools/call` with `params.task`: the step's task, once the step is
/// published (or, for a call refused before it became a step, a task
/// completed with the refusal).
async fn create(
    front: &McpFront,
    principal: &Principal,
    session: Option<&str>,
    params: &Value,
) -> Outcome {
    let Some(tool) = params.get("name").and_then(Value::as_str) else {
        return Err((INVALID_PARAMS, "tools/call needs `params.name`".to_owned()));
    };
    let arguments = match params.get("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(_) => {
            return Err((
                INVALID_PARAMS,
                format!("the arguments of `{tool}` must be a JSON object"),
            ));
        }
    };
    let meta = match params.get("_meta") {
        Some(Value::Object(m)) => m.clone(),
        _ => Map::new(),
    };
    let tasks = &front.shared.tasks;
    let ttl = tasks.ttl_for(
        params
            .get("task")
            .and_then(|t| t.get("ttl"))
            .and_then(Value::as_u64),
    );
    let cancel = CancellationToken::new();
    let prepared = front
        .prepare_call(principal, session, tool, arguments, &meta, &cancel)
        .map_err(|e| (i64::from(e.code.0), e.message.to_string()))?;
    let owner = principal.key();
    let (call, pending) = match prepared {
        Prepared::Refused(result) => {
            let task = tasks
                .insert(&owner, None, tool, ttl, cancel)
                .map_err(full)?;
            task.set(State::Completed(to_value(&result)?));
            return Ok(json!({ "task": task.wire() }));
        }
        Prepared::Step { call, pending } => (call, pending),
    };
    // The task's cancellation is what a session's retry looks at.
    let (task, was_published) =
        for_step(front, &owner, tool, call, pending, ttl, cancel).map_err(full)?;
    // Once the step is stepgate's, the client may stop waiting on this
    // request; a failed publish completes the task with what failed.
    if let Some(was_published) = was_published {
        let _ = tokio::time::timeout(PUBLISH_WAIT, was_published).await;
    }
    Ok(json!({ "task": task.wire() }))
}

/// The task of `call`'s step: the live one `owner` has for it already (a
/// call that names its step, made again: a re-issue after a broken stream
/// attaches to it rather than waiting twice), or a new one waiting for the
/// answer, with a receiver told once the step is on the intents topic
/// (dropped unsent if the publish failed). A session-numbered call
/// (`pending`) always has a task of its own.
pub(super) fn for_step(
    front: &McpFront,
    owner: &str,
    tool: &str,
    call: StepCall,
    pending: Option<Pending>,
    ttl: Duration,
    cancel: CancellationToken,
) -> Result<(Arc<Task>, Option<oneshot::Receiver<()>>), Full> {
    let step = pending.is_none().then(|| call.step_key().to_string());
    if let Some(task) = step
        .as_deref()
        .and_then(|step| front.shared.tasks.of_step(owner, step))
        .filter(|task| task.live())
    {
        return Ok((task, None));
    }
    let task = front.shared.tasks.insert(owner, step, tool, ttl, cancel)?;
    let (published, was_published) = oneshot::channel();
    let waiting = task.clone();
    let front = front.clone();
    let tool = tool.to_owned();
    tokio::spawn(async move {
        let call = call.timeout(waiting.ttl);
        tokio::select! {
            answer = front.answer(&tool, call, pending, Some(published)) => {
                let state = match answer.map_err(|e| e.message.to_string()).and_then(|r| {
                    serde_json::to_value(&r).map_err(|e| e.to_string())
                }) {
                    Ok(result) => State::Completed(result),
                    Err(e) => State::Completed(json!({
                        "content": [{"type": "text", "text": format!(
                            "stepgate's answer to this call of `{tool}` could not be read ({e}). \
                             Repeat the call for the same step to get its answer.")}],
                        "isError": true,
                    })),
                };
                waiting.set(state);
            }
            // Cancelled: a session-numbered step is left for the retry.
            _ = waiting.cancel.cancelled() => {}
        }
    });
    Ok((task, Some(was_published)))
}

pub(super) fn full(f: Full) -> (i64, String) {
    let text = match f {
        Full::Full(max) => format!(
            "This call was not performed: this server already holds its most tasks ({max}, \
             mcp.max_tasks), each still waiting for its answer. Call the tool again later, or \
             without asking for a task."
        ),
        Full::Principal(max) => format!(
            "This call was not performed: this caller already has its most tasks waiting for \
             their answers on this server ({max}, mcp.max_tasks_per_principal). Call the tool \
             again once some of them have finished (tasks/get or tasks/result reads them), or \
             without asking for a task."
        ),
    };
    (INTERNAL_ERROR, text)
}

fn to_value(result: &rmcp::model::CallToolResult) -> Outcome {
    serde_json::to_value(result).map_err(|e| (INTERNAL_ERROR, e.to_string()))
}

/// `tasks/cancel`: the task stops waiting; the step, handed over already, is
/// not undone.
fn cancel(task: &Task) -> Outcome {
    if task.set(State::Cancelled) {
        task.cancel.cancel();
        Ok(task.wire())
    } else {
        Err((
            INVALID_PARAMS,
            format!(
                "Task `{}` is already {} and cannot be cancelled.",
                task.id,
                task.state.borrow().name()
            ),
        ))
    }
}

/// `tasks/result`: the call's result once the task is done (waiting for it
/// until then).
async fn result(task: &Task) -> Outcome {
    let mut rx = task.state.subscribe();
    let state = rx
        .wait_for(|s| !matches!(s, State::Working))
        .await
        .map(|s| s.clone())
        .map_err(|e| (INTERNAL_ERROR, e.to_string()))?;
    match state {
        State::Completed(mut result) => {
            if let Some(r) = result.as_object_mut() {
                let meta = r.entry("_meta").or_insert_with(|| json!({}));
                if let Some(meta) = meta.as_object_mut() {
                    meta.insert(RELATED_TASK.into(), json!({"taskId": task.id}));
                }
            }
            Ok(result)
        }
        _ => Err((
            INVALID_PARAMS,
            format!(
                "Task `{}` was cancelled, so it has no result. Its call had been handed to \
                 stepgate and may still take effect: repeat the call for the same step to get \
                 the step's answer.",
                task.id
            ),
        )),
    }
}

/// What a response to `method` says once it announces the tasks: the
/// `initialize` result's `capabilities.tasks` (for 2025-11-25), each tool's
/// `execution.taskSupport` in `tools/list`.
pub fn amend(method: &str, message: &mut Value) {
    let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) else {
        return;
    };
    match method {
        "initialize" => {
            if result.get("protocolVersion").and_then(Value::as_str) != Some(TASKS_PROTOCOL) {
                return;
            }
            if let Some(caps) = result
                .get_mut("capabilities")
                .and_then(Value::as_object_mut)
            {
                caps.insert(
                    "tasks".into(),
                    json!({"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}),
                );
            }
        }
        "tools/list" => {
            if let Some(tools) = result.get_mut("tools").and_then(Value::as_array_mut) {
                for tool in tools.iter_mut().filter_map(Value::as_object_mut) {
                    tool.insert("execution".into(), json!({"taskSupport": "optional"}));
                }
            }
        }
        _ => {}
    }
}

/// `response` (rmcp's to a `method` request), amended by [`amend`]: a JSON
/// body, or the events of a `text/event-stream`, rewritten as they pass.
pub async fn amend_response(method: &'static str, response: Response) -> Response {
    use futures::StreamExt as _;
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let (mut parts, body) = response.into_parts();
    if content_type.starts_with("application/json") {
        let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
            return StatusCode::BAD_GATEWAY.into_response();
        };
        let bytes = match serde_json::from_slice::<Value>(&bytes) {
            Ok(mut v) => {
                amend(method, &mut v);
                Bytes::from(serde_json::to_vec(&v).unwrap_or_else(|_| bytes.to_vec()))
            }
            Err(_) => bytes,
        };
        parts.headers.remove(header::CONTENT_LENGTH);
        return Response::from_parts(parts, Body::from(bytes));
    }
    if !content_type.starts_with("text/event-stream") {
        return Response::from_parts(parts, body);
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    // Whole events only (each ends with a blank line), as they come.
    let events = futures::stream::unfold(
        (body.into_data_stream(), Vec::<u8>::new(), false),
        move |(mut inner, mut pending, done)| async move {
            if done {
                return None;
            }
            loop {
                match inner.next().await {
                    Some(Ok(chunk)) => {
                        pending.extend_from_slice(&chunk);
                        let mut out = Vec::new();
                        while let Some(end) = find_event_end(&pending) {
                            let event: Vec<u8> = pending.drain(..end).collect();
                            out.extend_from_slice(&amend_event(method, &event));
                        }
                        if !out.is_empty() {
                            return Some((Ok(Bytes::from(out)), (inner, pending, false)));
                        }
                    }
                    Some(Err(e)) => return Some((Err(e), (inner, pending, true))),
                    None if pending.is_empty() => return None,
                    None => {
                        let rest = Bytes::from(amend_event(method, &pending));
                        return Some((Ok::<_, axum::Error>(rest), (inner, Vec::new(), true)));
                    }
                }
            }
        },
    );
    Response::from_parts(parts, Body::from_stream(events))
}

/// The end (past its blank line) of the first whole event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One event, its `data` amended when it is a JSON-RPC result.
fn amend_event(method: &str, event: &[u8]) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(event) else {
        return event.to_vec();
    };
    let mut out = String::with_capacity(text.len() + 64);
    for line in text.split_inclusive('\n') {
        let (content, ending) = match line.strip_suffix("\r\n") {
            Some(c) => (c, "\r\n"),
            None => match line.strip_suffix('\n') {
                Some(c) => (c, "\n"),
                None => (line, ""),
            },
        };
        if let Some(data) = content.strip_prefix("data:")
            && let Ok(mut v) = serde_json::from_str::<Value>(data.trim_start())
            && v.get("result").is_some()
        {
            amend(method, &mut v);
            out.push_str("data: ");
            out.push_str(&v.to_string());
            out.push_str(ending);
        } else {
            out.push_str(line);
        }
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stream_is_amended_event_by_event() {
        let init = json!({"jsonrpc": "2.0", "id": 1, "result": {
            "protocolVersion": "2025-11-25", "capabilities": {"tools": {}}}});
        let event = format!("id: 0\ndata: {init}\n\n");
        let out = String::from_utf8(amend_event("initialize", event.as_bytes())).unwrap();
        assert!(out.starts_with("id: 0\ndata: {"), "{out}");
        let data: Value =
            serde_json::from_str(out.lines().find_map(|l| l.strip_prefix("data: ")).unwrap())
                .unwrap();
        assert_eq!(
            data["result"]["capabilities"]["tasks"]["requests"]["tools"]["call"],
            json!({})
        );
        // An older revision is not told of tasks it does not have.
        let mut old = init.clone();
        old["result"]["protocolVersion"] = json!("2025-06-18");
        amend("initialize", &mut old);
        assert!(old["result"]["capabilities"].get("tasks").is_none());
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some(9));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some(11));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }

    #[test]
    fn the_2025_tasks_are_answered_here_and_the_extensions_by_rmcp() {
        let get =
            json!({"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"taskId": "x"}});
        let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "t", "task": {"ttl": 1000}}});
        let plain =
            json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "t"}});
        assert!(is_ours(&get, Some("2025-11-25")) && is_ours(&get, None));
        assert!(is_ours(&call, Some("2025-11-25")));
        assert!(!is_ours(&plain, Some("2025-11-25")));
        assert!(!is_ours(&get, Some("2026-07-28")) && !is_ours(&call, Some("2026-07-28")));
    }

    #[test]
    fn tools_are_listed_as_taking_tasks() {
        let mut list = json!({"jsonrpc": "2.0", "id": 2, "result": {"tools": [{"name": "a"}]}});
        amend("tools/list", &mut list);
        assert_eq!(
            list["result"]["tools"][0]["execution"]["taskSupport"],
            "optional"
        );
    }

    #[test]
    fn a_task_is_its_owners_and_room_is_made_only_from_finished_ones() {
        let tasks = Tasks::new(2, 10, Duration::from_secs(3600), Duration::from_secs(60));
        let insert = |step: Option<&str>| {
            let ttl = tasks.ttl_for(None);
            tasks.insert(
                "alice",
                step.map(str::to_owned),
                "t",
                ttl,
                CancellationToken::new(),
            )
        };
        let a = insert(Some("wf/0")).ok().unwrap();
        assert!(tasks.get("bob", &a.id).is_none());
        assert!(tasks.get("alice", &a.id).is_some());
        assert_eq!(tasks.of_step("alice", "wf/0").unwrap().id, a.id);
        assert!(tasks.of_step("bob", "wf/0").is_none());
        let b = insert(None).ok().unwrap();
        // Both working: no room is made by dropping one.
        assert!(insert(None).is_err());
        assert!(a.set(State::Completed(json!({"content": []}))));
        assert!(!a.set(State::Cancelled), "a finished task stays finished");
        let c = insert(None).ok().unwrap();
        assert!(
            tasks.get("alice", &a.id).is_none(),
            "the finished one made room"
        );
        assert!(tasks.of_step("alice", "wf/0").is_none());
        assert!(tasks.get("alice", &b.id).is_some() && tasks.get("alice", &c.id).is_some());
    }

    #[test]
    fn one_principal_holds_at_most_its_share_of_working_tasks() {
        let tasks = Tasks::new(10, 2, Duration::from_secs(3600), Duration::from_secs(60));
        let insert = |owner: &str| {
            tasks.insert(
                owner,
                None,
                "t",
                tasks.ttl_for(None),
                CancellationToken::new(),
            )
        };
        let a = insert("alice").unwrap();
        insert("alice").unwrap();
        assert!(matches!(insert("alice"), Err(Full::Principal(2))));
        // Another principal is not affected.
        insert("bob").unwrap();
        // A finished task no longer counts.
        assert!(a.set(State::Completed(json!({"content": []}))));
        insert("alice").unwrap();
        assert!(
            full(Full::Principal(2))
                .1
                .contains("mcp.max_tasks_per_principal")
        );
    }

    #[test]
    fn a_requested_ttl_is_kept_within_bounds() {
        let tasks = Tasks::new(10, 10, Duration::from_secs(3600), Duration::from_secs(120));
        assert_eq!(tasks.ttl_for(None), Duration::from_secs(3600));
        assert_eq!(tasks.ttl_for(Some(1000)), Duration::from_secs(120));
        assert_eq!(tasks.ttl_for(Some(600_000)), Duration::from_secs(600));
        assert_eq!(tasks.ttl_for(Some(u64::MAX)), Duration::from_secs(3600));
    }
}
