//! Configuration: one TOML file, every key settable by a `STEPGATE_…` variable,
//! whether or not the file has it.
//!
//! The env name of a key is its path in upper case, each character other than
//! a letter or a digit made `_`, joined by `_`: `[kafka] brokers` →
//! `STEPGATE_KAFKA_BROKERS`, `[tools.send_email] url` →
//! `STEPGATE_TOOLS_SEND_EMAIL_URL`. A value is read as the key's type: a
//! number, `true`/`false`, a string (durations too), a list as `a,b` or a JSON
//! array, a table (`input_schema`, `mcp.auth.tokens`) as JSON.
//!
//! - Name-keyed tables take the rest of the name as the entry: librdkafka
//!   properties (`[kafka.client]`): `STEPGATE_KAFKA_CLIENT_SASL_MECHANISM` →
//!   `sasl.mechanism`; tool headers: `STEPGATE_TOOLS_PAY_HEADERS_X_API_KEY` →
//!   `x-api-key`; `[mcp.auth.scopes]`: lower case. An entry the file already
//!   has keeps its own spelling.
//! - Tools: a tool is defined in the file; the environment sets its keys. The
//!   tool is found among the file's tools by its name in variable form (so
//!   `send_email` and `send-email` read alike); a variable that fits the keys
//!   of two tools is refused, never guessed.
//! - Any other `STEPGATE_*` variable is refused at start, with the nearest
//!   known name, unless [`NOT_CONFIG_VARIABLES`] / [`NOT_CONFIG_PREFIXES`]
//!   list it (the CLI's, the tests') or an `env:` value of the config names it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

pub use crate::duration::Dur;
use crate::duration::dur;
pub use crate::redact::{REDACTED, is_secret_property, redact_client_properties, redact_url};
use crate::tools::tool::RESERVED_HEADERS;
pub use crate::tools::tool::{
    Category, HeaderSource, HeaderSpec, Policy, ToolAnnotations, ToolConfig,
};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config is not valid TOML or has a wrong field: {0}")]
    Parse(String),
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("invalid config: `{field}` {message}")]
    Invalid { field: String, message: String },
    /// A tool header whose value could not be read. Names the tool, the header
    /// and where the value was to come from; never the value.
    #[error("invalid config: `tools.{tool}.headers.{header}`: {message}")]
    Secret {
        tool: String,
        header: String,
        message: String,
    },
}

/// The whole configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub kafka: KafkaConfig,
    pub state: StateConfig,
    pub gate: GateConfig,
    pub executor: ExecutorConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
    /// `stepgate mcp` over HTTP: who may call, what, and in which workflows.
    pub mcp: McpConfig,
    /// OpenTelemetry traces of each step over OTLP/HTTP; off without an endpoint.
    pub traces: TracesConfig,
    /// `stepgate console`: the web console for approvals and in-doubt steps.
    pub console: ConsoleConfig,
    /// Tools by name.
    pub tools: BTreeMap<String, ToolConfig>,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated.
    pub brokers: String,
    pub topics: TopicsConfig,
    /// Consumer group of the gates.
    pub gate_group: String,
    /// Stable identity of this process: static group membership
    /// (`group.instance.id`) and transactional ids derive from it, so a restarted
    /// process takes its partitions back at once instead of after a session timeout.
    /// Must be unique per running process. Default: the host's name
    /// ([`default_instance_id`]), which differs between hosts and pods and stays
    /// the same across restarts of one.
    pub instance_id: String,
    /// Partitions of every topic that `stepgate topics create` makes.
    pub partitions: i32,
    /// Replication factor of the topics that `stepgate topics create` makes.
    pub replication_factor: i32,
    /// Consumer session timeout.
    pub session_timeout: Dur,
    /// Transaction timeout (bounds how long a dead process's open transaction can
    /// block read_committed consumers).
    pub transaction_timeout: Dur,
    /// Any librdkafka property (TLS, SASL, …), applied to every client.
    pub client: BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topics: TopicsConfig::default(),
            gate_group: "stepgate-gate".into(),
            instance_id: default_instance_id(),
            partitions: 4,
            replication_factor: 1,
            session_timeout: dur("30s"),
            transaction_timeout: dur("30s"),
            client: BTreeMap::new(),
        }
    }
}

/// `[kafka.client]` properties that stepgate sets itself, because the
/// guarantee rests on them or because a key of its own sets them: each is
/// refused at start ([`Config::validate`]) with why, and what to do instead.
/// Everything else (TLS, SASL, timeouts, `message.max.bytes`, `partitioner`:
/// every record stepgate writes names its partition, only DLQ copies do not,
/// …) passes through to every client.
pub const REFUSED_CLIENT_PROPERTIES: &[(&str, &str)] = &[
    (
        "isolation.level",
        "stepgate reads only committed records (read_committed); read_uncommitted would act on intents, outcomes and state of transactions that were aborted. Remove it.",
    ),
    (
        "enable.auto.commit",
        "the gate commits its input offsets inside each transaction, with the records they caused; an automatic commit would move past inputs whose outcome was never written. Remove it.",
    ),
    (
        "enable.auto.offset.store",
        "the gate stores its input offsets only inside each transaction; an automatic store would let a commit skip inputs whose outcome was never written. Remove it.",
    ),
    (
        "auto.offset.reset",
        "stepgate chooses where each reader starts (the gate at the beginning of a partition with no committed offset, a restore at its stored offset or nowhere); `latest` would skip intents published before the group first committed. Remove it.",
    ),
    (
        "partition.assignment.strategy",
        "the gate needs range assignment, which gives partition p of `intents` and of `progress` to the same process; another strategy splits a workflow's inputs between two gates. Remove it.",
    ),
    (
        "group.protocol",
        "the gate uses the classic group protocol with range assignment, which keeps co-partitioned topics on one process; the broker-side protocol (KIP-848) assigns partitions by its own rule. Remove it.",
    ),
    (
        "group.remote.assignor",
        "the gate uses the classic group protocol with range assignment; a broker-side assignor would split co-partitioned topics between processes. Remove it.",
    ),
    (
        "group.id",
        "stepgate names every consumer group itself (the gates', and one per restore or operator read); set `kafka.gate_group` instead.",
    ),
    (
        "group.instance.id",
        "stepgate derives the static membership of each consumer from `kafka.instance_id`, which must differ between processes; set `kafka.instance_id` instead.",
    ),
    (
        "transactional.id",
        "stepgate derives the transactional id from `kafka.instance_id`, so that a restarted process fences its predecessor's transactions; a fixed id shared by processes would fence live gates or let a zombie commit. Set `kafka.instance_id` instead.",
    ),
    (
        "enable.idempotence",
        "stepgate's transactions and operator commands need the idempotent producer (no duplicate or reordered record on a retry). Remove it.",
    ),
    (
        "acks",
        "a transaction must commit only records every in-sync replica has (acks=all), or a broker failover loses an outcome that was answered. Remove it.",
    ),
    (
        "request.required.acks",
        "a transaction must commit only records every in-sync replica has (acks=all), or a broker failover loses an outcome that was answered. Remove it.",
    ),
    (
        "max.in.flight.requests.per.connection",
        "the idempotent producer keeps records in order only with at most 5 requests in flight, which librdkafka's default already is. Remove it.",
    ),
    (
        "max.in.flight",
        "the idempotent producer keeps records in order only with at most 5 requests in flight, which librdkafka's default already is. Remove it.",
    ),
    (
        "transaction.timeout.ms",
        "stepgate sets it from `kafka.transaction_timeout`; set that instead.",
    ),
    (
        "session.timeout.ms",
        "stepgate sets it from `kafka.session_timeout`; set that instead.",
    ),
    (
        "bootstrap.servers",
        "stepgate sets it from `kafka.brokers` (which its clients and checks all read); set that instead.",
    ),
];

/// An http(s) URL with a host (what every URL stepgate calls must be).
fn is_http(u: &reqwest::Url) -> bool {
    matches!(u.scheme(), "http" | "https") && u.host().is_some()
}

/// A tool's `url` (or `mcp`), named `key`: an http(s) URL with a host. It
/// may carry credentials: echoed redacted.
fn check_tool_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        field: key.to_owned(),
        message,
    };
    match reqwest::Url::parse(url) {
        Ok(u) if is_http(&u) => Ok(()),
        Ok(_) => Err(invalid(format!(
            "must be an http(s) URL with a host, got `{}`",
            redact_url(url)
        ))),
        Err(e) => Err(invalid(format!(
            "must be an http(s) URL; what is configured is not a URL ({e})"
        ))),
    }
}

/// Why a `[kafka.client]` property may not be set, when it may not.
pub fn refused_client_property(name: &str) -> Option<&'static str> {
    let name = name.trim().to_ascii_lowercase();
    REFUSED_CLIENT_PROPERTIES
        .iter()
        .find(|(refused, _)| *refused == name)
        .map(|(_, why)| *why)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicsConfig {
    /// Agents' intents (public).
    pub intents: String,
    /// Final answers (public).
    pub results: String,
    /// Refused inputs with their reasons (public).
    pub dlq: String,
    /// The calls topic of each worker pool (tools declared `pool = "…"`):
    /// `{pool}` is replaced by the pool's name (internal; read by its workers).
    pub pool_calls: String,
    /// Outcomes of calls whose partition moved to another gate while they ran,
    /// handed to the partition's owner (internal).
    pub progress: String,
    /// The gate's state changes, compacted: restores a partition's state on a new
    /// owner or disk (internal).
    pub changelog: String,
    /// Operators → gate: resolutions of in-doubt steps, approvals and denials
    /// (written by `stepgate resolve` / `stepgate approvals`).
    pub commands: String,
    /// Gate → operators: calls waiting for a person's approval, and the
    /// decisions (public: an approval UI can read it).
    pub approvals: String,
}

impl TopicsConfig {
    /// Defaults under a name prefix (tests use a random one).
    pub fn with_prefix(prefix: &str) -> Self {
        TopicsConfig {
            intents: format!("{prefix}.intents"),
            results: format!("{prefix}.results"),
            dlq: format!("{prefix}.dlq"),
            pool_calls: format!("{prefix}.calls.{{pool}}"),
            progress: format!("{prefix}.progress"),
            changelog: format!("{prefix}.changelog"),
            commands: format!("{prefix}.commands"),
            approvals: format!("{prefix}.approvals"),
        }
    }

    /// The calls topic of worker pool `pool`.
    pub fn calls_for(&self, pool: &str) -> String {
        self.pool_calls.replace("{pool}", pool)
    }

    /// Every topic name, public ones first.
    pub fn all(&self) -> [&String; 7] {
        [
            &self.intents,
            &self.results,
            &self.dlq,
            &self.progress,
            &self.changelog,
            &self.commands,
            &self.approvals,
        ]
    }
}

impl Default for TopicsConfig {
    fn default() -> Self {
        TopicsConfig::with_prefix("stepgate")
    }
}

