//! Which key a `STEPGATE_*` variable names: every settable key and its type,
//! derived from the typed defaults (a new key is settable with no list to keep).

use super::Config;
use super::table::{lookup, merge};

/// How an environment value is read for a key: as the type of the key.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Kind {
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
pub(super) struct EnvSchema {
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
resource = ""
session_key = "env:X"
trusted_proxies = []
allowed_hosts = []
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
[pools]
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
pub(super) fn env_part<S: AsRef<str>>(path: &[S]) -> String {
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
    pub(super) fn new() -> EnvSchema {
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
    pub(super) fn target(
        &self,
        var: &str,
        root: &toml::Table,
    ) -> Result<Option<(Vec<String>, Kind)>, String> {
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

    /// Every variable name the config's keys have, for the nearest-name hint.
    pub(super) fn known_names(&self, root: &toml::Table) -> Vec<String> {
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
        out
    }
}

/// Every key the environment sets, with its variable, as the configuration
/// reference lists them: `("kafka.brokers", "STEPGATE_KAFKA_BROKERS")`; a
/// tool's key under `<name>`: `("tools.<name>.timeout",
/// "STEPGATE_TOOLS_<NAME>_TIMEOUT")`; an entry of a name-keyed table under
/// what names it: `("kafka.client.<property>",
/// "STEPGATE_KAFKA_CLIENT_<PROPERTY>")`.
pub fn key_variables() -> Vec<(String, String)> {
    let schema = EnvSchema::new();
    let mut out = Vec::new();
    let mut add = |leaves: &[Leaf], maps: &[MapAt], key: &str, var: &str| {
        for l in leaves {
            out.push((
                format!("{key}{}", l.path.join(".")),
                format!("{var}{}", l.env),
            ));
        }
        for m in maps {
            let entry = match m.keys {
                MapKeys::Property => "property",
                MapKeys::Header => "header",
                MapKeys::Lower => "name",
            };
            out.push((
                format!("{key}{}.<{entry}>", m.path.join(".")),
                format!("{var}{}_<{}>", m.env, entry.to_ascii_uppercase()),
            ));
        }
    };
    add(&schema.leaves, &schema.maps, "", "STEPGATE_");
    add(
        &schema.tool_leaves,
        &schema.tool_maps,
        "tools.<name>.",
        "STEPGATE_TOOLS_<NAME>_",
    );
    out
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
            // `STEPGATE_POOLS_GPU='{"key": "env:GPU_POOL_KEY"}'`.
            (false, ["pools"]) => Some((MapKeys::Lower, Kind::Json)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        ConsoleConfig, ExecutorConfig, GateConfig, HttpConfig, KafkaConfig, LogConfig,
        McpAuthConfig, McpConfig, StateConfig, ToolAnnotations, ToolConfig, TopicsConfig,
        TracesConfig,
    };

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
