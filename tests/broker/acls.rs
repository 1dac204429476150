//! The whole path under Kafka ACLs (#57): an agent, a gate and a pool's
//! worker, each its own SCRAM principal on the SASL_SSL listener, granted
//! only what docs/deploying.md's ACL table lists for it — and the worker's
//! principal refused where the table gives it nothing.
//!
//! The test broker runs Kafka's StandardAuthorizer with
//! `allow.everyone.if.no.acl.found=true` (deploy/local/kafka.sh): the ACLs
//! granted here, on this test's topics, groups and transactional ids, guard
//! those; the topics are made over the plaintext listener, as an admin would.
//! Users and ACLs are made through librdkafka's Admin API
//! (`kafka_admin.py`, confluent-kafka).

use crate::common::*;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;
use stepgate::client::{Client, StepCall};
use stepgate::config::Config;
use stepgate::contract::Status;

const PASSWORD_VAR: &str = "STEPGATE_KAFKA_CLIENT_SASL_PASSWORD";
const WAIT: Duration = Duration::from_secs(90);

const TOOLS: &str = r#"
[tools.pool_pay]
category = "unkeyed"
pool = "gpu"
timeout = "20s"
retries = 0
"#;

/// `python3 kafka_admin.py <what>` with `input` on its standard input.
fn kafka_admin(what: &str, input: &Value) -> std::process::ExitStatus {
    use std::io::Write as _;
    let mut child = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/broker/kafka_admin.py"
        ))
        .arg(what)
        .env("KAFKA_SASL_SSL_ENV", secured_env_path())
        .stdin(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    child.wait().unwrap()
}

/// One principal of the test: a SCRAM user of its own.
struct Principal {
    name: String,
    password: String,
}

impl Principal {
    fn new(role: &str) -> Principal {
        Principal {
            name: random_name(role),
            password: random_name("pw"),
        }
    }

    fn user(&self) -> String {
        format!("User:{}", self.name)
    }

    /// `[kafka.client]` for this principal (its password comes from the
    /// environment, as docs/deploying.md has it).
    fn client(&self, sec: &Secured) -> BTreeMap<String, String> {
        let mut c = sec.client_properties(&sec.ca);
        c.insert("sasl.username".into(), self.name.clone());
        c
    }

    fn kafka(&self, sec: &Secured) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &sec.brokers);
        for (k, v) in self.client(sec) {
            c.set(k, v);
        }
        c.set("sasl.password", &self.password);
        c
    }
}

/// An ACL binding for `kafka_admin.py acls`.
fn acl(p: &Principal, resource: &str, pattern: &str, name: &str, operation: &str) -> Value {
    json!({"principal": p.user(), "resource": resource, "pattern": pattern, "name": name,
        "operation": operation})
}

/// docs/deploying.md's table, for this stack's names: the gate, a worker of
/// pool `gpu`, an agent.
fn documented_acls(s: &Stack, gate: &Principal, worker: &Principal, agent: &Principal) -> Value {
    let t = &s.config.kafka.topics;
    let group = &s.config.kafka.gate_group;
    let calls = t.calls_for("gpu");
    let calls_prefix = t.calls_for("");
    let mut v = Vec::new();
    // stepgate (`stepgate run`).
    for topic in [&t.intents, &t.commands, &t.progress, &t.changelog] {
        v.push(acl(gate, "topic", "literal", topic, "read"));
    }
    for topic in [
        &t.results,
        &t.dlq,
        &t.approvals,
        &t.progress,
        &t.changelog,
        &t.intents,
    ] {
        v.push(acl(gate, "topic", "literal", topic, "write"));
    }
    v.push(acl(gate, "topic", "prefixed", &calls_prefix, "write"));
    for op in ["describe", "describe_configs"] {
        v.push(acl(
            gate,
            "topic",
            "prefixed",
            &format!("{}.", s.prefix),
            op,
        ));
    }
    v.push(acl(gate, "group", "prefixed", group, "read"));
    for op in ["write", "describe"] {
        v.push(acl(
            gate,
            "transactional_id",
            "prefixed",
            &format!("{group}-gate-"),
            op,
        ));
    }
    // A worker of pool `gpu`.
    for op in ["read", "describe"] {
        v.push(acl(worker, "topic", "literal", &calls, op));
    }
    for op in ["write", "describe"] {
        v.push(acl(worker, "topic", "literal", &t.progress, op));
    }
    v.push(acl(
        worker,
        "group",
        "literal",
        &format!("{group}.pool.gpu"),
        "read",
    ));
    // An agent (the Rust client).
    for op in ["write", "describe"] {
        v.push(acl(agent, "topic", "literal", &t.intents, op));
    }
    for op in ["read", "describe"] {
        v.push(acl(agent, "topic", "literal", &t.results, op));
    }
    v.push(acl(agent, "group", "prefixed", "sg-", "read"));
    Value::Array(v)
}