/// The RocksDB block cache when none is configured (`state.block_cache_mib`).
pub const DEFAULT_BLOCK_CACHE_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Directory of the gate's RocksDB.
    pub path: PathBuf,
    /// How long a step record answers repeats after its last change.
    pub retention: Dur,
    /// How often expired records are purged.
    pub purge_interval: Dur,
    /// How long operators' decisions (the `commands` topic: resolutions,
    /// approvals, denials) are kept, for the audit; unset: forever. Applied by
    /// `stepgate topics create`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions_retention: Option<Dur>,
    /// RocksDB block cache, in MiB, shared by every column family: data, index
    /// and filter blocks (so memory does not grow with the records).
    pub block_cache_mib: usize,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            path: PathBuf::from("./stepgate-state"),
            retention: dur("7d"),
            purge_interval: dur("1m"),
            decisions_retention: None,
            block_cache_mib: DEFAULT_BLOCK_CACHE_BYTES >> 20,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateConfig {
    /// Most inputs in one batch (one Kafka transaction). A batch closes when the
    /// previous one's commit returns, or when it holds this many.
    pub max_batch: usize,
    /// Added to a tool's own deadline before a started call with no outcome is
    /// declared in doubt (or re-run, when re-running is safe).
    pub in_doubt_grace: Dur,
    /// Largest accepted intent, in bytes.
    pub max_intent_bytes: usize,
    /// Refuse an intent found outside its workflow's partition (murmur2 of the
    /// `workflow_id`, as Kafka's Java client and stepgate's clients partition):
    /// a step is deduplicated only within one partition, so a retry published
    /// elsewhere could run again. `false` accepts any partition — only for
    /// producers with a partitioner of their own that never changes.
    pub check_partition: bool,
    /// With `check_partition`: an intent found outside its workflow's
    /// partition is re-routed there, in the gate's transaction, and answered in
    /// the partition it reached — whatever partitioner the agent's client used.
    /// `false` refuses it (`wrong_partition`) instead.
    pub forward_wrong_partition: bool,
    /// `/healthz` fails when the gate's loop has made no progress for this
    /// long (a stuck process is restarted by its orchestrator). Above the
    /// longest legitimate wait: a commit retried through a broker outage.
    pub stall_timeout: Dur,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            max_batch: 2000,
            in_doubt_grace: dur("30s"),
            max_intent_bytes: 1024 * 1024,
            check_partition: true,
            forward_wrong_partition: true,
            stall_timeout: dur("5m"),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutorConfig {
    /// Most tool calls running at once in this process (the invoker pool); a
    /// tool's `max_concurrency` bounds it further for that tool.
    pub concurrency: usize,
    /// On shutdown, how long in-flight calls may finish before the process exits
    /// (unfinished ones stay `started` and the gate's deadline settles them).
    pub drain_timeout: Dur,
    /// Most calls handed to the invoker and not finished (running, or queued
    /// for a slot). At this, the gate pauses reading `intents` until a quarter
    /// has drained: a flood behind a slow tool waits in Kafka, not in memory.
    pub max_queued_calls: usize,
    /// ... and most bytes of their arguments.
    pub max_queued_bytes: usize,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            concurrency: 64,
            drain_timeout: dur("20s"),
            max_queued_calls: 1024,
            max_queued_bytes: 64 << 20,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz` and `/readyz`; empty to disable.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `pretty` or `json`.
    pub format: String,
    /// A tracing filter, e.g. `info` or `stepgate=debug,rdkafka=warn`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: "pretty".into(),
            level: "info".into(),
        }
    }
}

/// `stepgate mcp` over HTTP (`--listen`): an OAuth 2.1 resource server in
/// front of the tools. Unused on stdio, where the host that starts the process
/// is its only client.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// The front's URL as clients dial it, e.g. `"https://mcp.example.com/mcp"`:
    /// the audience tokens must be issued for (RFC 8707) and the `resource` of
    /// its metadata (RFC 9728). Default: `http://<listen address>/mcp`.
    pub resource: Option<String>,
    /// `Host` names (or `host:port`) requests may carry, besides those given
    /// with `--allowed-host`. The loopback names are allowed only when the front
    /// listens on a loopback address, and only from a loopback peer.
    pub allowed_hosts: Vec<String>,
    /// Browser origins allowed to call, e.g. `"https://app.example.com"` (`:*`
    /// for any port). A request with any other `Origin` gets 403; one without
    /// `Origin` (not from a browser) is not affected.
    pub allowed_origins: Vec<String>,
    /// The largest request body in bytes; larger gets 413.
    pub max_request_bytes: u64,
    /// Open MCP sessions per principal: opening one more closes its least
    /// recently used.
    pub max_sessions_per_principal: u32,
    /// Open MCP sessions on this front, all principals together. A new
    /// session beyond it closes the least recently used one if that has been
    /// idle for `session_idle_timeout`; otherwise the new one is refused (503
    /// with `Retry-After`) and no open session is touched.
    pub max_sessions: u32,
    /// A session without a request for this long is closed (and its step
    /// counter forgotten); a request naming it afterwards gets 404 with a text
    /// saying to start a new session. Keep it above `stepgate mcp --timeout`:
    /// a call in flight counts as idle time.
    pub session_idle_timeout: Dur,
    /// Requests per second a principal may make, sustained (429 beyond).
    pub requests_per_second: u32,
    /// Requests a principal may make at once above the sustained rate.
    pub burst: u32,
    /// Tasks (a `tools/call` with `params.task`, protocol 2025-11-25) held
    /// at once; a task still waiting for its answer is never dropped for a
    /// new one, which is refused instead.
    pub max_tasks: u32,
    /// A task's lifetime: its call waits up to this for stepgate's answer
    /// (at least `stepgate mcp --timeout`), and a finished task is kept this
    /// long after it was made (and 10 minutes after it finished). A client
    /// may ask for less.
    pub task_ttl: Dur,
    /// A call from a client that accepts tasks the 2026-07-28 way (the
    /// `io.modelcontextprotocol/tasks` extension) and not answered within
    /// this is answered with its step's task instead.
    pub task_after: Dur,
    pub auth: McpAuthConfig,
}

impl Default for McpConfig {
    fn default() -> Self {
        McpConfig {
            resource: None,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            max_request_bytes: 1024 * 1024,
            max_sessions_per_principal: 16,
            max_sessions: 10_000,
            session_idle_timeout: dur("30m"),
            requests_per_second: 20,
            burst: 40,
            max_tasks: 10_000,
            task_ttl: dur("1h"),
            task_after: dur("20s"),
            auth: McpAuthConfig::default(),
        }
    }
}

/// Who may call `stepgate mcp`: bearer JWTs of an OAuth authorization server
/// (`issuer` and `jwks_url`), static tokens (`[[mcp.auth.tokens]]`), or both.
/// With neither, the front serves only on a loopback address (unless
/// `--insecure-no-auth`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpAuthConfig {
    /// The authorization server's issuer identifier: tokens' `iss` must be
    /// exactly this, and the metadata names it in `authorization_servers`.
    pub issuer: Option<String>,
    /// Where the issuer publishes its signing keys (a JWK Set); fetched at
    /// start, every `jwks_refresh`, and when a token names an unknown key.
    pub jwks_url: Option<String>,
    /// How often the JWK Set is fetched again.
    pub jwks_refresh: Dur,
    /// JWS algorithms accepted (asymmetric only: RS*, PS*, ES256, ES384, EdDSA).
    pub algorithms: Vec<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Dur,
    /// The token claim that names the principal's workflow namespace: it may
    /// name only workflows `<value>/…` in `_meta`.
    pub namespace_claim: String,
    /// Scope → the tools it lets a principal list and call (`"*"`: every tool).
    pub scopes: BTreeMap<String, Vec<String>>,
    /// Static bearer tokens, the simple mode.
    pub tokens: Vec<McpStaticToken>,
}

impl Default for McpAuthConfig {
    fn default() -> Self {
        McpAuthConfig {
            issuer: None,
            jwks_url: None,
            jwks_refresh: dur("10m"),
            algorithms: ["RS256", "ES256"].map(String::from).to_vec(),
            leeway: dur("30s"),
            namespace_claim: "sub".into(),
            scopes: BTreeMap::new(),
            tokens: Vec::new(),
        }
    }
}

impl McpAuthConfig {
    /// Whether any authorization is configured.
    pub fn enabled(&self) -> bool {
        self.issuer.is_some() || !self.tokens.is_empty()
    }
}

/// One static bearer token: a principal with its scopes and namespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpStaticToken {
    /// The principal's name (logs, limits, the intent's metadata).
    pub name: String,
    /// `"env:NAME"` or `"file:/path"` (a literal works, but keeps the secret in
    /// the config file).
    pub token: HeaderSpec,
    /// Scopes of `[mcp.auth.scopes]` this token has.
    pub scopes: Vec<String>,
    /// The workflow ids it may name start with this. Default `"<name>/"`; `""`
    /// is every workflow.
    pub namespace: Option<String>,
}

impl McpStaticToken {
    /// The workflow-id prefix this token may name.
    pub fn namespace(&self) -> String {
        self.namespace
            .clone()
            .unwrap_or_else(|| format!("{}/", self.name))
    }
}

/// The JWS algorithms `[mcp.auth] algorithms` may name: asymmetric only (a
/// shared secret would let any resource server mint tokens).
pub const MCP_JWT_ALGORITHMS: [&str; 9] = [
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
];

