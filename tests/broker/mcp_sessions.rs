//! The MCP front's sessions, against the real broker: `stepgate mcp --listen`
//! driven with raw Streamable HTTP requests (so that thousands of sessions
//! can be opened quickly), a tool of the test's tool server behind it that
//! records every raw invocation. Calls without `_meta` are numbered by their
//! session: a session must keep its count however many others come and go,
//! and a session the front no longer knows must be refused, never numbered
//! from step 0 again (step 0's answer would come back, nothing run).

use crate::common;

use common::*;
use futures::StreamExt as _;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const PROTOCOL: &str = "2025-11-25";
const TOOL: &str = "send_email";

/// An HTTP answer: status, `Retry-After`, `Mcp-Session-Id`, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    session: Option<String>,
    body: String,
}

impl Answer {
    /// The JSON-RPC message answering request `id` (the body is JSON, or
    /// an SSE stream whose `data:` lines are).
    fn reply(&self, id: u64) -> Option<Value> {
        let candidates: Vec<&str> = if self.body.trim_start().starts_with('{') {
            vec![self.body.as_str()]
        } else {
            self.body
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .collect()
        };
        candidates
            .into_iter()
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|v| v["id"] == json!(id))
    }
}

/// A raw Streamable HTTP client of one front.
#[derive(Clone)]
struct Raw {
    http: reqwest::Client,
    url: String,
}

impl Raw {
    fn new(port: u16) -> Raw {
        Raw {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }

    async fn send(
        &self,
        method: reqwest::Method,
        session: Option<&str>,
        body: Option<Value>,
    ) -> Answer {
        let mut r = self
            .http
            .request(method, &self.url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", PROTOCOL);
        if let Some(s) = session {
            r = r.header("mcp-session-id", s);
        }
        if let Some(b) = body {
            r = r
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = r.send().await.expect("the front answers");
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let (retry_after, session) = (header("retry-after"), header("mcp-session-id"));
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap_or_default();
        Answer {
            status,
            retry_after,
            session,
            body,
        }
    }

    async fn post(&self, session: Option<&str>, body: Value) -> Answer {
        self.send(reqwest::Method::POST, session, Some(body)).await
    }

    /// `initialize`: the new session's id, or the refusal.
    async fn open(&self) -> Result<String, Answer> {
        let a = self
            .post(
                None,
                json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": PROTOCOL,
                    "capabilities": {},
                    "clientInfo": {"name": "stepgate-sessions-test", "version": "0"},
                }}),
            )
            .await;
        match (&a.session, a.status) {
            (Some(id), 200) => Ok(id.clone()),
            _ => Err(a),
        }
    }

    /// `initialize` and `notifications/initialized`: a session ready for calls.
    async fn open_ready(&self) -> String {
        let id = self.open().await.expect("a session opens");
        let a = self
            .post(
                Some(&id),
                json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            )
            .await;
        assert_eq!(a.status, 202, "{a:?}");
        id
    }

    /// `tools/call` of [`TOOL`] without `_meta`, in `session`.
    async fn call(&self, session: &str, id: u64, args: Value) -> Answer {
        self.post(
            Some(session),
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                   "params": {"name": TOOL, "arguments": args}}),
        )
        .await
    }

    async fn ping(&self, session: &str) -> Answer {
        self.post(
            Some(session),
            json!({"jsonrpc": "2.0", "id": 7, "method": "ping"}),
        )
        .await
    }

    /// `DELETE`: 204 when the session was open (the MCP SDKs take 200 or 204
    /// as closed, and log anything else as a failure).
    async fn close(&self, session: &str) -> Answer {
        self.send(reqwest::Method::DELETE, Some(session), None)
            .await
    }
}

