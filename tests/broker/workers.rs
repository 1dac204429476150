//! Worker pools (docs/design.md "Worker pools", #31), on the real broker: a
//! tool declared `pool = "…"` is run by `stepgate worker` processes, never by
//! the gate (whose config names no URL for it). Effects are counted at the
//! test's tool server, which records every raw invocation and, for
//! `Reply::Provider`, deduplicates by `Idempotency-Key` as a provider does.

use crate::common;

use common::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use stepgate::config::Config;
use stepgate::contract::Status;

/// The gate's view of the pool tools: a category, a pool and a deadline;
/// no address, no headers.
const POOL_TOOLS: &str = r#"
[tools.render]
category = "unkeyed"
pool = "gpu"
timeout = "4s"
retries = 0

[tools.charge_remote]
category = "keyed"
pool = "gpu"
timeout = "10s"
retries = 0

[tools.lonely]
category = "keyed"
pool = "nobody"
timeout = "1s"
retries = 0

[tools.echo_pool]
category = "keyed"
pool = "gpu"
timeout = "5s"
"#;

async fn pool_stack() -> Stack {
    Stack::new(StackOptions {
        tool_tables: POOL_TOOLS.into(),
        ..StackOptions::default()
    })
    .await
}

/// The worker's config: the stack's Kafka settings, and the pool's tools with
/// their addresses (at the test's tool server) — configured here only.
fn worker_config(s: &Stack) -> PathBuf {
    let mut cfg: Config = s.config.clone();
    cfg.http.listen = String::new();
    cfg.state.path = s.dir.path().join("worker-state-unused");
    let tables = format!(
        r#"
[tools.render]
category = "unkeyed"
url = "{base}/render"
timeout = "4s"
retries = 0

[tools.charge_remote]
category = "keyed"
url = "{base}/charge_remote"
timeout = "10s"
retries = 0

[tools.echo_pool]
category = "keyed"
url = "{base}/echo_pool"
timeout = "5s"
"#,
        base = s.tools.base
    );
    cfg.tools = Config::from_toml_str(&tables, Vec::new())
        .expect("the worker's tools")
        .tools;
    cfg.validate().expect("the worker's config is valid");
    let path = s.dir.path().join("worker.toml");
    write_config(&cfg, &path);
    path
}

/// `stepgate worker --pool gpu`, logging to `worker-<name>.log`; killed -9
/// when dropped. `name` is its static group member id.
pub(crate) fn spawn_worker(s: &Stack, config: &PathBuf, name: &str) -> Killed {
    spawn_worker_with(s, config, name, &[])
}

fn spawn_worker_with(s: &Stack, config: &PathBuf, name: &str, args: &[&str]) -> Killed {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(s.dir.path().join(format!("worker-{name}.log")))
        .unwrap();
    Killed(
        Command::new(stepgate_bin())
            .args(["worker", "--pool", "gpu", "--instance-id"])
            .arg(format!("{}-worker-{name}", s.prefix))
            .arg("--config")
            .arg(config)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("stepgate worker starts"),
    )
}

pub(crate) fn worker_log(s: &Stack, name: &str) -> String {
    std::fs::read_to_string(s.dir.path().join(format!("worker-{name}.log"))).unwrap_or_default()
}

/// kill -9 a worker (as `Killed`'s drop does, said explicitly).
fn kill9(w: Killed) {
    drop(w);
}

/// The raw invocations of `tool` for one workflow's steps.
fn runs_of(s: &Stack, tool: &str, wf: &str) -> usize {
    s.tools
        .calls(tool)
        .iter()
        .filter(|c| c.headers.get("stepgate-workflow-id").map(String::as_str) == Some(wf))
        .count()
}

