//! MCP both ways, against the real broker: `stepgate mcp` driven by the official
//! `mcp` Python SDK's client (Streamable HTTP and stdio), with an existing MCP
//! server (FastMCP) as a tool behind stepgate (`mcp = "…"`). The tool server
//! records every raw invocation with its key and deduplicates by key, so both a
//! repeated invocation and a repeated effect would show.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

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
        "MCP protocol over HTTP {}, over stdio {}, of the high-level Client {}",
        r["http_protocol"], r["stdio_protocol"], r["client_protocol"]
    );
    check_the_high_level_client(&r);

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
    // Without `_meta`, in the handshake's session: that session's step.
    assert_eq!(r["no_meta_http"]["is_error"], false, "{r}");
    assert_eq!(r["no_meta_http"]["meta"]["stepgate/step_index"], 0, "{r}");

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
    // first, same_a, same_b, rerun, no_meta_http (numbered by its session);
    // the high-level Client's two calls and its named step; over stdio
    // lost/retry (one step), next.
    assert_eq!(per_key.len(), 10, "{counts}\n{r}");
    assert_eq!(counts["tickets"].as_object().unwrap().len(), 10);
}

/// An MCP host that knows nothing of stepgate, on the official Python SDK's
/// high-level `Client` (its default mode probes `server/discover`, and would
/// use the sessionless 2026-07-28 revision if offered it): it is offered the
/// revisions with a session, so its calls without `_meta` are numbered by
/// that session, each its own step, run once; the server names itself; the
/// session's `DELETE` is answered as the SDK expects. A client that declares
/// the `stepgate/steps` extension gets 2026-07-28, and one pinned to it that
/// sends no `_meta` is refused with a text that says what to do.
fn check_the_high_level_client(r: &Value) {
    assert_eq!(r["client_protocol"], "2025-11-25", "{r}");
    assert_eq!(
        r["server_info"],
        json!({"name": "stepgate", "version": env!("CARGO_PKG_VERSION")}),
        "{r}"
    );
    let (first, second) = (&r["client_first"], &r["client_second"]);
    for c in [first, second] {
        assert_eq!(c["is_error"], false, "{r}");
        assert_eq!(c["meta"]["stepgate/deduplicated"], false, "{r}");
    }
    assert_eq!(first["structured"]["title"], "host call 1", "{r}");
    assert_eq!(second["structured"]["title"], "host call 2", "{r}");
    assert_eq!(first["meta"]["stepgate/step_index"], 0, "{r}");
    assert_eq!(second["meta"]["stepgate/step_index"], 1, "{r}");
    let workflow = first["meta"]["stepgate/workflow_id"]
        .as_str()
        .unwrap_or_default();
    assert!(workflow.starts_with("mcp-"), "{r}");
    assert_eq!(second["meta"]["stepgate/workflow_id"], workflow, "{r}");
    assert_eq!(r["client_warnings"], json!([]), "the SDK warned: {r}");
    assert_eq!(r["steps_protocol"], "2026-07-28", "{r}");
    assert_eq!(r["steps_call"]["is_error"], false, "{r}");
    let refused = &r["pinned_no_meta"];
    assert_eq!(refused["is_error"], true, "{r}");
    let text = refused["text"][0].as_str().unwrap_or_default();
    assert!(
        text.contains("without an MCP session")
            && text.contains("`_meta`")
            && text.contains("stepgate/steps"),
        "{r}"
    );
}

/// The `[mcp]` section of the network test: the test issuer's tokens, three
/// static tokens (from the environment), three sessions per principal, and
/// `extra` (more `[mcp]` keys) and `auth_extra` (more `[mcp.auth]` keys).
fn network_mcp_section(issuer: &str, extra: &str, auth_extra: &str) -> String {
    format!(
        r#"
allowed_origins = ["http://app.test"]
max_sessions_per_principal = 3
task_after = "3s"
{extra}

[auth]
issuer = "{issuer}"
jwks_url = "{issuer}/jwks"
{auth_extra}

[auth.scopes]
tickets = ["create_ticket"]
reports = ["export_report"]
search = ["search"]
admin = ["*"]

[[auth.tokens]]
name = "ops"
token = "env:MCP_OPS_TOKEN"
scopes = ["admin"]

[[auth.tokens]]
name = "flood"
token = "env:MCP_FLOOD_TOKEN"
scopes = ["search"]

[[auth.tokens]]
name = "reporter"
token = "env:MCP_REPORTER_TOKEN"
scopes = ["reports"]
"#
    )
}

const OPS_TOKEN: &str = "ops-static-token-0123456789abcdef";
const FLOOD_TOKEN: &str = "flood-static-token-0123456789abcdef";
const REPORTER_TOKEN: &str = "reporter-static-token-0123456789abcdef";

/// A stack behind `stepgate mcp --listen 127.0.0.1:<port>`, configured with
/// [`network_mcp_section`]: tokens of a test issuer (`mcp_issuer.py`, with
/// `clients`) and three static ones.
struct OauthFront {
    s: Stack,
    work: tempfile::TempDir,
    issuer: String,
    url: String,
    port: u16,
    _issuer: Killed,
    _front: Killed,
}

impl OauthFront {
    async fn start(clients: Value) -> OauthFront {
        OauthFront::start_with(clients, "", "").await
    }

    /// With `extra` keys in `[mcp]`, `auth_extra` in `[mcp.auth]`.
    async fn start_with(clients: Value, extra: &str, auth_extra: &str) -> OauthFront {
        let root = env!("CARGO_MANIFEST_DIR");
        let work = tempfile::tempdir().unwrap();
        let issuer_port = free_port();
        let issuer = format!("http://127.0.0.1:{issuer_port}");
        let issuer_process = Killed(
            Command::new("python3")
                .arg(format!("{root}/tests/interop/mcp_issuer.py"))
                .arg(issuer_port.to_string())
                .arg(clients.to_string())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(work.path().join("issuer.log")).unwrap())
                .spawn()
                .expect("python3 runs"),
        );
        wait_listening(issuer_port, "the test issuer listens").await;