async fn wait_listening(port: u16, log: &std::path::Path) {
    eventually(Duration::from_secs(60), "stepgate mcp listens", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(!text.contains("error:"), "{text}");
}

/// A session's calls, each checked to have got its own answer: step `n` of
/// the session's workflow, run now (not a repeat), on the arguments it sent.
struct Calls {
    made: u64,
}

impl Calls {
    async fn next(&mut self, raw: &Raw, session: &str, logs: &dyn Fn() -> String) {
        let n = self.made;
        let a = raw.call(session, 100 + n, json!({"to": "a", "n": n})).await;
        let reply = a.reply(100 + n);
        let result = reply
            .as_ref()
            .map(|r| r["result"].clone())
            .unwrap_or_default();
        assert_eq!(a.status, 200, "call {n}: {a:?}\n{}", logs());
        assert_eq!(result["isError"], false, "call {n}: {a:?}\n{}", logs());
        let meta = &result["_meta"];
        assert_eq!(meta["stepgate/step_index"], json!(n), "call {n}: {result}");
        assert_eq!(meta["stepgate/deduplicated"], false, "call {n}: {result}");
        assert_eq!(
            meta["stepgate/workflow_id"],
            json!(format!("mcp-{session}")),
            "call {n}: {result}"
        );
        assert_eq!(
            result["structuredContent"]["echo"]["n"],
            json!(n),
            "call {n} got another call's answer: {result}"
        );
        self.made += 1;
    }
}

/// What the tool was invoked with: the `n` of each raw invocation, in order.
fn invoked(s: &Stack) -> Vec<Value> {
    s.tools
        .calls(TOOL)
        .iter()
        .map(|c| c.body["n"].clone())
        .collect()
}

fn refused_as_unknown(a: &Answer) -> bool {
    a.status == 404
        && a.body
            .contains("this MCP session is not open on this server")
        && a.body.contains("Nothing in this request was performed")
        && a.body.contains("Start a new MCP session")
}

/// One session outlives 10 500 others at the default `mcp.max_sessions`
/// (10 000): some opened and closed, most opened and left idle, until the
/// cap is reached; a new session is then refused (503) rather than an open
/// one closed, and a closed one frees its place. All along, each of the one
/// session's calls (no `_meta`: numbered by the session) runs the tool once
/// and gets its own answer — never an earlier step's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_session_outlives_10500_others_and_each_of_its_calls_runs_once() {
    let work = tempfile::tempdir().unwrap();
    let mut s = Stack::new(StackOptions {
        configure: |c| {
            // One (anonymous) principal opens every session here: its own
            // limits are lifted, the front's cap is the default.
            c.mcp.max_sessions_per_principal = 1_000_000;
            c.mcp.requests_per_second = 1_000_000;
            c.mcp.burst = 1_000_000;
        },
        ..StackOptions::default()
    })
    .await;
    let cap = s.config.mcp.max_sessions as usize;
    assert_eq!(
        cap,
        stepgate::config::McpConfig::default().max_sessions as usize
    );
    assert_eq!(cap, 10_000);
    s.start().await;
    let port = free_port();
    let log = work.path().join("mcp-front.log");
    let _front = start_mcp_front(&s, port, &log);
    wait_listening(port, &log).await;
    let logs = || {
        let front = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = front.lines().rev().take(40).collect();
        format!(
            "--- mcp front (last lines) ---\n{}\n--- gate ---\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            s.log_tail(40)
        )
    };
    let raw = Raw::new(port);
    let started = Instant::now();

    let a = raw.open_ready().await;
    let mut calls = Calls { made: 0 };
    calls.next(&raw, &a, &logs).await;

    // Others, 250 at a time (8 at once), the first 25 of each batch closed
    // again; a call of the one session after each batch.
    let mut idle: Vec<String> = Vec::new();
    let mut closed = 0usize;
    while idle.len() + closed < 10_500 {
        let opened: Vec<Result<String, Answer>> = futures::stream::iter(0..250)
            .map(|_| {
                let raw = raw.clone();
                async move { raw.open().await }
            })
            .buffer_unordered(8)
            .collect()
            .await;
        for (i, o) in opened.into_iter().enumerate() {
            let id = o.unwrap_or_else(|a| {
                panic!(
                    "a session refused with {} open: {a:?}\n{}",
                    idle.len() + 1,
                    logs()
                )
            });
            if i < 25 {
                let d = raw.close(&id).await;
                assert_eq!(d.status, 204, "DELETE: {d:?}");
                closed += 1;
            } else {
                idle.push(id);
            }
        }
        calls.next(&raw, &a, &logs).await;
    }
    println!(
        "{} sessions opened, {closed} closed again, {} left idle, in {:?}",
        idle.len() + closed,
        idle.len(),
        started.elapsed()
    );

    // Fill up to the cap, one at a time: the one session and `cap - 1` others.
    while idle.len() + 1 < cap {
        match raw.open().await {
            Ok(id) => idle.push(id),
            Err(a) => panic!(
                "a session refused with {} open: {a:?}\n{}",
                idle.len() + 1,
                logs()
            ),
        }
    }
    calls.next(&raw, &a, &logs).await;
    // At the cap, every session used within the idle bound: refused, and
    // nothing open is closed for it.
    let refused = raw.open().await.expect_err("a session beyond the cap");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(
        refused.body.contains("does not close a session in use")
            && refused.body.contains("nothing was performed"),
        "{refused:?}"
    );
    let wait: u64 = refused
        .retry_after
        .as_deref()
        .and_then(|r| r.parse().ok())
        .expect("Retry-After in seconds");
    assert!(wait > 60 && wait <= 30 * 60, "Retry-After {wait}");
    // The least recently used session is still open, and so is the newest.
    for id in [&idle[0], idle.last().unwrap()] {
        let p = raw.ping(id).await;
        assert_eq!(p.status, 200, "an open session was closed: {p:?}");
    }
    calls.next(&raw, &a, &logs).await;
    // A closed session frees its place at once.
    let d = raw.close(&idle.pop().unwrap()).await;
    assert_eq!(d.status, 204, "{d:?}");
    idle.push(raw.open().await.expect("a place freed by a DELETE"));
    calls.next(&raw, &a, &logs).await;

    // At the tool: one raw invocation per call, each on its own arguments,
    // in order.
    let made = calls.made;
    let expected: Vec<Value> = (0..made).map(|n| json!(n)).collect();
    assert_eq!(invoked(&s), expected, "{}", logs());
    println!(
        "{} others opened ({} left open), the one session's {made} calls each ran once, in {:?}",
        idle.len() + closed + 1,
        idle.len(),
        started.elapsed()
    );
}

