//! stepgate and its Rust client through a `SASL_SSL` listener (SCRAM-SHA-512
//! over TLS): the test broker's second listener, which `deploy/local/kafka.sh`
//! runs with a throwaway CA and SCRAM user (`common::secured`). The config is
//! the documented one: `[kafka.client]` names the protocol, mechanism, user and
//! CA; the password comes from the environment
//! (`STEPGATE_KAFKA_CLIENT_SASL_PASSWORD`), never the file. A wrong password
//! and an untrusted CA each stop `stepgate run` at start with an error naming
//! the cause, within a bounded time, and so does the Rust client's connect.
//! The Python client (`clients/python`) and `stepgate mcp` (stdio) go through
//! the same listener.
//!
//! The topics are made over the plaintext listener (as an admin would); every
//! client of the test's gate and agent uses the secured one only.

use crate::common;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};
use stepgate::client::{Client, ClientError, ClientOptions, StepCall};
use stepgate::contract::Status;
use stepgate_client::ConnectError;

const PASSWORD_VAR: &str = "STEPGATE_KAFKA_CLIENT_SASL_PASSWORD";

/// How long a refused start may take: the first contact gives up on a
/// refused login or handshake at once, on silence after 15 s.
const REFUSED_WITHIN: Duration = Duration::from_secs(30);

/// A stack whose gate reaches the broker only through the SASL_SSL listener,
/// trusting `ca`; the password is left to the environment of each process.
async fn secured_stack(sec: &Secured, ca: &str) -> Stack {
    let mut s = Stack::new(StackOptions::default()).await;
    s.config.kafka.brokers = sec.brokers.clone();
    s.config.kafka.client = sec.client_properties(ca);
    s.config.validate().expect("the secured config is valid");
    write_config(&s.config, &s.config_path);
    let written = std::fs::read_to_string(&s.config_path).unwrap();
    assert!(
        written.contains("security.protocol") && !written.contains(&sec.password),
        "the file names the listener and holds no password:\n{written}"
    );
    s
}