#[tokio::test]
async fn a_pool_tool_is_run_by_its_worker_once_and_repeats_are_answered_by_the_gate() {
    let mut s = pool_stack().await;
    assert!(
        s.config.tools["render"].url.is_empty(),
        "the gate has no address for a pool tool"
    );
    s.start().await;
    let wc = worker_config(&s);
    let _worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let wf = random_name("wf");

    let first = agent
        .call(intent(&wf, 0, "render", json!({"page": 1}), "c1"))
        .await;
    assert_eq!(
        first.status,
        Status::Ok,
        "{first:?}\n{}",
        worker_log(&s, "a")
    );
    assert!(!first.deduplicated);
    assert_eq!(first.output.as_ref().unwrap()["echo"], json!({"page": 1}));
    let calls = s.tools.calls("render");
    assert_eq!(calls.len(), 1, "the tool ran once");
    // The worker sent the step's headers and key, as the gate's invoker does.
    let key = stepgate::contract::StepKey {
        workflow_id: wf.clone(),
        step_index: 0,
        tool: "render".into(),
        attempt: 0,
    }
    .idempotency_key();
    assert_eq!(calls[0].idempotency_key, key);
    assert_eq!(calls[0].headers["stepgate-workflow-id"], wf);

    // A repeat (rephrased, even) is the gate's answer; the tool is not run again.
    let again = agent
        .call(intent(&wf, 0, "render", json!({"page": "one"}), "c2"))
        .await;
    assert!(again.deduplicated);
    same_but_call_id(&first, &again);
    assert_eq!(s.tools.count("render"), 1);

    // A keyed pool tool too, and the gate counted what it published.
    let k = agent
        .call(intent(&wf, 1, "charge_remote", json!({"cents": 5}), "c3"))
        .await;
    assert_eq!(k.status, Status::Ok, "{k:?}");
    assert_eq!(s.tools.count("charge_remote"), 1);
    let m = s.metrics().await;
    assert!(
        m.contains(r#"stepgate_pool_calls_total{pool="gpu",tool="render"} 1"#),
        "{m}"
    );
}

/// kill -9 a worker after it took an unkeyed call and before the tool
/// answered: the step ends `in_doubt` at its deadline, and no worker ever
/// invokes it again — not the restarted one, which goes on with later calls.
#[tokio::test]
async fn an_unkeyed_call_whose_worker_dies_mid_call_is_in_doubt_and_never_run_again() {
    let mut s = pool_stack().await;
    s.tools.script(
        "render",
        vec![Reply::Delay(Duration::from_secs(120)), Reply::Ok],
    );
    s.start().await;
    let wc = worker_config(&s);
    let worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let wf = random_name("wf");

    agent.send(&intent(&wf, 0, "render", json!({}), "u1")).await;
    eventually(
        Duration::from_secs(60),
        "the worker invokes the tool",
        || s.tools.count("render") == 1,
    )
    .await;
    kill9(worker);

    let answer = agent.answer("u1", Duration::from_secs(60)).await;
    assert_eq!(answer.status, Status::InDoubt, "{answer:?}");
    assert_eq!(answer.error.as_ref().unwrap().kind, "executor_lost");

    // A new worker of the pool (the same member) takes the next call and
    // never the one taken by the dead worker.
    let _again = spawn_worker(&s, &wc, "a");
    let next = agent.call(intent(&wf, 1, "render", json!({}), "u2")).await;
    assert_eq!(next.status, Status::Ok, "{next:?}\n{}", worker_log(&s, "a"));
    assert_eq!(runs_of(&s, "render", &wf), 2);
    let step0: Vec<_> = s
        .tools
        .calls("render")
        .into_iter()
        .filter(|c| c.headers["stepgate-step-index"] == "0")
        .collect();
    assert_eq!(step0.len(), 1, "the unkeyed step was invoked once");
    // A repeat gets the same in_doubt answer.
    let repeat = agent.call(intent(&wf, 0, "render", json!({}), "u3")).await;
    same_but_call_id(&answer, &repeat);
    assert_eq!(s.tools.count("render"), 2);
}

/// kill -9 a worker during a keyed call: the next member runs it again with
/// the same key; the provider performs one effect; the agent gets `ok`.
#[tokio::test]
async fn a_keyed_call_whose_worker_dies_is_run_again_with_one_key_and_one_effect() {
    let mut s = pool_stack().await;
    s.tools.script(
        "charge_remote",
        vec![Reply::Provider(Duration::from_secs(3))],
    );
    s.start().await;
    let wc = worker_config(&s);
    let worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let wf = random_name("wf");

    agent
        .send(&intent(
            &wf,
            0,
            "charge_remote",
            json!({"cents": 700}),
            "k1",
        ))
        .await;
    eventually(
        Duration::from_secs(60),
        "the worker invokes the tool",
        || s.tools.count("charge_remote") == 1,
    )
    .await;
    kill9(worker);
    let _again = spawn_worker(&s, &wc, "a");

    let answer = agent.answer("k1", Duration::from_secs(90)).await;
    assert_eq!(
        answer.status,
        Status::Ok,
        "{answer:?}\n{}",
        worker_log(&s, "a")
    );
    assert!(
        s.tools.count("charge_remote") >= 2,
        "the call was run again after the crash"
    );
    let keys = s.tools.keys_per_step("charge_remote");
    assert_eq!(keys.len(), 1);
    assert!(keys.values().all(|k| k.len() == 1), "one key: {keys:?}");
    assert_eq!(s.tools.performed("charge_remote"), 1, "one effect");
    assert_eq!(
        answer.output.as_ref().unwrap()["performed_for"],
        json!(keys.values().next().unwrap().iter().next().unwrap())
    );
    assert_eq!(agent.answers("k1").len(), 1);
}

/// kill -9 the gate while a worker holds calls: the outcomes wait on
/// `progress` and the gate's next process settles each once.
#[tokio::test]
async fn outcomes_of_calls_held_while_the_gate_dies_are_settled_once_by_the_next_owner() {
    let mut s = pool_stack().await;
    s.tools
        .script("render", vec![Reply::Delay(Duration::from_secs(2))]);
    s.tools.script(
        "charge_remote",
        vec![Reply::Provider(Duration::from_secs(2))],
    );
    s.start().await;
    let wc = worker_config(&s);
    let _worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let wf = random_name("wf");

    agent.send(&intent(&wf, 0, "render", json!({}), "g1")).await;
    agent
        .send(&intent(&wf, 1, "charge_remote", json!({}), "g2"))
        .await;
    eventually(
        Duration::from_secs(60),
        "the worker holds both calls",
        || s.tools.count("render") == 1 && s.tools.count("charge_remote") == 1,
    )
    .await;
    s.kill();
    s.start().await;

    for id in ["g1", "g2"] {
        let a = agent.answer(id, Duration::from_secs(60)).await;
        assert_eq!(a.status, Status::Ok, "{id}: {a:?}\n{}", s.log_tail(40));
        assert!(!a.deduplicated);
    }
    assert_eq!(s.tools.count("render"), 1);
    assert_eq!(s.tools.performed("charge_remote"), 1);
    // Answered once each: a later step's answer shows the gate went on past them.
    let later = agent.call(intent(&wf, 2, "render", json!({}), "g3")).await;
    assert_eq!(later.status, Status::Ok);
    assert_eq!(agent.answers("g1").len(), 1);
    assert_eq!(agent.answers("g2").len(), 1);
}

/// A pool with no worker: at the call's deadline the agent is told that
/// nothing was done (`no_worker`), not `in_doubt`, and the gate counts it.
#[tokio::test]
async fn a_pool_with_no_worker_answers_no_worker_at_the_deadline() {
    let mut s = pool_stack().await;
    s.start().await;
    let agent = s.agent();
    let wf = random_name("wf");
    let answer = agent.call(intent(&wf, 0, "lonely", json!({}), "n1")).await;
    assert_eq!(answer.status, Status::Error, "{answer:?}");
    let error = answer.error.as_ref().unwrap();
    assert_eq!(error.kind, "no_worker");
    assert!(error.message.contains("`nobody`"), "{}", error.message);
    assert!(
        error.message.contains("Nothing was done"),
        "{}",
        error.message
    );
    s.metrics_until(
        r#"stepgate_pool_unclaimed_total{pool="nobody",tool="lonely"} 1"#,
        Duration::from_secs(10),
    )
    .await;
    // The call was published all the same (a worker started late would see
    // it, past its take_by time, and leave it).
    let calls = s
        .reader("calls.nobody")
        .wait_for(1, Duration::from_secs(30))
        .await;
    assert_eq!(calls[0].value["step"]["tool"], json!("lonely"));
    assert_eq!(calls[0].value["category"], json!("keyed"));
}

/// A pool tool served over MCP: the worker speaks MCP `tools/call` to it
/// (the same client as the gate's in-process invoker), with the step's key
/// in `_meta`; the gate's config names neither the server nor the protocol.
#[tokio::test]
async fn a_worker_calls_an_mcp_tool_with_the_steps_key() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut s = Stack::new(StackOptions {
        tool_tables:
            "[tools.create_ticket]\ncategory = \"keyed\"\npool = \"gpu\"\ntimeout = \"10s\"\n"
                .into(),
        ..StackOptions::default()
    })
    .await;
    let counts = s.dir.path().join("counts.json");
    let port = free_port();
    let _server = Killed(
        Command::new("python3")
            .arg(format!("{root}/tests/interop/mcp_tool_server.py"))
            .arg(port.to_string())
            .arg(&counts)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(s.dir.path().join("mcp-server.log")).unwrap())
            .spawn()
            .expect("python3 runs"),
    );
    eventually(
        Duration::from_secs(60),
        "the MCP tool server listens",
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
    )
    .await;
    s.start().await;
    let mut cfg: Config = s.config.clone();
    cfg.http.listen = String::new();
    cfg.tools = Config::from_toml_str(
        &format!(
            "[tools.create_ticket]\ncategory = \"keyed\"\nmcp = \"http://127.0.0.1:{port}/mcp\"\ntimeout = \"10s\"\n"
        ),
        Vec::new(),
    )
    .unwrap()
    .tools;
    let wc = s.dir.path().join("worker-mcp.toml");
    write_config(&cfg, &wc);
    let _worker = spawn_worker(&s, &wc, "mcp");
    let agent = s.agent();
    let wf = random_name("wf");

    let first = agent
        .call(intent(
            &wf,
            0,
            "create_ticket",
            json!({"title": "printer"}),
            "m1",
        ))
        .await;
    assert_eq!(
        first.status,
        Status::Ok,
        "{first:?}\n{}",
        worker_log(&s, "mcp")
    );
    assert_eq!(first.output.as_ref().unwrap()["title"], json!("printer"));
    let again = agent
        .call(intent(
            &wf,
            0,
            "create_ticket",
            json!({"title": "printer"}),
            "m2",
        ))
        .await;
    same_but_call_id(&first, &again);
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&counts).unwrap()).unwrap();
    let key = stepgate::contract::StepKey {
        workflow_id: wf,
        step_index: 0,
        tool: "create_ticket".into(),
        attempt: 0,
    }
    .idempotency_key();
    assert_eq!(
        recorded["invocations"],
        json!([key]),
        "one invocation, with the step's key"
    );
}