impl McpConfig {
    fn validate(&self, tools: &BTreeMap<String, ToolConfig>) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: field.to_owned(),
            message,
        };
        if let Some(r) = &self.resource {
            match reqwest::Url::parse(r) {
                Ok(u) if is_http(&u) && u.fragment().is_none() => {}
                _ => {
                    return Err(invalid(
                        "mcp.resource",
                        format!(
                            "must be the front's http(s) URL without a fragment, e.g. \"https://mcp.example.com/mcp\"; got `{r}`"
                        ),
                    ));
                }
            }
        }
        for (field, n) in [
            ("mcp.max_request_bytes", self.max_request_bytes),
            (
                "mcp.max_sessions_per_principal",
                self.max_sessions_per_principal.into(),
            ),
            ("mcp.max_sessions", self.max_sessions.into()),
            ("mcp.requests_per_second", self.requests_per_second.into()),
            ("mcp.burst", self.burst.into()),
            ("mcp.max_tasks", self.max_tasks.into()),
        ] {
            if n == 0 {
                return Err(invalid(field, "must be at least 1".into()));
            }
        }
        if self.session_idle_timeout.0 < std::time::Duration::from_secs(1) {
            return Err(invalid(
                "mcp.session_idle_timeout",
                "must be at least 1s".into(),
            ));
        }
        if self.task_ttl.0 < std::time::Duration::from_secs(1) {
            return Err(invalid("mcp.task_ttl", "must be at least 1s".into()));
        }
        let a = &self.auth;
        match (&a.issuer, &a.jwks_url) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(invalid(
                    "mcp.auth",
                    "`issuer` and `jwks_url` go together: the issuer's tokens are checked against its keys".into(),
                ));
            }
            (Some(_), Some(url)) => {
                if !reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https")) {
                    return Err(invalid(
                        "mcp.auth.jwks_url",
                        format!("must be an http(s) URL, got `{}`", redact_url(url)),
                    ));
                }
                if a.namespace_claim.trim().is_empty() {
                    return Err(invalid(
                        "mcp.auth.namespace_claim",
                        "must name a claim, e.g. \"sub\"".into(),
                    ));
                }
            }
            (None, None) => {}
        }
        if a.algorithms.is_empty() {
            return Err(invalid(
                "mcp.auth.algorithms",
                "must name at least one algorithm".into(),
            ));
        }
        for alg in &a.algorithms {
            if !MCP_JWT_ALGORITHMS.contains(&alg.as_str()) {
                return Err(invalid(
                    "mcp.auth.algorithms",
                    format!("`{alg}` is not accepted; the algorithms are {MCP_JWT_ALGORITHMS:?}"),
                ));
            }
        }
        if a.enabled() && a.scopes.is_empty() {
            return Err(invalid(
                "mcp.auth.scopes",
                "must map at least one scope to the tools it grants, e.g. `search = [\"search\"]` (`\"*\"` for every tool)".into(),
            ));
        }
        for (scope, granted) in &a.scopes {
            for tool in granted {
                if tool != "*" && !tools.contains_key(tool) {
                    return Err(invalid(
                        &format!("mcp.auth.scopes.{scope}"),
                        format!("names `{tool}`, which is not a configured tool"),
                    ));
                }
            }
        }
        for (i, t) in a.tokens.iter().enumerate() {
            let field = format!("mcp.auth.tokens[{i}]");
            if t.name.trim().is_empty() {
                return Err(invalid(&field, "needs a `name`".into()));
            }
            if a.tokens[..i].iter().any(|o| o.name == t.name) {
                return Err(invalid(
                    &field,
                    format!("the name `{}` is used twice", t.name),
                ));
            }
            if let Some(s) = t.scopes.iter().find(|s| !a.scopes.contains_key(*s)) {
                return Err(invalid(
                    &field,
                    format!("has scope `{s}`, which `[mcp.auth.scopes]` does not define"),
                ));
            }
            if t.namespace
                .as_ref()
                .is_some_and(|n| !n.is_empty() && !n.ends_with('/'))
            {
                return Err(invalid(&field, "a `namespace` ends with `/` (e.g. \"support/\"), or is \"\" for every workflow".into()));
            }
            match &t.token.source {
                HeaderSource::Env(v) if v.is_empty() => {
                    return Err(invalid(&field, "`env:` needs a variable name".into()));
                }
                HeaderSource::File(p) if p.as_os_str().is_empty() => {
                    return Err(invalid(&field, "`file:` needs a path".into()));
                }
                HeaderSource::Literal(v) if v.trim().len() < 16 => {
                    return Err(invalid(&field, "the token must be at least 16 characters (or \"env:NAME\", \"file:/path\")".into()));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The same with static tokens' literal values redacted.
    pub fn redacted(&self) -> McpConfig {
        let mut c = self.clone();
        for t in &mut c.auth.tokens {
            // Its source (`env:…`, `file:…`), or REDACTED for a literal.
            t.token = HeaderSpec::parse(&t.token.shown());
        }
        c
    }
}

impl Config {
    /// Read a TOML file (or defaults when `path` is None), apply `STEPGATE_*`
    /// overrides from `env` (refusing a variable that names no key; see the
    /// module's doc), and validate.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                path: p.to_owned(),
                source,
            })?,
            None => String::new(),
        };
        Config::from_toml_str(&text, env)
    }

    pub fn from_toml_str(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let file: toml::Table = toml::from_str(text).map_err(|e| syntax_error(&e, text))?;
        // The file over the defaults: the env overlay finds the file's tools
        // and map entries in it.
        let mut merged = toml::Table::try_from(Config::default())
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        merge(&mut merged, file);
        let env: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with("STEPGATE_"))
            .collect();
        apply_env(&mut merged, &env)?;
        let config: Config = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| shape_error(&e, text))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks that serde cannot express, with the offending field named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: &str| ConfigError::Invalid {
            field: field.to_owned(),
            message: message.to_owned(),
        };
        if self.kafka.brokers.trim().is_empty() {
            return Err(invalid(
                "kafka.brokers",
                "must name at least one broker, e.g. \"127.0.0.1:9092\"",
            ));
        }
        if self.kafka.instance_id.trim().is_empty() {
            return Err(invalid("kafka.instance_id", "must not be empty"));
        }
        if self.kafka.partitions < 1 {
            return Err(invalid("kafka.partitions", "must be at least 1"));
        }
        for name in self.kafka.client.keys() {
            if let Some(why) = refused_client_property(name) {
                return Err(invalid(
                    &format!("kafka.client.\"{name}\""),
                    &format!("cannot be set: {why}"),
                ));
            }
        }
        let names = self.kafka.topics.all();
        for (i, a) in names.iter().enumerate() {
            if a.is_empty() {
                return Err(invalid("kafka.topics", "topic names must not be empty"));
            }
            if names[i + 1..].contains(a) {
                return Err(invalid(
                    "kafka.topics",
                    &format!("topic `{a}` is used for two purposes"),
                ));
            }
        }
        if self.tools.values().any(|t| t.pool.is_some())
            && !self.kafka.topics.pool_calls.contains("{pool}")
        {
            return Err(invalid(
                "kafka.topics.pool_calls",
                "must contain `{pool}` (each pool has its own calls topic)",
            ));
        }
        if self.state.retention.0.is_zero() {
            return Err(invalid("state.retention", "must be longer than 0"));
        }
        if self.gate.max_batch == 0 {
            return Err(invalid("gate.max_batch", "must be at least 1"));
        }
        if self.executor.max_queued_calls == 0 || self.executor.max_queued_bytes == 0 {
            return Err(invalid(
                "executor.max_queued_calls",
                "`executor.max_queued_calls` and `executor.max_queued_bytes` must be at least 1: at the bound the gate pauses its intents",
            ));
        }
        if self.executor.concurrency == 0 {
            return Err(invalid("executor.concurrency", "must be at least 1"));
        }
        if !matches!(self.log.format.as_str(), "pretty" | "json") {
            return Err(invalid("log.format", "must be \"pretty\" or \"json\""));
        }
        if !self.http.listen.is_empty() && self.http.listen.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(invalid(
                "http.listen",
                "must be an address like \"127.0.0.1:9464\" (or empty to disable)",
            ));
        }
        for (name, tool) in &self.tools {
            if !crate::contract::valid_tool_name(name) {
                return Err(invalid(
                    &format!("tools.{name}"),
                    "tool names are 1 to 128 of [A-Za-z0-9_.:-]",
                ));
            }
            // A pool tool has no address here: its workers hold it.
            let url_key = match (&tool.pool, &tool.mcp_tool) {
                (Some(_), _) => None,
                (None, Some(_)) => Some(format!("tools.{name}.mcp")),
                (None, None) => Some(format!("tools.{name}.url")),
            };
            // The URL may carry credentials: echoed redacted, or not at all.
            if let Some(url_key) = url_key {
                check_tool_url(&url_key, &tool.url)?;
            }
            if reqwest::header::HeaderName::from_bytes(tool.idempotency_header.as_bytes()).is_err()
            {
                return Err(invalid(
                    &format!("tools.{name}.idempotency_header"),
                    &format!(
                        "`{}` is not a valid HTTP header name",
                        tool.idempotency_header
                    ),
                ));
            }
            if tool
                .idempotency_field
                .as_ref()
                .is_some_and(|f| f.split('.').any(str::is_empty))
            {
                return Err(invalid(
                    &format!("tools.{name}.idempotency_field"),
                    "must be a dotted path like \"metadata.idempotency_key\"",
                ));
            }
            if tool.timeout.0.is_zero() {
                return Err(invalid(
                    &format!("tools.{name}.timeout"),
                    "must be longer than 0",
                ));
            }
            if tool.max_output_bytes == 0 {
                return Err(invalid(
                    &format!("tools.{name}.max_output_bytes"),
                    "must be at least 1",
                ));
            }
            if tool.max_concurrency == Some(0) {
                return Err(invalid(
                    &format!("tools.{name}.max_concurrency"),
                    "must be at least 1 (leave it out for no limit)",
                ));
            }
            if tool.queue_timeout.0.is_zero() {
                return Err(invalid(
                    &format!("tools.{name}.queue_timeout"),
                    "must be longer than 0",
                ));
            }
            for (i, (header, spec)) in tool.headers.iter().enumerate() {
                let field = format!("tools.{name}.headers.{header}");
                if reqwest::header::HeaderName::from_bytes(header.as_bytes()).is_err() {
                    return Err(invalid(&field, "is not a valid HTTP header name"));
                }
                if tool
                    .headers
                    .keys()
                    .skip(i + 1)
                    .any(|other| other.eq_ignore_ascii_case(header))
                {
                    return Err(invalid(
                        &field,
                        "is given twice (header names are case-insensitive)",
                    ));
                }
                if let Some(reserved) = RESERVED_HEADERS
                    .iter()
                    .copied()
                    .chain([tool.idempotency_header.as_str()])
                    .find(|r| r.eq_ignore_ascii_case(header))
                {
                    return Err(invalid(
                        &field,
                        &format!(
                            "cannot be set: stepgate sends `{reserved}` itself on every call \
                             (the protocol's headers and the request's framing are not configurable)"
                        ),
                    ));
                }
                // Only what the spec names, never a value.
                match &spec.source {
                    HeaderSource::Env(var) if var.is_empty() => {
                        return Err(invalid(
                            &field,
                            "`env:` needs a variable name, e.g. \"env:PAY_TOKEN\"",
                        ));
                    }
                    HeaderSource::File(path) if path.as_os_str().is_empty() => {
                        return Err(invalid(
                            &field,
                            "`file:` needs a path, e.g. \"file:/run/secrets/pay_key\"",
                        ));
                    }
                    HeaderSource::Literal(v)
                        if v.trim().is_empty()
                            || reqwest::header::HeaderValue::from_str(v.trim()).is_err() =>
                    {
                        return Err(invalid(
                            &field,
                            "is empty or not a valid HTTP header value (write \"env:NAME\" or \"file:/path\" to read it from the environment or a file)",
                        ));
                    }
                    _ => {}
                }
            }
        }
        self.mcp.validate(&self.tools)?;
        self.traces.validate()?;
        self.console.validate()?;
        Ok(())
    }

    /// Read every tool header's value from the environment (through `env`) or
    /// its file, once, at start. A missing variable or unreadable file is an
    /// error naming the tool, the header and the source — never a value.
    /// Headers already resolved are left as they are.
    pub fn resolve_tool_headers(
        &mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        for (tool, t) in &mut self.tools {
            for (header, spec) in &mut t.headers {
                if spec.value().is_some() && !matches!(spec.source, HeaderSource::Literal(_)) {
                    continue;
                }
                spec.resolve(&env).map_err(|message| ConfigError::Secret {
                    tool: tool.clone(),
                    header: header.clone(),
                    message,
                })?;
            }
        }
        Ok(())
    }

    /// The same config with every secret replaced by [`REDACTED`]: the
    /// `[kafka.client]` properties [`is_secret_property`] names, credentials
    /// in URLs ([`redact_url`]) and tool header values (their `env:`/`file:`
    /// sources stay, they are not secrets). What `check-config` prints and what
    /// `Debug` shows; it still loads.
    pub fn redacted(&self) -> Config {
        Config {
            kafka: self.kafka.redacted(),
            mcp: self.mcp.redacted(),
            traces: self.traces.redacted(),
            console: self.console.redacted(),
            tools: self
                .tools
                .iter()
                .map(|(n, t)| (n.clone(), t.redacted()))
                .collect(),
            ..self.clone()
        }
    }

    /// Sorted tool names.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }
}

// Redaction: the one place that decides what is a secret. `check-config`
// prints `Config::redacted()`; every `Debug` below shows redacted values.

impl KafkaConfig {
    /// The `[kafka.client]` pass-through redacted ([`redact_client_properties`]).
    pub fn redacted(&self) -> KafkaConfig {
        KafkaConfig {
            client: redact_client_properties(&self.client),
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("KafkaConfig")
            .field("brokers", &r.brokers)
            .field("topics", &r.topics)
            .field("gate_group", &r.gate_group)
            .field("instance_id", &r.instance_id)
            .field("partitions", &r.partitions)
            .field("replication_factor", &r.replication_factor)
            .field("session_timeout", &r.session_timeout)
            .field("transaction_timeout", &r.transaction_timeout)
            .field("client", &r.client)
            .finish()
    }
}

/// The default `kafka.instance_id`: this host's name, which is distinct per
/// host, container and Kubernetes pod and stable across restarts of one (static
/// membership and transactional ids rely on both). `HOSTNAME` first (Kubernetes
/// sets it to the pod's name, Docker to the container's id), then the system's
/// host name.
pub fn default_instance_id() -> String {
    instance_id_from(std::env::var("HOSTNAME").ok(), system_hostname)
}

/// [`default_instance_id`] from its sources: the first usable name, made of
/// the characters Kafka accepts in a `group.instance.id` (`[A-Za-z0-9._-]`,
/// anything else becomes `-`) and at most 200 of them; `stepgate-0` only when
/// no source names the host.
pub fn instance_id_from(
    hostname_env: Option<String>,
    system: impl FnOnce() -> Option<String>,
) -> String {
    fn usable(name: Option<String>) -> Option<String> {
        let name = name?;
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        Some(
            name.chars()
                .take(200)
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                        c
                    } else {
                        '-'
                    }
                })
                .collect(),
        )
    }
    usable(hostname_env)
        .or_else(|| usable(system()))
        .unwrap_or_else(|| "stepgate-0".to_owned())
}

