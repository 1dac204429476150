//! `[console]`: the web console's address, how it names a principal, and the
//! principals' roles.

use super::ConfigError;
use crate::duration::{Dur, dur};
use crate::redact::redact_url;
use crate::tools::tool::{HeaderSource, HeaderSpec};
use crate::tools::validate::is_http;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// `stepgate console`: a web console over the topics (no state of its own;
/// any number may run). Who a request comes from is read from a bearer token
/// (`tokens`, or `[mcp.auth]`'s tokens and JWTs with `mcp_auth`), the login
/// cookie holding one, or a trusted proxy's header (`proxy_user_header`);
/// what they may do from `roles`. Nothing is served to a principal without a role.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// The address it serves on: loopback unless set otherwise.
    pub listen: String,
    /// Principal → `viewer`, `approver` or `operator`.
    pub roles: BTreeMap<String, ConsoleRole>,
    /// Bearer tokens (or the login form's) naming principals.
    pub tokens: Vec<ConsoleToken>,
    /// Also accept `[mcp.auth]`'s static tokens and JWTs (their issuer,
    /// keys and audience); the principal is the token's name or subject.
    pub mcp_auth: bool,
    /// A header a trusted proxy (oauth2-proxy, an ingress's OIDC) sets to the
    /// signed-in user, e.g. `"X-Forwarded-User"`. Only honoured when set: set it
    /// only where every request comes through that proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_user_header: Option<String>,
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

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            listen: "127.0.0.1:9470".into(),
            roles: BTreeMap::new(),
            tokens: Vec::new(),
            mcp_auth: false,
            proxy_user_header: None,
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
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "listen",
                format!(
                    "must be an address and port, e.g. \"127.0.0.1:9470\"; got `{}`",
                    self.listen
                ),
            ));
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

    /// The same with literal tokens redacted.
    pub fn redacted(&self) -> ConsoleConfig {
        let mut c = self.clone();
        for t in &mut c.tokens {
            t.token = HeaderSpec::parse(&t.token.shown());
        }
        c
    }
}