        let mut s = Stack::new(StackOptions {
            tools: vec![
                ("create_ticket", "keyed", "5s"),
                ("search", "read_only", "5s"),
                ("export_report", "keyed", "150s"),
            ],
            ..StackOptions::default()
        })
        .await;
        s.start().await;

        // The stack's config with the `[mcp]` section.
        let mut config: toml::Table =
            toml::from_str(&std::fs::read_to_string(&s.config_path).unwrap()).unwrap();
        let mcp: toml::Table =
            toml::from_str(&network_mcp_section(&issuer, extra, auth_extra)).unwrap();
        config.insert("mcp".into(), toml::Value::Table(mcp));
        let config_path = work.path().join("mcp.toml");
        std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();

        let port = free_port();
        let front = Killed(
            Command::new(stepgate_bin())
                .args(["mcp", "--config"])
                .arg(&config_path)
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .env("MCP_OPS_TOKEN", OPS_TOKEN)
                .env("MCP_FLOOD_TOKEN", FLOOD_TOKEN)
                .env("MCP_REPORTER_TOKEN", REPORTER_TOKEN)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(work.path().join("mcp-front.log")).unwrap())
                .spawn()
                .expect("stepgate binary starts"),
        );
        let f = OauthFront {
            s,
            work,
            issuer,
            url: format!("http://127.0.0.1:{port}/mcp"),
            port,
            _issuer: issuer_process,
            _front: front,
        };
        eventually(Duration::from_secs(60), "stepgate mcp listens", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                || f.front_log().contains("error:")
        })
        .await;
        assert!(!f.front_log().contains("error:"), "{}", f.front_log());
        f
    }

    fn front_log(&self) -> String {
        std::fs::read_to_string(self.work.path().join("mcp-front.log")).unwrap_or_default()
    }

    fn logs(&self) -> String {
        format!(
            "--- mcp front ---\n{}\n--- issuer ---\n{}\n--- gate ---\n{}",
            self.front_log(),
            std::fs::read_to_string(self.work.path().join("issuer.log")).unwrap_or_default(),
            self.s.log_tail(40)
        )
    }

    /// No token in `tokens` reached a tool, and no `Authorization` header.
    fn assert_no_token_reached_a_tool(&self, tokens: &[String]) {
        for tool in ["create_ticket", "search"] {
            for call in self.s.tools.calls(tool) {
                let seen = format!("{:?} {}", call.headers, call.body);
                for t in tokens {
                    assert!(
                        !seen.contains(t.as_str()),
                        "a client token reached `{tool}`"
                    );
                }
                assert!(
                    !call
                        .headers
                        .keys()
                        .any(|h| h.eq_ignore_ascii_case("authorization")),
                    "{seen}"
                );
            }
        }
    }
}

