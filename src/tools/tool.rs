//! What a tool *is*: its category, policy and MCP annotations, its
//! configuration (`[tools.<name>]`) and the questions the gate and the invoker
//! ask of it (`recorded()`, `awaits_approval()`, `ends_workflow()`,
//! `deadline()`).

use crate::duration::{Dur, dur};
use crate::redact::{REDACTED, redact_url};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// How a tool may be retried; see README "Tools" and `docs/design.md` "Step lifecycle".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Re-run freely (search, get_customer).
    ReadOnly,
    /// Re-run freely (set_status, PUT a document).
    Idempotent,
    /// Re-run only with the same provider key (charge_card with a key).
    Keyed,
    /// Never re-run blindly: in doubt instead.
    Unkeyed,
}

impl Category {
    pub fn as_str(self) -> &'static str {
        match self {
            Category::ReadOnly => "read_only",
            Category::Idempotent => "idempotent",
            Category::Keyed => "keyed",
            Category::Unkeyed => "unkeyed",
        }
    }

    /// May a call that perhaps ran be run again (with the same key)?
    pub fn rerun_is_safe(self) -> bool {
        !matches!(self, Category::Unkeyed)
    }
}

/// What an `unkeyed` tool does about the risk of running twice; see README
/// "Choosing a category".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Run each step once; an unknown outcome is reported `in_doubt` and the
    /// step stays settled until an operator resolves it.
    #[default]
    InDoubt,
    /// Every call waits for a person's approval before it runs.
    Approval,
    /// The tool ends its workflow: any new step of the workflow after it is
    /// rejected.
    LastStep,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::InDoubt => "in_doubt",
            Policy::Approval => "approval",
            Policy::LastStep => "last_step",
        }
    }
}

/// `[tools.<name>.annotations]`: MCP tool annotations, given to the agents
/// that list the tool through `stepgate mcp`. Without an explicit `category`, they choose one:
/// `readOnlyHint` → `read_only`; else `idempotentHint` → `idempotent`; else
/// `unkeyed` (an effect with no known provider key). `keyed` is never inferred:
/// it needs a provider key, so it is declared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolAnnotations {
    /// The tool only reads: `read_only` when the tool has no `category`.
    #[serde(
        rename = "readOnlyHint",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub read_only: Option<bool>,
    /// A second call with the same arguments has no further effect:
    /// `idempotent` when the tool has no `category` and is not read-only.
    #[serde(
        rename = "idempotentHint",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub idempotent: Option<bool>,
    /// The tool may destroy or overwrite data: a hint for agents, which
    /// chooses no category (without `category`, such a tool is `unkeyed`).
    #[serde(
        rename = "destructiveHint",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub destructive: Option<bool>,
    /// The tool reaches beyond a closed domain (the web, other parties): a
    /// hint for agents, which chooses no category.
    #[serde(
        rename = "openWorldHint",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub open_world: Option<bool>,
}

impl ToolAnnotations {
    pub fn category(&self) -> Category {
        if self.read_only == Some(true) {
            Category::ReadOnly
        } else if self.idempotent == Some(true) {
            Category::Idempotent
        } else {
            Category::Unkeyed
        }
    }
}

