//! The command line: one subcommand per verb (the clap structs here), and
//! what each does ([`run`], in `commands`). The binary's edge: `anyhow` is
//! used here and in `main.rs` only.

mod commands;

pub use commands::run;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "stepgate",
    version,
    about = "Exactly-once-effect tool calls for AI agents, on Kafka"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gate (which invokes the tools of the steps it owns) until SIGTERM/SIGINT.
    Run {
        #[command(flatten)]
        deployment: Deployment,
        #[command(flatten)]
        local: Local,
    },
    /// Run a worker pool's tools (declared `pool = "<name>"` in the gate's
    /// config) from where they can be reached: take their calls from the
    /// pool's calls topic, invoke them by the `url`/`mcp` (and headers) of
    /// this config's tools, report outcomes to the gate. Until SIGTERM/SIGINT.
    Worker {
        #[command(flatten)]
        deployment: Deployment,
        /// The pool whose calls this worker takes.
        #[arg(long)]
        pool: String,
        /// Calls invoked at once by this process.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Static group membership: a worker restarted with the same id gets
        /// its partitions back at once (unique per process).
        #[arg(long)]
        instance_id: Option<String>,
        /// `<tool>=<calls per second>`: start at most that many calls of the
        /// tool per second from this process (repeat for more tools).
        #[arg(long)]
        rate: Vec<String>,
    },
    /// Manage stepgate's topics.
    Topics {
        #[command(subcommand)]
        action: TopicsCommand,
    },
    /// A zero-setup tour: in-process Kafka, gate, executor, demo tools and a
    /// scripted agent.
    Demo {
        /// Where the demo serves /metrics while it runs.
        #[arg(long, default_value = "127.0.0.1:9464")]
        metrics: String,
        /// Keep serving /metrics after the tour until Ctrl-C.
        #[arg(long)]
        keep_running: bool,
    },
    /// Publish one intent and print its answer (Result v1 JSON). Exits 0 when the
    /// status is `ok`, 2 for `error`/`in_doubt`/`rejected`, 1 when no answer came.
    Call(CallArgs),
    /// Serve the configured tools over MCP: each `tools/call` becomes a step
    /// (its identity from the call's `_meta`, or from the MCP session). On
    /// stdio by default (an MCP client starts it); Streamable HTTP at
    /// `http://<listen>/mcp` with `--listen`.
    Mcp {
        #[command(flatten)]
        deployment: Deployment,
        /// Serve Streamable HTTP on this address (e.g. 127.0.0.1:9480) instead of stdio.
        #[arg(long)]
        listen: Option<String>,
        /// A `Host` (or `host:port`) HTTP requests may name; repeat for more
        /// (DNS-rebinding protection). The loopback names are allowed only
        /// when listening on loopback. Adds to `mcp.allowed_hosts`.
        #[arg(long)]
        allowed_host: Vec<String>,
        /// A browser origin allowed to call (e.g. https://app.example.com);
        /// a request with any other `Origin` gets 403. Adds to `mcp.allowed_origins`.
        #[arg(long)]
        allowed_origin: Vec<String>,
        /// Serve on an address beyond loopback with no `[mcp.auth]` configured
        /// (only behind something else that authorizes every request).
        #[arg(long)]
        insecure_no_auth: bool,
        /// How long one call waits for stepgate's answer.
        #[arg(long, default_value = "120s")]
        timeout: humantime::Duration,
    },
    /// Serve the web console: calls held for approval, in-doubt steps,
    /// workflow timelines and per-tool figures, from the topics (see
    /// docs/console.md). Binds `console.listen` (loopback by default).
    Console {
        #[command(flatten)]
        deployment: Deployment,
        /// Serve on this address instead of `console.listen`.
        #[arg(long)]
        listen: Option<String>,
    },
    /// Report what agents did, replayed from the intents and results topics
    /// (read-only: live state is not touched).
    Audit {
        #[command(flatten)]
        deployment: Deployment,
        /// Only this workflow.
        #[arg(long)]
        workflow: Option<String>,
        /// Only records at or after this time (RFC 3339, e.g. 2026-11-29T08:00:00Z);
        /// from the beginning otherwise.
        #[arg(long)]
        since: Option<String>,
        /// `text` (default), `json` or `html`.
        #[arg(long, default_value = "text")]
        format: AuditFormat,
        /// Write the report to this file instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// A workflow's recorded steps, as the gate last committed them (read from
    /// the changelog topic).
    Steps {
        #[command(subcommand)]
        action: StepsCommand,
    },
    /// Settle an in-doubt step: it did take effect (`--executed --output JSON`,
    /// which becomes its `ok` answer), it did not (`--not-executed`: its next
    /// call runs it), or it ran and failed without effect (`--failed --reason
    /// TEXT`: its `error` answer, not run again). Recorded with who and when.
    #[command(group(clap::ArgGroup::new("outcome").required(true).args(["executed", "not_executed", "failed"])))]
    Resolve {
        #[command(flatten)]
        step: StepArgs,
        /// The call did take effect.
        #[arg(long, requires = "output")]
        executed: bool,
        /// Its output (a JSON value) with `--executed`: what the agent receives.
        #[arg(long)]
        output: Option<String>,
        /// The call did not take effect: allow the step to run again.
        #[arg(long)]
        not_executed: bool,
        /// The call ran and failed without effect: `--reason` (what you found)
        /// becomes its error answer; the step is not run again.
        #[arg(long, requires = "reason")]
        failed: bool,
        #[command(flatten)]
        who: Who,
        #[command(flatten)]
        target: Target,
    },
    /// Calls of `approval` tools waiting for a person.
    Approvals {
        #[command(subcommand)]
        action: ApprovalsCommand,
    },
    /// The gate's local state.
    State {
        #[command(subcommand)]
        action: StateCommand,
    },
    /// Load and validate a config (file + STEPGATE_* environment), print it as TOML.
    CheckConfig {
        #[command(flatten)]
        deployment: Deployment,
    },
}