/// `stepgate mcp --listen` on loopback as an OAuth 2.1 resource server: the
/// official Python SDK client gets its token from a test issuer by the MCP
/// authorization flow and sees only the tools its scopes grant; everything a
/// well-behaved client never sends is refused with the status the spec names;
/// a principal cannot reach another's workflow or session; and no token
/// reaches a tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_over_http_is_an_oauth_resource_server_with_tenants() {
    let root = env!("CARGO_MANIFEST_DIR");
    let f = OauthFront::start(json!({
        "agent-a": {"secret": "secret-a", "scopes": ["tickets", "search"]},
        "agent-b": {"secret": "secret-b", "scopes": ["search"]},
        "agent-c": {"secret": "secret-c", "scopes": ["tickets"]},
    }))
    .await;
    let (issuer, url, mcp_port) = (&f.issuer, &f.url, f.port);
    let out = Command::new("python3")
        .arg(format!("{root}/tests/interop/mcp_auth_client.py"))
        .args([url, issuer, OPS_TOKEN, FLOOD_TOKEN])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let logs = || f.logs();
    assert!(
        out.status.success(),
        "mcp_auth_client.py:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs()
    );
    let r: Value = serde_json::from_str(stdout.trim()).unwrap();
    let status = |k: &str| r[k]["status"].as_u64().unwrap_or_default();
    let challenge = |k: &str| {
        r[k]["www_authenticate"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    // The SDK client, authorized through the spec's discovery flow.
    let a = &r["agent_a"];
    assert_eq!(a["tools"], json!(["create_ticket", "search"]), "{r}");
    assert_eq!(a["first"]["is_error"], false, "{r}");
    assert_eq!(a["again"]["meta"]["stepgate/deduplicated"], true, "{r}");
    assert_eq!(a["again"]["structured"], a["first"]["structured"]);
    assert_eq!(a["granted_scope"], "tickets search", "{r}");
    // Scopes → tools: agent-b (scope `search`) lists and calls only search.
    assert_eq!(r["agent_b"]["tools"], json!(["search"]), "{r}");
    assert_eq!(r["agent_b"]["search"]["is_error"], false, "{r}");

    // Tenants: a workflow outside the caller's namespace is refused, and the
    // refusal is the same for another's answered step as for a workflow that
    // never existed: nothing of the other workflow shows.
    assert_eq!(a["foreign_wf"]["is_error"], true, "{r}");
    assert!(
        a["foreign_wf"]["text"][0]
            .as_str()
            .unwrap_or_default()
            .contains("`jwt:agent-a/`"),
        "{r}"
    );
    // Distinct roots: a JWT subject `agent-a` does not get the namespace a
    // static token `agent-a` would have.
    assert_eq!(a["static_root"]["is_error"], true, "{r}");
    assert_eq!(a["static_root"]["text"], a["foreign_wf"]["text"], "{r}");
    let c = &r["agent_c"];
    assert_eq!(c["others_step"]["is_error"], true, "{r}");
    assert_eq!(c["others_step"]["text"], c["no_such_wf"]["text"], "{r}");
    assert_eq!(c["others_step"]["meta"], c["no_such_wf"]["meta"], "{r}");
    assert!(c["others_step"]["structured"].is_null(), "{r}");
    assert!(!c["others_step"].to_string().contains("Printer"), "{r}");
    assert_eq!(c["own"]["is_error"], false, "{r}");

    // 401 with the metadata pointer; the metadata names the issuer and this resource.
    assert_eq!(status("unauthenticated"), 401, "{r}");
    let meta_url = format!("http://127.0.0.1:{mcp_port}/.well-known/oauth-protected-resource/mcp");
    assert_eq!(
        challenge("unauthenticated"),
        format!("Bearer resource_metadata=\"{meta_url}\""),
        "{r}"
    );
    for k in ["metadata", "metadata_root"] {
        assert_eq!(r[k]["status"], 200, "{r}");
        assert_eq!(r[k]["json"]["resource"], url.as_str(), "{r}");
        assert_eq!(
            r[k]["json"]["authorization_servers"],
            json!([issuer]),
            "{r}"
        );
        assert_eq!(
            r[k]["json"]["scopes_supported"],
            json!(["admin", "reports", "search", "tickets"]),
            "{r}"
        );
    }
    assert_eq!(status("valid"), 200, "{r}");
    // Tokens that are not this resource's: 401 invalid_token.
    for k in [
        "wrong_audience",
        "expired",
        "foreign_key",
        "no_audience",
        "not_a_jwt",
        "static_wrong",
        "slash_sub",
    ] {
        assert_eq!(status(k), 401, "{k}: {r}");
        assert!(challenge(k).contains("error=\"invalid_token\""), "{k}: {r}");
        assert!(challenge(k).contains(&meta_url), "{k}: {r}");
    }
    assert!(challenge("expired").contains("expired"), "{r}");
    assert!(challenge("wrong_audience").contains("audience"), "{r}");
    assert!(challenge("slash_sub").contains("`/`"), "{r}");
    // A scope without the tool: 403 insufficient_scope, naming the scopes that grant it.
    assert_eq!(status("search_only_init"), 200, "{r}");
    assert_eq!(status("scope_without_tool"), 403, "{r}");
    assert!(
        challenge("scope_without_tool").contains("error=\"insufficient_scope\""),
        "{r}"
    );
    assert!(
        challenge("scope_without_tool").contains("scope=\"admin tickets\""),
        "{r}"
    );

    // Transport hygiene.
    assert_eq!(status("foreign_origin"), 403, "{r}");
    assert_eq!(status("allowed_origin"), 200, "{r}");
    assert_eq!(status("foreign_host"), 403, "{r}");
    assert_eq!(status("huge_body"), 413, "{r}");
    assert_eq!(status("static"), 200, "{r}");
    assert_eq!(status("hijack"), 404, "{r}");
    assert_eq!(status("capped_oldest"), 404, "{r}");
    assert_eq!(status("capped_newest"), 202, "{r}");
    let flood = &r["flood"]["limited"];
    assert_eq!(flood["status"], 429, "{r}");
    assert!(flood["retry_after"].as_str().is_some(), "{r}");
    assert_eq!(status("after_flood_other"), 200, "{r}");
    // An address guessing tokens gets 429 for them; a valid token from it,
    // JWT or static, is still served.
    let guessing = &r["guessing"]["limited"];
    assert_eq!(guessing["status"], 429, "{r}");
    assert!(guessing["retry_after"].as_str().is_some(), "{r}");
    assert_eq!(status("valid_while_locked"), 200, "{r}");
    assert_eq!(status("static_while_locked"), 200, "{r}");

    // The keys were fetched at start and cached; fetched again for the
    // rotated key's kid, once however many tokens named it before it came.
    assert_eq!(r["rotated"]["status"], 200, "{r}");
    assert_eq!(r["rotated"]["kid"], "test-key-2", "{r}");
    assert_eq!(status("old_key_after_rotation"), 200, "{r}");
    assert_eq!(r["issuer_stats"]["jwks_fetches"], 2, "{r}");

    // Each step ran once, and no token reached the tool.
    assert_eq!(f.s.tools.count("create_ticket"), 2, "{r}\n{}", logs());
    let tokens: Vec<String> = r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect();
    assert!(tokens.len() >= 10, "{r}");
    f.assert_no_token_reached_a_tool(&tokens);
}

/// A directory with the official TypeScript SDK (npm
/// `@modelcontextprotocol/sdk`, installed once under Cargo's target tmp dir)
/// and `script` from tests/interop (ESM resolves packages from the script's
/// own directory).
fn ts_sdk_with(script: &str) -> std::path::PathBuf {
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let root = env!("CARGO_MANIFEST_DIR");
    let node = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("mcp-ts-sdk");
    let sdk = node.join("node_modules/@modelcontextprotocol/sdk/package.json");
    let _one_at_a_time = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    if !sdk.exists() {
        std::fs::create_dir_all(&node).unwrap();
        let out = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&node)
            .arg("@modelcontextprotocol/sdk@1.32.2")
            .output()
            .expect("npm runs");
        assert!(
            out.status.success(),
            "npm install @modelcontextprotocol/sdk: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::copy(format!("{root}/tests/interop/{script}"), node.join(script)).unwrap();
    node
}

/// The official TypeScript SDK's client (npm `@modelcontextprotocol/sdk`,
/// installed once under Cargo's target tmp dir) authorized by the test
/// issuer through the SDK's own client_credentials flow: it lists the tools
/// its scopes grant, a repeated step gets the first answer, another tenant's
/// workflow is refused, and the tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_typescript_sdk_client_is_authorized_by_the_issuer() {
    let node = ts_sdk_with("mcp_ts_client.mjs");
    let f = OauthFront::start(json!({
        "agent-t": {"secret": "secret-t", "scopes": ["tickets"]},
    }))
    .await;
    let out = Command::new("node")
        .arg(node.join("mcp_ts_client.mjs"))
        .args([&f.url, &f.issuer, "agent-t", "secret-t"])
        .output()
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mcp_ts_client.mjs:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        f.logs()
    );
    let r: Value = serde_json::from_str(stdout.trim().lines().last().unwrap_or("")).unwrap();
    assert_eq!(r["tools"], json!(["create_ticket"]), "{r}");
    assert_eq!(r["granted_scope"], "tickets", "{r}");
    assert_eq!(r["first"]["is_error"], false, "{r}");
    assert_eq!(
        r["first"]["structured"]["echo"]["title"], "From TypeScript",
        "{r}"
    );
    assert_eq!(r["again"]["structured"], r["first"]["structured"], "{r}");
    assert_eq!(r["again"]["meta"]["stepgate/deduplicated"], true, "{r}");
    assert_eq!(r["foreign_wf"]["is_error"], true, "{r}");
    assert!(
        r["foreign_wf"]["text"][0]
            .as_str()
            .unwrap_or_default()
            .contains("`jwt:agent-t/`"),
        "{r}"
    );
    assert_eq!(f.s.tools.count("create_ticket"), 1, "{r}\n{}", f.logs());
    let token = r["token"]
        .as_str()
        .expect("the SDK kept its token")
        .to_owned();
    f.assert_no_token_reached_a_tool(&[token]);
}

