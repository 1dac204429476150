//! MCP both ways, against the real broker: `stepgate mcp` driven by the official
//! `mcp` Python SDK's client (Streamable HTTP and stdio), with an existing MCP
//! server (FastMCP) as a tool behind stepgate (`mcp = "…"`). The tool server
//! records every raw invocation with its key and deduplicates by key, so both a
//! repeated invocation and a repeated effect would show.

mod common;

use common::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process killed when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_listening(port: u16, what: &str) {
    eventually(Duration::from_secs(60), what, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_clients_and_mcp_tools_get_one_invocation_per_step() {
    let root = env!("CARGO_MANIFEST_DIR");
    let work = tempfile::tempdir().unwrap();
    let counts = work.path().join("counts.json");
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
    wait_listening(tool_port, "the FastMCP tool server listens").await;

    let tool_tables = format!(
        r#"
[tools.create_ticket]
category = "keyed"
mcp = "http://127.0.0.1:{tool_port}/mcp"
timeout = "10s"
retries = 1
backoff = "50ms"
description = "Open a support ticket."
input_schema = {{ type = "object", properties = {{ title = {{ type = "string" }} }}, required = ["title"] }}
"#
    );
    let mut s = Stack::new(StackOptions {
        tools: vec![("search", "read_only", "5s")],
        tool_tables,
        ..StackOptions::default()
    })
    .await;
    s.start().await;

    let mcp_port = free_port();
    let config = s.config_path.display().to_string();
    let _front = Killed(
        Command::new(stepgate_bin())
            .args(["mcp", "--config", &config, "--listen"])
            .arg(format!("127.0.0.1:{mcp_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(work.path().join("mcp-front.log")).unwrap())
            .spawn()
            .expect("stepgate binary starts"),
    );
    wait_listening(mcp_port, "stepgate mcp listens").await;

    let out = Command::new("python3")
        .arg(format!("{root}/tests/interop/mcp_client.py"))
        .arg(format!("http://127.0.0.1:{mcp_port}/mcp"))
        .arg(stepgate_bin())
        .arg(&config)
        .output()
        .unwrap();
    let logs = || {
        format!(
            "--- mcp front ---\n{}\n--- tool server ---\n{}\n--- gate ---\n{}",
            std::fs::read_to_string(work.path().join("mcp-front.log")).unwrap_or_default(),
            std::fs::read_to_string(work.path().join("tool-server.log")).unwrap_or_default(),
            s.log_tail(60)
        )
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mcp_client.py:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs()
    );
    let r: Value = serde_json::from_str(stdout.trim()).unwrap();
    println!(
        "MCP protocol over HTTP {}, over stdio {}; a call without _meta over HTTP: {}",
        r["http_protocol"], r["stdio_protocol"], r["no_meta_http"]
    );

    // The tool list: configured description and schema; annotations from the category.
    let tools = &r["tools"];
    assert_eq!(
        tools["create_ticket"]["description"],
        "Open a support ticket."
    );
    assert_eq!(
        tools["create_ticket"]["schema"]["required"],
        json!(["title"])
    );
    assert_eq!(
        tools["create_ticket"]["annotations"]["readOnlyHint"], false,
        "{r}"
    );
    assert_eq!(tools["search"]["annotations"]["readOnlyHint"], true, "{r}");

    let text = |k: &str| r[k]["text"][0].as_str().unwrap_or_default().to_owned();
    let ticket = |k: &str| r[k]["structured"]["ticket"].as_i64();
    // A rephrased repeat of step 0 reads exactly as the first answer.
    assert_eq!(r["first"]["is_error"], false, "{r}");
    assert_eq!(r["first"]["structured"]["title"], "Printer jammed");
    assert_eq!(r["again"]["text"], r["first"]["text"]);
    assert_eq!(r["again"]["structured"], r["first"]["structured"]);
    assert_eq!(r["again"]["is_error"], false);
    assert_eq!(r["first"]["meta"]["stepgate/deduplicated"], false);
    assert_eq!(r["again"]["meta"]["stepgate/deduplicated"], true);
    assert_eq!(r["again"]["meta"]["stepgate/step_index"], 0);
    // Identical arguments, two steps: two tickets.
    assert!(
        ticket("same_a").is_some() && ticket("same_b").is_some(),
        "{r}"
    );
    assert_ne!(ticket("same_a"), ticket("same_b"));
    assert_ne!(ticket("same_a"), ticket("first"));
    // A deliberate re-run (attempt 1) runs again, with a new key.
    assert_eq!(r["rerun"]["meta"]["stepgate/attempt"], 1);
    assert_ne!(ticket("rerun"), ticket("first"));
    // A half-named step is refused with a text a model can act on.
    assert_eq!(r["bad_meta"]["is_error"], true);
    assert!(text("bad_meta").contains("`_meta.step_index`"), "{r}");
    // A read-only HTTP tool through the same front.
    assert_eq!(r["read_only"]["is_error"], false, "{r}");

    // Over stdio, without `_meta`: the call the client gave up on and the
    // model's rephrased retry are one step; the retry gets the first call's result.
    assert!(r["lost"]["error"].is_string(), "{r}");
    assert_eq!(r["retry"]["is_error"], false, "{r}");
    assert_eq!(r["retry"]["structured"]["title"], "slow refund", "{r}");
    assert_eq!(r["next"]["structured"]["title"], "Other", "{r}");
    assert_ne!(ticket("next"), ticket("retry"));

    // Counted at the tool: one raw invocation per key, every one with a key.
    let counts: Value = serde_json::from_str(&std::fs::read_to_string(&counts).unwrap()).unwrap();
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    for k in counts["invocations"].as_array().unwrap() {
        let k = k
            .as_str()
            .expect("every invocation carried _meta.idempotency_key");
        *per_key.entry(k.to_owned()).or_default() += 1;
    }
    let repeated: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "keys invoked twice: {repeated:?}\n{}",
        logs()
    );
    // first, same_a, same_b, rerun, and over stdio lost/retry (one step), next;
    // plus the HTTP call without a session when the client negotiated one.
    let http_sessionless = r["no_meta_http"]["is_error"] == true;
    let expected = 6 + usize::from(!http_sessionless);
    assert_eq!(per_key.len(), expected, "{counts}\n{r}");
    assert_eq!(counts["tickets"].as_object().unwrap().len(), expected);
    if http_sessionless {
        assert!(
            text("no_meta_http").contains("without an MCP session"),
            "{r}"
        );
    }
}
