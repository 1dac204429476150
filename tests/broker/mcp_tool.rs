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