/// The Rust client's options for the stack, with `password`.
fn client_options(s: &Stack, password: &str) -> ClientOptions {
    let mut o = stepgate::client::options_from_config(&s.config);
    o.kafka.insert("sasl.password".into(), password.into());
    o.timeout = Duration::from_secs(60);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_and_its_clients_work_through_sasl_ssl() {
    let sec = secured();
    let mut s = secured_stack(&sec, &sec.ca).await;
    s.spawn(&[], &[(PASSWORD_VAR, &sec.password)]);
    s.wait_ready().await;

    let client = Client::new(client_options(&s, &sec.password))
        .await
        .expect("the Rust client connects through SASL_SSL");
    let call = |id: &str| {
        StepCall::new("wf-sasl", 0, "create_ticket", json!({"title": "over TLS"}))
            .unwrap()
            .call_id(id)
    };
    let first = client.call(call("sasl-1")).await.unwrap();
    assert_eq!(first.status, Status::Ok, "{first:?}\n{}", s.log_tail(40));
    // The same step again (a retry with a new call id): the first answer.
    let again = client.call(call("sasl-2")).await.unwrap();
    same_but_call_id(&first, &again);
    assert_eq!(
        s.tools.count("create_ticket"),
        1,
        "one step, one invocation\n{}",
        s.log_tail(40)
    );

    // `stepgate call` reads the same file and environment.
    let out = tokio::process::Command::new(stepgate_bin())
        .args(["call", "--config"])
        .arg(&s.config_path)
        .args([
            "--workflow",
            "wf-sasl",
            "--step",
            "1",
            "--tool",
            "create_ticket",
        ])
        .args(["--args", r#"{"title": "from the CLI"}"#])
        .env(PASSWORD_VAR, &sec.password)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "stepgate call through SASL_SSL: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(s.tools.count("create_ticket"), 2, "the CLI's step ran once");

    // The Python client, with the same librdkafka properties, run twice on
    // one step: the second answer is the first's.
    let t = &s.config.kafka.topics;
    let script = r#"
import json, os, sys
from stepgate_client import Client
brokers, intents, results = sys.argv[1:4]
config = json.loads(os.environ["SG_KAFKA_CONFIG"])
config["sasl.password"] = os.environ["SG_SASL_PASSWORD"]
client = Client(brokers, intents, results, config=config)
for call_id in ("py-1", "py-2"):
    a = client.call("wf-sasl", 2, "create_ticket", {"title": "from Python"}, call_id=call_id)
    print(json.dumps({"status": a.status, "deduplicated": a.deduplicated}))
"#;
    let out = tokio::process::Command::new("python3")
        .args(["-c", script, &sec.brokers, &t.intents, &t.results])
        .env(
            "PYTHONPATH",
            concat!(env!("CARGO_MANIFEST_DIR"), "/clients/python"),
        )
        .env(
            "SG_KAFKA_CONFIG",
            serde_json::to_string(&s.config.kafka.client).unwrap(),
        )
        .env("SG_SASL_PASSWORD", &sec.password)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the Python client through SASL_SSL: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            r#"{"status": "ok", "deduplicated": false}"#,
            r#"{"status": "ok", "deduplicated": true}"#
        ],
        "{stdout}"
    );
    assert_eq!(
        s.tools.count("create_ticket"),
        3,
        "the Python client's step ran once"
    );
}

/// Start the gate with `password`, wait for it to exit by itself, and return
/// its log and how long that took.
async fn refused_start(s: &mut Stack, password: &str) -> (String, Duration) {
    let t0 = Instant::now();
    s.spawn(&[], &[(PASSWORD_VAR, password)]);
    let status = s.exited(REFUSED_WITHIN).await;
    let took = t0.elapsed();
    assert!(
        !status.success(),
        "the start is refused: {}",
        s.log_tail(80)
    );
    (s.log(), took)
}

/// The Rust client's connect with `password`: its error, bounded.
async fn refused_connect(s: &Stack, password: &str) -> ClientError {
    // Seen once in a full CI run: the client's 15 s went by with no word
    // from librdkafka at all (no refused handshake, no error), and it said
    // `Unreachable`, which is what it should say of a broker that does not
    // answer. That is not what these tests ask about, so such an attempt is
    // made again (at most twice more) and said; the cause of that silence
    // (the shared broker's TLS listener slow under the suite's load is the
    // likeliest) is not established.
    for attempt in 1..=3 {
        let t0 = Instant::now();
        let e = Client::new(client_options(s, password))
            .await
            .err()
            .expect("the connect is refused");
        if attempt < 3 && matches!(e, ClientError::Connect(ConnectError::Unreachable { .. })) {
            eprintln!("attempt {attempt}: {e} — trying again");
            continue;
        }
        assert!(
            t0.elapsed() < REFUSED_WITHIN,
            "refused in {:?}",
            t0.elapsed()
        );
        return e;
    }
    unreachable!("the last attempt returns")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_stops_the_start_naming_the_credentials() {
    let sec = secured();
    let mut s = secured_stack(&sec, &sec.ca).await;
    let wrong = "not-the-password-7f3a";
    let (log, took) = refused_start(&mut s, wrong).await;
    assert!(
        log.contains("refused this client's credentials") && log.contains("sasl.password"),
        "the error names the credentials ({took:?}):\n{log}"
    );
    assert!(
        !log.contains(wrong),
        "the password is never printed:\n{log}"
    );
    assert_eq!(s.tools.count("create_ticket"), 0);

    let e = refused_connect(&s, wrong).await;
    assert!(
        matches!(e, ClientError::Connect(ConnectError::Authentication { .. })),
        "{e:?}"
    );
    assert!(e.to_string().contains("sasl.password"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_ca_stops_the_start_naming_the_certificate() {
    let sec = secured();
    let mut s = secured_stack(&sec, &sec.untrusted_ca).await;
    let (log, took) = refused_start(&mut s, &sec.password).await;
    assert!(
        log.contains("TLS handshake") && log.contains("ssl.ca.location"),
        "the error names the certificate check ({took:?}):\n{log}"
    );
    assert!(
        !log.contains(&sec.password),
        "the password is never printed:\n{log}"
    );

    let e = refused_connect(&s, &sec.password).await;
    assert!(
        matches!(e, ClientError::Connect(ConnectError::Tls { .. })),
        "{e:?}"
    );
    assert!(e.to_string().contains("ssl.ca.location"), "{e}");
}

/// `stepgate mcp` (stdio) with the same file and environment: a `tools/call`
/// of a step, twice, runs the tool once; with a wrong password it stops at
/// start naming the credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stepgate_mcp_works_through_sasl_ssl() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let sec = secured();
    let mut s = secured_stack(&sec, &sec.ca).await;
    s.spawn(&[], &[(PASSWORD_VAR, &sec.password)]);
    s.wait_ready().await;

    let mut mcp = tokio::process::Command::new(stepgate_bin())
        .args(["mcp", "--config"])
        .arg(&s.config_path)
        .env(PASSWORD_VAR, &sec.password)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(s.dir.path().join("mcp.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = mcp.stdin.take().unwrap();
    let mut lines = BufReader::new(mcp.stdout.take().unwrap()).lines();
    let mcp_log = || std::fs::read_to_string(s.dir.path().join("mcp.log")).unwrap_or_default();
    let call = |id: u64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "create_ticket", "arguments": {"title": "through MCP"},
            "_meta": {"workflow_id": "wf-sasl-mcp", "step_index": 0}}})
    };
    let requests = [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "secured", "version": "0"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        call(2),
        call(3),
    ];
    let mut answers = Vec::new();
    for r in requests {
        stdin.write_all(format!("{r}\n").as_bytes()).await.unwrap();
        let Some(id) = r.get("id") else { continue };
        let line = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let l = lines
                    .next_line()
                    .await
                    .unwrap()
                    .expect("stepgate mcp answers");
                let v: serde_json::Value = serde_json::from_str(&l).unwrap();
                if v.get("id") == Some(id) {
                    return v;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no answer to {r}: {}", mcp_log()));
        answers.push(line);
    }
    for a in &answers[1..] {
        assert_eq!(
            a["result"]["isError"],
            false,
            "{a}\n{}\n{}",
            mcp_log(),
            s.log_tail(40)
        );
    }
    assert_eq!(
        s.tools.count("create_ticket"),
        1,
        "one step through MCP, one invocation"
    );
    drop(stdin);

    // A wrong password: `stepgate mcp` stops at start, naming the cause.
    let t0 = Instant::now();
    let out = tokio::time::timeout(
        REFUSED_WITHIN,
        tokio::process::Command::new(stepgate_bin())
            .args(["mcp", "--config"])
            .arg(&s.config_path)
            .env(PASSWORD_VAR, "not-the-password-7f3a")
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("stepgate mcp stops within the bound")
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("refused this client's credentials"),
        "({:?}) {err}",
        t0.elapsed()
    );
}