/// Serving beyond loopback needs authorization (or an explicit flag) and the
/// host names to check; refused before anything is bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_refuses_to_serve_a_network_without_authorization() {
    let s = Stack::new(StackOptions {
        tools: vec![("search", "read_only", "5s")],
        ..StackOptions::default()
    })
    .await;
    let config = s.config_path.display().to_string();
    let work = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    // Its standard error, once it has exited (killed if it serves instead).
    let refused = |extra: &[&str]| -> String {
        let log = work.path().join("err.log");
        let mut front = Killed(
            Command::new(stepgate_bin())
                .args(["mcp", "--config", &config, "--listen"])
                .arg(format!("0.0.0.0:{port}"))
                .args(extra)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        );
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = front.0.try_wait().unwrap() {
                assert!(!status.success());
                return std::fs::read_to_string(&log).unwrap();
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "`stepgate mcp --listen 0.0.0.0:{port} {extra:?}` did not refuse: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let err = refused(&[]);
    assert!(err.contains("without authorization"), "{err}");
    assert!(err.contains("--insecure-no-auth"), "{err}");
    let err = refused(&["--insecure-no-auth"]);
    assert!(err.contains("--allowed-host"), "{err}");
}

/// A network namespace of the test's own, joined to this one by a veth pair
/// on a /30 of its own; removed (with the pair) when dropped.
struct Netns {
    name: String,
    /// The address on this side, and the one inside the namespace.
    host: String,
    inside: String,
}

impl Netns {
    /// `None` when namespaces cannot be made here (not root, no `ip`).
    fn new() -> Option<Netns> {
        let n = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
        let (a, b) = ((n >> 8) % 250, n % 63);
        let name = format!("sgmcp{:x}", n & 0xfffff);
        let ns = Netns {
            host: format!("10.213.{a}.{}", b * 4 + 1),
            inside: format!("10.213.{a}.{}", b * 4 + 2),
            name,
        };
        let (outer, inner) = (format!("{}h", ns.name), format!("{}n", ns.name));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns", "add", &ns.name],
            vec![
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ],
            vec!["link", "set", &inner, "netns", &ns.name],
            vec!["addr", "add", &format!("{}/30", ns.host), "dev", &outer],
            vec!["link", "set", &outer, "up"],
            vec![
                "-n",
                &ns.name,
                "addr",
                "add",
                &format!("{}/30", ns.inside),
                "dev",
                &inner,
            ],
            vec!["-n", &ns.name, "link", "set", &inner, "up"],
            vec!["-n", &ns.name, "link", "set", "lo", "up"],
        ]
        .into_iter()
        .map(|s| s.into_iter().map(str::to_owned).collect())
        .collect();
        for step in steps {
            let ok = Command::new("ip")
                .args(&step)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!(
                    "cannot make a network namespace here (`ip {}` failed)",
                    step.join(" ")
                );
                return None;
            }
        }
        Some(ns)
    }

    /// `curl` from inside the namespace: the HTTP status it got.
    fn curl(&self, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "curl", "-s", "-o", "/dev/null"])
            .args(["-w", "%{http_code}", "--max-time", "30"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &format!("{}h", self.name)])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// `Host: localhost` from a client that is not on loopback is refused: the
/// front listens on an address of a veth pair, a client in a network
/// namespace of the test's own sends the loopback name (what a DNS-rebinding
/// page or a spoofing client sends); the configured name is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_refuses_a_loopback_host_from_off_loopback() {
    let Some(ns) = Netns::new() else {
        eprintln!("skipped: this test needs root and `ip netns`");
        return;
    };
    // Only `initialize` is sent, but the gate is started all the same: its
    // readiness says the new topics have leaders (the front's Kafka client
    // fails at start while they have none).
    let mut s = Stack::new(StackOptions {
        tools: vec![("search", "read_only", "5s")],
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let work = tempfile::tempdir().unwrap();
    // The stack's config with the `[mcp]` section.
    let mut config: toml::Table =
        toml::from_str(&std::fs::read_to_string(&s.config_path).unwrap()).unwrap();
    let mcp: toml::Table = toml::from_str(
        r#"
[auth.scopes]
search = ["search"]

[[auth.tokens]]
name = "agent"
token = "env:MCP_AGENT_TOKEN"
scopes = ["search"]
"#,
    )
    .unwrap();
    config.insert("mcp".into(), toml::Value::Table(mcp));
    let config_path = work.path().join("mcp.toml");
    std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();
    let token = "agent-static-token-0123456789abcdef";
    let port = free_port();
    let listen = format!("{}:{port}", ns.host);
    let _front = Killed(
        Command::new(stepgate_bin())
            .args(["mcp", "--config"])
            .arg(&config_path)
            .args(["--listen", &listen, "--allowed-host", &ns.host])
            .env("MCP_AGENT_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(work.path().join("mcp-front.log")).unwrap())
            .spawn()
            .expect("stepgate binary starts"),
    );
    let front_log =
        || std::fs::read_to_string(work.path().join("mcp-front.log")).unwrap_or_default();
    let url = format!("http://{listen}/mcp");
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"probe","version":"0"}}}"#;
    let auth = format!("Authorization: Bearer {token}");
    let post = |host: Option<&str>| {
        let mut args = vec![
            "-H".to_owned(),
            auth.clone(),
            "-H".to_owned(),
            "Content-Type: application/json".to_owned(),
            "-H".to_owned(),
            "Accept: application/json, text/event-stream".to_owned(),
            "-d".to_owned(),
            init.to_owned(),
        ];
        if let Some(h) = host {
            args.extend(["-H".to_owned(), format!("Host: {h}")]);
        }
        args.push(url.clone());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ns.curl(&args)
    };
    let start = std::time::Instant::now();
    let served = loop {
        let got = post(None);
        if got == "200"
            || start.elapsed() > Duration::from_secs(60)
            || front_log().contains("error:")
        {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        served,
        "200",
        "the configured host is served\n{}",
        front_log()
    );
    for host in [
        "localhost",
        &format!("localhost:{port}"),
        "127.0.0.1",
        "[::1]",
    ] {
        assert_eq!(post(Some(host)), "403", "Host: {host}\n{}", front_log());
    }
}

