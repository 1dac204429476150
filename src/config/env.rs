//! The environment overlay: each `STEPGATE_*` variable set on the key it
//! names, read as that key's type, or refused (the rules: the module doc of
//! `config`).

use super::ConfigError;
use super::env_schema::{EnvSchema, Kind};
use super::table::set_at;

/// `STEPGATE_*` variables that are not config keys: accepted, and left to
/// whoever reads them — the CLI's own (`env = …` of its arguments in
/// `src/cli/mod.rs`) and those of the test suites, benchmarks and scripts (a
/// `stepgate` process they start inherits them). Every other `STEPGATE_*`
/// variable must name a config key, or be named by an `env:` value of the
/// config (a tool header's, a static MCP token's); see
/// [`Config::from_toml_str`](super::Config::from_toml_str).
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
    "STEPGATE_NPM_CACHE",
    "STEPGATE_CACHE",
    "STEPGATE_PEERS_DIR",
    "STEPGATE_CONSOLE_SCREENSHOTS",
    "STEPGATE_WRITE_REFERENCE",
];

/// Prefixes of `STEPGATE_*` variables that are not config keys: the test
/// hooks (`STEPGATE_TEST_CRASH_BEFORE_COMMIT`, …), the gate simulation's
/// settings (`STEPGATE_SIM_SEED`, …) and the bench's (`STEPGATE_BENCH_RUN_ID`,
/// `STEPGATE_BENCH_COMMAND`, which `benches/bench.sh` exports to every
/// stepgate it starts). No config section has these names.
pub const NOT_CONFIG_PREFIXES: &[&str] = &["STEPGATE_TEST_", "STEPGATE_SIM_", "STEPGATE_BENCH_"];

/// Whether a `STEPGATE_*` variable is one stepgate's config leaves alone.
pub fn is_not_config_variable(name: &str) -> bool {
    NOT_CONFIG_VARIABLES.contains(&name) || NOT_CONFIG_PREFIXES.iter().any(|p| name.starts_with(p))
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
pub(super) fn apply_env(
    root: &mut toml::Table,
    env: &[(String, String)],
) -> Result<(), ConfigError> {
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
        if let Some(message) = crate::retired::env_var(var) {
            return Err(ConfigError::Env {
                var: var.clone(),
                message,
            });
        }
        let nearest = schema
            .known_names(root)
            .into_iter()
            .chain(NOT_CONFIG_VARIABLES.iter().map(|s| s.to_string()))
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{SAMPLE, env};
    use crate::config::{Config, HeaderSource};
    use std::time::Duration;

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
            // benches/bench.sh exports these to every stepgate it starts.
            ("STEPGATE_BENCH_RUN_ID", "sgb1"),
            ("STEPGATE_BENCH_COMMAND", "bash benches/bench.sh"),
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
}
