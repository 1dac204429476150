//! `[console]`: the web console's address, how it names a principal, and the
//! principals' roles.

use super::ConfigError;
use crate::duration::{Dur, dur};
use crate::redact::{redact_url, url_secrets};
use crate::tools::tool::{HeaderSource, HeaderSpec};
use crate::tools::validate::is_http;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

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

/// The scope an `[mcp.auth]` token must hold to be a console login (with
/// `console.mcp_auth`): an agent's MCP token is not one unless the operator
/// grants exactly this.
pub const CONSOLE_SCOPE: &str = "stepgate:console";

/// `stepgate console`: a web console over the topics (no state of its own;
/// any number may run). Who a request comes from is read from a bearer token
/// (`tokens`, or — with `mcp_auth` — `[mcp.auth]`'s tokens and JWTs granted
/// the console), the signed session cookie of the login form, or a trusted
/// proxy's header (`proxy_user_header`, from `trusted_proxies` only); what
/// they may do from `roles`. Nothing is served to a principal without a role.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// The address it serves on: loopback unless set otherwise (beyond
    /// loopback `allowed_hosts` is required).
    pub listen: String,
    /// Principal → `viewer`, `approver` or `operator`. A console token or a
    /// proxy's user is named as configured (`alice`); an `[mcp.auth]`
    /// principal by its kind, `token:<name>` or `jwt:<sub>`.
    pub roles: BTreeMap<String, ConsoleRole>,
    /// Bearer tokens (or the login form's) naming principals.
    pub tokens: Vec<ConsoleToken>,
    /// Also accept `[mcp.auth]`'s static tokens and JWTs, but only those
    /// granted the console: a token must hold the scope `stepgate:console`,
    /// and a JWT must also be issued for `resource`. Its principal is
    /// `token:<name>` or `jwt:<sub>`.
    pub mcp_auth: bool,
    /// The console's own audience for JWTs (`aud`), e.g.
    /// `"https://console.example.com"`: required with `mcp_auth` when
    /// `[mcp.auth]` has an issuer, and never `mcp.resource` (the agents' audience).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// A header a trusted proxy (oauth2-proxy, an ingress's OIDC) sets to the
    /// signed-in user, e.g. `"X-Forwarded-User"`. Honoured only from
    /// `trusted_proxies`; sent by any other peer, or twice, the request is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_user_header: Option<String>,
    /// The peers (addresses or CIDRs, e.g. `"10.0.0.5"`, `"10.0.0.0/24"`)
    /// whose `proxy_user_header` and `X-Forwarded-Proto` are believed. Empty:
    /// loopback peers, and only on a loopback `listen` (the console refuses to
    /// start with `proxy_user_header` beyond loopback without them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trusted_proxies: Vec<String>,
    /// The `Host` names (`host` or `host:port`) the console answers to; any
    /// other gets 403. The loopback names are accepted from loopback peers on
    /// a loopback `listen`. Required beyond loopback.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_hosts: Vec<String>,
    /// The key that signs sessions, CSRF tokens and notices: `"env:NAME"` or
    /// `"file:/path"`, at least 32 characters. Consoles behind one load
    /// balancer share it; unset, each console makes a random one at start (its
    /// sessions end when it stops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_key: Option<HeaderSpec>,
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

/// A trusted peer: an address, or a network (`10.0.0.0/24`, `fd00::/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerNet {
    net: IpAddr,
    prefix: u8,
}

