//! Shared test harness: a real broker from `KAFKA_BROKERS`, random topics and
//! groups per test, a counting HTTP tool server, the stepgate binary as a child
//! process (so it can be killed -9), and an agent that reads answers by call id.
#![allow(dead_code)]

pub mod load;
pub mod processes;
pub mod proxy;

/// The fault scenarios (gates killed, frozen or restarted under load; brokers
/// of their own) load both cores, and each waits on timings the others would
/// stretch: they run one at a time across the test binary (`edges`, `faults`,
/// `cluster_faults`).
pub static FAULTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepgate::config::{
    Config, ExecutorConfig, HttpConfig, KafkaConfig, LogConfig, StateConfig, ToolConfig,
    TopicsConfig,
};
use stepgate::contract::ToolResult;
pub use stepgate::duration::dur;
use tokio::sync::Notify;

pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The replication factor of the tests' topics: `KAFKA_REPLICATION_FACTOR`
/// (3 on `deploy/local/cluster.sh`'s cluster, whose `min.insync.replicas` is
/// 2), else 1.
pub fn replication_factor() -> i32 {
    std::env::var("KAFKA_REPLICATION_FACTOR")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// Set a topic's config `name` to `value`, keeping its other dynamic configs
/// (AlterConfigs replaces a topic's whole set).
pub async fn set_topic_config(topic: &str, name: &str, value: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ConfigSource, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let described = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .unwrap();
    let current = described.into_iter().next().unwrap().unwrap();
    let kept: Vec<(String, String)> = current
        .entries
        .into_iter()
        .filter(|e| matches!(e.source, ConfigSource::DynamicTopic) && e.name != name)
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    let mut alter = AlterConfig::new(ResourceSpecifier::Topic(topic)).set(name, value);
    for (k, v) in &kept {
        alter = alter.set(k, v);
    }
    let r = admin.alter_configs([&alter], &opts).await.unwrap();
    r.into_iter().next().unwrap().unwrap();
}

pub fn random_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}-{:x}-{}",
        nanos & 0xffff_ffff_ffff,
        std::process::id()
    )
}

/// A `/metrics` scrape as series (name with labels) → value.
pub fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// The values of the changelog's records (every partition, all of it) whose
/// key names `workflow`, in each partition's order; `None` for a tombstone.
pub async fn changelog_values(brokers: &str, topic: &str, workflow: &str) -> Vec<Option<Vec<u8>>> {
    let (brokers, topic, workflow) = (brokers.to_owned(), topic.to_owned(), workflow.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", random_name("changelog-reader"))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", "read_committed")
            .create()
            .unwrap();
        let metadata = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .unwrap();
        let partitions = metadata.topics()[0].partitions().len();
        assert!(partitions > 0, "{topic} has partitions");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(&topic, p as i32, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let mut ended = std::collections::BTreeSet::new();
        let until = Instant::now() + Duration::from_secs(30);
        while ended.len() < partitions {
            assert!(Instant::now() < until, "reading the changelog took 30 s");
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m))
                    if m.key().is_some_and(|k| {
                        k.windows(workflow.len()).any(|w| w == workflow.as_bytes())
                    }) =>
                {
                    out.push(m.payload().map(<[u8]>::to_vec));
                }
                Some(Ok(_)) => {}
                Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                    ended.insert(p);
                }
                Some(Err(e)) => panic!("reading the changelog: {e}"),
                None => {}
            }
        }
        out
    })
    .await
    .unwrap()
}

/// Wait for `cond` (polled every 50 ms) or fail after `limit`.
pub async fn eventually<F: FnMut() -> bool>(limit: Duration, what: &str, mut cond: F) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------- tool server

/// How a tool answers, per invocation number (1-based); the last entry repeats.
#[derive(Clone, Debug)]
pub enum Reply {
    Ok,
    Status(u16),
    /// Answer 200 after this delay.
    Delay(Duration),
    /// A provider that deduplicates by `Idempotency-Key`, as Stripe and the
    /// IETF draft do: the first request with a key performs the effect (an
    /// entry in [`ToolServer::performed`]) and answers after this delay; a
    /// request with the key while that runs gets 409 Conflict; one after it
    /// gets the stored answer.
    Provider(Duration),
}

