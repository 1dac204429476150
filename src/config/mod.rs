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
//!
//! The files: the sections and their defaults ([`KafkaConfig`] in `kafka.rs`;
//! `mcp.rs`, `console.rs`, `traces.rs`; `process.rs`: state, gate, executor,
//! HTTP, logs), the environment overlay (`env.rs`, and `env_schema.rs`: which
//! key a variable names), this instance's identity (`instance.rs`), loading:
//! the file, the overlay, the checks (`load.rs`), and the TOML-table helpers
//! the last two share (`table.rs`). A tool's own checks are beside the tool
//! (`src/tools/validate.rs`).
//!
//! `docs/configuration-reference.md` is generated from these types: each
//! field's doc comment is its description there, a doc paragraph starting
//! `Advanced:` marks it advanced, and [`key_variables`] gives its variable
//! (`tests/offline/reference.rs` writes it and fails when it is stale).

mod console;
mod env;
mod env_schema;
mod instance;
mod kafka;
mod load;
mod mcp;
mod pools;
mod process;
mod table;
mod traces;

use crate::tools::validate::InvalidTool;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use thiserror::Error;

pub use crate::duration::Dur;
pub use crate::redact::{REDACTED, is_secret_property, redact_client_properties, redact_url};
pub use crate::tools::tool::{
    Category, HeaderSource, HeaderSpec, Policy, ToolAnnotations, ToolConfig,
};
pub use console::{CONSOLE_SCOPE, ConsoleConfig, ConsoleRole, ConsoleToken, PeerNet};
pub use env::{NOT_CONFIG_PREFIXES, NOT_CONFIG_VARIABLES, is_not_config_variable};
pub use env_schema::key_variables;
pub use instance::{default_instance_id, instance_id_from};
pub use kafka::{KafkaConfig, REFUSED_CLIENT_PROPERTIES, TopicsConfig, refused_client_property};
pub use mcp::{
    JWT_NAMESPACE_ROOT, MCP_JWT_ALGORITHMS, McpAuthConfig, McpConfig, McpStaticToken, TrustedProxy,
};
pub use pools::PoolConfig;
pub use process::{
    DEFAULT_BLOCK_CACHE_BYTES, ExecutorConfig, GateConfig, HttpConfig, LogConfig, StateConfig,
};
pub use traces::TracesConfig;

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
    /// A key of a protocol stepgate no longer speaks.
    #[error("invalid config: {message}")]
    Removed { field: String, message: String },
    /// A tool header whose value could not be read. Names the tool, the header
    /// and where the value was to come from; never the value.
    #[error("invalid config: `tools.{tool}.headers.{header}`: {message}")]
    Secret {
        tool: String,
        header: String,
        message: String,
    },
}

/// A tool's own check failed (`ToolConfig::validate`, beside the tool).
impl From<InvalidTool> for ConfigError {
    fn from(e: InvalidTool) -> Self {
        ConfigError::Invalid {
            field: e.field,
            message: e.message,
        }
    }
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
    /// Worker pools by name (`pools.rs`): the key the gates share with each.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<String, PoolConfig>,
}

// Redaction: the one place that decides what is a secret. `check-config`
// prints `Config::redacted()`; every section's `Debug` shows redacted values.

impl Config {
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
            pools: self
                .pools
                .iter()
                .map(|(n, p)| (n.clone(), p.redacted()))
                .collect(),
            ..self.clone()
        }
    }

    /// Read the pools' keys (every pool's, or only `only`'s: a worker's), once,
    /// at start; see `pools.rs`. The error names the pool and the source,
    /// never the key.
    pub fn resolve_pool_keys(
        &mut self,
        only: Option<&str>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        pools::resolve_pool_keys(&mut self.pools, only, &env)
    }

    /// Sorted tool names.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests;