/// `[tools.<name>]`: one tool. Its category says how a call may be retried;
/// its `url`, `mcp` or `pool` says where it runs; the rest, how it is called.
/// A tool is declared in the file; the environment sets the keys of the tools
/// the file declares. See docs/tools.md for the protocol.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawToolConfig")]
pub struct ToolConfig {
    /// How the tool may be retried; from `annotations` when not given.
    pub category: Category,
    /// What an `unkeyed` tool does about the risk of running twice:
    /// `in_doubt` (unset: this), `approval` (a person approves each call
    /// before it runs) or `last_step` (the call ends its workflow). Only for
    /// `unkeyed` tools.
    pub policy: Policy,
    /// `http://…` or `https://…` endpoint receiving `POST` with the arguments
    /// or, for a tool served over MCP (`mcp = "…"` in the config), the MCP
    /// server's Streamable HTTP endpoint. Empty for a pool tool.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub url: String,
    /// Set for a tool served over MCP: its name at the MCP server (by default
    /// the name it has here). Its calls are MCP `tools/call` requests instead of
    /// a `POST` of the arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mcp_tool: Option<String>,
    /// Set for a tool that runs elsewhere (`pool = "gpu"`, instead of `url`
    /// or `mcp`): the gate publishes its calls on the pool's calls topic, for
    /// `stepgate worker --pool <name>` processes, which hold its URL, headers
    /// and secrets (`url` is empty then). See docs/design.md "Worker pools".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// What the tool does, for the agents and models that list it (`stepgate mcp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON Schema of its arguments, for `stepgate mcp`'s tool list (any
    /// object when not given).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<serde_json::Map<String, serde_json::Value>>,
    /// How long one try may take: connecting, sending and reading the
    /// answer. With `max_concurrency`, it starts when the try has a slot.
    pub timeout: Dur,
    /// Extra tries after a failure where retrying is allowed.
    pub retries: u32,
    /// First backoff between tries; doubles each time, capped at 10 × this.
    pub backoff: Dur,
    /// Keep the full step log for a read-only/idempotent tool (repeats answered
    /// from the record instead of re-run). Always on for keyed/unkeyed tools.
    pub record: bool,
    /// The header carrying the step's idempotency key, as the provider names it
    /// (`Idempotency-Key` for Stripe and most; `X-Request-Id` for others).
    pub idempotency_header: String,
    /// Also put the key into the JSON body at this dotted path
    /// (e.g. `metadata.idempotency_key`) for providers that read it there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_field: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub annotations: Option<ToolAnnotations>,
    /// The largest answer body read from the tool, in bytes (default 512 KiB). A
    /// larger 2xx answer is not buffered: the step ends with the error
    /// `output_too_large` (the tool did run). The output travels in Kafka records
    /// (progress, result, changelog), which librdkafka caps at 1 000 000 bytes by
    /// default (`message.max.bytes`): raise this only with those limits.
    pub max_output_bytes: u64,
    /// At most this many calls of the tool in flight at once from one stepgate
    /// process (unset: no limit beyond `executor.concurrency`). A call waits for a
    /// free slot before each try; `timeout` counts from when it gets one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// With `max_concurrency`: the longest one try waits for a free slot (default:
    /// the tool's `timeout`). A try that gets none was never sent: it is retried,
    /// and the call ends `tool_unreachable` when its tries are spent. Bounded so
    /// that the tool's deadline (`deadline()`, which the gate waits before it
    /// settles a `started` step) covers the waiting too.
    pub queue_timeout: Dur,
    /// Extra headers sent on every call of the tool (credentials, API keys), by
    /// name: `"env:NAME"` reads an environment variable, `"file:/path"` a file
    /// (a Kubernetes or Docker secret), anything else is the value itself
    /// (discouraged for secrets: it sits in the config). Read once at start;
    /// never logged or printed. The protocol's own headers cannot be set here.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, HeaderSpec>,
    /// HTTP statuses by which the tool says "a request with this key is still
    /// being processed" (default 409, 423, 425: the IETF Idempotency-Key
    /// draft and Stripe answer a retry that overlaps the first try with 409).
    /// Never read as "not performed": a `keyed` tool is asked again with the
    /// same key until it answers (at most `busy_wait`), an `unkeyed` one is
    /// `in_doubt`, a read is retried like a 5xx.
    pub busy_statuses: Vec<u16>,
    /// How long a `keyed` tool that keeps answering a busy status is asked
    /// again, with the same key, before the step is `in_doubt` (default: the
    /// tool's `timeout`).
    pub busy_wait: Dur,
    /// The arguments that say *which* call this is (JSON pointers, e.g.
    /// `/to`; a bare name is a top-level field). A repeat of a recorded step
    /// whose identity values differ is not a retry but another call: it is
    /// refused as `identity_conflict` (nothing run, the recorded answer not
    /// given), and the clients send it as the next step. Free text (a subject,
    /// a body) stays out: a rephrased retry must still be a retry.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub identity: Vec<String>,
}