/// A tool that takes 90 s, called from the official TypeScript SDK client,
/// whose requests give up at 60 s: as a task (the SDK asks for one because
/// the tool lists `execution.taskSupport`) it is created at once, polled
/// with `tasks/get` and its answer read past the 60 s; a plain call of
/// another step gives up at 60 s, and that step re-issued (rephrased) as a
/// task attaches to it. Each step's effect happens once, counted at a tool
/// that deduplicates by `Idempotency-Key` and records raw invocations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_a_tool_slower_than_the_host_timeout_completes_as_a_task() {
    let node = ts_sdk_with("mcp_ts_tasks.mjs");
    let f = OauthFront::start(json!({
        "agent-r": {"secret": "secret-r", "scopes": ["reports"]},
    }))
    .await;
    f.s.tools.script(
        "export_report",
        vec![Reply::Provider(Duration::from_secs(90))],
    );
    let out = Command::new("node")
        .arg(node.join("mcp_ts_tasks.mjs"))
        .args([&f.url, &f.issuer, "agent-r", "secret-r", "export_report"])
        .output()
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mcp_ts_tasks.mjs:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        f.logs()
    );
    let r: Value = serde_json::from_str(stdout.trim().lines().last().unwrap_or("")).unwrap();
    assert_eq!(r["protocol"], "2025-11-25", "{r}");
    assert_eq!(
        r["tasks_capability"]["requests"]["tools"]["call"],
        json!({}),
        "{r}"
    );
    assert_eq!(r["task_support"], "optional", "{r}");

    // Step 0 as a task: made at once, working, then completed with the answer.
    let task = &r["task"];
    assert!(task["task_id"].is_string(), "{r}");
    assert!(task["created_ms"].as_u64().unwrap() < 30_000, "{r}");
    assert_eq!(task["statuses"], json!(["working", "completed"]), "{r}");
    assert!(task["error"].is_null(), "{r}");
    assert!(task["done_ms"].as_u64().unwrap() >= 60_000, "{r}");
    assert_eq!(task["result"]["is_error"], false, "{r}");
    assert_eq!(
        task["result"]["meta"]["io.modelcontextprotocol/related-task"]["taskId"], task["task_id"],
        "{r}"
    );
    // Step 1 as a plain call: the SDK gave up at 60 s, before the answer...
    assert!(
        r["plain"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("timed out")
            || r["plain"]["error"]
                .as_str()
                .unwrap_or_default()
                .contains("Timeout"),
        "{r}"
    );
    // ...and re-issued as a task it attached to the step still running: the
    // step's first answer, not a second run.
    let again = &r["reissued"];
    assert!(again["error"].is_null(), "{r}");
    assert_eq!(again["result"]["is_error"], false, "{r}");
    assert_eq!(again["result"]["meta"]["stepgate/step_index"], 1, "{r}");
    assert_eq!(
        again["result"]["structured"]["echo"]["month"], "2026-10",
        "{r}"
    );
    // Step 0 repeated as a plain call: its answer, at once.
    assert_eq!(
        r["again"]["structured"], task["result"]["structured"],
        "{r}"
    );
    assert_eq!(r["again"]["meta"]["stepgate/deduplicated"], true, "{r}");

    // One effect per step, at a tool that deduplicates by key and counts
    // every invocation.
    assert_eq!(f.s.tools.performed("export_report"), 2, "{}", f.logs());
    assert_eq!(f.s.tools.count("export_report"), 2, "{}", f.logs());
}

