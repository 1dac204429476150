//! `[mcp]`: the HTTP front of `stepgate mcp` and who may call it (`[mcp.auth]`).

use super::ConfigError;
use crate::duration::{Dur, dur};
use crate::redact::redact_url;
use crate::tools::tool::{HeaderSource, HeaderSpec, ToolConfig};
use crate::tools::validate::is_http;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

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
    /// Addresses (`"10.0.0.7"`) or networks (`"10.0.0.0/8"`, `"fd00::/8"`) of
    /// proxies in front of the front, e.g. the TLS-terminating one. A request
    /// from one of them is counted against the address its `X-Forwarded-For`
    /// names (the right-most one that is not itself a trusted proxy) when too
    /// many refused tokens lock an address out; from any other peer, the
    /// header is ignored. Empty: every request is its TCP peer's.
    pub trusted_proxies: Vec<String>,
    /// Requests per second a principal may make, sustained (429 beyond).
    pub requests_per_second: u32,
    /// Requests a principal may make at once above the sustained rate.
    pub burst: u32,
    /// Tasks (a `tools/call` with `params.task`, protocol 2025-11-25) held
    /// at once; a task still waiting for its answer is never dropped for a
    /// new one, which is refused instead.
    pub max_tasks: u32,
    /// Tasks still waiting for their answer one principal may hold at once; a
    /// new one beyond it is refused with a text. The default, a tenth of
    /// `max_tasks`, lets no single principal (calls held for a person's
    /// approval, say) take more than a tenth of the front's tasks from the
    /// others, and is far above what one agent host keeps in flight.
    pub max_tasks_per_principal: u32,
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
            trusted_proxies: Vec::new(),
            requests_per_second: 20,
            burst: 40,
            max_tasks: 10_000,
            max_tasks_per_principal: 1_000,
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
    /// An `https` URL (plain `http` only on a loopback host).
    pub issuer: Option<String>,
    /// Where the issuer publishes its signing keys (a JWK Set); fetched at
    /// start, every `jwks_refresh`, and when a token names an unknown key.
    /// An `https` URL (plain `http` only on a loopback host): whoever can
    /// change these keys in transit can sign any token.
    pub jwks_url: Option<String>,
    /// How often the JWK Set is fetched again.
    pub jwks_refresh: Dur,
    /// How long the last JWK Set fetched is used while fetching it again
    /// fails; beyond it no token is checked (503) until a fetch succeeds, so
    /// a key the issuer withdrew is not accepted for ever by a front that
    /// cannot reach it. At least `jwks_refresh`.
    pub jwks_max_stale: Dur,
    /// JWS algorithms accepted (asymmetric only: `RS*`, `PS*`, `ES256`,
    /// `ES384`, `EdDSA`).
    pub algorithms: Vec<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Dur,
    /// The token claim that names the principal's workflow namespace: it may
    /// name only workflows `jwt:<value>/…` in `_meta` (a value with `/` in it
    /// is refused, so no namespace holds another).
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
            jwks_max_stale: dur("1h"),
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
    /// is every workflow (other principals' included). No two static tokens'
    /// namespaces may be prefixes of each other, and none starts with `jwt:`,
    /// the JWT principals' root.
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
            (
                "mcp.max_tasks_per_principal",
                self.max_tasks_per_principal.into(),
            ),
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
        for (i, p) in self.trusted_proxies.iter().enumerate() {
            if let Err(why) = TrustedProxy::parse(p) {
                return Err(invalid(&format!("mcp.trusted_proxies[{i}]"), why));
            }
        }
        let a = &self.auth;
        match (&a.issuer, &a.jwks_url) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(invalid(
                    "mcp.auth",
                    "`issuer` and `jwks_url` go together: the issuer's tokens are checked against its keys".into(),
                ));
            }
            (Some(issuer), Some(url)) => {
                for (field, value) in [("mcp.auth.issuer", issuer), ("mcp.auth.jwks_url", url)] {
                    if let Err(why) = tls_unless_loopback(value) {
                        return Err(invalid(field, why));
                    }
                }
                if a.jwks_max_stale.0 < a.jwks_refresh.0 {
                    return Err(invalid(
                        "mcp.auth.jwks_max_stale",
                        format!(
                            "must be at least `jwks_refresh` ({}): the keys are fetched again only \
                             that often",
                            humantime::format_duration(a.jwks_refresh.0)
                        ),
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
            let namespace = t.namespace();
            if namespace.starts_with(JWT_NAMESPACE_ROOT) {
                return Err(invalid(
                    &field,
                    format!(
                        "its namespace `{namespace}` starts with `{JWT_NAMESPACE_ROOT}`, the root of \
                         the JWT principals' namespaces: it could name their workflows. Give it \
                         another `namespace` (or another `name`)"
                    ),
                ));
            }
            // Naming a step is enough to read its answer, so a namespace that
            // holds another's would read that tenant's answers.
            if let Some(other) = a.tokens[..i].iter().find(|o| {
                let theirs = o.namespace();
                !namespace.is_empty()
                    && !theirs.is_empty()
                    && (namespace.starts_with(&theirs) || theirs.starts_with(&namespace))
            }) {
                return Err(invalid(
                    &field,
                    format!(
                        "its namespace `{namespace}` and the namespace `{}` of token `{}` are \
                         prefixes of one another, so one could name (and read the answers of) \
                         the other's workflows. Give one of them another `namespace` (or \
                         `name`), e.g. \"{}-eu/\" rather than \"{}/eu/\"",
                        other.namespace(),
                        other.name,
                        namespace.trim_end_matches('/').replace('/', "-"),
                        other.namespace().trim_end_matches('/'),
                    ),
                ));
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

    /// The same with static tokens' literal values and any credentials in
    /// its URLs redacted.
    pub fn redacted(&self) -> McpConfig {
        let mut c = self.clone();
        for t in &mut c.auth.tokens {
            // Its source (`env:…`, `file:…`), or REDACTED for a literal.
            t.token = HeaderSpec::parse(&t.token.shown());
        }
        for url in [&mut c.resource, &mut c.auth.issuer, &mut c.auth.jwks_url]
            .into_iter()
            .flatten()
        {
            *url = redact_url(url);
        }
        c
    }
}

/// The root of every JWT principal's namespace (`jwt:<claim>/`): no static
/// token's namespace may start with it, so the two kinds never share one.
pub const JWT_NAMESPACE_ROOT: &str = "jwt:";

/// `Ok` for an `https` URL, or a plain `http` one on a loopback host.
fn tls_unless_loopback(value: &str) -> Result<(), String> {
    let shown = redact_url(value);
    let url =
        reqwest::Url::parse(value).map_err(|_| format!("must be an https URL, got `{shown}`"))?;
    let loopback = url.host_str().is_some_and(|h| {
        let h = h.trim_start_matches('[').trim_end_matches(']');
        h.eq_ignore_ascii_case("localhost") || h.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
    });
    match url.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        "http" => Err(format!(
            "must be an https URL: the authorization server's keys decide which tokens are \
             accepted, and over plain http whoever is on the path can swap in their own and sign \
             any token (plain http is accepted only on a loopback host); got `{shown}`"
        )),
        _ => Err(format!("must be an https URL, got `{shown}`")),
    }
}

/// One entry of `mcp.trusted_proxies`: an address, or a network in CIDR
/// notation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrustedProxy {
    network: IpAddr,
    prefix: u8,
}

impl TrustedProxy {
    /// `"10.0.0.7"`, `"10.0.0.0/8"`, `"::1"` or `"fd00::/8"`.
    pub fn parse(s: &str) -> Result<TrustedProxy, String> {
        let bad = || {
            format!(
                "`{s}` is neither an IP address nor a network (e.g. \"10.0.0.7\", \
                 \"10.0.0.0/8\", \"fd00::/8\")"
            )
        };
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p.parse::<u8>().map_err(|_| bad())?)),
            None => (s.trim(), None),
        };
        let network: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        if prefix > max {
            return Err(bad());
        }
        Ok(TrustedProxy { network, prefix })
    }

    /// Whether `ip` is this address or in this network (an IPv4 address
    /// mapped into IPv6 is its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let bits = |n: u128, width: u32| {
            let keep = u32::from(self.prefix);
            if keep == 0 { 0 } else { n >> (width - keep) }
        };
        match (self.network, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                bits(u32::from(net).into(), 32) == bits(u32::from(ip).into(), 32)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                bits(u128::from(net), 128) == bits(u128::from(ip), 128)
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_proxies_are_addresses_or_networks() {
        let p = |s: &str| TrustedProxy::parse(s).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(p("10.0.0.0/8").contains(ip("10.200.3.4")));
        assert!(!p("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(p("10.0.0.7").contains(ip("10.0.0.7")));
        assert!(!p("10.0.0.7").contains(ip("10.0.0.8")));
        assert!(p("0.0.0.0/0").contains(ip("203.0.113.1")));
        assert!(p("fd00::/8").contains(ip("fd12::1")));
        assert!(!p("fd00::/8").contains(ip("fe80::1")));
        // An IPv4 peer seen on an IPv6 socket.
        assert!(p("127.0.0.1").contains(ip("::ffff:127.0.0.1")));
        assert!(!p("::1").contains(ip("127.0.0.1")));
        for bad in ["10.0.0.0/33", "proxy.internal", "10.0.0/8", "::1/129", ""] {
            assert!(TrustedProxy::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_authorization_servers_urls_need_tls_beyond_loopback() {
        assert!(tls_unless_loopback("https://idp.example/jwks").is_ok());
        assert!(tls_unless_loopback("http://127.0.0.1:8000/jwks").is_ok());
        assert!(tls_unless_loopback("http://localhost/jwks").is_ok());
        assert!(tls_unless_loopback("http://[::1]:80/jwks").is_ok());
        let e = tls_unless_loopback("http://idp.example/jwks").unwrap_err();
        assert!(e.contains("https"), "{e}");
        let e = tls_unless_loopback("http://u:s3cret@idp.example/jwks").unwrap_err();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(tls_unless_loopback("ftp://idp.example/jwks").is_err());
        assert!(tls_unless_loopback("idp.example").is_err());
    }
}
