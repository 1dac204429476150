//! Who a console request comes from, and what they may do.
//!
//! Identity, in this order:
//! 1. a trusted proxy's header — only when `console.proxy_user_header` names
//!    one, and only from `console.trusted_proxies` (the guard in front of
//!    every route refuses the header from any other peer, and twice);
//! 2. a bearer token (`Authorization`) among `console.tokens`, or — with
//!    `console.mcp_auth` — an `[mcp.auth]` token or JWT **granted the
//!    console** (the scope [`CONSOLE_SCOPE`], and a JWT issued for
//!    `console.resource`), named `token:<name>` / `jwt:<sub>` as the MCP front
//!    names its principals, so an agent's token is never a person's login by
//!    accident;
//! 3. the login form's session cookie: signed ([`Signer`]), naming the
//!    principal and when it ends — never the token itself.
//!
//! The role is `console.roles`' entry for the principal's name; without one,
//! nothing. Forms carry a CSRF token derived from a random cookie of the
//! console's and the signed-in principal (an attacker who can plant a cookie
//! still cannot compute the token), and a browser's `Origin` must be the
//! console's own.

use crate::config::{CONSOLE_SCOPE, ConsoleConfig, ConsoleRole, McpConfig, PeerNet};
use crate::mcp::auth::Authorizer;
use axum::http::{HeaderMap, HeaderValue, header};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use subtle::ConstantTimeEq;
use thiserror::Error;

/// The signed session cookie of the login form (`__Host-` over https).
pub const SESSION_COOKIE: &str = "stepgate_console_session";
/// The random cookie the forms' CSRF tokens are derived from.
pub const CSRF_COOKIE: &str = "stepgate_console_csrf";
/// Every cookie of the console's: a request carrying one of them twice is
/// refused (a planted cookie must not shadow the console's own).
pub const COOKIES: [&str; 2] = [SESSION_COOKIE, CSRF_COOKIE];
/// How long a login lasts (a JWT's own expiry when sooner).
pub const SESSION_SECS: i64 = 12 * 3600;

#[derive(Debug, Error)]
pub enum ConsoleAuthError {
    #[error("`console.tokens` `{name}`: {message}")]
    Token { name: String, message: String },
    #[error("`[mcp.auth]` for the console")]
    Mcp(#[from] crate::mcp::auth::AuthSetupError),
    #[error("`console.mcp_auth` is set but `[mcp.auth]` configures neither tokens nor an issuer")]
    NoMcpAuth,
    #[error(
        "`console.mcp_auth` with `[mcp.auth]`'s issuer needs `console.resource`: the console's own audience, which JWTs for people must be issued for (an agent's token, issued for `mcp.resource`, is then no console login)"
    )]
    NoResource,
    #[error(
        "`console.resource` is `mcp.resource`: the agents' tokens would be console logins; give the console an audience of its own (its URL)"
    )]
    SharedResource,
    #[error("`console.session_key`: {0}")]
    SessionKey(String),
}

/// A signed-in person (or a principal acting as one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Person {
    /// What `console.roles` keys and decisions record: a console token's or a
    /// proxy user's name as configured, or `token:<name>` / `jwt:<sub>`.
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
    /// A token (or session) was presented and is not one this console accepts.
    BadToken(String),
}

/// What the guard in front of every route learnt about a request's peer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Peer {
    pub addr: Option<SocketAddr>,
    /// A trusted proxy: its user header and `X-Forwarded-Proto` count.
    pub trusted: bool,
    /// Served over https (a trusted proxy said so): cookies are `Secure` and
    /// `__Host-` named.
    pub https: bool,
}

impl Peer {
    pub fn of(addr: Option<SocketAddr>, headers: &HeaderMap, trusted: &[PeerNet]) -> Peer {
        let is_trusted = addr.is_some_and(|a| trusted.iter().any(|n| n.contains(a.ip())));
        let https = is_trusted
            && headers
                .get("x-forwarded-proto")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| {
                    v.split(',')
                        .next()
                        .is_some_and(|p| p.trim().eq_ignore_ascii_case("https"))
                });
        Peer {
            addr,
            trusted: is_trusted,
            https,
        }
    }

    /// A cookie's name on this request: `__Host-` prefixed over https.
    pub fn cookie_name(&self, base: &str) -> String {
        if self.https {
            format!("__Host-{base}")
        } else {
            base.to_owned()
        }
    }

    /// A `Set-Cookie` value: HttpOnly, SameSite=Strict, the whole site, and
    /// `Secure` over https. `max_age` 0 deletes it.
    pub fn set_cookie(&self, base: &str, value: &str, max_age: i64) -> Option<HeaderValue> {
        let secure = if self.https { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}",
            self.cookie_name(base)
        ))
        .ok()
    }

    /// The value of one of the console's cookies on this request.
    pub fn cookie(&self, headers: &HeaderMap, base: &str) -> Option<String> {
        cookie(headers, &self.cookie_name(base))
    }
}

