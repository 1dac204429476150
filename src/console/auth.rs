//! Who a console request comes from, and what they may do.
//!
//! Identity, in this order: a trusted proxy's header (only when
//! `console.proxy_user_header` names one), a bearer token (`Authorization`,
//! or the login form's HttpOnly cookie holding one) among `console.tokens`,
//! else `[mcp.auth]`'s tokens and JWTs when `console.mcp_auth`. The role is
//! `console.roles`' entry for the principal's name; without one, nothing.
//!
//! Forms are CSRF-safe twice over: a double-submitted token (a random
//! SameSite=Strict cookie whose value every form carries back) and, when the
//! browser sends one, an `Origin` that must be the console's own.

use crate::config::{ConsoleConfig, ConsoleRole, McpConfig};
use crate::mcp::auth::Authorizer;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use subtle::ConstantTimeEq;
use thiserror::Error;

/// The login cookie: a bearer token, HttpOnly, SameSite=Strict.
pub const TOKEN_COOKIE: &str = "stepgate_console_token";
/// The double-submit CSRF cookie.
pub const CSRF_COOKIE: &str = "stepgate_console_csrf";

#[derive(Debug, Error)]
pub enum ConsoleAuthError {
    #[error("`console.tokens` `{name}`: {message}")]
    Token { name: String, message: String },
    #[error("`[mcp.auth]` for the console")]
    Mcp(#[from] crate::mcp::auth::AuthSetupError),
    #[error("`console.mcp_auth` is set but `[mcp.auth]` configures neither tokens nor an issuer")]
    NoMcpAuth,
}

/// A signed-in person.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Person {
    pub name: String,
    pub role: Option<ConsoleRole>,
}

impl Person {
    pub fn may(&self, needed: ConsoleRole) -> bool {
        self.role.is_some_and(|r| r >= needed)
    }
}

/// Why a request has no person.
#[derive(Debug, PartialEq, Eq)]
pub enum Unknown {
    /// Nothing names anyone: the login form.
    Anonymous,
    /// A token was presented and is not one this console accepts.
    BadToken(String),
}

pub struct Identities {
    /// SHA-256 of each console token, with its principal.
    tokens: Vec<([u8; 32], String)>,
    mcp: Option<Authorizer>,
    proxy_header: Option<String>,
    roles: BTreeMap<String, ConsoleRole>,
    /// Every token's value, for the redaction of pages.
    pub secrets: Vec<String>,
}

impl Identities {
    pub fn new(
        console: &ConsoleConfig,
        mcp: &McpConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Identities, ConsoleAuthError> {
        let mut tokens = Vec::new();
        let mut secrets = Vec::new();
        for t in &console.tokens {
            let mut spec = t.token.clone();
            spec.resolve(env)
                .map_err(|message| ConsoleAuthError::Token {
                    name: t.name.clone(),
                    message,
                })?;
            let value = spec.value().unwrap_or_default().trim().to_owned();
            if value.len() < 16 {
                return Err(ConsoleAuthError::Token {
                    name: t.name.clone(),
                    message: "the token must be at least 16 characters".into(),
                });
            }
            tokens.push((Sha256::digest(value.as_bytes()).into(), t.name.clone()));
            secrets.push(value);
        }
        let mcp = if console.mcp_auth {
            let resource = mcp.resource.clone().unwrap_or_default();
            Some(Authorizer::new(&mcp.auth, &resource, env)?.ok_or(ConsoleAuthError::NoMcpAuth)?)
        } else {
            None
        };
        Ok(Identities {
            tokens,
            mcp,
            proxy_header: console.proxy_user_header.clone(),
            roles: console.roles.clone(),
            secrets,
        })
    }

    fn person(&self, name: String) -> Person {
        let role = self.roles.get(&name).copied();
        Person { name, role }
    }

    /// The principal a bearer token names.
    pub async fn by_token(&self, token: &str) -> Result<Person, Unknown> {
        let token = token.trim();
        if token.is_empty() {
            return Err(Unknown::Anonymous);
        }
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        // Every entry compared, in constant time.
        for (d, name) in &self.tokens {
            if bool::from(d[..].ct_eq(&digest[..])) {
                found = Some(name.clone());
            }
        }
        if let Some(name) = found {
            return Ok(self.person(name));
        }
        match &self.mcp {
            Some(a) => a
                .authorize(Some(&format!("Bearer {token}")))
                .await
                .map(|p| self.person(p.name))
                .map_err(|e| Unknown::BadToken(e.to_string())),
            None => Err(Unknown::BadToken("the token is not known here".into())),
        }
    }

    /// Who sent a request.
    pub async fn identify(&self, headers: &HeaderMap) -> Result<Person, Unknown> {
        if let Some(h) = &self.proxy_header
            && let Some(v) = headers.get(h.as_str()).and_then(|v| v.to_str().ok())
            && !v.trim().is_empty()
        {
            return Ok(self.person(v.trim().to_owned()));
        }
        if let Some(auth) = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        {
            return match auth.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                    self.by_token(token).await
                }
                _ => Err(Unknown::BadToken(
                    "the Authorization header must be `Bearer <token>`".into(),
                )),
            };
        }
        match cookie(headers, TOKEN_COOKIE) {
            Some(token) => self.by_token(&token).await,
            None => Err(Unknown::Anonymous),
        }
    }
}