/// Until `p` can log in (a new SCRAM user reaches the listener soon after
/// it is made).
async fn can_log_in(p: &Principal, sec: &Secured) {
    let consumer: BaseConsumer = p.kafka(sec).create().unwrap();
    let consumer = std::sync::Arc::new(consumer);
    let start = std::time::Instant::now();
    loop {
        let c = consumer.clone();
        let ok = tokio::task::spawn_blocking(move || {
            c.fetch_metadata(None, Duration::from_secs(5)).is_ok()
        })
        .await
        .unwrap();
        if ok {
            return;
        }
        assert!(start.elapsed() < WAIT, "{} never logged in", p.name);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A record `p` sends to `topic`: Ok, or the error code the broker answered.
async fn write_as(p: &Principal, sec: &Secured, topic: &str) -> Result<(), RDKafkaErrorCode> {
    let producer: FutureProducer = p
        .kafka(sec)
        .set("message.timeout.ms", "20000")
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::to(topic).key("forged").payload("{}"),
            Duration::from_secs(30),
        )
        .await
        .map(|_| ())
        .map_err(|(e, _)| e.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Unknown))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_path_runs_under_the_documented_acls_and_a_worker_writes_only_progress() {
    let sec = secured();
    assert!(
        kafka_admin("check", &json!(null)).success(),
        "the test broker runs no authorizer: restart it with this deploy/local/kafka.sh (`kafka.sh stop`, then `start`), which turns Kafka's StandardAuthorizer on"
    );
    let mut s = Stack::new(StackOptions {
        tool_tables: TOOLS.into(),
        ..StackOptions::default()
    })
    .await;
    stepgate::kafka::create_pool_topics(&s.config.kafka, &s.config.state, &["gpu".into()])
        .await
        .expect("the pool's calls topic");
    let (gate, worker, agent) = (
        Principal::new("gate"),
        Principal::new("worker"),
        Principal::new("agent"),
    );
    let users: BTreeMap<&str, &str> = [&gate, &worker, &agent]
        .iter()
        .map(|p| (p.name.as_str(), p.password.as_str()))
        .collect();
    assert!(kafka_admin("users", &json!(users)).success(), "users made");
    assert!(
        kafka_admin("acls", &documented_acls(&s, &gate, &worker, &agent)).success(),
        "ACLs granted"
    );
    for p in [&gate, &worker, &agent] {
        can_log_in(p, &sec).await;
    }

    // The gate, as its principal.
    s.config.kafka.brokers = sec.brokers.clone();
    s.config.kafka.client = gate.client(&sec);
    write_config(&s.config, &s.config_path);
    s.spawn(&[], &[(PASSWORD_VAR, &gate.password)]);
    s.wait_ready().await;

    // The pool's worker, as its own.
    let mut wc: Config = s.config.clone();
    wc.http.listen = String::new();
    wc.state.path = s.dir.path().join("worker-state-unused");
    wc.kafka.client = worker.client(&sec);
    wc.tools = Config::from_toml_str(
        &format!(
            "[tools.pool_pay]\ncategory = \"unkeyed\"\nurl = \"{}/pool_pay\"\ntimeout = \"20s\"\nretries = 0\n",
            s.tools.base
        ),
        Vec::new(),
    )
    .unwrap()
    .tools;
    let wc_path = s.dir.path().join("worker.toml");
    write_config(&wc, &wc_path);
    let log = s.dir.path().join("worker-acl.log");
    let _worker = Killed(
        Command::new(stepgate_bin())
            .args(["worker", "--pool", "gpu", "--config"])
            .arg(&wc_path)
            .env(PASSWORD_VAR, &worker.password)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("stepgate worker starts"),
    );

    // The agent, as its own: a pool tool's call and an in-process one.
    let mut options = stepgate::client::options_from_config(&s.config);
    options.kafka = agent.client(&sec);
    options
        .kafka
        .insert("sasl.password".into(), agent.password.clone());
    options.timeout = WAIT;
    let client = Client::new(options).await.expect("the agent connects");
    let worker_log = || std::fs::read_to_string(&log).unwrap_or_default();
    for (step, tool) in [(0, "pool_pay"), (1, "create_ticket")] {
        let call = StepCall::new("wf-acl", step, tool, json!({"n": step}))
            .unwrap()
            .call_id(&format!("acl-{step}"));
        let answer = client.call(call).await.unwrap_or_else(|e| {
            panic!(
                "{tool} under ACLs: {e}\n{}\nworker:\n{}",
                s.log_tail(40),
                worker_log()
            )
        });
        assert_eq!(
            answer.status,
            Status::Ok,
            "{answer:?}\n{}\nworker:\n{}",
            s.log_tail(40),
            worker_log()
        );
    }
    assert_eq!(s.tools.count("pool_pay"), 1);
    assert_eq!(s.tools.count("create_ticket"), 1);

    // What the worker's principal must not write: the gate's topics (calls
    // included: only gates publish calls), the agents', the operators'.
    let t = s.config.kafka.topics.clone();
    for topic in [
        t.calls_for("gpu"),
        t.intents.clone(),
        t.results.clone(),
        t.changelog.clone(),
        t.commands.clone(),
        t.approvals.clone(),
    ] {
        assert_eq!(
            write_as(&worker, &sec, &topic).await,
            Err(RDKafkaErrorCode::TopicAuthorizationFailed),
            "the worker's principal writes {topic}"
        );
    }
    // Nor an agent's `progress` (its outcomes would settle steps).
    assert_eq!(
        write_as(&agent, &sec, &t.progress).await,
        Err(RDKafkaErrorCode::TopicAuthorizationFailed)
    );
}