// `stepgate call`'s arguments: one struct, as its function takes them.
#[derive(Debug, clap::Args)]
pub struct CallArgs {
    #[command(flatten)]
    pub deployment: Deployment,
    #[arg(long)]
    pub workflow: String,
    #[arg(long)]
    pub step: u64,
    #[arg(long)]
    pub tool: String,
    /// The arguments, a JSON object.
    #[arg(long, default_value = "{}")]
    pub args: String,
    #[arg(long, default_value_t = 0)]
    pub attempt: u64,
    #[arg(long)]
    pub call_id: Option<String>,
    /// How long to wait for the answer.
    #[arg(long, default_value = "60s")]
    pub timeout: humantime::Duration,
}

#[derive(Debug, Subcommand)]
pub enum TopicsCommand {
    /// Create the intents, results, dlq and internal topics with equal partition
    /// counts (existing topics are left as they are, then checked).
    Create {
        #[command(flatten)]
        deployment: Deployment,
        /// Overrides `kafka.partitions`.
        #[arg(long)]
        partitions: Option<i32>,
    },
}

/// The config file a command reads when `--config` names none.
pub const DEFAULT_CONFIG: &str = "stepgate.toml";

/// Which deployment a command talks to: its config file (defaults and
/// `STEPGATE_*` variables otherwise) and an optional brokers override.
#[derive(Debug, Clone, clap::Args)]
pub struct Deployment {
    /// The TOML config file (default: `./stepgate.toml` when there is one).
    #[arg(long, short, env = "STEPGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Overrides `kafka.brokers`.
    #[arg(long)]
    pub brokers: Option<String>,
}

impl Deployment {
    /// `--config`, else `./stepgate.toml` when it exists (the file the docs
    /// have you write), else none: defaults and the environment only.
    pub fn config_path(&self) -> Option<PathBuf> {
        self.config.clone().or_else(|| {
            let here = PathBuf::from(DEFAULT_CONFIG);
            here.is_file().then_some(here)
        })
    }