/// A cookie's value.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// A new random CSRF token (hex).
pub fn new_csrf() -> String {
    let mut b = [0u8; 32];
    // The OS's randomness; without it no form could be trusted.
    getrandom::fill(&mut b).expect("the OS's random numbers");
    crate::contract::hex(&b)
}

/// Whether a form's CSRF token matches its cookie, and the request's
/// `Origin` (when the browser sent one) is the console's own (`Host`).
pub fn form_allowed(headers: &HeaderMap, form_csrf: &str) -> bool {
    let Some(cookie) = cookie(headers, CSRF_COOKIE) else {
        return false;
    };
    if cookie.len() < 32 || !bool::from(cookie.as_bytes().ct_eq(form_csrf.as_bytes())) {
        return false;
    }
    match headers
        .get(axum::http::header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    {
        None => true,
        Some(origin) => {
            let host = headers
                .get(axum::http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let origin_host = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                .unwrap_or_default();
            !host.is_empty() && origin_host == host
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_form_needs_its_cookie_and_the_console_s_origin() {
        let t = "a".repeat(64);
        let c = format!("{CSRF_COOKIE}={t}");
        let ok = headers(&[("cookie", &c), ("host", "127.0.0.1:9470")]);
        assert!(form_allowed(&ok, &t));
        assert!(!form_allowed(&ok, &"b".repeat(64)), "another token");
        assert!(!form_allowed(&headers(&[("host", "h")]), &t), "no cookie");
        let same = headers(&[
            ("cookie", &c),
            ("host", "127.0.0.1:9470"),
            ("origin", "http://127.0.0.1:9470"),
        ]);
        assert!(form_allowed(&same, &t));
        let cross = headers(&[
            ("cookie", &c),
            ("host", "127.0.0.1:9470"),
            ("origin", "http://evil.example"),
        ]);
        assert!(!form_allowed(&cross, &t), "another site's form");
    }

    #[tokio::test]
    async fn roles_come_from_the_config_and_the_proxy_header_only_when_named() {
        let console: ConsoleConfig = toml::from_str(
            r#"
proxy_user_header = "X-Forwarded-User"
roles = { alice = "approver", bob = "viewer" }
tokens = [{ name = "alice", token = "alice-token-0123456789" }]
"#,
        )
        .unwrap();
        let ids = Identities::new(&console, &McpConfig::default(), &|_| None).unwrap();
        let alice = ids
            .identify(&headers(&[(
                "authorization",
                "Bearer alice-token-0123456789",
            )]))
            .await
            .unwrap();
        assert!(alice.may(ConsoleRole::Approver) && !alice.may(ConsoleRole::Operator));
        let bob = ids
            .identify(&headers(&[("x-forwarded-user", "bob")]))
            .await
            .unwrap();
        assert!(bob.may(ConsoleRole::Viewer) && !bob.may(ConsoleRole::Approver));
        let eve = ids
            .identify(&headers(&[("x-forwarded-user", "eve")]))
            .await
            .unwrap();
        assert!(!eve.may(ConsoleRole::Viewer), "no role, nothing");
        assert!(matches!(
            ids.identify(&headers(&[(
                "authorization",
                "Bearer wrong-token-0123456789"
            )]))
            .await,
            Err(Unknown::BadToken(_))
        ));
        // With `mcp_auth`, the MCP front's tokens name principals too.
        let mcp: McpConfig = toml::from_str(
            r#"
[auth]
scopes = { all = ["*"] }
tokens = [{ name = "bot", token = "mcp-bot-token-0123456789", scopes = ["all"] }]
"#,
        )
        .unwrap();
        let with_mcp = ConsoleConfig {
            mcp_auth: true,
            roles: [("bot".to_owned(), ConsoleRole::Viewer)].into(),
            ..console.clone()
        };
        let ids = Identities::new(&with_mcp, &mcp, &|_| None).unwrap();
        let bot = ids
            .identify(&headers(&[(
                "authorization",
                "Bearer mcp-bot-token-0123456789",
            )]))
            .await
            .unwrap();
        assert_eq!(
            (bot.name.as_str(), bot.role),
            ("bot", Some(ConsoleRole::Viewer))
        );
        assert!(
            Identities::new(&with_mcp, &McpConfig::default(), &|_| None).is_err(),
            "mcp_auth without [mcp.auth]"
        );
        // Without the setting, the header names no one.
        let plain = ConsoleConfig {
            proxy_user_header: None,
            ..console
        };
        let ids = Identities::new(&plain, &McpConfig::default(), &|_| None).unwrap();
        assert_eq!(
            ids.identify(&headers(&[("x-forwarded-user", "bob")])).await,
            Err(Unknown::Anonymous)
        );
    }
}
