//! `[mcp]`: the HTTP front of `stepgate mcp` and who may call it (`[mcp.auth]`).

use super::ConfigError;
use crate::duration::{Dur, dur};
use crate::redact::redact_url;
use crate::tools::tool::{HeaderSource, HeaderSpec, ToolConfig};
use crate::tools::validate::is_http;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    pub(super) fn validate(&self, tools: &BTreeMap<String, ToolConfig>) -> Result<(), ConfigError> {
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