impl PeerNet {
    pub fn parse(s: &str) -> Option<PeerNet> {
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p.parse::<u8>().ok()?)),
            None => (s.trim(), None),
        };
        let net: IpAddr = addr.parse().ok()?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(PeerNet { net, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 peer on an IPv6 socket is `::ffff:a.b.c.d`.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            listen: "127.0.0.1:9470".into(),
            roles: BTreeMap::new(),
            tokens: Vec::new(),
            mcp_auth: false,
            resource: None,
            proxy_user_header: None,
            trusted_proxies: Vec::new(),
            allowed_hosts: Vec::new(),
            session_key: None,
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
        let Ok(listen) = self.listen.parse::<std::net::SocketAddr>() else {
            return Err(invalid(
                "listen",
                format!(
                    "must be an address and port, e.g. \"127.0.0.1:9470\"; got `{}`",
                    self.listen
                ),
            ));
        };
        for (i, p) in self.trusted_proxies.iter().enumerate() {
            if PeerNet::parse(p).is_none() {
                return Err(invalid(
                    &format!("trusted_proxies[{i}]"),
                    format!(
                        "must be an address or a network, e.g. \"10.0.0.5\" or \"10.0.0.0/24\"; got `{p}`"
                    ),
                ));
            }
        }
        for (i, h) in self.allowed_hosts.iter().enumerate() {
            let ok = axum::http::uri::Authority::try_from(h.as_str())
                .is_ok_and(|a| !a.host().is_empty() && !h.contains('@'));
            if !ok {
                return Err(invalid(
                    &format!("allowed_hosts[{i}]"),
                    format!(
                        "must be a host name, optionally with its port, as browsers send it in `Host` (e.g. \"console.example.com\" or \"console.example.com:8443\"); got `{h}`"
                    ),
                ));
            }
        }
        let loopback = listen.ip().is_loopback();
        if !loopback && self.allowed_hosts.is_empty() {
            return Err(invalid(
                "allowed_hosts",
                format!(
                    "must name the host names people use to reach the console: it listens on {listen}, beyond loopback, and answers only to the `Host` names listed (this stops DNS rebinding), e.g. allowed_hosts = [\"console.example.com\"]"
                ),
            ));
        }
        if self.proxy_user_header.is_some() && !loopback && self.trusted_proxies.is_empty() {
            return Err(invalid(
                "trusted_proxies",
                format!(
                    "must list the proxy's address: `proxy_user_header` names whoever sends it, and the console listens on {listen}, beyond loopback, where anyone could send it; e.g. trusted_proxies = [\"10.0.0.5\"]"
                ),
            ));
        }
        if let Some(r) = &self.resource
            && !reqwest::Url::parse(r).is_ok_and(|u| is_http(&u))
        {
            return Err(invalid(
                "resource",
                format!(
                    "must be the console's URL, the audience its JWTs are issued for, e.g. \"https://console.example.com\"; got `{}`",
                    redact_url(r)
                ),
            ));
        }
        if let Some(k) = &self.session_key {
            match &k.source {
                HeaderSource::Literal(v) if v.trim().len() < 32 => {
                    return Err(invalid(
                        "session_key",
                        "must be at least 32 characters (better \"env:NAME\" or \"file:/path\")"
                            .into(),
                    ));
                }
                HeaderSource::Env(v) if v.is_empty() => {
                    return Err(invalid(
                        "session_key",
                        "`env:` needs a variable name".into(),
                    ));
                }
                _ => {}
            }
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

    /// The same with literal tokens and keys, and credentials in URLs, redacted.
    pub fn redacted(&self) -> ConsoleConfig {
        let mut c = self.clone();
        for t in &mut c.tokens {
            t.token = HeaderSpec::parse(&t.token.shown());
        }
        if let Some(k) = &mut c.session_key {
            *k = HeaderSpec::parse(&k.shown());
        }
        for g in &mut c.gates {
            *g = shown_url(g);
        }
        c.trace_url = c.trace_url.as_deref().map(redact_url_template);
        c.resource = c.resource.as_deref().map(shown_url);
        c
    }

    /// The trusted peers, parsed (`validate` has checked them). Empty on a
    /// loopback `listen`: loopback peers.
    pub fn trusted_peers(&self) -> Vec<PeerNet> {
        let listed: Vec<PeerNet> = self
            .trusted_proxies
            .iter()
            .filter_map(|p| PeerNet::parse(p))
            .collect();
        if listed.is_empty()
            && self
                .listen
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.ip().is_loopback())
        {
            return ["127.0.0.0/8", "::1"]
                .iter()
                .filter_map(|p| PeerNet::parse(p))
                .collect();
        }
        listed
    }

    /// Whether the console listens on a loopback address.
    pub fn loopback(&self) -> bool {
        self.listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback())
    }
}

/// A URL as configured, or with its credentials redacted when it has any.
fn shown_url(u: &str) -> String {
    if url_secrets(u).is_empty() {
        u.to_owned()
    } else {
        redact_url(u)
    }
}

/// A URL template (`http://u:p@jaeger/trace/{trace_id}`) with its credentials
/// redacted, the placeholder kept as written.
fn redact_url_template(t: &str) -> String {
    const MARK: &str = "stepgate-trace-id-placeholder";
    shown_url(&t.replace("{trace_id}", MARK)).replace(MARK, "{trace_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn console(toml: &str) -> ConsoleConfig {
        toml::from_str(toml).unwrap()
    }

    fn refused(c: &ConsoleConfig) -> String {
        c.validate().unwrap_err().to_string()
    }

    #[test]
    fn beyond_loopback_the_hosts_and_the_proxies_are_named() {
        let e = refused(&console(r#"listen = "0.0.0.0:9470""#));
        assert!(e.contains("allowed_hosts"), "{e}");
        let e = refused(&console(
            r#"listen = "0.0.0.0:9470"
allowed_hosts = ["console.example.com"]
proxy_user_header = "X-Forwarded-User""#,
        ));
        assert!(e.contains("trusted_proxies"), "{e}");
        console(
            r#"listen = "0.0.0.0:9470"
allowed_hosts = ["console.example.com"]
proxy_user_header = "X-Forwarded-User"
trusted_proxies = ["10.0.0.0/24"]"#,
        )
        .validate()
        .unwrap();
        // On loopback, loopback peers are the proxy's.
        let c = console(r#"proxy_user_header = "X-Forwarded-User""#);
        c.validate().unwrap();
        assert!(c.trusted_peers()[0].contains("127.0.0.1".parse().unwrap()));
        let e = refused(&console(r#"trusted_proxies = ["10.0.0.0/33"]"#));
        assert!(e.contains("trusted_proxies[0]"), "{e}");
        let e = refused(&console(r#"session_key = "too-short""#));
        assert!(e.contains("session_key"), "{e}");
    }

    #[test]
    fn networks_contain_their_addresses() {
        let n = PeerNet::parse("10.1.0.0/16").unwrap();
        assert!(n.contains("10.1.200.3".parse().unwrap()));
        assert!(!n.contains("10.2.0.1".parse().unwrap()));
        assert!(
            n.contains("::ffff:10.1.0.9".parse().unwrap()),
            "IPv4 on an IPv6 socket"
        );
        let one = PeerNet::parse("fd00::5").unwrap();
        assert!(
            one.contains("fd00::5".parse().unwrap()) && !one.contains("fd00::6".parse().unwrap())
        );
        assert!(
            PeerNet::parse("0.0.0.0/0")
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
    }

    #[test]
    fn shown_without_credentials() {
        let c = console(
            r#"gates = ["http://admin:s3cret-1@gate-0:9464", "http://gate-1:9464"]
trace_url = "http://u:s3cret-2@jaeger:16686/trace/{trace_id}"
session_key = "a-literal-session-key-s3cret-3-0123456789""#,
        )
        .redacted();
        let shown = toml::to_string(&c).unwrap();
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("http://gate-1:9464\"") && shown.contains("{trace_id}"),
            "{shown}"
        );
    }
}