    /// The config from the file and the environment, `--brokers` applied.
    pub fn load(&self) -> Result<crate::config::Config, crate::config::ConfigError> {
        let mut cfg = crate::config::Config::load(self.config_path().as_deref(), std::env::vars())?;
        if let Some(b) = &self.brokers {
            cfg.kafka.brokers.clone_from(b);
        }
        Ok(cfg)
    }
}

/// What each gate process on one host needs of its own: more processes
/// split the partitions, and two on one host that share one of these are
/// refused at start, naming it.
#[derive(Debug, clap::Args)]
pub struct Local {
    /// Overrides `kafka.instance_id` (unique per process; the host's name by default).
    #[arg(long)]
    pub instance_id: Option<String>,
    /// Overrides `state.path` (a directory of this process's own).
    #[arg(long, value_name = "DIR")]
    pub state: Option<PathBuf>,
    /// Overrides `http.listen` (where /metrics, /healthz and /readyz are
    /// served; "" for none).
    #[arg(long, value_name = "ADDR")]
    pub http_listen: Option<String>,
}

impl Local {
    pub fn apply(self, cfg: &mut crate::config::Config) {
        if let Some(i) = self.instance_id {
            cfg.kafka.instance_id = i;
        }
        if let Some(p) = self.state {
            cfg.state.path = p;
        }
        if let Some(l) = self.http_listen {
            cfg.http.listen = l;
        }
    }
}

/// The step a decision is about.
#[derive(Debug, clap::Args)]
pub struct StepArgs {
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    #[arg(long, default_value_t = 0)]
    pub attempt: u64,
}

impl StepArgs {
    pub fn key(self) -> crate::contract::StepKey {
        crate::contract::StepKey {
            workflow_id: self.workflow_id,
            step_index: self.step_index,
            tool: self.tool,
            attempt: self.attempt,
        }
    }
}

/// Who decides, and why (recorded for audit).
#[derive(Debug, clap::Args)]
pub struct Who {
    /// Who decides (default: $STEPGATE_OPERATOR, then $USER).
    #[arg(long, env = "STEPGATE_OPERATOR")]
    pub by: Option<String>,
    /// Why (shown to the model in a denial).
    #[arg(long)]
    pub reason: Option<String>,
}

/// Which deployment, and how long to wait for the gate to apply a decision.
#[derive(Debug, clap::Args)]
pub struct Target {
    #[command(flatten)]
    pub deployment: Deployment,
    /// How long to wait until a gate has applied the decision.
    #[arg(long, default_value = "30s")]
    pub wait: humantime::Duration,
    /// The run of the step you checked (the DISPATCH column of `steps
    /// show`). Without it, the run current when this command reads the step.
    /// If the step was re-run since, the gate refuses the decision as stale.
    #[arg(long, value_name = "DISPATCH")]
    pub run: Option<u32>,
}