#[derive(Clone, Debug)]
pub struct Invocation {
    pub tool: String,
    pub idempotency_key: String,
    pub headers: HashMap<String, String>,
    pub body: Value,
}

#[derive(Default)]
struct ToolState {
    script: HashMap<String, Vec<Reply>>,
    calls: Vec<Invocation>,
    /// [`Reply::Provider`]: per (tool, key), the stored answer once performed.
    provider: HashMap<(String, String), Option<Value>>,
}

#[derive(Clone)]
pub struct ToolServer {
    pub base: String,
    state: Arc<Mutex<ToolState>>,
    pub entered: Arc<Notify>,
}

impl ToolServer {
    pub async fn start() -> ToolServer {
        let state = Arc::new(Mutex::new(ToolState::default()));
        let entered = Arc::new(Notify::new());
        let app = Router::new()
            .route("/t/{name}", post(handle))
            .with_state((state.clone(), entered.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        ToolServer {
            base: format!("http://{addr}/t"),
            state,
            entered,
        }
    }

    pub fn script(&self, tool: &str, replies: Vec<Reply>) {
        self.state
            .lock()
            .unwrap()
            .script
            .insert(tool.into(), replies);
    }

    pub fn calls(&self, tool: &str) -> Vec<Invocation> {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.tool == tool)
            .cloned()
            .collect()
    }

    pub fn count(&self, tool: &str) -> usize {
        self.calls(tool).len()
    }

    /// Effects a [`Reply::Provider`] tool performed (one per key it saw first).
    pub fn performed(&self, tool: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .provider
            .keys()
            .filter(|(t, _)| t == tool)
            .count()
    }

    /// The effects a provider that deduplicates by `Idempotency-Key` performs:
    /// one per distinct key (raw invocations are [`ToolServer::count`]).
    pub fn effects(&self, tool: &str) -> usize {
        self.keys_per_step(tool).values().map(|k| k.len()).sum()
    }

    /// Per step (workflow id, step index, attempt, from the stepgate headers):
    /// the distinct keys its invocations carried. One step, one key.
    pub fn keys_per_step(
        &self,
        tool: &str,
    ) -> HashMap<(String, String, String), std::collections::BTreeSet<String>> {
        let mut out: HashMap<_, std::collections::BTreeSet<String>> = HashMap::new();
        for c in self.calls(tool) {
            let h = |k: &str| c.headers.get(k).cloned().unwrap_or_default();
            out.entry((
                h("stepgate-workflow-id"),
                h("stepgate-step-index"),
                h("stepgate-attempt"),
            ))
            .or_default()
            .insert(c.idempotency_key.clone());
        }
        out
    }
}

async fn handle(
    State((state, entered)): State<(Arc<Mutex<ToolState>>, Arc<Notify>)>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let reply = {
        let mut s = state.lock().unwrap();
        let n = s.calls.iter().filter(|c| c.tool == name).count();
        s.calls.push(Invocation {
            tool: name.clone(),
            idempotency_key: headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                .collect(),
            body: serde_json::from_str(&body).unwrap_or(Value::Null),
        });
        let script = s
            .script
            .get(&name)
            .cloned()
            .unwrap_or_else(|| vec![Reply::Ok]);
        script[n.min(script.len() - 1)].clone()
    };
    entered.notify_waiters();
    let n_body = serde_json::json!({"tool": name, "echo": serde_json::from_str::<Value>(&body).unwrap_or(Value::Null)});
    match reply {
        Reply::Ok => (StatusCode::OK, n_body.to_string()),
        Reply::Status(code) => (
            StatusCode::from_u16(code).unwrap(),
            format!("{{\"error\":\"status {code}\"}}"),
        ),
        Reply::Delay(d) => {
            tokio::time::sleep(d).await;
            (StatusCode::OK, n_body.to_string())
        }
        Reply::Provider(d) => {
            let id = (name.clone(), key.clone());
            // Looked up and claimed under one lock: one request per key performs.
            let seen = {
                let mut s = state.lock().unwrap();
                let seen = s.provider.get(&id).cloned();
                if seen.is_none() {
                    s.provider.insert(id.clone(), None);
                }
                seen
            };
            match seen {
                Some(Some(stored)) => (StatusCode::OK, stored.to_string()),
                Some(None) => (
                    StatusCode::CONFLICT,
                    r#"{"error":"a request with this Idempotency-Key is in progress"}"#.into(),
                ),
                None => {
                    // The effect completes even if the caller hangs up (its
                    // try timed out), as a real provider's does.
                    let body = serde_json::json!({"performed_for": key, "echo": n_body["echo"]});
                    let work = tokio::spawn(async move {
                        tokio::time::sleep(d).await;
                        state
                            .lock()
                            .unwrap()
                            .provider
                            .insert(id, Some(body.clone()));
                        body
                    });
                    let body = work.await.expect("the provider's work completes");
                    (StatusCode::OK, body.to_string())
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the stack

pub struct Stack {
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    pub http: String,
    pub tools: ToolServer,
    pub child: Option<Child>,
    pub config: Config,
    starts: u32,
}

pub struct StackOptions {
    /// Bootstrap servers (default: [`brokers`]).
    pub brokers: Option<String>,
    /// Tools of the test's tool server: (name, category, timeout).
    pub tools: Vec<(&'static str, &'static str, &'static str)>,
    /// The consumer session timeout (how long a killed member keeps its partitions).
    pub session_timeout: &'static str,
    /// `gate.in_doubt_grace`.
    pub grace: &'static str,
    /// More tools, as a user writes them: `[tools.x]` tables (with a policy, an
    /// MCP endpoint, …); `{tools}` is replaced by the tool server's base URL.
    pub tool_tables: String,
    /// Any other change to the config before it is written.
    pub configure: fn(&mut Config),
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            tools: vec![
                ("send_email", "keyed", "5s"),
                ("create_ticket", "unkeyed", "5s"),
                ("wire", "unkeyed", "2s"),
                ("charge", "keyed", "2s"),
                ("search", "read_only", "5s"),
            ],
            brokers: None,
            session_timeout: "10s",
            grace: "1s",
            tool_tables: String::new(),
            configure: |_| {},
        }
    }
}

/// The key of pool `pool` in the deployment of `prefix` (in its config
/// file, where its gates and workers read it).
pub fn pool_key(prefix: &str, pool: &str) -> String {
    format!("{prefix}-{pool}-pool-key-0123456789abcdef")
}

/// `tables` (a test's `[tools.x]` tables) with a `[pools.<name>]` and its
/// key for each pool a tool names that they do not give themselves.
pub fn with_pool_keys(tables: &str, prefix: &str) -> String {
    let parsed: toml::Table = toml::from_str(tables).expect("the test's tool tables are TOML");
    let pools: std::collections::BTreeSet<String> = parsed
        .get("tools")
        .and_then(toml::Value::as_table)
        .into_iter()
        .flatten()
        .filter_map(|(_, t)| t.get("pool")?.as_str().map(str::to_owned))
        .filter(|p| {
            !parsed
                .get("pools")
                .and_then(toml::Value::as_table)
                .is_some_and(|ps| ps.contains_key(p))
        })
        .collect();
    let mut out = tables.to_owned();
    for p in pools {
        out.push_str(&format!(
            "\n[pools.{p}]\nkey = \"{}\"\n",
            pool_key(prefix, &p)
        ));
    }
    out
}

/// Write a config where a `stepgate` command reads it.
pub fn write_config(cfg: &Config, path: &std::path::Path) {
    std::fs::write(path, toml::to_string(cfg).expect("a config serialises")).unwrap();
}

/// The config of a test deployment: its topics and groups under `prefix`,
/// its state in `state`, its HTTP endpoints on `http`.
pub fn test_config(prefix: &str, state: PathBuf, http: &str) -> Config {
    Config {
        kafka: KafkaConfig {
            brokers: brokers(),
            topics: TopicsConfig::with_prefix(prefix),
            gate_group: format!("{prefix}-gate"),
            instance_id: format!("{prefix}-0"),
            transaction_timeout: dur("10s"),
            replication_factor: replication_factor(),
            ..KafkaConfig::default()
        },
        state: StateConfig {
            path: state,
            ..StateConfig::default()
        },
        executor: ExecutorConfig {
            drain_timeout: dur("10s"),
            ..ExecutorConfig::default()
        },
        http: HttpConfig {
            listen: http.to_owned(),
        },
        log: LogConfig {
            level: "info,rdkafka=warn".into(),
            ..LogConfig::default()
        },
        ..Config::default()
    }
}

/// The `stepgate` binary under test: Cargo's build of this package, or
/// `STEPGATE_BIN` (to test another build, e.g. a release binary).
pub fn stepgate_bin() -> String {
    std::env::var("STEPGATE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_stepgate").to_owned())
}

/// Wait until the `/readyz` of a stepgate serving on `http` says ready.
pub async fn wait_ready(http: &str) {
    let url = format!("http://{http}/readyz");
    let start = Instant::now();
    loop {
        if let Ok(r) = reqwest::get(&url).await
            && r.status().is_success()
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{http} not ready in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `http` again if it can still be bound, else a free address: a process
/// restarted on the port it had may find it taken meanwhile (see
/// [`Stack::spawn`]).
pub fn still_free(http: &mut String) {
    if !http.is_empty() && std::net::TcpListener::bind(http.as_str()).is_err() {
        *http = format!("127.0.0.1:{}", free_port());
    }
}

impl Stack {
    /// Topics, a tool server and a config; the process is started with [`Stack::start`].
    pub async fn new(opts: StackOptions) -> Stack {
        let prefix = random_name("sgt");
        let dir = tempfile::tempdir().unwrap();
        let tools = ToolServer::start().await;
        let http = format!("127.0.0.1:{}", free_port());
        let mut config = test_config(&prefix, dir.path().join("state"), &http);
        if let Some(b) = &opts.brokers {
            config.kafka.brokers = b.clone();
        }
        config.kafka.session_timeout = dur(opts.session_timeout);
        config.gate.in_doubt_grace = dur(opts.grace);
        for (name, category, timeout) in &opts.tools {
            let tool: ToolConfig = toml::from_str(&format!(
                "category = \"{category}\"\nurl = \"{}/{name}\"\ntimeout = \"{timeout}\"\nretries = 1\nbackoff = \"50ms\"\n",
                tools.base
            ))
            .expect("a test tool");
            config.tools.insert((*name).to_owned(), tool);
        }
        let tables = opts.tool_tables.replace("{tools}", &tools.base);
        let more = Config::from_toml_str(&with_pool_keys(&tables, &prefix), Vec::new())
            .expect("the test's tool tables");
        config.tools.extend(more.tools);
        config.pools.extend(more.pools);
        (opts.configure)(&mut config);
        config.validate().expect("the test's config is valid");
        let config_path = dir.path().join("stepgate.toml");
        write_config(&config, &config_path);
        // A loaded broker sometimes refuses a CreateTopics for a moment
        // (seen: "Metadata fetch error: Unknown broker error"): try again.
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            match stepgate::kafka::create_topics(&config.kafka, &config.state).await {
                Ok(_) => break,
                Err(e) if Instant::now() < until => {
                    eprintln!("creating the test's topics failed, retrying: {e:?}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("creating the test's topics: {e:?}"),
            }
        }
        Stack {
            prefix,
            dir,
            config_path,
            http,
            tools,
            child: None,
            config,
            starts: 0,
        }
    }

    /// Run another `stepgate` command against this stack's config.
    pub async fn cli(&self, args: &[&str]) -> std::process::Output {
        tokio::process::Command::new(stepgate_bin())
            .args(args)
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("STEPGATE_OPERATOR")
            .output()
            .await
            .expect("stepgate binary runs")
    }

    /// Start `stepgate run` and wait until /readyz says ready.
    pub async fn start(&mut self) {
        self.start_with(&[]).await
    }

    /// [`Stack::start`] with extra arguments for `stepgate run`.
    pub async fn start_with(&mut self, args: &[&str]) {
        self.spawn(args, &[]);
        self.wait_ready().await;
    }

    /// Start `stepgate run` without waiting for readiness.
    pub fn spawn(&mut self, args: &[&str], env: &[(&str, &str)]) {
        assert!(self.child.is_none());
        self.keep_http_free();
        self.starts += 1;
        let log = std::fs::File::create(
            self.dir
                .path()
                .join(format!("stepgate-{}.log", self.starts)),
        )
        .unwrap();
        let child = Command::new(stepgate_bin())
            .args(["run", "--config"])
            .arg(&self.config_path)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("stepgate binary starts");
        self.child = Some(child);
    }

    /// The HTTP port was free when the stack was made, but between a stop
    /// and a restart any process may take it — another test's listener, or
    /// an outgoing connection's ephemeral port (seen under CI's load: the
    /// restart failed on "Address already in use"). Then the stack moves to
    /// a free port, in the config file as the test left it.
    fn keep_http_free(&mut self) {
        let mut moved = self.http.clone();
        still_free(&mut moved);
        if moved == self.http {
            return;
        }
        let text = std::fs::read_to_string(&self.config_path).unwrap();
        let quoted = format!("\"{}\"", self.http);
        assert!(text.contains(&quoted), "the config names {quoted}");
        let text = text.replace(&quoted, &format!("\"{moved}\""));
        std::fs::write(&self.config_path, text).unwrap();
        eprintln!("{} was taken: stepgate listens on {moved} now", self.http);
        self.config.http.listen = moved.clone();
        self.http = moved;
    }

    /// Wait until /readyz says ready.
    pub async fn wait_ready(&mut self) {
        let url = format!("http://{}/readyz", self.http);
        let start = Instant::now();
        loop {
            if let Ok(r) = reqwest::get(&url).await
                && r.status().is_success()
            {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("stepgate exited early ({status}): {}", self.log());
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "stepgate not ready in 60 s: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait for the process to exit by itself.
    pub async fn exited(&mut self, limit: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.as_mut().expect("running").try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(start.elapsed() < limit, "still running after {limit:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// kill -9.
    pub fn kill(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// SIGTERM, then wait for the exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        let start = Instant::now();
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no exit 60 s after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A copy of the config for another process of the same deployment: its own
    /// instance id, state directory and HTTP address ("" for none).
    pub fn config_for(&self, name: &str, http: &str) -> PathBuf {
        let mut cfg = self.config.clone();
        cfg.kafka.instance_id = format!("{}-{name}", self.prefix);
        cfg.http.listen = http.to_owned();
        cfg.state.path = self.dir.path().join(format!("state-{name}"));
        let path = self.dir.path().join(format!("stepgate-{name}.toml"));
        write_config(&cfg, &path);
        path
    }

    /// Start another `stepgate run` of this deployment (see
    /// [`Stack::config_for`]), killed when the test ends however it ends (a
    /// gate left running would take partitions in later tests).
    pub fn spawn_other(&self, name: &str, http: &str, args: &[&str]) -> Killed {
        let log = std::fs::File::create(self.dir.path().join(format!("other-{name}.log"))).unwrap();
        Killed(
            Command::new(stepgate_bin())
                .args(["run", "--config"])
                .arg(self.config_for(name, http))
                .args(args)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("stepgate binary starts"),
        )
    }

    pub fn other_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("other-{name}.log")))
            .unwrap_or_default()
    }

    pub fn log(&self) -> String {
        (1..=self.starts)
            .map(|n| {
                std::fs::read_to_string(self.dir.path().join(format!("stepgate-{n}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- restart ---\n")
    }

    /// The log without librdkafka's per-connection noise (a broker outage
    /// writes thousands of "connection refused" lines), its last `lines`
    /// lines: what a failing assertion can print whole.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let kept: Vec<&str> = log.lines().filter(|l| !connection_noise(l)).collect();
        kept[kept.len().saturating_sub(lines)..].join("\n")
    }

    /// Asserts that stepgate logged `needle`: `what` happened, and the
    /// failure shows the log's end.
    pub fn assert_logged(&self, needle: &str, what: &str) {
        assert!(
            self.log().contains(needle),
            "{what}: the log has no {needle:?}\n{}",
            self.log_tail(40)
        );
    }

    /// Asserts that stepgate has not logged `needle`: `what` holds, and the
    /// failure shows the log's end.
    pub fn assert_not_logged(&self, needle: &str, what: &str) {
        assert!(
            !self.log().contains(needle),
            "{what}: the log has {needle:?}\n{}",
            self.log_tail(40)
        );
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.http))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Wait until `/metrics` contains `text`; the last scrape.
    pub async fn metrics_until(&self, text: &str, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let m = self.metrics().await;
            if m.contains(text) {
                return m;
            }
            assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting for `{text}` in /metrics:\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The gate group's committed offsets of `intents`, summed over its
    /// partitions (those with none count 0): how many intents it has
    /// committed past.
    pub fn committed_intents(&self) -> i64 {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let k = &self.config.kafka;
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &k.brokers)
            .set("group.id", &k.gate_group)
            .create()
            .unwrap();
        let meta = consumer
            .fetch_metadata(Some(&k.topics.intents), Duration::from_secs(10))
            .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in meta.topics()[0].partitions() {
            tpl.add_partition(&k.topics.intents, p.id());
        }
        let committed = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        committed
            .elements()
            .iter()
            .filter_map(|e| e.offset().to_raw())
            .filter(|o| *o > 0)
            .sum()
    }

    pub fn agent(&self) -> Agent {
        Agent::new(
            &self.config.kafka.brokers,
            &self.config.kafka.topics.intents,
            &self.config.kafka.topics.results,
        )
    }

    /// A reader of one of this deployment's topics (`"dlq"`, …), from the beginning.
    pub fn reader(&self, which: &str) -> TopicReader {
        TopicReader::new(&self.config.kafka.brokers, &self.topic(which))
    }

    pub fn topic(&self, which: &str) -> String {
        format!("{}.{which}", self.prefix)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // STEPGATE_TEST_KEEP_LOGS=<dir>: the processes' logs outlive the
        // test's temporary directory (for a failure to be read whole).
        if let Ok(keep) = std::env::var("STEPGATE_TEST_KEEP_LOGS") {
            let to = PathBuf::from(keep).join(&self.prefix);
            let _ = std::fs::create_dir_all(&to);
            for e in std::fs::read_dir(self.dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(e.path(), to.join(e.file_name()));
                }
            }
        }
    }
}

/// With `STEPGATE_TEST_KEEP_LOGS=<dir>`, a failing test's broker directory
/// (logs and data: its topics with their transaction markers) is copied to
/// `<dir>/<name>`, to be read after the test's temporary directory is gone.
pub fn keep_dir_on_failure(dir: &std::path::Path, name: &str) {
    if std::thread::panicking()
        && let Ok(keep) = std::env::var("STEPGATE_TEST_KEEP_LOGS")
    {
        let to = std::path::Path::new(&keep).join(name);
        let _ = std::fs::create_dir_all(&keep);
        let _ = Command::new("cp").arg("-r").arg(dir).arg(&to).status();
        eprintln!("the {name}'s directory is kept in {}", to.display());
    }
}

/// A log line about a broker being away (librdkafka logs thousands during an
/// outage): left out of what a failing assertion prints.
pub fn connection_noise(line: &str) -> bool {
    (line.contains("librdkafka")
        && (line.contains("Connect to")
            || line.contains("Disconnected")
            || line.contains("Global error")
            || line.contains("brokers are down")))
        || line.contains("consumer error (librdkafka retries by itself)")
}

// ---------------------------------------------------------------- the agent

/// A received record.
#[derive(Clone, Debug)]
pub struct Received {
    pub partition: i32,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub value: Value,
}

/// Reads a whole topic from the beginning (read_committed) into memory.
pub struct TopicReader {
    records: Arc<Mutex<Vec<Received>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl TopicReader {
    pub fn new(brokers: &str, topic: &str) -> TopicReader {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", random_name("reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "20")
            // After a broker's hard kill librdkafka may find its position
            // invalid (leader epoch validation) and reset it: to the start,
            // where the offsets below skip what was read — never past records
            // (the default, `latest`, would lose answers stepgate wrote).
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        let md_consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .unwrap();
        let md = md_consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .unwrap();
        let n = md.topics()[0].partitions().len() as i32;
        drop(md);
        drop(md_consumer);
        let mut tpl = TopicPartitionList::new();
        for p in 0..n {
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&tpl).unwrap();
        drop(tpl);
        let records = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, s) = (records.clone(), stop.clone());
        tokio::spawn(async move {
            // Per partition, the next offset not yet kept: a record read again
            // after a position reset is skipped.
            let mut next: HashMap<i32, i64> = HashMap::new();
            while !s.load(std::sync::atomic::Ordering::SeqCst) {
                let Ok(Ok(m)) =
                    tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await
                else {
                    continue;
                };
                let n = next.entry(m.partition()).or_insert(0);
                if m.offset() < *n {
                    continue;
                }
                *n = m.offset() + 1;
                let value = m
                    .payload()
                    .and_then(|p| serde_json::from_slice(p).ok())
                    .unwrap_or(Value::Null);
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|x| (x.key.to_owned(), x.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                r.lock().unwrap().push(Received {
                    partition: m.partition(),
                    key: m.key().map(<[u8]>::to_vec),
                    headers,
                    value,
                });
            }
        });
        TopicReader { records, stop }
    }

    pub fn all(&self) -> Vec<Received> {
        self.records.lock().unwrap().clone()
    }

    pub async fn wait_for(&self, n: usize, limit: Duration) -> Vec<Received> {
        eventually(limit, &format!("{n} records"), || {
            self.records.lock().unwrap().len() >= n
        })
        .await;
        self.all()
    }
}

impl Drop for TopicReader {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

pub struct Agent {
    producer: FutureProducer,
    intents: String,
    pub results: TopicReader,
}

impl Agent {
    pub fn new(brokers: &str, intents: &str, results: &str) -> Agent {
        let producer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            // Java's partitioner, as stepgate's clients use (the gate refuses an
            // intent outside its workflow's partition).
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "0")
            .create()
            .unwrap();
        Agent {
            producer,
            intents: intents.into(),
            results: TopicReader::new(brokers, results),
        }
    }

    /// Publish raw bytes keyed by `key` (optionally to a given partition, with headers).
    pub async fn send_raw(
        &self,
        key: &str,
        payload: &[u8],
        partition: Option<i32>,
        headers: &[(&str, &str)],
    ) {
        let mut rec = FutureRecord::to(&self.intents).key(key).payload(payload);
        if let Some(p) = partition {
            rec = rec.partition(p);
        }
        if !headers.is_empty() {
            let mut h = OwnedHeaders::new();
            for (k, v) in headers {
                h = h.insert(Header {
                    key: k,
                    value: Some(*v),
                });
            }
            rec = rec.headers(h);
        }
        self.producer
            .send(rec, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    /// Publish an intent with a given record timestamp (ms since the epoch),
    /// as an old record re-read would carry.
    pub async fn send_at(&self, intent: &Value, timestamp_ms: i64) {
        let key = intent["workflow_id"].as_str().unwrap_or("none").to_owned();
        let payload = intent.to_string();
        let rec = FutureRecord::to(&self.intents)
            .key(&key)
            .payload(&payload)
            .timestamp(timestamp_ms);
        self.producer
            .send(rec, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    pub async fn send(&self, intent: &Value) {
        let key = intent["workflow_id"].as_str().unwrap_or("none").to_owned();
        self.send_raw(&key, intent.to_string().as_bytes(), None, &[])
            .await;
    }

    /// Every answer for `call_id` so far.
    pub fn answers(&self, call_id: &str) -> Vec<(i32, ToolResult)> {
        self.results
            .all()
            .into_iter()
            .filter(|r| r.value["call_id"].as_str() == Some(call_id))
            .map(|r| {
                (
                    r.partition,
                    serde_json::from_value(r.value).expect("every result is a Result v1"),
                )
            })
            .collect()
    }

    pub async fn answer(&self, call_id: &str, limit: Duration) -> ToolResult {
        eventually(limit, &format!("an answer for {call_id}"), || {
            !self.answers(call_id).is_empty()
        })
        .await;
        self.answers(call_id).remove(0).1
    }

    /// Publish and await the answer.
    pub async fn call(&self, intent: Value) -> ToolResult {
        let id = intent["call_id"]
            .as_str()
            .expect("test intents carry a call_id")
            .to_owned();
        self.send(&intent).await;
        self.answer(&id, Duration::from_secs(30)).await
    }
}

pub fn intent(wf: &str, step: u64, tool: &str, args: Value, call_id: &str) -> Value {
    serde_json::json!({"workflow_id": wf, "step_index": step, "tool": tool, "arguments": args, "call_id": call_id})
}

/// `a` and `b` are the same answer except call_id and deduplicated.
/// The one answer a `call_id` got. Every answer to a `call_id` is the same
/// answer: a repeat answered at once and read again after a crash is answered
/// a second, identical time (docs/design.md "Repeats answered at once"); a
/// first answer goes with its batch's transaction and is never written twice.
pub fn the_one_answer<'a>(id: &str, answers: &'a [ToolResult]) -> &'a ToolResult {
    let first = answers
        .first()
        .unwrap_or_else(|| panic!("{id} was never answered"));
    assert!(
        answers.iter().all(|a| a == first),
        "{id} was answered differently: {answers:?}"
    );
    assert!(
        answers.len() == 1 || first.deduplicated,
        "{id} is no repeat, yet was answered {} times: {answers:?}",
        answers.len()
    );
    first
}

pub fn same_but_call_id(a: &ToolResult, b: &ToolResult) {
    let mut b2 = b.clone();
    b2.call_id = a.call_id.clone();
    b2.deduplicated = a.deduplicated;
    assert_eq!(a, &b2);
}

// ------------------------------------------------------------ SASL_SSL listener

/// The test broker's SASL_SSL listener (SCRAM over TLS with a throwaway CA):
/// `deploy/local/kafka.sh start` writes its coordinates to `sasl_ssl.env` in
/// its data dir and prints that path as `KAFKA_SASL_SSL_ENV`.
#[derive(Clone, Debug)]
pub struct Secured {
    pub brokers: String,
    pub mechanism: String,
    pub username: String,
    pub password: String,
    /// The CA that signed the broker's certificate.
    pub ca: String,
    /// A CA that signed nothing the broker presents.
    pub untrusted_ca: String,
}

/// The file naming the SASL_SSL listener's coordinates: `KAFKA_SASL_SSL_ENV`,
/// else where `deploy/local/kafka.sh` writes it for the port of [`brokers`].
pub fn secured_env_path() -> String {
    std::env::var("KAFKA_SASL_SSL_ENV").unwrap_or_else(|_| {
        let cache = std::env::var("STEPGATE_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/stepgate",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        let b = brokers();
        let port = b.rsplit(':').next().unwrap_or("9092").to_owned();
        format!("{cache}/kafka-run-{port}/sasl_ssl.env")
    })
}

/// [`Secured`] from `KAFKA_SASL_SSL_ENV`, else from the data dir that
/// `deploy/local/kafka.sh` uses for the port of [`brokers`].
pub fn secured() -> Secured {
    let path = secured_env_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "no SASL_SSL listener's coordinates at {path} ({e}): start the test broker with `deploy/local/kafka.sh start` (a broker started by an older kafka.sh has no SASL_SSL listener: `kafka.sh stop --wipe` first), or set KAFKA_SASL_SSL_ENV"
        )
    });
    let vars: HashMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .collect();
    let get = |k: &str| {
        vars.get(k)
            .unwrap_or_else(|| panic!("{path} has no {k}"))
            .to_string()
    };
    Secured {
        brokers: get("KAFKA_SASL_SSL_BROKERS"),
        mechanism: get("KAFKA_SASL_MECHANISM"),
        username: get("KAFKA_SASL_USERNAME"),
        password: get("KAFKA_SASL_PASSWORD"),
        ca: get("KAFKA_SSL_CA_LOCATION"),
        untrusted_ca: get("KAFKA_SSL_UNTRUSTED_CA_LOCATION"),
    }
}

impl Secured {
    /// `[kafka.client]` for this listener, trusting `ca`, without the password
    /// (which a deployment gives through the environment).
    pub fn client_properties(&self, ca: &str) -> std::collections::BTreeMap<String, String> {
        [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", self.mechanism.as_str()),
            ("sasl.username", self.username.as_str()),
            ("ssl.ca.location", ca),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }
}

// ---------------------------------------------------------------- processes

/// A child process killed when the test ends, however it ends.
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Killed {
    type Target = std::process::Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// `stepgate mcp --listen 127.0.0.1:<port>` on the stack's config, logging
/// to `log`.
pub fn start_mcp_front(s: &Stack, port: u16, log: &std::path::Path) -> Killed {
    Killed(
        std::process::Command::new(stepgate_bin())
            .args(["mcp", "--config"])
            .arg(&s.config_path)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("stepgate binary starts"),
    )
}
