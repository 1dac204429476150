//! `[pools.<name>]`: what the gates share with a worker pool — its key.
//!
//! A tool declared `pool = "gpu"` is run by `stepgate worker --pool gpu`
//! processes (docs/design.md "Worker pools"). Gates sign every Call v1 they
//! publish on the pool's calls topic with the pool's key, and take a worker's
//! Outcome v1 only when it is signed with it; workers run only calls signed
//! with it. So whoever can write those topics without the key (another
//! pool's worker, an agent, a misplaced ACL) can neither make a worker run a
//! call nor settle a step (`contract::sign`).

use super::{ConfigError, HeaderSource, HeaderSpec, REDACTED};
use crate::contract::sign::MIN_POOL_KEY_BYTES;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A worker pool, by its name (`[pools.gpu]` for the tools declared
/// `pool = "gpu"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The key the gates and this pool's workers share: HMAC-SHA256 signs
    /// every Call v1 and Outcome v1 of the pool. `"env:NAME"` reads an
    /// environment variable, `"file:/path"` a file (a Kubernetes or Docker
    /// secret); anything else is the key itself (discouraged: it sits in the
    /// config). At least 32 bytes (`openssl rand -hex 32` makes one), and a
    /// key of its own per pool. Read once at start; never logged or printed.
    pub key: HeaderSpec,
}

impl PoolConfig {
    /// The key's source kept, a literal key replaced by [`REDACTED`].
    pub fn redacted(&self) -> PoolConfig {
        PoolConfig {
            key: HeaderSpec::parse(&match &self.key.source {
                HeaderSource::Literal(_) => REDACTED.to_owned(),
                _ => self.key.shown(),
            }),
        }
    }

    /// The key's bytes, once resolved ([`resolve_pool_keys`]).
    pub fn key_bytes(&self) -> Option<&[u8]> {
        self.key.value().map(str::as_bytes)
    }
}

/// Every pool a tool names has its `[pools.<name>]` (its key is read at
/// start, [`resolve_pool_keys`]), and every section names a pool.
pub(super) fn validate(
    pools: &BTreeMap<String, PoolConfig>,
    tools: &BTreeMap<String, crate::config::ToolConfig>,
) -> Result<(), ConfigError> {
    for name in pools.keys() {
        if !crate::tools::tool::valid_pool_name(name) {
            return Err(ConfigError::Invalid {
                field: format!("pools.{name}"),
                message:
                    "is not a pool name: 1 to 100 of [A-Za-z0-9_-], as the tools' `pool` names it"
                        .into(),
            });
        }
    }
    for (tool, t) in tools {
        if let Some(pool) = &t.pool
            && !pools.contains_key(pool)
        {
            return Err(ConfigError::Invalid {
                field: format!("tools.{tool}.pool"),
                message: format!(
                    "names the pool `{pool}`, which has no `[pools.{pool}]`: add `[pools.{pool}]` with `key = \"env:<VARIABLE>\"` (or `\"file:<path>\"`), the key of at least {MIN_POOL_KEY_BYTES} bytes this gate and the pool's workers share to sign its calls and outcomes"
                ),
            });
        }
    }
    Ok(())
}

/// Read the keys of `pools` (each, or only `only`) from their sources, once,
/// at start. A missing source, or a key shorter than [`MIN_POOL_KEY_BYTES`],
/// is an error naming the pool and the source, never the key.
pub(super) fn resolve_pool_keys(
    pools: &mut BTreeMap<String, PoolConfig>,
    only: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    if let Some(pool) = only
        && !pools.contains_key(pool)
    {
        return Err(ConfigError::Invalid {
            field: format!("pools.{pool}"),
            message: format!(
                "is missing: a worker of pool `{pool}` needs `[pools.{pool}]` with `key = \"env:<VARIABLE>\"` (or `\"file:<path>\"`), the key its gates sign the pool's calls with (at least {MIN_POOL_KEY_BYTES} bytes)"
            ),
        });
    }
    for (name, pool) in pools.iter_mut() {
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let field = format!("pools.{name}.key");
        pool.key
            .resolve(env)
            .map_err(|message| ConfigError::Invalid {
                field: field.clone(),
                message,
            })?;
        let len = pool.key_bytes().map_or(0, <[u8]>::len);
        if len < MIN_POOL_KEY_BYTES {
            return Err(ConfigError::Invalid {
                field,
                message: format!(
                    "is {len} bytes long: a pool key must be at least {MIN_POOL_KEY_BYTES} bytes (`openssl rand -hex 32` makes one of 64)"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const GATE: &str = r#"
[tools.render]
category = "unkeyed"
pool = "gpu"
"#;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_pool_tool_needs_its_pool_section() {
        let e = Config::from_toml_str(GATE, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tools.render.pool"), "{e}");
        assert!(e.contains("[pools.gpu]"), "{e}");
        let ok = format!("{GATE}[pools.gpu]\nkey = \"env:GPU_POOL_KEY\"\n");
        Config::from_toml_str(&ok, env(&[])).expect("a pool with its key");
        let bad = "[pools.\"g u\"]\nkey = \"env:X\"\n";
        let e = Config::from_toml_str(bad, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pools.g u"), "{e}");
        let unknown = "[pools.gpu]\nkey = \"env:X\"\nkeys = 1\n";
        assert!(Config::from_toml_str(unknown, env(&[])).is_err());
    }

    #[test]
    fn keys_are_read_at_start_never_shown_and_must_be_long_enough() {
        let text = format!("{GATE}[pools.gpu]\nkey = \"env:GPU_POOL_KEY\"\n");
        let mut c = Config::from_toml_str(&text, env(&[])).unwrap();
        let e = c.resolve_pool_keys(None, |_| None).unwrap_err().to_string();
        assert!(e.contains("pools.gpu.key"), "{e}");
        assert!(e.contains("GPU_POOL_KEY"), "{e}");
        let short = "s3cr3t-but-short";
        let e = c
            .resolve_pool_keys(None, |_| Some(short.into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 32 bytes"), "{e}");
        assert!(!e.contains(short), "{e}");
        let key = "k".repeat(32);
        c.resolve_pool_keys(None, |v| (v == "GPU_POOL_KEY").then(|| key.clone()))
            .unwrap();
        assert_eq!(c.pools["gpu"].key_bytes(), Some(key.as_bytes()));
        // Printed and debugged as its source; a literal key is redacted.
        assert!(!format!("{c:?}").contains(&key));
        let shown = toml::to_string(&c.redacted()).unwrap();
        assert!(
            shown.contains("env:GPU_POOL_KEY") && !shown.contains(&key),
            "{shown}"
        );
        let literal = format!("{GATE}[pools.gpu]\nkey = \"{key}\"\n");
        let c = Config::from_toml_str(&literal, env(&[])).unwrap();
        let shown = toml::to_string(&c.redacted()).unwrap();
        assert!(!shown.contains(&key), "{shown}");
        // Through the environment, as every key.
        let c = Config::from_toml_str(
            GATE,
            env(&[("STEPGATE_POOLS_GPU", r#"{"key": "env:GPU_POOL_KEY"}"#)]),
        )
        .unwrap();
        assert!(c.pools.contains_key("gpu"));
    }

    #[test]
    fn a_worker_reads_its_own_pool_s_key_and_needs_its_section() {
        let mut c = Config::from_toml_str("", env(&[])).unwrap();
        let e = c
            .resolve_pool_keys(Some("gpu"), |_| None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pools.gpu") && e.contains("worker"), "{e}");
    }
}