/// HMAC-SHA-256 (RFC 2104) over the console's key: sessions, CSRF tokens and
/// notices are signed by it, so none can be made by anyone else.
pub struct Signer {
    key: [u8; 32],
}

impl Signer {
    /// From a configured key (any length: it is hashed), or a random one.
    pub fn new(configured: Option<&str>) -> Signer {
        let key = match configured {
            Some(k) => Sha256::digest(k.as_bytes()).into(),
            None => {
                let mut b = [0u8; 32];
                // The OS's randomness; without it nothing could be signed.
                getrandom::fill(&mut b).expect("the OS's random numbers");
                b
            }
        };
        Signer { key }
    }

    fn mac(&self, purpose: &str, msg: &[u8]) -> [u8; 32] {
        // The purpose keeps a signature of one kind from passing as another's.
        let mut m = Vec::with_capacity(purpose.len() + 1 + msg.len());
        m.extend_from_slice(purpose.as_bytes());
        m.push(0);
        m.extend_from_slice(msg);
        hmac_sha256(&self.key, &m)
    }

    /// `msg`'s signature for `purpose`, hex.
    pub fn sign(&self, purpose: &str, msg: &[u8]) -> String {
        crate::contract::hex(&self.mac(purpose, msg))
    }

    /// Whether `sig` (hex) is `msg`'s signature for `purpose`, compared in
    /// constant time.
    pub fn verify(&self, purpose: &str, msg: &[u8], sig: &str) -> bool {
        let want = self.sign(purpose, msg);
        want.len() == sig.len() && bool::from(want.as_bytes().ct_eq(sig.as_bytes()))
    }

    /// A value and its signature, `<hex value>.<signature>`: what a cookie
    /// or a link carries.
    pub fn seal(&self, purpose: &str, value: &[u8]) -> String {
        format!(
            "{}.{}",
            crate::contract::hex(value),
            self.sign(purpose, value)
        )
    }

    /// The value of a [`Signer::seal`], if its signature holds.
    pub fn open(&self, purpose: &str, sealed: &str) -> Option<Vec<u8>> {
        let (value, sig) = sealed.split_once('.')?;
        let value = unhex(value)?;
        self.verify(purpose, &value, sig).then_some(value)
    }
}