/// The kernel's host name (`gethostname(2)`), else `/etc/hostname`.
fn system_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass;
    // gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if let Ok(name) = std::str::from_utf8(&buf[..end])
            && !name.trim().is_empty()
        {
            return Some(name.to_owned());
        }
    }
    std::fs::read_to_string("/etc/hostname").ok()
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// A TOML syntax error by line and column, without the excerpt of the file
/// that toml's own message quotes: that line may hold a secret.
fn syntax_error(e: &toml::de::Error, text: &str) -> ConfigError {
    let at = e.span().map(|span| {
        let before = text.get(..span.start).unwrap_or(text);
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("line {line}, column {column}: ")
    });
    ConfigError::Parse(format!("{}{}", at.unwrap_or_default(), e.message()))
}

/// An error of the merged config. A key no section has can only come from the
/// file (the environment's are checked against the schema first): it is
/// located in the file (line, column), else named with its section.
fn shape_error(e: &toml::de::Error, text: &str) -> ConfigError {
    if e.message().starts_with("unknown field") {
        // The file alone, deserialized for its spans (the merged table has none).
        if let Err(at) = toml::from_str::<Config>(text)
            && at.span().is_some()
            && at.message().starts_with("unknown field")
        {
            return syntax_error(&at, text);
        }
        // `… in `gate``: on one line.
        return ConfigError::Parse(e.to_string().trim_end().replace('\n', " "));
    }
    ConfigError::Parse(e.to_string())
}

/// `STEPGATE_*` variables that are not config keys: accepted, and left to
/// whoever reads them — the CLI's own (`env = …` of its arguments in
/// `src/cli/mod.rs`) and those of the test suites, benchmarks and scripts (a
/// `stepgate` process they start inherits them). Every other `STEPGATE_*`
/// variable must name a config key, or be named by an `env:` value of the
/// config (a tool header's, a static MCP token's); see [`Config::from_toml_str`].
pub const NOT_CONFIG_VARIABLES: &[&str] = &[
    // src/cli/mod.rs
    "STEPGATE_CONFIG",
    "STEPGATE_OPERATOR",
    // tests/, benches/, deploy/local/
    "STEPGATE_BIN",
    "STEPGATE_NEED_KAFKA",
    "STEPGATE_KEEP_KAFKA",
    "STEPGATE_CRASH_MATRIX",
    "STEPGATE_CRASH_SEED",
    "STEPGATE_FUZZ_CASES",
    "STEPGATE_LONG_FAULTS",
    "STEPGATE_CLUSTER_FAULTS",
    "STEPGATE_K8S_SCHEMAS",
    "STEPGATE_BENCH_RUN_ID",
    "STEPGATE_CACHE",
    "STEPGATE_PEERS_DIR",
    "STEPGATE_CONSOLE_SCREENSHOTS",
];

/// Prefixes of `STEPGATE_*` variables that are not config keys: the test
/// hooks (`STEPGATE_TEST_CRASH_BEFORE_COMMIT`, …) and the gate simulation's
/// settings (`STEPGATE_SIM_SEED`, …). No config section has these names.
pub const NOT_CONFIG_PREFIXES: &[&str] = &["STEPGATE_TEST_", "STEPGATE_SIM_"];

/// Whether a `STEPGATE_*` variable is one stepgate's config leaves alone.
pub fn is_not_config_variable(name: &str) -> bool {
    NOT_CONFIG_VARIABLES.contains(&name) || NOT_CONFIG_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// How an environment value is read for a key: as the type of the key.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Int,
    Float,
    Bool,
    Str,
    /// Comma-separated items, or a JSON array.
    List(Box<Kind>),
    /// JSON: a table (`input_schema`) or an array of tables (`mcp.auth.tokens`).
    Json,
}

/// How the rest of a variable names a key of a name-keyed table.
#[derive(Debug, Clone, Copy, PartialEq)]
enum MapKeys {
    /// A librdkafka property: `SSL_CA_LOCATION` → `ssl.ca.location`.
    Property,
    /// An HTTP header: `X_API_KEY` → `x-api-key`.
    Header,
    /// As written, in lower case: `SUPPORT` → `support`.
    Lower,
}

/// One settable key: its variable name (after `STEPGATE_`, or after
/// `STEPGATE_TOOLS_<TOOL>_` for a tool's), its path and its type.
#[derive(Debug)]
struct Leaf {
    env: String,
    path: Vec<String>,
    kind: Kind,
}

/// A table keyed by names (`[kafka.client]`, a tool's `headers`,
/// `[mcp.auth.scopes]`): `<env>_<NAME>` sets its entry `NAME`.
#[derive(Debug)]
struct MapAt {
    env: String,
    path: Vec<String>,
    kind: Kind,
    keys: MapKeys,
}

/// Every key the environment can set, from the typed defaults.
#[derive(Debug)]
struct EnvSchema {
    leaves: Vec<Leaf>,
    maps: Vec<MapAt>,
    /// A tool's keys, relative to `[tools.<name>]`.
    tool_leaves: Vec<Leaf>,
    tool_maps: Vec<MapAt>,
}

/// The keys whose default is unset, so that a serialized default does not
/// show them: given a value here so that the schema knows them and their type
/// (`every_key_is_in_the_env_schema` checks that none is missed).
const UNSET_BY_DEFAULT: &str = r#"
[state]
decisions_retention = "1d"
[mcp]
resource = ""
[traces]
endpoint = ""
[console]
proxy_user_header = ""
trace_url = ""
[[console.tokens]]
name = ""
token = "env:X"
[mcp.auth]
issuer = ""
jwks_url = ""
[[mcp.auth.tokens]]
name = ""
token = "env:X"
scopes = []
"#;

/// A tool with every key set (`mcp`, which excludes `url`, is added in
/// [`EnvSchema::new`]).
const TOOL_WITH_EVERY_KEY: &str = r#"
category = "keyed"
policy = "in_doubt"
url = "http://h/x"
mcp_tool = "x"
description = ""
input_schema = { type = "object" }
timeout = "1s"
retries = 1
backoff = "1s"
record = false
idempotency_header = "Idempotency-Key"
idempotency_field = "a"
annotations = { readOnlyHint = false, idempotentHint = false, destructiveHint = false, openWorldHint = false }
max_output_bytes = 1
max_concurrency = 1
queue_timeout = "1s"
headers = { H = "v" }
busy_statuses = [409]
busy_wait = "1s"
identity = ["/a"]
"#;

/// The variable-name form of a key path: upper case, anything but a letter
/// or digit `_`, parts joined by `_`.
fn env_part<S: AsRef<str>>(path: &[S]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|p| {
            p.as_ref()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_uppercase()
                    } else {
                        '_'
                    }
                })
                .collect()
        })
        .collect();
    parts.join("_")
}

fn kind_of(v: &toml::Value) -> Kind {
    match v {
        toml::Value::Integer(_) => Kind::Int,
        toml::Value::Float(_) => Kind::Float,
        toml::Value::Boolean(_) => Kind::Bool,
        toml::Value::Array(a) => match a.first() {
            Some(toml::Value::Table(_)) => Kind::Json,
            Some(item) => Kind::List(Box::new(kind_of(item))),
            None => Kind::List(Box::new(Kind::Str)),
        },
        _ => Kind::Str,
    }
}

impl EnvSchema {
    fn new() -> EnvSchema {
        let mut sample =
            toml::Table::try_from(Config::default()).expect("the default config serialises");
        sample.remove("tools");
        merge(
            &mut sample,
            toml::from_str(UNSET_BY_DEFAULT).expect("UNSET_BY_DEFAULT is TOML"),
        );
        let mut tool: toml::Table =
            toml::from_str(TOOL_WITH_EVERY_KEY).expect("TOOL_WITH_EVERY_KEY is TOML");
        tool.insert("mcp".into(), toml::Value::String(String::new()));
        // `pool` excludes `url`: settable all the same (`STEPGATE_TOOLS_<NAME>_POOL`).
        tool.insert("pool".into(), toml::Value::String(String::new()));
        let (mut leaves, mut maps) = (Vec::new(), Vec::new());
        collect(&sample, &mut Vec::new(), false, &mut leaves, &mut maps);
        let (mut tool_leaves, mut tool_maps) = (Vec::new(), Vec::new());
        collect(
            &tool,
            &mut Vec::new(),
            true,
            &mut tool_leaves,
            &mut tool_maps,
        );
        EnvSchema {
            leaves,
            maps,
            tool_leaves,
            tool_maps,
        }
    }

