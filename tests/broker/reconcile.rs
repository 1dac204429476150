//! In-doubt steps that settle themselves where the tool can be asked, against
//! the real broker: three unkeyed tools, each with a `reconcile` lookup, are
//! mid-call when the gate is killed (kill -9). The restarted gate declares the
//! three steps in doubt, asks each tool's lookup, and:
//! - a lookup that reports the effect settles the step `ok` with its output,
//!   and no person is asked;
//! - a lookup that reports nothing happened leaves the step to its next call,
//!   which runs the tool once (raw invocations counted at the tool);
//! - a lookup that keeps failing leaves the step in doubt for a person, with
//!   the lookups' answers in the console.

use crate::common;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use common::*;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stepgate::contract::{Settler, Status};

const TOOLS: &str = r#"
[tools.fax_done]
category = "unkeyed"
url = "{tools}/fax_done"
timeout = "6s"
retries = 0
reconcile = { url = "{lookup}/executed", every = "300ms", until = "6s", timeout = "2s" }

[tools.fax_never]
category = "unkeyed"
url = "{tools}/fax_never"
timeout = "6s"
retries = 0
reconcile = { url = "{lookup}/not_executed", every = "300ms", until = "6s", timeout = "2s" }

[tools.fax_dark]
category = "unkeyed"
url = "{tools}/fax_dark"
timeout = "6s"
retries = 0
reconcile = { url = "{lookup}/failing", every = "300ms", until = "3s", timeout = "2s" }
"#;

const OLIVIA: &str = "olivia-operator-token-0001";

/// The lookups' server: what each was asked.
#[derive(Clone, Default)]
struct Lookups {
    asked: Arc<Mutex<Vec<(String, Value)>>>,
}