/// SIGTERM: a worker finishes the call it holds, reports it, commits it
/// and exits 0; the call is not run again.
#[tokio::test]
async fn a_worker_stopped_with_sigterm_finishes_its_call_first() {
    let mut s = pool_stack().await;
    s.tools
        .script("charge_remote", vec![Reply::Delay(Duration::from_secs(2))]);
    s.start().await;
    let wc = worker_config(&s);
    let mut worker = spawn_worker(&s, &wc, "a");
    let agent = s.agent();
    let wf = random_name("wf");
    agent
        .send(&intent(&wf, 0, "charge_remote", json!({}), "t1"))
        .await;
    eventually(
        Duration::from_secs(60),
        "the worker invokes the tool",
        || s.tools.count("charge_remote") == 1,
    )
    .await;
    Command::new("kill")
        .args(["-TERM", &worker.0.id().to_string()])
        .status()
        .unwrap();
    let answer = agent.answer("t1", Duration::from_secs(60)).await;
    assert_eq!(
        answer.status,
        Status::Ok,
        "{answer:?}\n{}",
        worker_log(&s, "a")
    );
    let mut exit = None;
    eventually(Duration::from_secs(30), "the worker exits", || {
        exit = worker.0.try_wait().unwrap();
        exit.is_some()
    })
    .await;
    assert!(exit.unwrap().success(), "{}", worker_log(&s, "a"));
    // A new member starts after the committed call: the next one only.
    let _again = spawn_worker(&s, &wc, "a");
    let next = agent
        .call(intent(&wf, 1, "charge_remote", json!({}), "t2"))
        .await;
    assert_eq!(next.status, Status::Ok);
    assert_eq!(s.tools.count("charge_remote"), 2);
}