/// Where a tool header's value comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum HeaderSource {
    /// `env:NAME`: the environment variable `NAME`.
    Env(String),
    /// `file:/path`: the file's content, surrounding whitespace trimmed.
    File(PathBuf),
    /// The value itself, written in the config.
    Literal(String),
}

/// A tool header as configured (`"env:PAY_TOKEN"`), and its value once
/// [`Config::resolve_tool_headers`] has read it. Serialized as configured; its
/// `Debug` never shows a value.
#[derive(Clone)]
pub struct HeaderSpec {
    pub source: HeaderSource,
    value: Option<String>,
}

/// The largest header value read from a file: a secret, not a document (and a
/// misconfigured `file:/dev/zero` must not hang the start).
const MAX_HEADER_FILE_BYTES: u64 = 64 * 1024;

impl HeaderSpec {
    pub fn parse(spec: &str) -> HeaderSpec {
        let source = if let Some(name) = spec.strip_prefix("env:") {
            HeaderSource::Env(name.to_owned())
        } else if let Some(path) = spec.strip_prefix("file:") {
            HeaderSource::File(PathBuf::from(path))
        } else {
            HeaderSource::Literal(spec.to_owned())
        };
        let value = match &source {
            HeaderSource::Literal(v) => Some(v.clone()),
            _ => None,
        };
        HeaderSpec { source, value }
    }

    /// The value to send, once resolved (a literal is resolved from the start).
    pub fn value(&self) -> Option<&str> {
        self.value.as_deref()
    }

    /// The spec as written, a literal value replaced by [`REDACTED`].
    pub(crate) fn shown(&self) -> String {
        match &self.source {
            HeaderSource::Env(n) => format!("env:{n}"),
            HeaderSource::File(p) => format!("file:{}", p.display()),
            HeaderSource::Literal(_) => REDACTED.to_owned(),
        }
    }

    /// Read the value from its source. The error says where from, never what.
    pub(crate) fn resolve(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
        let raw = match &self.source {
            HeaderSource::Literal(v) => v.clone(),
            HeaderSource::Env(name) => {
                env(name).ok_or_else(|| format!("environment variable `{name}` is not set"))?
            }
            HeaderSource::File(path) => {
                use std::io::Read as _;
                let shown = path.display();
                let mut buf = Vec::new();
                std::fs::File::open(path)
                    .and_then(|f| f.take(MAX_HEADER_FILE_BYTES + 1).read_to_end(&mut buf))
                    .map_err(|e| format!("cannot read file `{shown}`: {e}"))?;
                if buf.len() as u64 > MAX_HEADER_FILE_BYTES {
                    return Err(format!(
                        "file `{shown}` is larger than {MAX_HEADER_FILE_BYTES} bytes"
                    ));
                }
                String::from_utf8(buf).map_err(|_| format!("file `{shown}` is not UTF-8"))?
            }
        };
        let value = raw.trim();
        let from = match &self.source {
            HeaderSource::Env(name) => format!("environment variable `{name}`"),
            HeaderSource::File(path) => format!("file `{}`", path.display()),
            HeaderSource::Literal(_) => "the configured value".to_owned(),
        };
        if value.is_empty() {
            return Err(format!("{from} is empty"));
        }
        if reqwest::header::HeaderValue::from_str(value).is_err() {
            return Err(format!(
                "{from} is not a valid HTTP header value (it holds control or non-ASCII characters)"
            ));
        }
        self.value = Some(value.to_owned());
        Ok(())
    }
}

impl std::fmt::Debug for HeaderSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderSource::Env(n) => f.debug_tuple("Env").field(n).finish(),
            HeaderSource::File(p) => f.debug_tuple("File").field(p).finish(),
            HeaderSource::Literal(_) => f.debug_tuple("Literal").field(&REDACTED).finish(),
        }
    }
}