/// The MCP Inspector's CLI mode (npm `@modelcontextprotocol/inspector`
/// 0.15.0, the last that runs on Node 20; installed once under Cargo's target
/// tmp dir) against a front on loopback without authorization: it lists the
/// tools and calls one, which runs once. (It has no option to send a token or
/// `_meta`: its calls are named by their MCP session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_inspector_cli_lists_and_calls_a_tool() {
    let node = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("mcp-inspector");
    let cli = node.join("node_modules/@modelcontextprotocol/inspector-cli/build/index.js");
    if !cli.exists() {
        std::fs::create_dir_all(&node).unwrap();
        let out = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&node)
            .arg("@modelcontextprotocol/inspector@0.15.0")
            .output()
            .expect("npm runs");
        assert!(
            out.status.success(),
            "npm install @modelcontextprotocol/inspector: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut s = Stack::new(StackOptions {
        tools: vec![("create_ticket", "keyed", "5s")],
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let _front = start_mcp_front(&s, port, &work.path().join("mcp-front.log"));
    wait_listening(port, "stepgate mcp listens").await;
    let url = format!("http://127.0.0.1:{port}/mcp");
    let inspector = |args: &[&str]| -> Value {
        let out = Command::new("node")
            .arg(&cli)
            .arg(&url)
            .args(args)
            .output()
            .expect("node runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "inspector {args:?}:\n{stdout}\n{}\n--- mcp front ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(work.path().join("mcp-front.log")).unwrap_or_default()
        );
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    let list = inspector(&["--method", "tools/list"]);
    let names: Vec<&str> = list["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["create_ticket"], "{list}");
    let called = inspector(&[
        "--method",
        "tools/call",
        "--tool-name",
        "create_ticket",
        "--tool-arg",
        "title=Printer on fire",
    ]);
    assert_eq!(called["isError"], false, "{called}");
    assert_eq!(
        called["structuredContent"]["echo"]["title"], "Printer on fire",
        "{called}"
    );
    assert_eq!(s.tools.count("create_ticket"), 1);
}

/// The current revision, 2026-07-28, from the official Rust SDK's client
/// (rmcp) that declares the `stepgate/steps` extension: `server/discover`,
/// sessionless requests with the step in `_meta`, and the tasks extension. A call the front cannot answer within
/// `mcp.task_after` (3 s here) is answered with its step's task; the same
/// step's call again gets that task; `tasks/get` completes it with the answer;
/// another principal cannot see it. The tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_current_revision_answers_a_slow_call_with_its_steps_task() {
    use rmcp::model::{
        CallToolRequestParams, CallToolResponse, ClientConfig, GetTaskParams, ProtocolVersion,
        TaskStatus,
    };
    use rmcp::service::{ClientLifecycleMode, ClientServiceExt as _};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

    let f = OauthFront::start(json!({})).await;
    f.s.tools.script(
        "export_report",
        vec![Reply::Provider(Duration::from_secs(10))],
    );
    let connect = |token: &str, tasks: bool| {
        let transport = StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(f.url.clone()).auth_header(token),
        );
        // It names its steps in `_meta`, and says so: the front offers the
        // sessionless revision only to such a client.
        let mut capabilities = json!({"extensions": {"stepgate/steps": {}}});
        if tasks {
            capabilities["extensions"]["io.modelcontextprotocol/tasks"] = json!({});
        }
        let config: ClientConfig = serde_json::from_value(json!({
            "protocolVersion": "2026-07-28",
            "capabilities": capabilities,
            "clientInfo": {"name": "stepgate-rmcp-test", "version": "0"},
        }))
        .unwrap();
        config.serve_with_lifecycle(
            transport,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
    };
    let call = |step: u64, month: &str| -> CallToolRequestParams {
        serde_json::from_value(json!({
            "name": "export_report",
            "arguments": {"month": month},
            "_meta": {"workflow_id": "ops/rmcp-wf", "step_index": step},
        }))
        .unwrap()
    };
    let client = connect(OPS_TOKEN, true).await.expect("discover");
    let negotiated = client
        .peer()
        .peer_info()
        .map(|i| i.protocol_version.to_string());
    assert_eq!(negotiated.as_deref(), Some("2026-07-28"));
    let tools = client.list_all_tools().await.expect("tools/list");
    assert!(tools.iter().any(|t| t.name == "export_report"));

    let started = std::time::Instant::now();
    let CallToolResponse::Task(task) = client
        .call_tool_once(call(0, "2026-11"))
        .await
        .expect("tools/call")
    else {
        panic!("a call slower than task_after is answered with a task");
    };
    assert!(started.elapsed() < Duration::from_secs(9), "{task:?}");
    assert_eq!(task.task.status, TaskStatus::Working);
    let id = task.task.task_id.clone();
    // The same step, rephrased, while its task stands: that task.
    let CallToolResponse::Task(again) = client
        .call_tool_once(call(0, "November 2026"))
        .await
        .expect("tools/call again")
    else {
        panic!("the step's second call is answered with its task");
    };
    assert_eq!(again.task.task_id, id);
    // Another principal does not see it (the same text as for no task).
    let flood = connect(FLOOD_TOKEN, true).await.expect("discover");
    let foreign = flood.get_task(GetTaskParams::new(id.clone())).await;
    let missing = flood.get_task(GetTaskParams::new("sg-none")).await;
    let text = |r: &Result<_, rmcp::ServiceError>| match r {
        Err(rmcp::ServiceError::McpError(e)) => e.message.to_string(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        text(&foreign).replace(id.as_str(), "ID"),
        text(&missing).replace("sg-none", "ID")
    );
    // Polled to completion.
    let done = loop {
        let t = client
            .get_task(GetTaskParams::new(id.clone()))
            .await
            .expect("tasks/get");
        if t.task.status() != TaskStatus::Working {
            break t;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{t:?}\n{}",
            f.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let result = serde_json::to_value(&done).unwrap();
    assert_eq!(result["status"], "completed", "{result}");
    assert_eq!(result["result"]["isError"], false, "{result}");
    assert_eq!(
        result["result"]["structuredContent"]["echo"]["month"], "2026-11",
        "{result}"
    );
    // A client without the extension gets the answer itself.
    let plain = connect(OPS_TOKEN, false).await.expect("discover");
    let CallToolResponse::Complete(r) = plain
        .call_tool_once(call(0, "Nov"))
        .await
        .expect("tools/call")
    else {
        panic!("no task for a client that did not declare the extension");
    };
    let r = serde_json::to_value(&r).unwrap();
    assert_eq!(r["_meta"]["stepgate/deduplicated"], true, "{r}");
    assert_eq!(
        r["structuredContent"],
        result["result"]["structuredContent"]
    );
    assert_eq!(f.s.tools.performed("export_report"), 1, "{}", f.logs());
    assert_eq!(f.s.tools.count("export_report"), 1, "{}", f.logs());
    let _ = (
        client.cancel().await,
        flood.cancel().await,
        plain.cancel().await,
    );
}

/// A JSON-RPC request to the front (protocol 2025-11-25) with a bearer token
/// and `headers`: its status and its JSON-RPC message (the body, or the
/// first `data:` of an event stream; `Null` for a refusal's text).
async fn rpc(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Value) {
    let mut r = http
        .post(url)
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .header("mcp-protocol-version", "2025-11-25");
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let resp = r
        .body(body.to_string())
        .send()
        .await
        .expect("the front answers");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str(&text)
        .ok()
        .or_else(|| {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .find_map(|d| serde_json::from_str(d.trim()).ok())
        })
        .unwrap_or(Value::Null);
    (status, message)
}

fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "probe", "version": "0"}}})
}

/// A token of the test issuer with these claims (`iss`, `iat`, `exp` added).
async fn mint(http: &reqwest::Client, issuer: &str, claims: Value) -> String {
    let r: Value = http
        .post(format!("{issuer}/mint"))
        .json(&claims)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["access_token"].as_str().unwrap().to_owned()
}