/// Two workers of one pool share its calls (a consumer group over the calls
/// topic's partitions): every call is run once, by one of them, and both take
/// some.
#[tokio::test]
async fn two_workers_share_a_pools_calls_each_run_once() {
    let mut s = pool_stack().await;
    s.start().await;
    let wc = worker_config(&s);
    let _a = spawn_worker(&s, &wc, "a");
    let _b = spawn_worker(&s, &wc, "b");
    // Both are members with partitions (the group has settled on two).
    let assigned = |name: &str| {
        worker_log(&s, name)
            .lines()
            .rev()
            .find(|l| l.contains("calls partitions assigned"))
            .is_some_and(|l| !l.contains("partitions=[]"))
    };
    eventually(
        Duration::from_secs(60),
        "both workers own partitions",
        || assigned("a") && assigned("b"),
    )
    .await;
    let agent = s.agent();
    let run = random_name("wf");
    for i in 0..24 {
        agent
            .send(&intent(
                &format!("{run}-{i}"),
                0,
                "echo_pool",
                json!({"i": i}),
                &format!("s{i}"),
            ))
            .await;
    }
    for i in 0..24 {
        let a = agent
            .answer(&format!("s{i}"), Duration::from_secs(60))
            .await;
        assert_eq!(a.status, Status::Ok, "{a:?}");
    }
    assert_eq!(s.tools.count("echo_pool"), 24, "each call run once");
    let took = |name: &str| worker_log(&s, name).matches("call taken").count();
    assert_eq!(took("a") + took("b"), 24);
    assert!(
        took("a") > 0 && took("b") > 0,
        "a took {}, b took {}",
        took("a"),
        took("b")
    );
}