impl std::fmt::Debug for HeaderSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown())
    }
}

impl Serialize for HeaderSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.source {
            HeaderSource::Env(n) => s.serialize_str(&format!("env:{n}")),
            HeaderSource::File(p) => s.serialize_str(&format!("file:{}", p.display())),
            HeaderSource::Literal(v) => s.serialize_str(v),
        }
    }
}

impl<'de> Deserialize<'de> for HeaderSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|s| HeaderSpec::parse(&s))
    }
}

/// Headers a tool's `headers` may not set: the protocol's own (a second
/// `Idempotency-Key` or `traceparent` would break the step's identity or its
/// trace) and the ones that frame the request.
pub(crate) const RESERVED_HEADERS: [&str; 10] = [
    crate::contract::headers::IDEMPOTENCY_KEY,
    crate::contract::headers::WORKFLOW_ID,
    crate::contract::headers::STEP_INDEX,
    crate::contract::headers::ATTEMPT,
    crate::contract::headers::TRACEPARENT,
    "Content-Type",
    "Content-Length",
    "Transfer-Encoding",
    "Host",
    "Connection",
];

/// A tool as written in the config, before `category` is settled.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToolConfig {
    category: Option<Category>,
    #[serde(default)]
    policy: Option<Policy>,
    /// The `http://…` or `https://…` endpoint that receives each call's
    /// arguments as a `POST`. A tool has one of `url`, `mcp` and `pool`.
    #[serde(default)]
    url: Option<String>,
    /// The Streamable HTTP endpoint of an MCP server that serves the tool,
    /// instead of `url`: its calls are MCP `tools/call` requests, and the
    /// step's key goes in `_meta.idempotency_key` (see `mcp_tool`).
    #[serde(default)]
    mcp: Option<String>,
    #[serde(default)]
    mcp_tool: Option<String>,
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default = "default_tool_timeout")]
    timeout: Dur,
    #[serde(default = "default_retries")]
    retries: u32,
    #[serde(default = "default_backoff")]
    backoff: Dur,
    #[serde(default)]
    record: bool,
    #[serde(default = "default_key_header")]
    idempotency_header: String,
    #[serde(default)]
    idempotency_field: Option<String>,
    #[serde(default)]
    annotations: Option<ToolAnnotations>,
    #[serde(default = "default_max_output_bytes")]
    max_output_bytes: u64,
    #[serde(default)]
    max_concurrency: Option<u32>,
    #[serde(default)]
    queue_timeout: Option<Dur>,
    #[serde(default)]
    headers: BTreeMap<String, HeaderSpec>,
    #[serde(default = "default_busy_statuses")]
    busy_statuses: Vec<u16>,
    #[serde(default)]
    busy_wait: Option<Dur>,
    #[serde(default)]
    identity: Vec<String>,
}