impl Lookups {
    async fn start() -> (Lookups, String) {
        let l = Lookups::default();
        let app = Router::new()
            .route("/lookup/{answer}", post(lookup))
            .with_state(l.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (l, format!("http://{addr}/lookup"))
    }

    fn asked(&self, answer: &str) -> Vec<Value> {
        self.asked
            .lock()
            .unwrap()
            .iter()
            .filter(|(a, _)| a == answer)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

async fn lookup(
    State(l): State<Lookups>,
    Path(answer): Path<String>,
    body: String,
) -> (StatusCode, String) {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    l.asked.lock().unwrap().push((answer.clone(), body));
    match answer.as_str() {
        "executed" => (
            StatusCode::OK,
            json!({"status": "executed", "output": {"fax_id": "F-77"}}).to_string(),
        ),
        "not_executed" => (
            StatusCode::OK,
            json!({"status": "not_executed"}).to_string(),
        ),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "down".into()),
    }
}

fn configure(c: &mut stepgate::config::Config) {
    c.console = toml::from_str(&format!(
        "roles = {{ olivia = \"operator\" }}\ntokens = [{{ name = \"olivia\", token = \"{OLIVIA}\" }}]\n"
    ))
    .expect("the console's test config");
}

/// A repeat of the step, until its answer is no longer `in_doubt` (bounded).
async fn settled(
    agent: &Agent,
    wf: &str,
    tool: &str,
    prefix: &str,
) -> stepgate::contract::ToolResult {
    for n in 0..120 {
        let call_id = format!("{prefix}-{n}");
        let r = agent
            .call(intent(wf, 0, tool, json!({"to": "+331"}), &call_id))
            .await;
        if r.status != Status::InDoubt {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("{wf}: still in doubt after 120 repeats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gate_s_in_doubt_calls_are_settled_by_asking_each_tool() {
    let _serial = common::FAULTS.lock().await;
    let (lookups, lookup_url) = Lookups::start().await;
    let mut s = Stack::new(StackOptions {
        tool_tables: TOOLS.replace("{lookup}", &lookup_url),
        configure,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    // Each call hangs at its tool: the gate is killed while they run.
    let tools = ["fax_done", "fax_never", "fax_dark"];
    for t in tools {
        s.tools
            .script(t, vec![Reply::Delay(Duration::from_secs(120)), Reply::Ok]);
        agent
            .send(&intent(
                &format!("wf-{t}"),
                0,
                t,
                json!({"to": "+331"}),
                &format!("{t}-first"),
            ))
            .await;
    }
    eventually(Duration::from_secs(30), "every tool entered", || {
        tools.iter().all(|t| s.tools.count(t) == 1)
    })
    .await;
    s.kill();
    s.start().await;

    // The first callers are answered in doubt, structured: the reconciler
    // is settling each.
    for t in tools {
        let r = agent
            .answer(&format!("{t}-first"), Duration::from_secs(60))
            .await;
        assert_eq!(r.status, Status::InDoubt, "{t}: {r:?}");
        let d = r.in_doubt.clone().expect("a structured in_doubt");
        assert_eq!(d.settling, Settler::Reconciler, "{t}");
        assert!(d.until.is_some());
        let key = s.tools.calls(t)[0].idempotency_key.clone();
        assert_eq!(d.idempotency_key, key, "{t}: the key the call carried");
    }

    // Reported executed: ok with the lookup's output; the tool ran once.
    let done = settled(&agent, "wf-fax_done", "fax_done", "d").await;
    assert_eq!(done.status, Status::Ok, "{done:?}");
    assert_eq!(done.output, Some(json!({"fax_id": "F-77"})));
    assert_eq!(s.tools.count("fax_done"), 1);
    let asked = lookups.asked("executed");
    assert_eq!(
        asked[0]["idempotency_key"],
        json!(s.tools.calls("fax_done")[0].idempotency_key)
    );
    assert_eq!(asked[0]["arguments"], json!({"to": "+331"}));
    // No person was asked: the decision is the reconciler's.
    let out = s.cli(&["steps", "show", "wf-fax_done", "--json"]).await;
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    let log = &shown["steps"][0]["operator_log"];
    assert_eq!(log.as_array().map(Vec::len), Some(1), "{shown}");
    assert_eq!(log[0]["by"], "stepgate:reconciler");
    assert_eq!(log[0]["action"], "resolve_executed");

    // Reported not executed: the next repeat runs the tool, once.
    let never = settled(&agent, "wf-fax_never", "fax_never", "n").await;
    assert_eq!(never.status, Status::Ok, "{never:?}");
    assert!(!never.deduplicated, "the repeat that ran it");
    assert_eq!(
        s.tools.count("fax_never"),
        2,
        "one before the kill, one rerun"
    );
    let calls = s.tools.calls("fax_never");
    assert_eq!(
        calls[0].idempotency_key, calls[1].idempotency_key,
        "the same key"
    );
    let again = agent
        .call(intent(
            "wf-fax_never",
            0,
            "fax_never",
            json!({"to": "+331"}),
            "n-last",
        ))
        .await;
    same_but_call_id(&never, &again);
    assert_eq!(s.tools.count("fax_never"), 2);

    // The lookup keeps failing: past `until`, a person's, with the lookups as
    // evidence; a repeat says so.
    let mut dark = None;
    for n in 0..100 {
        let r = agent
            .call(intent(
                "wf-fax_dark",
                0,
                "fax_dark",
                json!({"to": "+331"}),
                &format!("k-{n}"),
            ))
            .await;
        if r.in_doubt
            .as_ref()
            .is_some_and(|d| d.settling == Settler::Person)
        {
            dark = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dark = dark.expect("left to a person within 25 s");
    assert_eq!(dark.status, Status::InDoubt);
    assert!(lookups.asked("failing").len() >= 2);
    assert_eq!(s.tools.count("fax_dark"), 1);
    // The console's In doubt page shows the lookups.
    let port = free_port();
    let _console = {
        let mut cmd = std::process::Command::new(stepgate_bin());
        cmd.args(["console", "--config"])
            .arg(&s.config_path)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        Killed(cmd.spawn().expect("stepgate console starts"))
    };
    let base = format!("http://127.0.0.1:{port}");
    let mut page = String::new();
    for _ in 0..600 {
        if let Ok(r) = reqwest::Client::new()
            .get(format!("{base}/in-doubt"))
            .bearer_auth(OLIVIA)
            .send()
            .await
        {
            page = r.text().await.unwrap_or_default();
            if page.contains("wf-fax_dark") && page.contains("could not tell") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(page.contains("wf-fax_dark"), "{page}");
    assert!(
        page.contains("the tool&#39;s lookups could not tell")
            || page.contains("the tool's lookups could not tell"),
        "{page}"
    );
    assert!(page.contains("lookup 1 at"), "{page}");
    assert!(page.contains("<b>failed</b>"), "{page}");
}