/// `--rate echo_pool=5`: 15 calls sent at once start at most 5 a second
/// (a burst of 5, then one every 200 ms), so the last is answered no sooner
/// than 2 s after they were sent; all are answered, each run once.
#[tokio::test]
async fn a_workers_rate_limit_spaces_a_tools_calls() {
    let mut s = pool_stack().await;
    s.start().await;
    let wc = worker_config(&s);
    let _worker = spawn_worker_with(&s, &wc, "rated", &["--rate", "echo_pool=5"]);
    let agent = s.agent();
    let wf = random_name("wf");
    // The worker is up and has its partitions: one call through first.
    let first = agent
        .call(intent(&wf, 0, "echo_pool", json!({}), "r0"))
        .await;
    assert_eq!(first.status, Status::Ok, "{first:?}");
    // At most 5 of the next 15 find a token (the bucket holds 5): the other
    // 10 wait their turns, one every 200 ms.
    let t = std::time::Instant::now();
    for i in 1..=15 {
        agent
            .send(&intent(&wf, i, "echo_pool", json!({}), &format!("r{i}")))
            .await;
    }
    for i in 1..=15 {
        let a = agent
            .answer(&format!("r{i}"), Duration::from_secs(60))
            .await;
        assert_eq!(a.status, Status::Ok, "{a:?}");
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1900),
        "15 calls at 5 a second were answered in {took:?}"
    );
    assert_eq!(s.tools.count("echo_pool"), 16);
}

