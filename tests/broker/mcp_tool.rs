//! An MCP tool behind stepgate, against the real broker: every call to one MCP
//! server shares one MCP session, so one call's timeout must give up only its
//! own request. The tool server is FastMCP (`tests/interop/mcp_tool_server.py`):
//! `held_ticket` answers once the test releases it, `stuck_ticket` never
//! answers in time.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use std::time::Duration;
use stepgate::contract::Status;

const HELD: u64 = 19;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_mcp_call_timing_out_leaves_the_others_their_answers() {
    let root = env!("CARGO_MANIFEST_DIR");
    let work = tempfile::tempdir().unwrap();
    let counts = work.path().join("counts.json");
    let release = work.path().join("counts.json.release");
    let tool_port = free_port();
    let _tool_server = Killed(
        Command::new("python3")
            .arg(format!("{root}/tests/interop/mcp_tool_server.py"))
            .arg(tool_port.to_string())
            .arg(&counts)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(work.path().join("tool-server.log")).unwrap())
            .spawn()
            .expect("python3 runs"),
    );
    eventually(
        Duration::from_secs(60),
        "the FastMCP tool server listens",
        || std::net::TcpStream::connect(("127.0.0.1", tool_port)).is_ok(),
    )
    .await;

    // Two tools of one MCP server: one session carries the calls of both.
    // Both unkeyed, no retries: a call cut off is answered in_doubt.
    let tool_tables = format!(
        r#"
[tools.held_ticket]
category = "unkeyed"
mcp = "http://127.0.0.1:{tool_port}/mcp"
timeout = "60s"
retries = 0

[tools.stuck_ticket]
category = "unkeyed"
mcp = "http://127.0.0.1:{tool_port}/mcp"
timeout = "1s"
retries = 0
"#
    );
    let mut s = Stack::new(StackOptions {
        tools: vec![],
        tool_tables,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let held = |counts: &std::path::Path| -> usize {
        std::fs::read_to_string(counts)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["held"].as_array().map(Vec::len))
            .unwrap_or(0)
    };

    // 19 calls in flight at the tool, on the shared session...
    for i in 0..HELD {
        let args = json!({"title": format!("held {i}")});
        agent
            .send(&intent(
                "wf-mcp",
                i,
                "held_ticket",
                args,
                &format!("held-{i}"),
            ))
            .await;
    }
    eventually(
        Duration::from_secs(60),
        "19 calls are in flight at the MCP tool",
        || held(&counts) >= HELD as usize,
    )
    .await;
    // ... then a 20th on the same session times out.
    agent
        .send(&intent(
            "wf-mcp",
            HELD,
            "stuck_ticket",
            json!({"title": "stuck"}),
            "stuck",
        ))
        .await;
    let stuck = agent.answer("stuck", Duration::from_secs(60)).await;
    assert_eq!(
        stuck.status,
        Status::InDoubt,
        "the call that timed out: {stuck:?}"
    );
    // The others are still running at the tool: release them.
    std::fs::write(&release, b"").unwrap();
    let mut wrong = Vec::new();
    for i in 0..HELD {
        let r = agent
            .answer(&format!("held-{i}"), Duration::from_secs(60))
            .await;
        let title = format!("held {i}");
        let real = r.status == Status::Ok
            && r.output
                .as_ref()
                .is_some_and(|o| o["held"] == title.as_str());
        if !real {
            wrong.push(format!("held-{i}: {:?} {:?}", r.status, r.error));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {HELD} calls on the shared MCP session did not get their real answer after one call timed out:\n{}\n--- tool server ---\n{}\n--- gate ---\n{}",
        wrong.len(),
        wrong.join("\n"),
        std::fs::read_to_string(work.path().join("tool-server.log")).unwrap_or_default(),
        s.log_tail(40)
    );
    assert_eq!(held(&counts), HELD as usize, "each held call invoked once");
}

/// The credential the tools below send (as a configured header), which the
/// careless MCP server echoes.
const ECHOED_SECRET: &str = "sk-live-ECHOED-0123456789abcdef";

/// A minimal Streamable HTTP MCP server that answers every `tools/call` the
/// careless way: it quotes the `x-api-key` it was sent, in a JSON-RPC
/// internal error (`leak_internal`), a refusal (`leak_refused`), or a result
/// marked `isError` (`leak_result`), each padded to 20 000 characters.
async fn echoing_mcp_server() -> u16 {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    async fn mcp(headers: HeaderMap, body: String) -> axum::response::Response {
        let key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let Ok(req) = serde_json::from_str::<Value>(&body) else {
            return StatusCode::BAD_REQUEST.into_response();
        };
        let Some(id) = req.get("id").cloned() else {
            return StatusCode::ACCEPTED.into_response();
        };
        let padding = "x".repeat(20_000);
        let reply = match (req["method"].as_str(), req["params"]["name"].as_str()) {
            (Some("initialize"), _) => json!({"result": {
                "protocolVersion": "2025-06-18",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "careless", "version": "0"}}}),
            (Some("tools/call"), Some("leak_internal")) => json!({"error": {
                "code": -32603, "message": format!("bad key {key}"),
                "data": {"authorization": format!("Bearer {key}"), "trace": padding}}}),
            (Some("tools/call"), Some("leak_refused")) => json!({"error": {
                "code": -32602, "message": format!("invalid api key {key} {padding}")}}),
            (Some("tools/call"), Some("leak_result")) => json!({"result": {
                "content": [{"type": "text", "text": format!("rejected key {key} {padding}")}],
                "isError": true}}),
            _ => json!({"error": {"code": -32601, "message": "no such method"}}),
        };
        let mut reply = reply;
        reply["jsonrpc"] = json!("2.0");
        reply["id"] = id;
        axum::Json(reply).into_response()
    }
    let app = axum::Router::new().route(
        "/mcp",
        axum::routing::post(mcp).get(|| async { StatusCode::METHOD_NOT_ALLOWED }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// An MCP tool's error texts reach the model and the results topic as the
/// HTTP path's refusals do: the tool's own credential, echoed by the server,
/// redacted, and the text cut to a bounded excerpt — for a JSON-RPC internal
/// error (in doubt), a refusal, and a result marked `isError`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tool_error_texts_carry_no_secret_and_are_bounded() {
    let port = echoing_mcp_server().await;
    let table = |name: &str| {
        format!(
            r#"
[tools.{name}]
category = "unkeyed"
mcp = "http://127.0.0.1:{port}/mcp"
timeout = "10s"
retries = 0
headers = {{ "x-api-key" = "{ECHOED_SECRET}" }}
"#
        )
    };
    let mut s = Stack::new(StackOptions {
        tools: vec![],
        tool_tables: ["leak_internal", "leak_refused", "leak_result"]
            .map(table)
            .concat(),
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    for (i, (tool, status, kind)) in [
        ("leak_internal", Status::InDoubt, "outcome_unknown"),
        ("leak_refused", Status::Error, "tool_refused"),
        ("leak_result", Status::Error, "tool_error"),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = agent
            .call(intent("wf-leak", i as u64, tool, json!({}), tool))
            .await;
        let error = answer.error.clone().expect("an error");
        assert_eq!(
            answer.status,
            status,
            "{tool}: {answer:?}\n{}",
            s.log_tail(40)
        );
        assert_eq!(error.kind, kind, "{tool}: {answer:?}");
        assert!(
            !error.message.contains(ECHOED_SECRET) && !error.message.contains("ECHOED-0123456789"),
            "{tool} shows the credential: {}",
            error.message.chars().take(600).collect::<String>()
        );
        assert!(
            error.message.contains("bad key") || error.message.contains(" key "),
            "{tool}: the server's words are still there: {}",
            error.message
        );
        assert!(
            error.message.chars().count() < 1_000,
            "{tool}: a text of {} characters",
            error.message.chars().count()
        );
    }
}
