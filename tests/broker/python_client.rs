//! The Python client package (`clients/python`), installed with pip as a user
//! would, against the binary and a real broker.

use crate::common;

use common::*;
use serde_json::Value;
use std::process::Command;

/// The package pip-installed into a fresh directory, as a user installs it
/// (from a copy of the sources, so that a test run never touches the
/// checkout; an in-tree build leaves nothing behind either, which
/// `clients/python/tests/test_packaging.py` checks).
fn pip_install() -> tempfile::TempDir {
    let site = tempfile::tempdir().unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let src = tempfile::tempdir().unwrap();
    assert!(
        Command::new("cp")
            .args([
                "-r",
                &format!("{root}/clients/python/."),
                &src.path().display().to_string()
            ])
            .status()
            .unwrap()
            .success()
    );
    let pip = Command::new("python3")
        .args(["-m", "pip", "install", "-q", "--no-deps", "--target"])
        .arg(site.path())
        .arg(src.path())
        .output()
        .expect("python3 runs");
    assert!(
        pip.status.success(),
        "pip install clients/python: {}",
        String::from_utf8_lossy(&pip.stderr)
    );
    site
}

/// The package's own pytest suite (`clients/python/tests`), on the installed
/// package, against the real broker and this build's binary: it starts its
/// own `stepgate run`s with topics of their own.
#[test]
fn the_python_package_s_own_pytest_suite_passes_against_the_real_broker() {
    let site = pip_install();
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"])
        .arg(format!("{root}/clients/python/tests"))
        .env("PYTHONPATH", site.path())
        .env("STEPGATE_BIN", stepgate_bin())
        .env("KAFKA_BROKERS", brokers())
        .env("PYTEST_STEPGATE_CLIENT_SITE", site.path())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "pytest clients/python/tests:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pip_installed_python_client_answers_a_rephrased_retry_once_and_runs_identical_steps() {
    let site = pip_install();
    let root = env!("CARGO_MANIFEST_DIR");
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let t = &s.config.kafka.topics;
    let out = Command::new("python3")
        .arg(format!("{root}/tests/interop/python_client.py"))
        .args([
            &s.config.kafka.brokers,
            &t.intents,
            &t.results,
            "create_ticket",
        ])
        .env("PYTHONPATH", site.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python_client.py:\n{stdout}\n{}\n--- stepgate log ---\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_tail(80)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();

    // The same partitioner as the gate checks (murmur2 of workflow_id).
    for (w, p) in lines[0]["partitions"].as_object().unwrap() {
        assert_eq!(
            p.as_i64().unwrap() as i32,
            stepgate::contract::partition_for(w, 4),
            "partition of {w:?}"
        );
    }

    let r = &lines[1];
    assert_eq!(r["first"]["status"], "ok");
    assert_eq!(r["first"]["deduplicated"], false);
    // The rephrased retry gets the first answer; only call_id and the flag differ.
    assert_eq!(r["again"]["deduplicated"], true);
    assert_eq!(r["again"]["call_id"], "model-call-1b");
    assert_eq!(r["again"]["output"], r["first"]["output"]);
    assert_eq!(r["again"]["status"], r["first"]["status"]);
    for k in ["one", "two"] {
        assert_eq!(r[k]["status"], "ok", "{k}");
        assert_eq!(r[k]["deduplicated"], false, "{k}");
    }
    assert_eq!(r["one"]["step_index"], 1);
    assert_eq!(r["two"]["step_index"], 2);
    assert_eq!(r["next_step"], 3);
    // The OpenAI Agents SDK adapter, as the SDK's runner calls a tool.
    let a = &lines[2]["agents"];
    assert!(a.is_object(), "openai-agents is installed (test.sh): {a}");
    let output = |k: &str| -> Value { serde_json::from_str(a[k].as_str().unwrap()).unwrap() };
    assert_eq!(output("first")["echo"]["title"], "Order confirmed");
    assert!(
        a["lost"].as_str().unwrap().starts_with("not answered yet"),
        "{a}"
    );
    // The model's rephrased retry takes the unanswered step: the first call's result.
    assert_eq!(output("retry")["echo"]["title"], "Refund issued");
    assert_eq!(output("same_a")["echo"]["title"], "Same");
    assert_eq!(output("same_b")["echo"]["title"], "Same");
    assert_eq!(a["state"]["next_step"], 4, "{a}");
    assert_eq!(
        a["state"]["unanswered"]["create_ticket"],
        serde_json::json!([])
    );

    // The LangGraph adapter, through LangGraph's ToolNode: the step index kept
    // in the state's `stepgate` channel (checkpointed).
    let g = &lines[3]["langgraph"];
    assert!(g.is_object(), "langgraph is installed (test.sh): {g}");
    let out = |k: &str, i: usize| -> Value {
        serde_json::from_str(g[k][i].as_str().unwrap()).unwrap_or(Value::Null)
    };
    assert_eq!(out("first", 0)["echo"]["title"], "Order confirmed", "{g}");
    assert!(
        g["lost"][0]
            .as_str()
            .unwrap()
            .starts_with("not answered yet"),
        "{g}"
    );
    assert_eq!(out("retry", 0)["echo"]["title"], "Refund issued", "{g}");
    assert_eq!(out("same", 0)["echo"]["title"], "Same", "{g}");
    assert_eq!(out("same", 1)["echo"]["title"], "Same", "{g}");

    // Counted at the tool: the rephrased retries never ran it.
    assert_eq!(s.tools.count("create_ticket"), 3 + 4 + 4);
    let keys: std::collections::BTreeSet<String> = s
        .tools
        .calls("create_ticket")
        .into_iter()
        .map(|c| c.idempotency_key)
        .collect();
    assert_eq!(keys.len(), 3 + 4 + 4, "one key per step");
}