/// Behind a TLS proxy every client shares the proxy's address. With the
/// proxy in `mcp.trusted_proxies`, an address that guesses tokens is the
/// client's (the right-most `X-Forwarded-For` hop that is not a trusted
/// proxy): a client guessing tokens is locked out (429) and another client
/// behind the same proxy is not; what a client writes into the header
/// itself is not believed; and a valid token is never refused for its
/// address, even the locked-out one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_lockout_behind_a_trusted_proxy_is_the_clients_and_spares_valid_tokens() {
    let f = OauthFront::start_with(
        json!({}),
        r#"trusted_proxies = ["127.0.0.1", "10.0.0.0/8"]"#,
        "",
    )
    .await;
    let http = reqwest::Client::new();
    let init = initialize();
    let post = |token: &str, forwarded: &str| {
        let (http, url, init) = (&http, &f.url, &init);
        let (token, forwarded) = (token.to_owned(), forwarded.to_owned());
        async move {
            rpc(http, url, &token, &[("x-forwarded-for", &forwarded)], init)
                .await
                .0
        }
    };
    // Guesses in rounds of 20 at once until the address is locked out.
    let flood = |forwarded: &'static str| {
        let post = &post;
        async move {
            for round in 0..20 {
                let guesses = (0..20)
                    .map(|i| post(&format!("guess-{round}-{i}-0123456789abcdef"), forwarded));
                let statuses = futures::future::join_all(guesses).await;
                assert!(
                    statuses.iter().all(|s| *s == 401 || *s == 429),
                    "{statuses:?}"
                );
                if statuses.contains(&429) {
                    return true;
                }
            }
            false
        }
    };
    // The bad client at 203.0.113.7, through two proxies (10.1.2.3, then the
    // front's peer 127.0.0.1).
    let bad = "203.0.113.7, 10.1.2.3";
    assert!(
        flood(bad).await,
        "the guessing client was never locked out\n{}",
        f.logs()
    );
    // Right after: another client behind the same proxies is not locked
    // out, with a valid token nor with a wrong one (401, not 429)...
    assert_eq!(post(OPS_TOKEN, "198.51.100.2, 10.1.2.3").await, 200);
    assert_eq!(
        post("wrong-token-0123456789abcdef", "198.51.100.2").await,
        401
    );
    // ...and a valid token from the locked-out address itself is served.
    assert_eq!(post(OPS_TOKEN, bad).await, 200, "{}", f.logs());
    assert_eq!(post(REPORTER_TOKEN, bad).await, 200, "{}", f.logs());
    // A client claiming another's address in the header it sends (the proxy
    // appends the one it saw) is still itself.
    assert!(flood("198.51.100.9, 203.0.113.8").await);
    assert_eq!(
        post("wrong-token-0123456789abcdef", "198.51.100.9").await,
        401
    );
}

/// `mcp.max_tasks_per_principal`: one principal's tasks still waiting (a
/// slow tool's, held for a person, …) cannot take the places of the
/// others'. Its next task is refused with a text, the same step again still
/// finds its task, and another principal makes tasks as before. Each intent
/// records the principal that sent it (`metadata["stepgate.principal"]`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_one_principal_holds_at_most_its_share_of_tasks() {
    let f = OauthFront::start_with(json!({}), "max_tasks_per_principal = 2", "").await;
    f.s.tools.script(
        "export_report",
        vec![Reply::Delay(Duration::from_secs(120))],
    );
    let intents = f.s.reader("intents");
    let http = reqwest::Client::new();
    let task = |workflow: &str, step: u64| {
        json!({"jsonrpc": "2.0", "id": 10 + step, "method": "tools/call", "params": {
            "name": "export_report", "arguments": {"month": "2026-11"}, "task": {},
            "_meta": {"workflow_id": workflow, "step_index": step}}})
    };
    let mut ids = Vec::new();
    for step in 0..2 {
        let (status, m) = rpc(&http, &f.url, OPS_TOKEN, &[], &task("ops/exports", step)).await;
        assert_eq!(status, 200, "{m}\n{}", f.logs());
        assert_eq!(m["result"]["task"]["status"], "working", "{m}");
        ids.push(m["result"]["task"]["taskId"].clone());
    }
    let (_, refused) = rpc(&http, &f.url, OPS_TOKEN, &[], &task("ops/exports", 2)).await;
    let text = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("not performed") && text.contains("mcp.max_tasks_per_principal"),
        "{refused}"
    );
    // The same step again is its task, not a new one.
    let (_, again) = rpc(&http, &f.url, OPS_TOKEN, &[], &task("ops/exports", 0)).await;
    assert_eq!(again["result"]["task"]["taskId"], ids[0], "{again}");
    // Other principals are not affected: a static one, and a JWT one.
    let (_, other) = rpc(
        &http,
        &f.url,
        REPORTER_TOKEN,
        &[],
        &task("reporter/exports", 0),
    )
    .await;
    assert_eq!(other["result"]["task"]["status"], "working", "{other}");
    let jwt = mint(
        &http,
        &f.issuer,
        json!({"sub": "agent-x", "aud": f.url, "scope": "reports"}),
    )
    .await;
    let (_, by_jwt) = rpc(&http, &f.url, &jwt, &[], &task("jwt:agent-x/exports", 0)).await;
    assert_eq!(by_jwt["result"]["task"]["status"], "working", "{by_jwt}");

    // Who sent each step, as the intents carry it (every publish of it: the
    // front publishes a step again while its answer is slow); the refused
    // one never became one.
    intents.wait_for(4, Duration::from_secs(60)).await;
    let by: std::collections::BTreeSet<(String, u64, String)> = intents
        .all()
        .iter()
        .map(|r| {
            (
                r.value["workflow_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                r.value["step_index"].as_u64().unwrap_or_default(),
                r.value["metadata"]["stepgate.principal"].to_string(),
            )
        })
        .collect();
    let expected: std::collections::BTreeSet<(String, u64, String)> = [
        ("jwt:agent-x/exports", 0, "\"jwt:agent-x\""),
        ("ops/exports", 0, "\"token:ops\""),
        ("ops/exports", 1, "\"token:ops\""),
        ("reporter/exports", 0, "\"token:reporter\""),
    ]
    .into_iter()
    .map(|(w, n, p)| (w.to_owned(), n, p.to_owned()))
    .collect();
    assert_eq!(by, expected, "{}", f.logs());
}