impl TryFrom<RawToolConfig> for ToolConfig {
    type Error = String;
    fn try_from(r: RawToolConfig) -> Result<Self, String> {
        // Explicit config overrides the annotations.
        let category = r.category.or(r.annotations.map(|a| a.category())).ok_or_else(|| {
            "a tool needs `category` (read_only | idempotent | keyed | unkeyed) or MCP `annotations`".to_owned()
        })?;
        if r.policy.is_some_and(|p| p != Policy::InDoubt) && category != Category::Unkeyed {
            return Err(format!(
                "`policy` applies to unkeyed tools only; this tool is {}, which is safe to re-run \
                 (remove `policy`, or declare `category = \"unkeyed\"`)",
                category.as_str()
            ));
        }
        // `mcp = URL` names an MCP server; `url` with `mcp_tool` is the same
        // thing as this struct serializes it.
        if let Some(pool) = &r.pool {
            if r.url.is_some() || r.mcp.is_some() || r.mcp_tool.is_some() {
                return Err(
                    "give either `pool` (a tool its pool's workers run) or `url`/`mcp`, not both: \
                     a pool tool's address is configured on its workers"
                        .to_owned(),
                );
            }
            if !valid_pool_name(pool) {
                return Err(format!(
                    "`pool` {pool:?} is not a pool name: 1 to 100 of [A-Za-z0-9_-] (it names a topic)"
                ));
            }
            if !r.headers.is_empty() {
                return Err(
                    "a pool tool's `headers` (its credentials) are configured on its workers \
                     only, never on the gate: remove `headers` here"
                        .to_owned(),
                );
            }
        }
        let (url, mcp_tool) = match (r.url, r.mcp) {
            _ if r.pool.is_some() => (String::new(), None),
            (Some(_), Some(_)) => {
                return Err(
                    "give either `url` (a plain HTTP tool) or `mcp` (an MCP server's \
                            endpoint), not both"
                        .to_owned(),
                );
            }
            (None, None) => {
                return Err(
                    "a tool needs `url` (a plain HTTP tool), `mcp` (an MCP server's \
                            Streamable HTTP endpoint) or `pool` (run by a worker pool)"
                        .to_owned(),
                );
            }
            (Some(url), None) => (url, r.mcp_tool),
            (None, Some(url)) => (url, Some(r.mcp_tool.unwrap_or_default())),
        };
        if let Some(bad) = r.busy_statuses.iter().find(|c| !(400..=599).contains(*c)) {
            return Err(format!(
                "`busy_statuses` lists {bad}: only 4xx and 5xx statuses can mean \"still being processed\""
            ));
        }
        let identity = r
            .identity
            .into_iter()
            .map(|f| identity_pointer(&f))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ToolConfig {
            category,
            policy: r.policy.unwrap_or_default(),
            url,
            mcp_tool,
            pool: r.pool,
            description: r.description,
            input_schema: r.input_schema,
            timeout: r.timeout,
            retries: r.retries,
            backoff: r.backoff,
            record: r.record,
            idempotency_header: r.idempotency_header,
            idempotency_field: r.idempotency_field,
            annotations: r.annotations,
            max_output_bytes: r.max_output_bytes,
            max_concurrency: r.max_concurrency,
            queue_timeout: r.queue_timeout.unwrap_or(r.timeout),
            headers: r.headers,
            busy_statuses: r.busy_statuses,
            busy_wait: r.busy_wait.unwrap_or(r.timeout),
            identity,
        })
    }
}