    /// The key a `STEPGATE_*` variable sets, with its type; `Ok(None)` when it
    /// names none. `root` is the config as read from the file (its tools,
    /// its map entries).
    fn target(&self, var: &str, root: &toml::Table) -> Result<Option<(Vec<String>, Kind)>, String> {
        let Some(rest) = var.strip_prefix("STEPGATE_") else {
            return Ok(None);
        };
        if let Some(t) = find(&self.leaves, &self.maps, rest, root, &[]) {
            return Ok(Some(t));
        }
        let Some(rest) = rest.strip_prefix("TOOLS_") else {
            return Ok(None);
        };
        let tools = root.get("tools").and_then(toml::Value::as_table);
        let mut found = Vec::new();
        for (name, t) in tools.into_iter().flatten() {
            let Some(suffix) = rest
                .strip_prefix(env_part(&[name]).as_str())
                .and_then(|s| s.strip_prefix('_'))
            else {
                continue;
            };
            let empty = toml::Table::new();
            let t = t.as_table().unwrap_or(&empty);
            let prefix = ["tools".to_owned(), name.clone()];
            if let Some(target) = find(&self.tool_leaves, &self.tool_maps, suffix, t, &prefix) {
                found.push((name, target));
            }
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop().map(|(_, t)| t)),
            _ => Err(format!(
                "names a key of more than one tool ({}): their names differ only in characters that are `_` in a variable name. Rename one of the tools, or set the key in the file",
                found
                    .iter()
                    .map(|(n, (p, _))| format!("`{n}`: `{}`", p.join(".")))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// Every variable name the config knows, for the nearest-name hint.
    fn known_names(&self, root: &toml::Table) -> Vec<String> {
        let mut out: Vec<String> = self
            .leaves
            .iter()
            .map(|l| format!("STEPGATE_{}", l.env))
            .collect();
        let entries = |maps: &[MapAt], table: &toml::Table, prefix: &str, out: &mut Vec<String>| {
            for m in maps {
                if let Some(t) = lookup(table, &m.path).and_then(toml::Value::as_table) {
                    out.extend(
                        t.keys()
                            .map(|k| format!("{prefix}{}_{}", m.env, env_part(&[k]))),
                    );
                }
            }
        };
        entries(&self.maps, root, "STEPGATE_", &mut out);
        for (name, t) in root
            .get("tools")
            .and_then(toml::Value::as_table)
            .into_iter()
            .flatten()
        {
            let prefix = format!("STEPGATE_TOOLS_{}_", env_part(&[name]));
            out.extend(
                self.tool_leaves
                    .iter()
                    .map(|l| format!("{prefix}{}", l.env)),
            );
            if let Some(t) = t.as_table() {
                entries(&self.tool_maps, t, &prefix, &mut out);
            }
        }
        out.extend(NOT_CONFIG_VARIABLES.iter().map(|s| s.to_string()));
        out
    }
}

/// The leaves and name-keyed tables under `table`.
fn collect(
    table: &toml::Table,
    path: &mut Vec<String>,
    tool: bool,
    leaves: &mut Vec<Leaf>,
    maps: &mut Vec<MapAt>,
) {
    for (k, v) in table {
        path.push(k.clone());
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        let map = match (tool, p.as_slice()) {
            (false, ["kafka", "client"]) => Some((MapKeys::Property, Kind::Str)),
            (false, ["mcp", "auth", "scopes"]) => {
                Some((MapKeys::Lower, Kind::List(Box::new(Kind::Str))))
            }
            (false, ["console", "roles"]) => Some((MapKeys::Lower, Kind::Str)),
            (true, ["headers"]) | (false, ["traces", "headers"]) => {
                Some((MapKeys::Header, Kind::Str))
            }
            _ => None,
        };
        let json = tool && p.as_slice() == ["input_schema"];
        match (map, v) {
            (Some((keys, kind)), _) => maps.push(MapAt {
                env: env_part(path),
                path: path.clone(),
                kind,
                keys,
            }),
            (None, toml::Value::Table(t)) if !json => collect(t, path, tool, leaves, maps),
            (None, v) => leaves.push(Leaf {
                env: env_part(path),
                path: path.clone(),
                kind: if json { Kind::Json } else { kind_of(v) },
            }),
        }
        path.pop();
    }
}

fn lookup<'a>(table: &'a toml::Table, path: &[String]) -> Option<&'a toml::Value> {
    let (first, rest) = path.split_first()?;
    let v = table.get(first)?;
    if rest.is_empty() {
        Some(v)
    } else {
        lookup(v.as_table()?, rest)
    }
}

/// The key `rest` (a variable name without its prefix) sets among `leaves`
/// and `maps`; `table` holds the entries the file gave the maps, and `prefix`
/// goes before the path.
fn find(
    leaves: &[Leaf],
    maps: &[MapAt],
    rest: &str,
    table: &toml::Table,
    prefix: &[String],
) -> Option<(Vec<String>, Kind)> {
    let full = |p: &[String]| prefix.iter().chain(p).cloned().collect::<Vec<_>>();
    if let Some(l) = leaves.iter().find(|l| l.env == rest) {
        return Some((full(&l.path), l.kind.clone()));
    }
    for m in maps {
        let Some(name) = rest
            .strip_prefix(m.env.as_str())
            .and_then(|r| r.strip_prefix('_'))
            .filter(|r| !r.is_empty())
        else {
            continue;
        };
        // An entry the file has, under its own spelling; else the rule.
        let existing = lookup(table, &m.path)
            .and_then(toml::Value::as_table)
            .and_then(|t| t.keys().find(|k| env_part(&[k]) == name).cloned());
        let key = existing.unwrap_or_else(|| {
            let lower = name.to_ascii_lowercase();
            match m.keys {
                MapKeys::Property => lower.replace('_', "."),
                MapKeys::Header => lower.replace('_', "-"),
                MapKeys::Lower => lower,
            }
        });
        let mut path = full(&m.path);
        path.push(key);
        return Some((path, m.kind.clone()));
    }
    None
}

/// Set `path` in `root` to `value`, making the tables on the way.
fn set_at(root: &mut toml::Table, path: &[String], value: toml::Value) {
    let (last, parents) = path.split_last().expect("a key path is not empty");
    let mut table = root;
    for p in parents {
        let entry = table
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        table = entry.as_table_mut().expect("made a table above");
    }
    table.insert(last.clone(), value);
}

/// An environment value read as the key's type. An error never quotes a
/// string value (it may be a secret).
fn parse_env_value(kind: &Kind, raw: &str) -> Result<toml::Value, String> {
    let t = raw.trim();
    Ok(match kind {
        Kind::Int => toml::Value::Integer(
            t.parse()
                .map_err(|_| format!("expected an integer, got `{raw}`"))?,
        ),
        Kind::Float => toml::Value::Float(
            t.parse()
                .map_err(|_| format!("expected a number, got `{raw}`"))?,
        ),
        Kind::Bool => toml::Value::Boolean(
            t.parse()
                .map_err(|_| format!("expected true or false, got `{raw}`"))?,
        ),
        Kind::Str => toml::Value::String(raw.to_owned()),
        Kind::List(_) if t.starts_with('[') => parse_json(t)?,
        Kind::List(item) => toml::Value::Array(
            t.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| parse_env_value(item, s))
                .collect::<Result<_, _>>()?,
        ),
        Kind::Json => parse_json(t)?,
    })
}

fn parse_json(t: &str) -> Result<toml::Value, String> {
    let v: serde_json::Value =
        serde_json::from_str(t).map_err(|e| format!("expected JSON ({e})"))?;
    toml::Value::try_from(v).map_err(|_| "this JSON has no TOML form (a `null` has none)".into())
}

/// Every `env:NAME` a string value of the config names.
fn env_references(v: &toml::Value, out: &mut Vec<String>) {
    match v {
        toml::Value::String(s) => {
            if let Some(name) = s.strip_prefix("env:") {
                out.push(name.to_owned());
            }
        }
        toml::Value::Array(a) => a.iter().for_each(|v| env_references(v, out)),
        toml::Value::Table(t) => t.values().for_each(|v| env_references(v, out)),
        _ => {}
    }
}

/// Apply the `STEPGATE_*` variables of `env` to `root` (the defaults with the
/// file over them). Each must set a key (then read as the key's type), be in
/// [`NOT_CONFIG_VARIABLES`]/[`NOT_CONFIG_PREFIXES`], or be named by an `env:`
/// value of the config; any other is refused, with the nearest known name.
fn apply_env(root: &mut toml::Table, env: &[(String, String)]) -> Result<(), ConfigError> {
    let schema = EnvSchema::new();
    let mut unknown = Vec::new();
    let mut sets = Vec::new();
    for (var, raw) in env {
        match schema.target(var, root) {
            Ok(Some((path, kind))) => {
                let value = parse_env_value(&kind, raw).map_err(|message| ConfigError::Env {
                    var: var.clone(),
                    message,
                })?;
                sets.push((path, value));
            }
            Ok(None) => unknown.push(var),
            Err(message) => {
                return Err(ConfigError::Env {
                    var: var.clone(),
                    message,
                });
            }
        }
    }
    for (path, value) in sets {
        set_at(root, &path, value);
    }
    let mut referenced = Vec::new();
    env_references(&toml::Value::Table(root.clone()), &mut referenced);
    unknown.sort();
    if let Some(var) = unknown
        .into_iter()
        .find(|v| !is_not_config_variable(v) && !referenced.contains(v))
    {
        let nearest = schema
            .known_names(root)
            .into_iter()
            .min_by_key(|k| strsim::levenshtein(k, var))
            .unwrap_or_default();
        let tools = if var.starts_with("STEPGATE_TOOLS_") {
            " (the environment sets the keys of the tools the config file defines: a tool is added in the file)"
        } else {
            ""
        };
        return Err(ConfigError::Env {
            var: var.clone(),
            message: format!(
                "is not a stepgate setting; did you mean `{nearest}`? Every `STEPGATE_*` variable sets a config key (`[section] key` is `STEPGATE_SECTION_KEY`){tools}: correct its name, or unset it"
            ),
        });
    }
    Ok(())
}

/// What a person may do in the console. Each role may do what the one before
/// it may: a viewer reads, an approver also approves and denies held calls,
/// an operator also resolves in-doubt steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsoleRole {
    Viewer,
    Approver,
    Operator,
}

impl ConsoleRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ConsoleRole::Viewer => "viewer",
            ConsoleRole::Approver => "approver",
            ConsoleRole::Operator => "operator",
        }
    }
}

/// One console bearer token: the principal it names.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleToken {
    /// The principal's name: its role is `[console.roles]`'s entry for it, and
    /// its decisions are recorded under it.
    pub name: String,
    /// `"env:NAME"` or `"file:/path"` (a literal works, but keeps the secret in
    /// the config file); at least 16 characters.
    pub token: HeaderSpec,
}

/// `stepgate console`: a web console over the topics (no state of its own;
/// any number may run). Who a request comes from is read from a bearer token
/// (`tokens`, or `[mcp.auth]`'s tokens and JWTs with `mcp_auth`), the login
/// cookie holding one, or a trusted proxy's header (`proxy_user_header`);
/// what they may do from `roles`. Nothing is served to a principal without a role.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// The address it serves on: loopback unless set otherwise.
    pub listen: String,
    /// Principal → `viewer`, `approver` or `operator`.
    pub roles: BTreeMap<String, ConsoleRole>,
    /// Bearer tokens (or the login form's) naming principals.
    pub tokens: Vec<ConsoleToken>,
    /// Also accept `[mcp.auth]`'s static tokens and JWTs (their issuer,
    /// keys and audience); the principal is the token's name or subject.
    pub mcp_auth: bool,
    /// A header a trusted proxy (oauth2-proxy, an ingress's OIDC) sets to the
    /// signed-in user, e.g. `"X-Forwarded-User"`. Only honoured when set: set it
    /// only where every request comes through that proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_user_header: Option<String>,
    /// A trace UI's URL for one trace, `{trace_id}` replaced by the step's
    /// trace id (from its `traceparent`), e.g.
    /// `"http://jaeger:16686/trace/{trace_id}"`. Unset: no trace links.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_url: Option<String>,
    /// How often the open pages look for new held calls and in-doubt steps.
    pub refresh: Dur,
    /// How long an action waits for the gate to apply it before the page
    /// says it was sent but not yet applied.
    pub decision_wait: Dur,
    /// The gates' HTTP base URLs (their `http.listen`), e.g.
    /// `["http://127.0.0.1:9464"]`: the overview reads each one's `/metrics`
    /// for which partitions it owns and their restore state. Empty: not shown.
    pub gates: Vec<String>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            listen: "127.0.0.1:9470".into(),
            roles: BTreeMap::new(),
            tokens: Vec::new(),
            mcp_auth: false,
            proxy_user_header: None,
            trace_url: None,
            refresh: dur("1s"),
            decision_wait: dur("15s"),
            gates: Vec::new(),
        }
    }
}

impl ConsoleConfig {
    /// Checks serde cannot express, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: format!("console.{field}"),
            message,
        };
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "listen",
                format!(
                    "must be an address and port, e.g. \"127.0.0.1:9470\"; got `{}`",
                    self.listen
                ),
            ));
        }
        if let Some(h) = &self.proxy_user_header
            && reqwest::header::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            return Err(invalid(
                "proxy_user_header",
                format!("`{h}` is not a valid HTTP header name"),
            ));
        }
        if let Some(u) = &self.trace_url
            && !u.contains("{trace_id}")
        {
            return Err(invalid(
                "trace_url",
                "must contain `{trace_id}`, e.g. \"http://jaeger:16686/trace/{trace_id}\"".into(),
            ));
        }
        if self.refresh.0 < std::time::Duration::from_millis(100) {
            return Err(invalid("refresh", "must be at least 100ms".into()));
        }
        for (i, g) in self.gates.iter().enumerate() {
            if !reqwest::Url::parse(g).is_ok_and(|u| is_http(&u)) {
                return Err(invalid(
                    &format!("gates[{i}]"),
                    format!(
                        "must be a gate's HTTP base URL, e.g. \"http://127.0.0.1:9464\"; got `{}`",
                        redact_url(g)
                    ),
                ));
            }
        }
        for (i, t) in self.tokens.iter().enumerate() {
            let field = format!("tokens[{i}]");
            if t.name.trim().is_empty() {
                return Err(invalid(&field, "needs a `name`".into()));
            }
            if self.tokens[..i].iter().any(|o| o.name == t.name) {
                return Err(invalid(
                    &field,
                    format!("the name `{}` is used twice", t.name),
                ));
            }
            if let HeaderSource::Literal(v) = &t.token.source
                && v.trim().len() < 16
            {
                return Err(invalid(
                    &field,
                    "the token must be at least 16 characters (or \"env:NAME\", \"file:/path\")"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Whether any way of naming a principal is configured.
    pub fn has_identity(&self) -> bool {
        !self.tokens.is_empty() || self.mcp_auth || self.proxy_user_header.is_some()
    }

    /// The same with literal tokens redacted.
    pub fn redacted(&self) -> ConsoleConfig {
        let mut c = self.clone();
        for t in &mut c.tokens {
            t.token = HeaderSpec::parse(&t.token.shown());
        }
        c
    }
}

/// `[traces]`: where and how much to export. Without `endpoint`, nothing is.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracesConfig {
    /// The OTLP/HTTP traces URL, protobuf encoding, e.g.
    /// `"http://127.0.0.1:4318/v1/traces"` (an OpenTelemetry Collector,
    /// Jaeger, Tempo, Langfuse's `/api/public/otel/v1/traces`, …), used as
    /// given. Unset: no traces, and no cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The share of new traces kept, 0 to 1 (by trace id, so a trace is kept
    /// or dropped whole).
    pub sample_ratio: f64,
    /// Follow the agent's decision when its `traceparent` has one (its
    /// sampled flag): `sample_ratio` then applies only to intents without a
    /// `traceparent`.
    pub parent_based: bool,
    /// `service.name` of the spans.
    pub service_name: String,
    /// How often finished spans are sent (in batches, from a thread of their own).
    pub export_interval: Dur,
    /// How long one export may take.
    pub timeout: Dur,
    /// HTTP headers of every export request (an `Authorization` for a hosted
    /// backend). Values are secrets: set them from the environment
    /// (`STEPGATE_TRACES_HEADERS_AUTHORIZATION`); `check-config` prints them
    /// redacted.
    pub headers: BTreeMap<String, String>,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            endpoint: None,
            sample_ratio: 1.0,
            parent_based: true,
            service_name: "stepgate".into(),
            export_interval: crate::duration::dur("5s"),
            timeout: crate::duration::dur("10s"),
            headers: BTreeMap::new(),
        }
    }
}