/// HMAC-SHA-256 with a key of 32 bytes.
fn hmac_sha256(key: &[u8; 32], msg: &[u8]) -> [u8; 32] {
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for (i, k) in key.iter().enumerate() {
        ipad[i] ^= k;
        opad[i] ^= k;
    }
    let mut inner = Sha256::new();
    inner.update(ipad);
    inner.update(msg);
    let inner: [u8; 32] = inner.finalize().into();
    let mut outer = Sha256::new();
    outer.update(opad);
    outer.update(inner);
    outer.finalize().into()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What the session cookie holds (signed).
#[derive(Debug, Serialize, Deserialize)]
struct Session {
    /// The principal.
    p: String,
    /// For a console token: the start of its SHA-256, so that a changed or
    /// removed token ends its sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    t: Option<String>,
    /// When it ends (seconds since the epoch).
    e: i64,
}

pub struct Identities {
    /// SHA-256 of each console token, with its principal.
    tokens: Vec<([u8; 32], String)>,
    mcp: Option<Authorizer>,
    proxy_header: Option<String>,
    roles: BTreeMap<String, ConsoleRole>,
    pub signer: Signer,
    /// Whether `console.session_key` is configured (else a random key).
    pub shared_key: bool,
    /// Every token's and key's value, for the redaction of pages.
    pub secrets: Vec<String>,
}

impl Identities {
    /// Every check `stepgate console` makes of its identities before it
    /// serves (`stepgate check-config` makes the same).
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
            if mcp.auth.issuer.is_some() {
                match &console.resource {
                    None => return Err(ConsoleAuthError::NoResource),
                    Some(r)
                        if mcp.resource.as_deref().map(|m| m.trim_end_matches('/'))
                            == Some(r.trim_end_matches('/')) =>
                    {
                        return Err(ConsoleAuthError::SharedResource);
                    }
                    Some(_) => {}
                }
            }
            // JWTs are checked against the console's own audience.
            let resource = console.resource.clone().unwrap_or_default();
            Some(Authorizer::new(&mcp.auth, &resource, env)?.ok_or(ConsoleAuthError::NoMcpAuth)?)
        } else {
            None
        };
        let key = match &console.session_key {
            None => None,
            Some(k) => {
                let mut spec = k.clone();
                spec.resolve(env).map_err(ConsoleAuthError::SessionKey)?;
                let v = spec.value().unwrap_or_default().trim().to_owned();
                if v.len() < 32 {
                    return Err(ConsoleAuthError::SessionKey(
                        "must be at least 32 characters".into(),
                    ));
                }
                secrets.push(v.clone());
                Some(v)
            }
        };
        Ok(Identities {
            tokens,
            mcp,
            proxy_header: console.proxy_user_header.clone(),
            roles: console.roles.clone(),
            signer: Signer::new(key.as_deref()),
            shared_key: key.is_some(),
            secrets,
        })
    }

    fn person(&self, name: String) -> Person {
        let role = self.roles.get(&name).copied();
        Person { name, role }
    }

    /// The principal a bearer token names, and when a session of it must end.
    pub async fn by_token(&self, token: &str) -> Result<(Person, i64), Unknown> {
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
        let ends = chrono::Utc::now().timestamp() + SESSION_SECS;
        if let Some(name) = found {
            return Ok((self.person(name), ends));
        }
        let Some(a) = &self.mcp else {
            return Err(Unknown::BadToken("the token is not known here".into()));
        };
        let p = a
            .authorize(Some(&format!("Bearer {token}")))
            .await
            .map_err(|e| Unknown::BadToken(e.to_string()))?;
        if !p.scopes.iter().any(|s| s == CONSOLE_SCOPE) {
            return Err(Unknown::BadToken(format!(
                "this token is accepted by the MCP front but not granted the console: it needs the scope `{CONSOLE_SCOPE}` (an agent's token is not a person's login)"
            )));
        }
        Ok((
            self.person(p.key()),
            jwt_expiry(token).map_or(ends, |e| e.min(ends)),
        ))
    }

    /// Who sent a request. The guard has already refused a proxy header from
    /// an untrusted peer, or sent twice.
    pub async fn identify(&self, headers: &HeaderMap, peer: &Peer) -> Result<Person, Unknown> {
        if let Some(h) = &self.proxy_header
            && peer.trusted
            && let Some(v) = headers.get(h.as_str()).and_then(|v| v.to_str().ok())
            && !v.trim().is_empty()
        {
            return Ok(self.person(v.trim().to_owned()));
        }
        if let Some(auth) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        {
            return match auth.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                    self.by_token(token).await.map(|(p, _)| p)
                }
                _ => Err(Unknown::BadToken(
                    "the Authorization header must be `Bearer <token>`".into(),
                )),
            };
        }
        match peer.cookie(headers, SESSION_COOKIE) {
            Some(s) => self.session(&s),
            None => Err(Unknown::Anonymous),
        }
    }

    /// A new session cookie's value for `person`, ending at `ends` (seconds).
    pub fn new_session(&self, person: &Person, token: &str, ends: i64) -> String {
        let digest: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        let console_token = self.tokens.iter().any(|(d, _)| *d == digest);
        let s = Session {
            p: person.name.clone(),
            t: console_token.then(|| crate::contract::hex(&digest[..8])),
            e: ends,
        };
        self.signer.seal(
            "session",
            serde_json::to_string(&s).unwrap_or_default().as_bytes(),
        )
    }

    /// The person of a session cookie, while it is signed, unexpired, and its
    /// console token is still configured.
    fn session(&self, cookie: &str) -> Result<Person, Unknown> {
        let expired = || Unknown::BadToken("your session has ended: sign in again".into());
        let s: Session = self
            .signer
            .open("session", cookie)
            .and_then(|v| serde_json::from_slice(&v).ok())
            .ok_or_else(expired)?;
        if s.e <= chrono::Utc::now().timestamp() {
            return Err(expired());
        }
        if let Some(t) = &s.t
            && !self
                .tokens
                .iter()
                .any(|(d, name)| *name == s.p && crate::contract::hex(&d[..8]) == *t)
        {
            return Err(expired());
        }
        Ok(self.person(s.p))
    }

    /// The CSRF token of forms for `principal` (`""` before signing in), from
    /// the request's CSRF cookie `nonce`.
    pub fn csrf_token(&self, nonce: &str, principal: &str) -> String {
        self.signer
            .sign("csrf", format!("{nonce}\0{principal}").as_bytes())
    }

    /// Whether a form's CSRF token is the one for its cookie and `principal`,
    /// and the request's `Origin` (when the browser sent one) is the
    /// console's own (`Host`).
    pub fn form_allowed(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
        principal: &str,
        form_csrf: &str,
    ) -> bool {
        let Some(nonce) = peer.cookie(headers, CSRF_COOKIE).filter(|c| c.len() >= 32) else {
            return false;
        };
        let want = self.csrf_token(&nonce, principal);
        if want.len() != form_csrf.len() || !bool::from(want.as_bytes().ct_eq(form_csrf.as_bytes()))
        {
            return false;
        }
        match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
            None => true,
            Some(origin) => {
                let host = headers
                    .get(header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                let origin_host = origin
                    .strip_prefix("http://")
                    .or_else(|| origin.strip_prefix("https://"))
                    .unwrap_or_default();
                !host.is_empty() && origin_host.eq_ignore_ascii_case(host)
            }
        }
    }
}