/// A session the front no longer knows — evicted after being idle at the
/// cap, closed by a DELETE, opened before a restart of `stepgate mcp`, or
/// never opened — is refused with a text saying what happened and what to
/// do (404), and nothing runs: never an earlier step's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_or_evicted_mcp_session_is_refused_never_answered_from_an_old_step() {
    let work = tempfile::tempdir().unwrap();
    let mut s = Stack::new(StackOptions {
        configure: |c| {
            c.mcp.max_sessions = 3;
            c.mcp.session_idle_timeout = stepgate::config::Dur(Duration::from_secs(8));
            c.mcp.max_sessions_per_principal = 1_000;
            c.mcp.requests_per_second = 100_000;
            c.mcp.burst = 100_000;
        },
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let port = free_port();
    let log = work.path().join("mcp-front-1.log");
    let mut front = start_mcp_front(&s, port, &log);
    wait_listening(port, &log).await;
    let logs = || {
        format!(
            "--- mcp front ---\n{}\n--- gate ---\n{}",
            std::fs::read_to_string(&log).unwrap_or_default(),
            s.log_tail(40)
        )
    };
    let raw = Raw::new(port);

    // Session b: two calls, two steps, the tool ran twice.
    let b = raw.open_ready().await;
    let mut b_calls = Calls { made: 0 };
    b_calls.next(&raw, &b, &logs).await;
    b_calls.next(&raw, &b, &logs).await;
    assert_eq!(invoked(&s), vec![json!(0), json!(1)]);

    // A session that was never opened.
    let never = raw
        .call("0123456789abcdef0123456789abcdef", 1, json!({"n": 99}))
        .await;
    assert!(refused_as_unknown(&never), "{never:?}");

    // The cap (3) reached with sessions in use: a fourth is refused, and b
    // stays open with its count.
    let c1 = raw.open().await.expect("c1");
    let _c2 = raw.open().await.expect("c2");
    assert_eq!(raw.ping(&b).await.status, 200);
    let full = raw.open().await.expect_err("beyond the cap");
    assert_eq!(full.status, 503, "{full:?}");
    assert!(full.retry_after.is_some(), "{full:?}");
    b_calls.next(&raw, &b, &logs).await;
    assert_eq!(raw.ping(&c1).await.status, 200, "c1 was closed");

    // Once b and the others have been idle for the bound, they go for new
    // sessions (least recently used first).
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut newer = Vec::new();
    while newer.len() < 3 {
        match raw.open().await {
            Ok(id) => newer.push(id),
            Err(a) if a.status == 503 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(a) => panic!("no session opened: {a:?}\n{}", logs()),
        }
    }
    let before = invoked(&s);
    let evicted = raw.call(&b, 50, json!({"to": "a", "n": 0})).await;
    assert!(
        refused_as_unknown(&evicted),
        "an evicted session's call: {evicted:?}\n{}",
        logs()
    );
    assert!(
        evicted.reply(50).is_none(),
        "an evicted session got an answer: {evicted:?}"
    );
    assert_eq!(invoked(&s), before, "nothing ran for the evicted session");
    for id in &newer {
        let _ = raw.close(id).await;
    }

    // Closed by a DELETE.
    let d = raw.open_ready().await;
    let mut d_calls = Calls { made: 0 };
    d_calls.next(&raw, &d, &logs).await;
    assert_eq!(raw.close(&d).await.status, 204);
    let after_delete = raw.call(&d, 51, json!({"to": "a", "n": 0})).await;
    assert!(refused_as_unknown(&after_delete), "{after_delete:?}");

    // Opened before a restart of `stepgate mcp`: its step 0 is answered in
    // Kafka, and a front that numbered it from 0 again would hand that back.
    let f = raw.open_ready().await;
    let mut f_calls = Calls { made: 0 };
    f_calls.next(&raw, &f, &logs).await;
    let before_restart = invoked(&s);
    drop(front);
    let log2 = work.path().join("mcp-front-2.log");
    front = start_mcp_front(&s, port, &log2);
    wait_listening(port, &log2).await;
    // A new client: the old one's connections were to the stopped process.
    let raw = Raw::new(port);
    let after_restart = raw.call(&f, 52, json!({"to": "a", "n": 0})).await;
    assert!(refused_as_unknown(&after_restart), "{after_restart:?}");
    assert!(after_restart.reply(52).is_none(), "{after_restart:?}");
    assert_eq!(invoked(&s), before_restart, "nothing ran after the restart");
    // A new session on the restarted front: its own steps from 0.
    let g = raw.open_ready().await;
    let mut g_calls = Calls { made: 0 };
    g_calls.next(&raw, &g, &logs).await;
    assert_eq!(invoked(&s).len(), before_restart.len() + 1);
    drop(front);
}