/// A pool's name: it is part of a topic name.
pub fn valid_pool_name(name: &str) -> bool {
    (1..=100).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn default_key_header() -> String {
    crate::contract::headers::IDEMPOTENCY_KEY.into()
}
fn default_tool_timeout() -> Dur {
    dur("10s")
}
fn default_retries() -> u32 {
    2
}
fn default_backoff() -> Dur {
    dur("200ms")
}
/// An `identity` entry as a JSON pointer: `/to` as written, `to` → `/to`.
fn identity_pointer(field: &str) -> Result<String, String> {
    let pointer = if field.starts_with('/') {
        field.to_owned()
    } else if !field.is_empty() && !field.contains('/') {
        format!("/{}", field.replace('~', "~0"))
    } else {
        return Err(format!(
            "`identity` entry {field:?} is neither a field name nor a JSON pointer (`/to`, `/recipient/email`)"
        ));
    };
    Ok(pointer)
}

fn default_busy_statuses() -> Vec<u16> {
    vec![409, 423, 425]
}
fn default_max_output_bytes() -> u64 {
    512 * 1024
}

impl ToolConfig {
    /// For a tool served over MCP, its name at the MCP server (`name` is the
    /// name it has in stepgate's config).
    pub fn mcp_name<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.mcp_tool
            .as_deref()
            .map(|t| if t.is_empty() { name } else { t })
    }

    /// Where `repeat` names another call than the recorded `first` (by the
    /// tool's `identity` arguments): each differing field with its recorded
    /// and its new value. Empty when the repeat is the same call (or the tool
    /// declares no identity).
    pub fn identity_conflict(
        &self,
        first: &crate::contract::Arguments,
        repeat: &crate::contract::Arguments,
    ) -> Vec<(String, serde_json::Value, serde_json::Value)> {
        if self.identity.is_empty() || repeat.same_as(first) {
            return Vec::new();
        }
        let (a, b) = (first.to_value(), repeat.to_value());
        let null = serde_json::Value::Null;
        self.identity
            .iter()
            .filter_map(|p| {
                let (x, y) = (a.pointer(p).unwrap_or(&null), b.pointer(p).unwrap_or(&null));
                (x != y).then(|| (p.clone(), x.clone(), y.clone()))
            })
            .collect()
    }

    /// Whether calls of this tool go through the durable step log.
    pub fn recorded(&self) -> bool {
        // A pool's call is published with its `started` record: always logged.
        self.record
            || self.pool.is_some()
            || matches!(self.category, Category::Keyed | Category::Unkeyed)
    }

    /// Whether each call waits for a person's approval before it runs (a
    /// policy only `unkeyed` tools take).
    pub fn awaits_approval(&self) -> bool {
        self.category == Category::Unkeyed && self.policy == Policy::Approval
    }

    /// Whether a call of this tool ends its workflow (`last_step`).
    pub fn ends_workflow(&self) -> bool {
        self.category == Category::Unkeyed && self.policy == Policy::LastStep
    }

    /// Backoff before try number `n` (1-based retries).
    pub fn backoff_before(&self, retry: u32) -> Duration {
        let base = self.backoff.0;
        let factor = 1u32 << retry.saturating_sub(1).min(16);
        (base * factor).min(base * 10)
    }

    /// The longest a single dispatch of this tool can legitimately take in an
    /// executor: every try's timeout (and, with `max_concurrency`, its wait for
    /// a free slot) plus the backoffs between them.
    pub fn deadline(&self) -> Duration {
        let tries = self.retries + 1;
        let per_try = match self.max_concurrency {
            Some(_) => self.timeout.0 + self.queue_timeout.0,
            None => self.timeout.0,
        };
        let mut d = per_try * tries;
        for r in 1..=self.retries {
            d += self.backoff_before(r);
        }
        // Not `busy_wait`: a keyed call asked again past this runs in the
        // owner's process (which gives it time), or, moved or lost, is re-run
        // with the same key — which the provider answers as the same request.
        d
    }
}

impl ToolConfig {
    /// The URL's credentials redacted, and header values (literal ones: a
    /// source `env:`/`file:` is kept) replaced by [`REDACTED`].
    pub fn redacted(&self) -> ToolConfig {
        let headers = self
            .headers
            .iter()
            .map(|(k, spec)| {
                let spec = match spec.source {
                    HeaderSource::Literal(_) => HeaderSpec::parse(REDACTED),
                    _ => HeaderSpec {
                        source: spec.source.clone(),
                        value: None,
                    },
                };
                (k.clone(), spec)
            })
            .collect();
        ToolConfig {
            url: redact_url(&self.url),
            headers,
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for ToolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("ToolConfig")
            .field("category", &r.category)
            .field("policy", &r.policy)
            .field("url", &r.url)
            .field("mcp_tool", &r.mcp_tool)
            .field("pool", &r.pool)
            .field("description", &r.description)
            .field("input_schema", &r.input_schema)
            .field("timeout", &r.timeout)
            .field("retries", &r.retries)
            .field("backoff", &r.backoff)
            .field("record", &r.record)
            .field("idempotency_header", &r.idempotency_header)
            .field("idempotency_field", &r.idempotency_field)
            .field("annotations", &r.annotations)
            .field("max_output_bytes", &r.max_output_bytes)
            .field("max_concurrency", &r.max_concurrency)
            .field("queue_timeout", &r.queue_timeout)
            .field("headers", &r.headers)
            .field("busy_statuses", &r.busy_statuses)
            .field("busy_wait", &r.busy_wait)
            .field("identity", &r.identity)
            .finish()
    }
}