#[derive(Debug, Subcommand)]
pub enum StepsCommand {
    /// List a workflow's steps with their state and operators' decisions.
    Show {
        workflow_id: String,
        /// Print the records as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// List the steps no one has settled (in doubt, awaiting approval,
    /// started), across all workflows, oldest first. They are kept past the
    /// retention until resolved.
    List {
        /// Only unresolved steps (the one listing there is: reading every
        /// settled step would mean the whole state).
        #[arg(long, required = true)]
        unresolved: bool,
        /// Print the records as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        deployment: Deployment,
    },
}

#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// Calls waiting for approval, oldest first.
    List {
        /// Print them as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Let a held call run.
    Approve {
        #[command(flatten)]
        step: StepArgs,
        #[command(flatten)]
        who: Who,
        #[command(flatten)]
        target: Target,
    },
    /// Refuse a held call: the agent is told a person refused it (with `--reason`).
    Deny {
        #[command(flatten)]
        step: StepArgs,
        #[command(flatten)]
        who: Who,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Debug, Subcommand)]
pub enum StateCommand {
    /// Rebuild a gate's RocksDB state from the changelog topic (disaster
    /// recovery, or moving to a new disk). Never touches a running gate's state:
    /// `--path` must be a new, empty directory.
    Rebuild {
        #[command(flatten)]
        deployment: Deployment,
        /// Where to write the rebuilt state (default: `state.path`).
        #[arg(long)]
        path: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuditFormat {
    Text,
    Json,
    Html,
}

pub use crate::config::{REDACTED, is_secret_property};

/// A config as TOML for people to read (`check-config`), secrets redacted by
/// [`crate::config::Config::redacted`] (the one place that decides what is a
/// secret; `Debug` uses it too): `[kafka.client]` properties that hold
/// passwords, secrets, tokens or key material, credentials in URLs
/// (`https://user:pass@host`, `?api_key=`), and tool header values.
pub fn render_config(cfg: &crate::config::Config) -> Result<String, toml::ser::Error> {
    toml::to_string_pretty(&cfg.redacted())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_config_output_lacks_every_secret() {
        let text = r#"
[kafka]
brokers = "127.0.0.1:9092"
[kafka.client]
"security.protocol" = "sasl_ssl"
"sasl.mechanism" = "PLAIN"
"sasl.username" = "stepgate"
"sasl.password" = "hunter2-sasl"
"ssl.key.password" = "hunter2-key"
"ssl.keystore.password" = "hunter2-keystore"
"sasl.oauthbearer.client.secret" = "hunter2-oauth"
"sasl.oauthbearer.config" = "principal=x clientSecret=hunter2-conf"
"ssl.key.pem" = "-----BEGIN PRIVATE KEY-----hunter2-pem"
"ssl.ca.location" = "/etc/ssl/ca.pem"
[tools.search]
category = "read_only"
url = "https://bot:hunter2-url@tools.example.com/search?api_key=hunter2-query&q=1"
headers = { Authorization = "env:SEARCH_TOKEN", "X-Api-Key" = "hunter2-literal" }
"#;
        let env = [(
            "STEPGATE_KAFKA_CLIENT_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL".to_owned(),
            "https://idp.example.com/token".to_owned(),
        )];
        let mut cfg = crate::config::Config::from_toml_str(text, env).unwrap();
        cfg.resolve_tool_headers(|v| (v == "SEARCH_TOKEN").then(|| "Bearer hunter2-env".into()))
            .unwrap();
        let out = render_config(&cfg).unwrap();
        let debug = format!("{cfg:?} {:?}", cfg.tools["search"]);
        for shown in [&out, &debug] {
            assert!(!shown.contains("hunter2"), "a secret was shown:\n{shown}");
            for kept in [
                "sasl.username",
                "stepgate",
                "/etc/ssl/ca.pem",
                "sasl_ssl",
                "https://bot:redacted@tools.example.com/search?api_key=redacted&q=1",
                "https://idp.example.com/token",
                "env:SEARCH_TOKEN",
            ] {
                assert!(shown.contains(kept), "`{kept}` missing:\n{shown}");
            }
            assert!(shown.matches(REDACTED).count() >= 7, "{shown}");
        }
        // What is printed still loads (secrets replaced, nothing dropped).
        crate::config::Config::from_toml_str(&out, std::iter::empty()).unwrap();
    }

    #[test]
    fn secret_properties() {
        for secret in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "SASL.PASSWORD",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "ssl.key.pem",
            "ssl_key",
        ] {
            assert!(is_secret_property(secret), "{secret}");
        }
        for plain in [
            "sasl.username",
            "ssl.ca.location",
            "ssl.key.location",
            "ssl.keystore.location",
            "ssl.certificate.pem",
            "sasl.kerberos.keytab",
            "sasl.oauthbearer.token.endpoint.url",
            "sasl.oauthbearer.client.id",
            "message.max.bytes",
        ] {
            assert!(!is_secret_property(plain), "{plain}");
        }
    }
}