impl TracesConfig {
    /// Checks serde cannot express, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: format!("traces.{field}"),
            message,
        };
        if let Some(e) = &self.endpoint {
            match reqwest::Url::parse(e) {
                Ok(u) if is_http(&u) => {}
                _ => {
                    return Err(invalid(
                        "endpoint",
                        format!(
                            "must be the http(s) URL of an OTLP/HTTP traces endpoint, e.g. \"http://127.0.0.1:4318/v1/traces\", got `{}`",
                            redact_url(e)
                        ),
                    ));
                }
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid(
                "sample_ratio",
                format!("must be from 0 to 1, got {}", self.sample_ratio),
            ));
        }
        if self.service_name.trim().is_empty() {
            return Err(invalid("service_name", "must not be empty".into()));
        }
        if self.export_interval.0.is_zero() || self.timeout.0.is_zero() {
            return Err(invalid(
                "export_interval",
                "`traces.export_interval` and `traces.timeout` must be longer than 0".into(),
            ));
        }
        for name in self.headers.keys() {
            if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(invalid(
                    &format!("headers.{name}"),
                    "is not a valid HTTP header name".into(),
                ));
            }
        }
        Ok(())
    }

    /// The same with header values and credentials in the URL redacted.
    pub fn redacted(&self) -> TracesConfig {
        TracesConfig {
            endpoint: self.endpoint.as_deref().map(redact_url),
            headers: self
                .headers
                .keys()
                .map(|k| (k.clone(), REDACTED.to_owned()))
                .collect(),
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for TracesConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("TracesConfig")
            .field("endpoint", &r.endpoint)
            .field("sample_ratio", &r.sample_ratio)
            .field("parent_based", &r.parent_based)
            .field("service_name", &r.service_name)
            .field("export_interval", &r.export_interval)
            .field("timeout", &r.timeout)
            .field("headers", &r.headers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SAMPLE: &str = r#"
[kafka]
brokers = "10.0.0.1:9092"

[state]
retention = "2d"

[tools.send_email]
category = "keyed"
url = "http://127.0.0.1:8080/send_email"
timeout = "5s"
"#;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn file_values_and_defaults() {
        let c = Config::from_toml_str(SAMPLE, env(&[])).unwrap();
        assert_eq!(c.kafka.brokers, "10.0.0.1:9092");
        assert_eq!(c.state.retention.0, Duration::from_secs(2 * 86400));
        assert_eq!(c.kafka.topics.intents, "stepgate.intents");
        let t = &c.tools["send_email"];
        assert_eq!(t.category, Category::Keyed);
        assert_eq!(t.retries, 2);
        assert!(t.recorded());
    }

    #[test]
    fn env_overrides_every_level() {
        let c = Config::from_toml_str(
            SAMPLE,
            env(&[
                ("STEPGATE_KAFKA_BROKERS", "127.0.0.1:19092"),
                ("STEPGATE_GATE_MAX_BATCH", "7"),
                ("STEPGATE_KAFKA_TOPICS_INTENTS", "x.intents"),
                ("STEPGATE_TOOLS_SEND_EMAIL_URL", "http://127.0.0.1:9/x"),
                ("STEPGATE_KAFKA_CLIENT_SECURITY_PROTOCOL", "ssl"),
                ("OTHER", "ignored"),
            ]),
        )
        .unwrap();
        assert_eq!(c.kafka.brokers, "127.0.0.1:19092");
        assert_eq!(c.gate.max_batch, 7);
        assert_eq!(c.kafka.topics.intents, "x.intents");
        assert_eq!(c.tools["send_email"].url, "http://127.0.0.1:9/x");
        assert_eq!(c.kafka.client["security.protocol"], "ssl");
    }

    #[test]
    fn bad_values_name_the_field() {
        let e =
            Config::from_toml_str(SAMPLE, env(&[("STEPGATE_GATE_MAX_BATCH", "many")])).unwrap_err();
        assert!(e.to_string().contains("STEPGATE_GATE_MAX_BATCH"), "{e}");
        let e = Config::from_toml_str("[state]\nretention = \"soon\"\n", env(&[])).unwrap_err();
        assert!(e.to_string().contains("soon"), "{e}");
        let e = Config::from_toml_str("[gate]\nmax_batchh = 1\n", env(&[])).unwrap_err();
        assert!(e.to_string().contains("max_batchh"), "{e}");
        let e = Config::from_toml_str(
            "[tools.x]\ncategory = \"keyed\"\nurl = \"ftp://h/x\"\n",
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("tools.x.url"), "{e}");
        let e = Config::from_toml_str(
            "[tools.x]\ncategory = \"sometimes\"\nurl = \"http://h/x\"\n",
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("sometimes"), "{e}");
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_place() {
        // Among them the keys of unreleased layouts (never in a release).
        for (section, key) in [
            ("kafka", "executor_group"),
            ("kafka.topics", "calls"),
            ("gate", "commit_interval"),
            ("gate", "fast_path_timeout"),
            ("executor", "commit_interval"),
        ] {
            let text = format!("# a comment\n[{section}]\n{key} = \"1s\"\n");
            let e = Config::from_toml_str(&text, env(&[]))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "line 3, column 1: unknown field `{key}`, expected"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn unkeyed_tools_take_a_policy_and_only_they_do() {
        let load = |t: &str| {
            Config::from_toml_str(&format!("[tools.t]\nurl = \"http://h/t\"\n{t}"), env(&[]))
        };
        let c = load("category = \"unkeyed\"\n").unwrap();
        assert_eq!(c.tools["t"].policy, Policy::InDoubt);
        for (text, policy) in [
            ("approval", Policy::Approval),
            ("last_step", Policy::LastStep),
            ("in_doubt", Policy::InDoubt),
        ] {
            let c = load(&format!("category = \"unkeyed\"\npolicy = \"{text}\"\n")).unwrap();
            assert_eq!(c.tools["t"].policy, policy);
        }
        let e = load("category = \"keyed\"\npolicy = \"approval\"\n").unwrap_err();
        assert!(e.to_string().contains("unkeyed tools only"), "{e}");
        let e = load("category = \"unkeyed\"\npolicy = \"sometimes\"\n").unwrap_err();
        assert!(e.to_string().contains("sometimes"), "{e}");
    }

    #[test]
    fn mcp_annotations_choose_a_category_unless_one_is_given() {
        let cases = [
            ("{readOnlyHint = true}", Category::ReadOnly),
            (
                "{readOnlyHint = false, idempotentHint = true}",
                Category::Idempotent,
            ),
            ("{destructiveHint = false}", Category::Unkeyed),
            (
                "{destructiveHint = true, openWorldHint = true}",
                Category::Unkeyed,
            ),
            ("{}", Category::Unkeyed),
        ];
        for (ann, want) in cases {
            let c = Config::from_toml_str(
                &format!("[tools.t]\nurl = \"http://h/t\"\nannotations = {ann}\n"),
                env(&[]),
            )
            .unwrap();
            assert_eq!(c.tools["t"].category, want, "{ann}");
        }
        let c = Config::from_toml_str(
            "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nannotations = {readOnlyHint = true}\n",
            env(&[]),
        )
        .unwrap();
        assert_eq!(
            c.tools["t"].category,
            Category::Keyed,
            "explicit config overrides"
        );
        let e = Config::from_toml_str("[tools.t]\nurl = \"http://h/t\"\n", env(&[])).unwrap_err();
        assert!(e.to_string().contains("needs `category`"), "{e}");
    }

    #[test]
    fn a_tool_is_served_over_http_or_over_mcp() {
        let c = Config::from_toml_str(
            "[tools.a]\ncategory = \"keyed\"\nmcp = \"http://h/mcp\"\n\
             [tools.b]\ncategory = \"keyed\"\nmcp = \"http://h/mcp\"\nmcp_tool = \"open\"\n\
             description = \"Open one.\"\ninput_schema = { type = \"object\" }\n\
             [tools.c]\ncategory = \"keyed\"\nurl = \"http://h/c\"\n",
            env(&[]),
        )
        .unwrap();
        assert_eq!(c.tools["a"].url, "http://h/mcp");
        assert_eq!(c.tools["a"].mcp_name("a"), Some("a"));
        assert_eq!(c.tools["b"].mcp_name("b"), Some("open"));
        assert_eq!(c.tools["b"].description.as_deref(), Some("Open one."));
        assert_eq!(
            c.tools["b"].input_schema.as_ref().unwrap()["type"],
            "object"
        );
        assert_eq!(c.tools["c"].mcp_name("c"), None);
        for (toml, wanted) in [
            ("url = \"http://h/x\"\nmcp = \"http://h/mcp\"", "not both"),
            ("", "needs `url`"),
            ("mcp = \"stdio:server\"", "tools.x.mcp"),
        ] {
            let e = Config::from_toml_str(
                &format!("[tools.x]\ncategory = \"keyed\"\n{toml}\n"),
                env(&[]),
            )
            .unwrap_err();
            assert!(e.to_string().contains(wanted), "{toml}: {e}");
        }
    }

    #[test]
    fn provider_key_settings_are_checked() {
        let c = Config::from_toml_str(SAMPLE, env(&[])).unwrap();
        assert_eq!(c.tools["send_email"].idempotency_header, "Idempotency-Key");
        let e = Config::from_toml_str(
            "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nidempotency_header = \"bad header\"\n",
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("tools.t.idempotency_header"), "{e}");
        let e = Config::from_toml_str(
            "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nidempotency_field = \"a..b\"\n",
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("tools.t.idempotency_field"), "{e}");
    }

    #[test]
    fn tool_deadline_covers_every_try() {
        let c = Config::from_toml_str(SAMPLE, env(&[])).unwrap();
        let t = &c.tools["send_email"];
        // 3 tries × 5 s + 200 ms + 400 ms of backoff
        assert_eq!(t.deadline(), Duration::from_millis(15_600));
    }

    #[test]
    fn output_cap_and_concurrency_limit_are_checked() {
        let load = |t: &str| {
            Config::from_toml_str(
                &format!(
                    "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\ntimeout = \"5s\"\n{t}"
                ),
                env(&[]),
            )
        };
        let c = load("").unwrap();
        assert_eq!(c.tools["t"].max_output_bytes, 512 * 1024);
        assert_eq!(c.tools["t"].max_concurrency, None);
        let c = load("max_output_bytes = 4096\nmax_concurrency = 2\n").unwrap();
        assert_eq!(c.tools["t"].max_output_bytes, 4096);
        assert_eq!(c.tools["t"].max_concurrency, Some(2));
        assert_eq!(
            c.tools["t"].queue_timeout.0,
            Duration::from_secs(5),
            "defaults to timeout"
        );
        // Each of the 3 tries may wait for a slot as long as it may run.
        assert_eq!(c.tools["t"].deadline(), Duration::from_millis(30_600));
        let c = load("max_concurrency = 2\nqueue_timeout = \"1s\"\n").unwrap();
        assert_eq!(c.tools["t"].deadline(), Duration::from_millis(18_600));
        for (line, field) in [
            ("max_output_bytes = 0", "tools.t.max_output_bytes"),
            ("max_concurrency = 0", "tools.t.max_concurrency"),
            ("queue_timeout = \"0s\"", "tools.t.queue_timeout"),
        ] {
            let e = load(&format!("{line}\n")).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
        let e = load("max_output_bytes = -1\n").unwrap_err();
        assert!(e.to_string().contains("max_output_bytes"), "{e}");
        let c = Config::from_toml_str(
            "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nmax_concurrency = 2\n",
            env(&[("STEPGATE_TOOLS_T_MAX_CONCURRENCY", "3")]),
        )
        .unwrap();
        assert_eq!(c.tools["t"].max_concurrency, Some(3));
    }

    fn tool_with(headers: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(
            &format!("[tools.pay]\ncategory = \"keyed\"\nurl = \"http://h/pay\"\n{headers}"),
            env(&[]),
        )
    }

    #[test]
    fn tool_headers_resolve_from_env_file_or_literal() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "  secret-from-file\r\n").unwrap();
        let mut c = tool_with(&format!(
            "headers = {{ Authorization = \"env:PAY_TOKEN\", \"X-Api-Key\" = \"file:{}\", \"X-Tenant\" = \"acme\" }}\n",
            file.display()
        ))
        .unwrap();
        let h = &c.tools["pay"].headers;
        assert_eq!(
            h["Authorization"].source,
            HeaderSource::Env("PAY_TOKEN".into())
        );
        assert_eq!(h["Authorization"].value(), None, "not read before start");
        assert_eq!(h["X-Tenant"].value(), Some("acme"));
        c.resolve_tool_headers(|v| (v == "PAY_TOKEN").then(|| "Bearer abc".into()))
            .unwrap();
        let h = &c.tools["pay"].headers;
        assert_eq!(h["Authorization"].value(), Some("Bearer abc"));
        assert_eq!(h["X-Api-Key"].value(), Some("secret-from-file"));
        // Serialized as configured, so check-config shows where values come from.
        let out = toml::to_string(&c).unwrap();
        assert!(out.contains("env:PAY_TOKEN"), "{out}");
        assert!(
            !out.contains("Bearer abc") && !out.contains("secret-from-file"),
            "{out}"
        );
        // From the environment too, like every key.
        let c = Config::from_toml_str(
            "[tools.pay]\ncategory = \"keyed\"\nurl = \"http://h/pay\"\nheaders = { Authorization = \"env:A\" }\n",
            env(&[("STEPGATE_TOOLS_PAY_HEADERS_AUTHORIZATION", "env:B")]),
        )
        .unwrap();
        assert_eq!(
            c.tools["pay"].headers["Authorization"].source,
            HeaderSource::Env("B".into())
        );
    }

    #[test]
    fn a_missing_header_secret_names_tool_and_header_never_a_value() {
        let mut c = tool_with("headers = { Authorization = \"env:PAY_TOKEN\" }\n").unwrap();
        let e = c.resolve_tool_headers(|_| None).unwrap_err().to_string();
        assert!(e.contains("tools.pay.headers.Authorization"), "{e}");
        assert!(e.contains("PAY_TOKEN") && e.contains("not set"), "{e}");
        // A value that is not a header value: refused, and not echoed.
        let e = c
            .resolve_tool_headers(|_| Some("Bearer hunter2\u{7}".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a valid HTTP header value"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = c.resolve_tool_headers(|_| Some(" ".into())).unwrap_err();
        assert!(e.to_string().contains("is empty"), "{e}");
        let mut c = tool_with("headers = { \"X-Api-Key\" = \"file:/nonexistent/stepgate/key\" }\n")
            .unwrap();
        let e = c.resolve_tool_headers(|_| None).unwrap_err().to_string();
        assert!(e.contains("tools.pay.headers.X-Api-Key"), "{e}");
        assert!(e.contains("/nonexistent/stepgate/key"), "{e}");
        let e = tool_with("headers = { Authorization = \"Bearer hunter2\\u0001\" }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tools.pay.headers.Authorization"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn protocol_headers_cannot_be_configured() {
        for name in [
            "Idempotency-Key",
            "idempotency-key",
            "Content-Type",
            "traceparent",
            "Stepgate-Workflow-Id",
            "Host",
        ] {
            let e = tool_with(&format!("headers = {{ \"{name}\" = \"x\" }}\n")).unwrap_err();
            assert!(e.to_string().contains("cannot be set"), "{name}: {e}");
        }
        // The tool's own key header is reserved too.
        let e = tool_with(
            "idempotency_header = \"X-Request-Id\"\nheaders = { \"x-request-id\" = \"x\" }\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("X-Request-Id"), "{e}");
        for (headers, says) in [
            ("{ \"bad header\" = \"x\" }", "not a valid HTTP header name"),
            ("{ A = \"env:\" }", "needs a variable name"),
            ("{ A = \"file:\" }", "needs a path"),
            ("{ A = \"x\", a = \"y\" }", "given twice"),
        ] {
            let e = tool_with(&format!("headers = {headers}\n")).unwrap_err();
            assert!(e.to_string().contains(says), "{headers}: {e}");
        }
    }

    #[test]
    fn validation_errors_never_echo_credentials() {
        for url in [
            "ftp://bot:hunter2@h/x",
            "http//bot:hunter2@h/x",
            "https://bot:hunter2@/x",
        ] {
            let e = Config::from_toml_str(
                &format!("[tools.x]\ncategory = \"keyed\"\nurl = \"{url}\"\n"),
                env(&[]),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("tools.x.url"), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        // A TOML syntax error is placed by line and column, its line not quoted.
        let e = Config::from_toml_str("[kafka.client]\n\"sasl.password\" = hunter2\n", env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn urls_lose_their_credentials() {
        for (url, shown) in [
            (
                "https://bot:pw@h.example/x",
                "https://bot:redacted@h.example/x",
            ),
            ("https://tok@h.example/x", "https://redacted@h.example/x"),
            (
                "https://h.example/x?api_key=k1&q=a+b&access_token=t",
                "https://h.example/x?api_key=redacted&q=a+b&access_token=redacted",
            ),
            ("https://h.example/x?q=1", "https://h.example/x?q=1"),
            ("127.0.0.1:9092", "127.0.0.1:9092"),
        ] {
            assert_eq!(redact_url(url), shown);
        }
    }

    #[test]
    fn debug_shows_no_secret() {
        let mut c = Config::from_toml_str(
            "[kafka.client]\n\"sasl.password\" = \"hunter2-a\"\n\"ssl.key.password\" = \"hunter2-b\"\n\
             \"sasl.oauthbearer.client.secret\" = \"hunter2-c\"\n\"ssl.key.location\" = \"/etc/k.pem\"\n\
             [tools.pay]\ncategory = \"keyed\"\nurl = \"https://u:hunter2-d@h/pay\"\n\
             headers = { Authorization = \"env:T\", \"X-Key\" = \"hunter2-e\" }\n",
            env(&[]),
        )
        .unwrap();
        c.resolve_tool_headers(|_| Some("hunter2-f".into()))
            .unwrap();
        let d = format!("{c:?}");
        assert!(!d.contains("hunter2"), "{d}");
        assert!(d.contains("/etc/k.pem") && d.contains("env:T"), "{d}");
    }

    #[test]
    fn the_default_instance_id_is_the_host_name() {
        let sys = |name: &'static str| move || Some(name.to_owned());
        // Kubernetes sets HOSTNAME to the pod's name.
        assert_eq!(
            instance_id_from(Some("gate-7f9c-x2x".into()), sys("node")),
            "gate-7f9c-x2x"
        );
        // Without it, the system's host name (as gethostname or /etc/hostname give it).
        assert_eq!(instance_id_from(None, sys("build-box\n")), "build-box");
        assert_eq!(instance_id_from(Some("  ".into()), sys("h1")), "h1");
        // Only characters Kafka takes in a group.instance.id, and a bounded length.
        assert_eq!(
            instance_id_from(Some("a b/c:d".into()), sys("x")),
            "a-b-c-d"
        );
        assert_eq!(instance_id_from(Some("h".repeat(300)), sys("x")).len(), 200);
        assert_eq!(instance_id_from(None, || None), "stepgate-0");
        // Stable: the same host gives the same id each time (restarts keep
        // their static membership and transactional ids).
        assert_eq!(default_instance_id(), default_instance_id());
        assert_eq!(KafkaConfig::default().instance_id, default_instance_id());
        assert!(!default_instance_id().is_empty());
    }

    #[test]
    fn client_properties_that_break_the_guarantee_are_refused() {
        // Each refused property, with what its message must say.
        let cases = [
            ("isolation.level", "read_uncommitted", "read_committed"),
            ("enable.auto.commit", "true", "inside each transaction"),
            (
                "enable.auto.offset.store",
                "true",
                "only inside each transaction",
            ),
            ("auto.offset.reset", "latest", "would skip intents"),
            (
                "partition.assignment.strategy",
                "roundrobin",
                "range assignment",
            ),
            ("group.protocol", "consumer", "KIP-848"),
            ("group.remote.assignor", "uniform", "broker-side assignor"),
            ("group.id", "g", "set `kafka.gate_group` instead"),
            ("group.instance.id", "i", "set `kafka.instance_id` instead"),
            ("transactional.id", "t", "fences its predecessor"),
            ("enable.idempotence", "false", "idempotent producer"),
            ("acks", "1", "acks=all"),
            ("request.required.acks", "1", "acks=all"),
            ("max.in.flight.requests.per.connection", "20", "at most 5"),
            ("max.in.flight", "20", "at most 5"),
            ("transaction.timeout.ms", "60000", "set that instead"),
            ("session.timeout.ms", "60000", "`kafka.session_timeout`"),
            ("bootstrap.servers", "h:9092", "`kafka.brokers`"),
        ];
        assert_eq!(cases.len(), REFUSED_CLIENT_PROPERTIES.len());
        for (name, value, says) in cases {
            let e = Config::from_toml_str(
                &format!("[kafka.client]\n\"{name}\" = \"{value}\"\n"),
                env(&[]),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(&format!("kafka.client.\"{name}\"")), "{e}");
            assert!(
                e.contains("cannot be set") && e.contains(says),
                "{name}: {e}"
            );
            // From the environment too.
            let var = format!("STEPGATE_KAFKA_CLIENT_{}", env_part(&[name]));
            let e = Config::from_toml_str("", env(&[(var.as_str(), value)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{var}: {e}");
        }
        // In any case.
        let e = Config::from_toml_str("[kafka.client]\n\"ACKS\" = \"1\"\n", env(&[])).unwrap_err();
        assert!(e.to_string().contains("acks=all"), "{e}");
        // What stepgate does not rely on passes through.
        let c = Config::from_toml_str(
            "[kafka.client]\n\"security.protocol\" = \"ssl\"\npartitioner = \"murmur2_random\"\n\
             \"message.max.bytes\" = \"2000000\"\n\"linger.ms\" = \"5\"\n",
            env(&[]),
        )
        .unwrap();
        assert_eq!(c.kafka.client["partitioner"], "murmur2_random");
    }

    #[test]
    fn every_property_stepgate_sets_is_refused_or_tunable() {
        // What stepgate sets that an operator may tune (performance, not the
        // guarantee). Anything else it sets must be refused in `[kafka.client]`.
        const TUNABLE: [&str; 7] = [
            "linger.ms",
            "message.max.bytes",
            "max.poll.interval.ms",
            "statistics.interval.ms",
            "fetch.wait.max.ms",
            "queued.max.messages.kbytes",
            "fetch.queue.backoff.ms",
        ];
        let k = KafkaConfig::default();
        let consumer = crate::kafka::txn_consumer_config(&k, "g", "i");
        let producer = crate::kafka::txn_producer_config(&k, "t");
        for (name, _) in consumer
            .config_map()
            .into_iter()
            .chain(producer.config_map())
        {
            assert!(
                TUNABLE.contains(&name) || refused_client_property(name).is_some(),
                "stepgate sets `{name}`: refuse it in [kafka.client] (REFUSED_CLIENT_PROPERTIES) or list it as tunable here"
            );
        }
    }

    #[test]
    fn env_sets_keys_the_file_does_not_have() {
        let c = Config::from_toml_str(
            SAMPLE,
            env(&[
                ("STEPGATE_STATE_DECISIONS_RETENTION", "30d"),
                ("STEPGATE_MCP_RESOURCE", "https://mcp.example.com/mcp"),
                ("STEPGATE_MCP_ALLOWED_HOSTS", "a.example, b.example"),
                ("STEPGATE_MCP_AUTH_SCOPES_SUPPORT", "send_email"),
                ("STEPGATE_TOOLS_SEND_EMAIL_MAX_CONCURRENCY", "4"),
                ("STEPGATE_TOOLS_SEND_EMAIL_RECORD", "true"),
                ("STEPGATE_TOOLS_SEND_EMAIL_BUSY_STATUSES", "409,503"),
                ("STEPGATE_TOOLS_SEND_EMAIL_IDENTITY", "[\"to\", \"/cc\"]"),
                (
                    "STEPGATE_TOOLS_SEND_EMAIL_HEADERS_X_API_KEY",
                    "env:MAIL_KEY",
                ),
                (
                    "STEPGATE_TOOLS_SEND_EMAIL_ANNOTATIONS_READONLYHINT",
                    "false",
                ),
                (
                    "STEPGATE_TOOLS_SEND_EMAIL_INPUT_SCHEMA",
                    r#"{"type": "object", "required": ["to"]}"#,
                ),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.state.decisions_retention.unwrap().0,
            Duration::from_secs(30 * 86400)
        );
        assert_eq!(
            c.mcp.resource.as_deref(),
            Some("https://mcp.example.com/mcp")
        );
        assert_eq!(c.mcp.allowed_hosts, ["a.example", "b.example"]);
        assert_eq!(c.mcp.auth.scopes["support"], ["send_email"]);
        let t = &c.tools["send_email"];
        assert_eq!(t.max_concurrency, Some(4));
        assert!(t.record);
        assert_eq!(t.busy_statuses, [409, 503]);
        assert_eq!(t.identity, ["/to", "/cc"]);
        assert_eq!(
            t.headers["x-api-key"].source,
            HeaderSource::Env("MAIL_KEY".into())
        );
        assert_eq!(t.annotations.unwrap().read_only, Some(false));
        assert_eq!(t.input_schema.as_ref().unwrap()["required"][0], "to");
        // A value of the wrong type names the variable, and never quotes JSON.
        let e = Config::from_toml_str(
            SAMPLE,
            env(&[("STEPGATE_TOOLS_SEND_EMAIL_INPUT_SCHEMA", "{hunter2")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("STEPGATE_TOOLS_SEND_EMAIL_INPUT_SCHEMA"), "{e}");
        assert!(e.contains("expected JSON") && !e.contains("hunter2"), "{e}");
        let e = Config::from_toml_str(
            SAMPLE,
            env(&[("STEPGATE_TOOLS_SEND_EMAIL_BUSY_STATUSES", "409,soon")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("expected an integer"), "{e}");
    }

    #[test]
    fn a_misspelled_variable_is_refused_naming_the_nearest() {
        for (var, nearest) in [
            ("STEPGATE_GATE_MAX_BATHC", "STEPGATE_GATE_MAX_BATCH"),
            ("STEPGATE_KAFKA_BROKER", "STEPGATE_KAFKA_BROKERS"),
            ("STEPGATE_STATE_RETENTON", "STEPGATE_STATE_RETENTION"),
            (
                "STEPGATE_TOOLS_SEND_MAIL_URL",
                "STEPGATE_TOOLS_SEND_EMAIL_URL",
            ),
            (
                "STEPGATE_TOOLS_SEND_EMAIL_TIMEOUTS",
                "STEPGATE_TOOLS_SEND_EMAIL_TIMEOUT",
            ),
            ("STEPGATE_CONFIGG", "STEPGATE_CONFIG"),
        ] {
            let e = Config::from_toml_str(SAMPLE, env(&[(var, "1")]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(var), "{e}");
            assert!(e.contains("is not a stepgate setting"), "{e}");
            assert!(
                e.contains(&format!("did you mean `{nearest}`?")),
                "{var}: {e}"
            );
        }
        // A tool the file does not define is not made from the environment.
        let e = Config::from_toml_str(SAMPLE, env(&[("STEPGATE_TOOLS_REFUND_URL", "http://h/r")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a tool is added in the file"), "{e}");
    }

    #[test]
    fn variables_that_are_not_config_keys_are_accepted() {
        let mut vars: Vec<(&str, &str)> = NOT_CONFIG_VARIABLES.iter().map(|v| (*v, "1")).collect();
        vars.extend([
            ("STEPGATE_TEST_CRASH_BEFORE_COMMIT", "1"),
            ("STEPGATE_SIM_SEED", "7"),
            // Named by the config: a header's value comes from it.
            ("STEPGATE_PAY_TOKEN", "Bearer x"),
            ("PATH", "/bin"),
        ]);
        let c = Config::from_toml_str(
            "[tools.pay]\ncategory = \"keyed\"\nurl = \"http://h/pay\"\n\
             headers = { Authorization = \"env:STEPGATE_PAY_TOKEN\" }\n",
            env(&vars),
        )
        .unwrap();
        assert_eq!(c.tools["pay"].url, "http://h/pay");
        // The same variable, named by nothing, is refused.
        let e = Config::from_toml_str("", env(&[("STEPGATE_PAY_TOKEN", "Bearer x")])).unwrap_err();
        assert!(e.to_string().contains("not a stepgate setting"), "{e}");
    }

    #[test]
    fn the_cli_variables_are_allow_listed() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, found: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                if let Some(v) = a.get_env() {
                    found.push(v.to_string_lossy().into_owned());
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, found);
            }
        }
        let mut found = Vec::new();
        walk(&crate::cli::Cli::command(), &mut found);
        assert!(found.contains(&"STEPGATE_CONFIG".to_owned()), "{found:?}");
        for v in found.iter().filter(|v| v.starts_with("STEPGATE_")) {
            assert!(
                is_not_config_variable(v),
                "the CLI reads {v}: add it to NOT_CONFIG_VARIABLES"
            );
        }
    }

    #[test]
    fn tool_names_with_underscores_resolve_against_the_file() {
        let tools = "[tools.a]\ncategory = \"keyed\"\nurl = \"http://h/a\"\n\
                     [tools.a_b]\ncategory = \"keyed\"\nurl = \"http://h/ab\"\n\
                     [tools.send-email]\ncategory = \"keyed\"\nurl = \"http://h/s\"\n";
        let c = Config::from_toml_str(
            tools,
            env(&[
                ("STEPGATE_TOOLS_A_B_URL", "http://h/ab2"),
                ("STEPGATE_TOOLS_A_RETRIES", "5"),
                ("STEPGATE_TOOLS_SEND_EMAIL_RETRIES", "4"),
            ]),
        )
        .unwrap();
        assert_eq!(c.tools["a_b"].url, "http://h/ab2");
        assert_eq!(c.tools["a"].url, "http://h/a");
        assert_eq!(c.tools["a"].retries, 5);
        assert_eq!(c.tools["send-email"].retries, 4);
        // Fits two tools: `p`'s header `url`, and `p_headers`'s url. Refused.
        let e = Config::from_toml_str(
            "[tools.p]\ncategory = \"keyed\"\nurl = \"http://h/p\"\n\
             [tools.p_headers]\ncategory = \"keyed\"\nurl = \"http://h/ph\"\n",
            env(&[("STEPGATE_TOOLS_P_HEADERS_URL", "http://h/x")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("more than one tool"), "{e}");
        assert!(e.contains("`p`: `tools.p.headers.url`"), "{e}");
        assert!(e.contains("`p_headers`: `tools.p_headers.url`"), "{e}");
    }

    /// The fields a type's `Deserialize` asks for (its `deserialize_struct`).
    fn fields_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
        use serde::de::{Error as _, Visitor};
        struct Probe(std::cell::Cell<&'static [&'static str]>);
        impl<'de> serde::Deserializer<'de> for &Probe {
            type Error = serde::de::value::Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
                Err(Self::Error::custom("probe"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Self::Error> {
                self.0.set(fields);
                Err(Self::Error::custom("probe"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
                bytes byte_buf option unit unit_struct newtype_struct seq tuple
                tuple_struct map enum identifier ignored_any
            }
        }
        let probe = Probe(std::cell::Cell::new(&[]));
        let _ = T::deserialize(&probe);
        probe.0.get()
    }

    #[test]
    fn every_key_is_in_the_env_schema() {
        let s = EnvSchema::new();
        let settable = |leaves: &[Leaf], maps: &[MapAt], path: &[&str]| {
            leaves.iter().any(|l| {
                l.path
                    .starts_with(&path.iter().map(|p| p.to_string()).collect::<Vec<_>>())
            }) || maps.iter().any(|m| m.path == path)
        };
        let fixed = [
            ("", fields_of::<Config>()),
            ("kafka", fields_of::<KafkaConfig>()),
            ("kafka.topics", fields_of::<TopicsConfig>()),
            ("state", fields_of::<StateConfig>()),
            ("gate", fields_of::<GateConfig>()),
            ("executor", fields_of::<ExecutorConfig>()),
            ("http", fields_of::<HttpConfig>()),
            ("log", fields_of::<LogConfig>()),
            ("mcp", fields_of::<McpConfig>()),
            ("traces", fields_of::<TracesConfig>()),
            ("console", fields_of::<ConsoleConfig>()),
            ("mcp.auth", fields_of::<McpAuthConfig>()),
        ];
        for (at, fields) in fixed {
            assert!(!fields.is_empty(), "{at}");
            for f in fields {
                let path: Vec<&str> = at
                    .split('.')
                    .filter(|p| !p.is_empty())
                    .chain([*f])
                    .collect();
                if path == ["tools"] {
                    continue;
                }
                assert!(
                    settable(&s.leaves, &s.maps, &path),
                    "`{}` cannot be set from the environment: give it a value in UNSET_BY_DEFAULT",
                    path.join(".")
                );
            }
        }
        for (at, fields) in [
            ("", fields_of::<ToolConfig>()),
            ("annotations", fields_of::<ToolAnnotations>()),
        ] {
            assert!(!fields.is_empty(), "tools.*.{at}");
            for f in fields {
                let path: Vec<&str> = at
                    .split('.')
                    .filter(|p| !p.is_empty())
                    .chain([*f])
                    .collect();
                assert!(
                    settable(&s.tool_leaves, &s.tool_maps, &path),
                    "`tools.<name>.{}` cannot be set from the environment: give it a value in TOOL_WITH_EVERY_KEY",
                    path.join(".")
                );
            }
        }
        // The samples are real configs, and no two keys share a variable.
        let _: ToolConfig = toml::from_str(TOOL_WITH_EVERY_KEY).unwrap();
        let mut sample = toml::Table::try_from(Config::default()).unwrap();
        merge(&mut sample, toml::from_str(UNSET_BY_DEFAULT).unwrap());
        let _: Config = toml::Value::Table(sample).try_into().unwrap();
        let mut names: Vec<&str> = s.leaves.iter().map(|l| l.env.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), s.leaves.len());
    }
}