/// The latency the worker path adds, beside the in-process path on the same
/// run: one agent, one new step at a time, publish → answer, alternating an
/// in-process `keyed` tool and a pool's `keyed` tool (same tool server). A
/// benchmark, not a check: run it with the binary to measure, e.g.
/// `STEPGATE_BIN=$CARGO_TARGET_DIR/release/stepgate cargo test --features
/// test-hooks --test broker workers::worker_path_latency -- --ignored --nocapture`
/// (`WORKER_BENCH_STEPS`: steps per path, default 200).
#[tokio::test]
#[ignore = "a benchmark: prints the figures (run with --ignored --nocapture)"]
async fn worker_path_latency_beside_in_process() {
    let n: usize = std::env::var("WORKER_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut s = pool_stack().await;
    s.start().await;
    let wc = worker_config(&s);
    let concurrency = std::env::var("WORKER_BENCH_CONCURRENCY").unwrap_or_else(|_| "64".into());
    let _worker = spawn_worker_with(&s, &wc, "bench", &["--concurrency", &concurrency]);
    let agent = s.agent();
    let run = random_name("b");
    let timed = |tool: &'static str, i: usize| {
        let (agent, wf) = (&agent, format!("{run}-{tool}-w{}", i % 16));
        async move {
            let id = format!("{tool}-{i}");
            let t = std::time::Instant::now();
            agent
                .send(&intent(&wf, (i / 16) as u64, tool, json!({"i": i}), &id))
                .await;
            let until = t + Duration::from_secs(30);
            loop {
                if let Some((_, a)) = agent.answers(&id).pop() {
                    assert_eq!(a.status, Status::Ok, "{a:?}");
                    return t.elapsed();
                }
                assert!(std::time::Instant::now() < until, "no answer for {id}");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    };
    // Warm-up (group joins, first transactions, connections), not counted.
    for i in 0..10 {
        timed("send_email", 100_000 + i).await;
        timed("echo_pool", 100_000 + i).await;
    }
    let (mut local, mut pool) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        local.push(timed("send_email", i).await);
        pool.push(timed("echo_pool", i).await);
    }
    let pct = |v: &mut Vec<Duration>, q: f64| {
        v.sort();
        let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
        v[i].as_secs_f64() * 1000.0
    };
    let (l50, l99) = (pct(&mut local, 0.50), pct(&mut local, 0.99));
    let (p50, p99) = (pct(&mut pool, 0.50), pct(&mut pool, 0.99));
    println!(
        "sequential new steps, {n} per path, alternating (binary: {}):",
        stepgate_bin()
    );
    println!("  in-process  p50 {l50:7.1} ms  p99 {l99:7.1} ms");
    println!("  worker pool p50 {p50:7.1} ms  p99 {p99:7.1} ms");
    println!(
        "  the worker path adds p50 {:+.1} ms, p99 {:+.1} ms",
        p50 - l50,
        p99 - l99
    );
    assert_eq!(s.tools.count("echo_pool"), n + 10);

    // Flood: `WORKER_BENCH_FLOOD` new steps (default 2000) published at once
    // per path, timed until the last is answered.
    let flood: usize = std::env::var("WORKER_BENCH_FLOOD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let flooded = |tool: &'static str| {
        let (agent, run) = (&agent, &run);
        async move {
            let t = std::time::Instant::now();
            futures::future::join_all((0..flood).map(|i| {
                let wf = format!("{run}-flood-{tool}-w{}", i % 64);
                let id = format!("flood-{tool}-{i}");
                async move {
                    agent
                        .send(&intent(&wf, (i / 64) as u64, tool, json!({"i": i}), &id))
                        .await
                }
            }))
            .await;
            let prefix = format!("flood-{tool}-");
            let answered = || {
                agent
                    .results
                    .all()
                    .iter()
                    .filter(|r| {
                        r.value["call_id"]
                            .as_str()
                            .is_some_and(|c| c.starts_with(&prefix))
                    })
                    .count()
            };
            eventually(Duration::from_secs(300), "the flood is answered", || {
                answered() >= flood
            })
            .await;
            flood as f64 / t.elapsed().as_secs_f64()
        }
    };
    let local_rate = flooded("send_email").await;
    let pool_rate = flooded("echo_pool").await;
    println!("flood of {flood} new steps per path (published at once, timed to the last answer):");
    println!("  in-process  {local_rate:7.0} steps/s");
    println!("  worker pool {pool_rate:7.0} steps/s (one worker, --concurrency {concurrency})");
}