/// A JWT's `exp` (it has been verified by then), to end a session with it.
fn jwt_expiry(token: &str) -> Option<i64> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64_url(payload)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v.get("exp")?.as_i64()
}

/// Unpadded base64url, as JWTs are written.
fn base64_url(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// A cookie's value (the guard has refused a request carrying one of the
/// console's cookies twice).
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    cookie_values(headers, name).into_iter().next()
}

/// Every value the request's cookies give `name`.
pub fn cookie_values(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
        .collect()
}

/// A new random CSRF nonce (hex).
pub fn new_nonce() -> String {
    let mut b = [0u8; 32];
    // The OS's randomness; without it no form could be trusted.
    getrandom::fill(&mut b).expect("the OS's random numbers");
    crate::contract::hex(&b)
}

/// Whether `ip` is in `nets`.
pub fn trusted(ip: IpAddr, nets: &[PeerNet]) -> bool {
    nets.iter().any(|n| n.contains(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // Test case 2: key "Jefe" (zero-padded, as HMAC pads it).
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        assert_eq!(
            crate::contract::hex(&hmac_sha256(&key, b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Seal and open: a changed value or signature does not open.
        let s = Signer { key };
        let sealed = s.seal("notice", b"hello");
        assert_eq!(s.open("notice", &sealed).as_deref(), Some(&b"hello"[..]));
        assert!(s.open("session", &sealed).is_none(), "another purpose");
        let tampered = sealed.replacen("68", "69", 1);
        assert!(s.open("notice", &tampered).is_none());
    }

    #[test]
    fn peers_are_trusted_by_network_and_cookies_follow_the_scheme() {
        let nets = vec![PeerNet::parse("10.0.0.0/24").unwrap()];
        let https = headers(&[("x-forwarded-proto", "https")]);
        let p = Peer::of(Some("10.0.0.7:5000".parse().unwrap()), &https, &nets);
        assert!(p.trusted && p.https);
        assert_eq!(
            p.cookie_name(SESSION_COOKIE),
            "__Host-stepgate_console_session"
        );
        let v = p.set_cookie(CSRF_COOKIE, "x", 60).unwrap();
        assert!(v.to_str().unwrap().ends_with("Secure"), "{v:?}");
        // Anyone else's X-Forwarded-Proto counts for nothing.
        let p = Peer::of(Some("10.0.1.7:5000".parse().unwrap()), &https, &nets);
        assert!(!p.trusted && !p.https);
        assert!(
            !p.set_cookie(CSRF_COOKIE, "x", 60)
                .unwrap()
                .to_str()
                .unwrap()
                .contains("Secure")
        );
    }

    #[tokio::test]
    async fn an_mcp_token_is_a_console_login_only_when_granted_the_console() {
        let console: ConsoleConfig = toml::from_str(
            r#"
mcp_auth = true
roles = { "token:bot" = "approver", "token:alice" = "approver", bot = "operator" }
"#,
        )
        .unwrap();
        let mcp: McpConfig = toml::from_str(
            r#"
[auth]
scopes = { all = ["*"], "stepgate:console" = [] }
tokens = [
  { name = "bot", token = "mcp-bot-token-0123456789", scopes = ["all"] },
  { name = "alice", token = "mcp-alice-token-0123456789", scopes = ["stepgate:console"] },
]
"#,
        )
        .unwrap();
        let ids = Identities::new(&console, &mcp, &|_| None).unwrap();
        let peer = Peer::default();
        let bearer = |t: &str| headers(&[("authorization", &format!("Bearer {t}"))]);
        assert!(matches!(
            ids.identify(&bearer("mcp-bot-token-0123456789"), &peer).await,
            Err(Unknown::BadToken(m)) if m.contains("stepgate:console")
        ));
        let alice = ids
            .identify(&bearer("mcp-alice-token-0123456789"), &peer)
            .await
            .unwrap();
        assert_eq!(
            (alice.name.as_str(), alice.role),
            ("token:alice", Some(ConsoleRole::Approver))
        );
    }

    #[tokio::test]
    async fn sessions_are_signed_and_end_with_their_token() {
        let console: ConsoleConfig = toml::from_str(
            r#"
roles = { alice = "approver" }
tokens = [{ name = "alice", token = "alice-token-0123456789" }]
"#,
        )
        .unwrap();
        let ids = Identities::new(&console, &McpConfig::default(), &|_| None).unwrap();
        let (alice, ends) = ids.by_token("alice-token-0123456789").await.unwrap();
        let cookie = ids.new_session(&alice, "alice-token-0123456789", ends);
        assert!(!cookie.contains("alice-token"), "never the token itself");
        let peer = Peer::default();
        let with = |c: &str| headers(&[("cookie", &format!("{SESSION_COOKIE}={c}"))]);
        assert_eq!(ids.identify(&with(&cookie), &peer).await.unwrap(), alice);
        // Forged: another name under the same signature.
        let (v, sig) = cookie.split_once('.').unwrap();
        let forged = String::from_utf8(unhex(v).unwrap())
            .unwrap()
            .replace("alice", "carol");
        let forged = format!("{}.{sig}", crate::contract::hex(forged.as_bytes()));
        assert!(ids.identify(&with(&forged), &peer).await.is_err());
        // The token rotated: its sessions end.
        let rotated: ConsoleConfig = toml::from_str(
            r#"
roles = { alice = "approver" }
tokens = [{ name = "alice", token = "alice-token-rotated-0123" }]
"#,
        )
        .unwrap();
        let mut ids2 = Identities::new(&rotated, &McpConfig::default(), &|_| None).unwrap();
        ids2.signer = Signer {
            key: ids.signer.key,
        };
        assert!(ids2.identify(&with(&cookie), &peer).await.is_err());
    }

    #[test]
    fn a_form_needs_its_derived_token_and_the_console_s_origin() {
        let ids =
            Identities::new(&ConsoleConfig::default(), &McpConfig::default(), &|_| None).unwrap();
        let nonce = "a".repeat(64);
        let c = format!("{CSRF_COOKIE}={nonce}");
        let t = ids.csrf_token(&nonce, "alice");
        let peer = Peer::default();
        let ok = headers(&[("cookie", &c), ("host", "127.0.0.1:9470")]);
        assert!(ids.form_allowed(&ok, &peer, "alice", &t));
        assert!(
            !ids.form_allowed(&ok, &peer, "mallory", &t),
            "another principal"
        );
        assert!(
            !ids.form_allowed(&ok, &peer, "alice", &nonce),
            "the nonce itself"
        );
        let cross = headers(&[
            ("cookie", &c),
            ("host", "127.0.0.1:9470"),
            ("origin", "http://evil.example"),
        ]);
        assert!(
            !ids.form_allowed(&cross, &peer, "alice", &t),
            "another site's form"
        );
    }
}