/// A key the issuer withdrew from its JWK Set is refused from the fetch
/// that no longer finds it — by the very request that made the front fetch
/// the set again — and never after; a token under its current key is
/// accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_a_withdrawn_jwks_key_is_refused_by_the_request_that_refreshed_the_set() {
    let f = OauthFront::start_with(json!({}), "", r#"jwks_refresh = "1s""#).await;
    let http = reqwest::Client::new();
    let claims = json!({"sub": "agent-w", "aud": f.url, "scope": "search"});
    let old = mint(&http, &f.issuer, claims.clone()).await;
    let fetches = || {
        let http = &http;
        let url = format!("{}/stats", f.issuer);
        async move {
            let stats: Value = http.get(url).send().await.unwrap().json().await.unwrap();
            stats["jwks_fetches"].as_u64().unwrap()
        }
    };
    assert_eq!(rpc(&http, &f.url, &old, &[], &initialize()).await.0, 200);
    // The issuer moves to a new key and withdraws the old one.
    http.post(format!("{}/rotate", f.issuer))
        .send()
        .await
        .unwrap();
    http.post(format!("{}/withdraw", f.issuer))
        .json(&json!({"kid": "test-key-1"}))
        .send()
        .await
        .unwrap();
    let new = mint(&http, &f.issuer, claims).await;
    // Until the front fetches the set again, its copy still has the old key;
    // the request during which it fetches must be refused.
    let started = std::time::Instant::now();
    loop {
        let before = fetches().await;
        let status = rpc(&http, &f.url, &old, &[], &initialize()).await.0;
        if fetches().await > before {
            assert_eq!(
                status,
                401,
                "the withdrawn key was accepted after the fetch\n{}",
                f.logs()
            );
            break;
        }
        assert_eq!(status, 200, "{}", f.logs());
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the JWK Set was not fetched again\n{}",
            f.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(rpc(&http, &f.url, &old, &[], &initialize()).await.0, 401);
    assert_eq!(rpc(&http, &f.url, &new, &[], &initialize()).await.0, 200);
}

/// What `[mcp]` the front refuses before it serves, in `stepgate
/// check-config` and at `stepgate mcp`: a JWK Set or issuer over plain http
/// beyond loopback, static tokens whose namespaces are prefixes of one
/// another or under the JWT principals' root; and what check-config prints
/// of the URLs: no credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_refuses_plain_http_keys_and_overlapping_namespaces_at_start() {
    let work = tempfile::tempdir().unwrap();
    let base = r#"
[kafka]
brokers = "127.0.0.1:9"

[tools.search]
category = "read_only"
url = "http://127.0.0.1:1/search"

[mcp.auth.scopes]
s = ["search"]
"#;
    let config = |name: &str, mcp: &str| {
        let path = work.path().join(name);
        std::fs::write(&path, format!("{base}\n{mcp}")).unwrap();
        path
    };
    let check = |path: &std::path::Path| {
        let out = Command::new(stepgate_bin())
            .args(["check-config", "--config"])
            .arg(path)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let auth = |issuer: &str, jwks: &str| {
        format!("[mcp.auth]\nissuer = \"{issuer}\"\njwks_url = \"{jwks}\"\n")
    };
    for (name, mcp, field) in [
        (
            "http-jwks.toml",
            auth("https://idp.example", "http://idp.example/jwks"),
            "mcp.auth.jwks_url",
        ),
        (
            "http-issuer.toml",
            auth("http://idp.example", "https://idp.example/jwks"),
            "mcp.auth.issuer",
        ),
    ] {
        let path = config(name, &mcp);
        let (ok, out) = check(&path);
        assert!(!ok, "{name}: {out}");
        assert!(
            out.contains(field) && out.contains("https"),
            "{name}: {out}"
        );
        // `stepgate mcp` refuses it too, before it listens.
        let port = free_port().to_string();
        let served = Command::new(stepgate_bin())
            .args(["mcp", "--config"])
            .arg(&path)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .output()
            .unwrap();
        assert!(!served.status.success(), "{name}");
        assert!(
            String::from_utf8_lossy(&served.stderr).contains(field),
            "{name}: {}",
            String::from_utf8_lossy(&served.stderr)
        );
    }
    // Plain http on a loopback host is accepted, and URLs show no credentials.
    let (ok, out) = check(&config(
        "loopback.toml",
        &format!(
            "[mcp]\nresource = \"https://front:pw-in-resource@mcp.example/mcp\"\n{}",
            auth(
                "http://127.0.0.1:8000",
                "http://user:pw-in-jwks@localhost:8000/jwks?token=tok-in-query"
            )
        ),
    ));
    assert!(ok, "{out}");
    for secret in ["pw-in-resource", "pw-in-jwks", "tok-in-query"] {
        assert!(!out.contains(secret), "check-config shows {secret}: {out}");
    }
    assert!(out.contains("localhost:8000/jwks"), "{out}");

    // Static tokens' namespaces: prefix-free, and none under `jwt:`.
    let token = |name: &str, namespace: Option<&str>| {
        let ns = namespace
            .map(|n| format!("namespace = \"{n}\"\n"))
            .unwrap_or_default();
        format!(
            "[[mcp.auth.tokens]]\nname = \"{name}\"\ntoken = \"literal-token-{name}-0123456789\"\nscopes = [\"s\"]\n{ns}"
        )
    };
    for (name, mcp, needle) in [
        (
            "prefixes.toml",
            token("acme", None) + &token("acme-eu", Some("acme/eu/")),
            "prefixes of one another",
        ),
        (
            "nested.toml",
            token("support", Some("support/")) + &token("tier2", Some("support/tier2/")),
            "prefixes of one another",
        ),
        (
            "jwt-root.toml",
            token("jwt:acme", None),
            "the JWT principals",
        ),
    ] {
        let (ok, out) = check(&config(name, &mcp));
        assert!(!ok, "{name}: {out}");
        assert!(
            out.contains("mcp.auth.tokens[") && out.contains(needle),
            "{name}: {out}"
        );
    }
    // Distinct namespaces, and "" (every workflow, an operator's), pass.
    let (ok, out) = check(&config(
        "distinct.toml",
        &(token("acme", None) + &token("acme-eu", None) + &token("ops", Some(""))),
    ));
    assert!(ok, "{out}");
}
