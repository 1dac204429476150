//! Loading: the file over the typed defaults, the `STEPGATE_*` environment
//! over both (`env.rs`), then the checks serde cannot express.

use super::env::apply_env;
use super::table::merge;
use super::{Config, ConfigError, HeaderSource, refused_client_property};
use std::path::Path;

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
        if let Some((field, message)) = crate::retired::in_table(&file) {
            return Err(ConfigError::Removed { field, message });
        }
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
            tool.validate(name)?;
        }
        super::pools::validate(&self.pools, &self.tools)?;
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Category;
    use crate::config::tests::{SAMPLE, env};
    use std::time::Duration;

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
}
