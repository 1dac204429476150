//! Who is calling `stepgate mcp` over HTTP, as the MCP specification has an
//! HTTP server authorize: an OAuth 2.1 resource server. A bearer token is a
//! JWT of the configured issuer — signature checked against the issuer's JWK
//! Set, `iss`, `exp` and `aud` checked, the audience being this front's own
//! URL (RFC 8707) — or one of the static tokens, compared in constant time.
//! The token becomes a [`Principal`]: a name, the tools its scopes grant, and
//! the workflow-id namespace it may name. The token itself goes no further: a
//! principal holds no credential, and nothing the front sends on carries one.

use crate::config::{HeaderSpec, JWT_NAMESPACE_ROOT, McpAuthConfig, McpStaticToken};
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use thiserror::Error;

/// The shortest time between two fetches of the JWK Set for a key it did not
/// have: a token naming made-up keys must not make the front hammer the issuer.
const MIN_REFETCH: Duration = Duration::from_secs(10);
/// How long one fetch of the JWK Set may take.
const JWKS_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest JWK Set read.
const MAX_JWKS_BYTES: usize = 256 * 1024;

/// A caller of the front, as its token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's `sub` (or `client_id`), or the static token's name.
    pub name: String,
    /// What limits and sessions are counted by: the name, and which kind of
    /// token it came from (a static token and a JWT subject may share a name).
    key: String,
    /// The workflow ids it may name start with this (`""`: any).
    pub namespace: String,
    tools: ToolGrant,
    /// The scopes it holds, for the record.
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ToolGrant {
    All,
    Only(BTreeSet<String>),
}

impl Principal {
    /// The caller when no authorization is configured (loopback only, or
    /// `--insecure-no-auth`): every tool, every workflow.
    pub fn anonymous() -> Principal {
        Principal {
            name: "anonymous".into(),
            key: "anonymous".into(),
            namespace: String::new(),
            tools: ToolGrant::All,
            scopes: Vec::new(),
        }
    }

    /// What limits and sessions are counted by.
    pub fn key(&self) -> String {
        self.key.clone()
    }

    /// Who sent a call, as the intent's `metadata` records it under
    /// [`PRINCIPAL_METADATA`]: `token:<name>` or `jwt:<sub>`; `None` when no
    /// authorization is configured (anyone who reaches the front).
    pub fn sender(&self) -> Option<&str> {
        (self.key != Principal::anonymous().key).then_some(self.key.as_str())
    }

    pub fn may_call(&self, tool: &str) -> bool {
        match &self.tools {
            ToolGrant::All => true,
            ToolGrant::Only(tools) => tools.contains(tool),
        }
    }

    pub fn may_name(&self, workflow_id: &str) -> bool {
        workflow_id.starts_with(&self.namespace)
    }
}

/// The intent `metadata` key naming the principal that sent a call through
/// the front (its [`Principal::sender`]); whatever the caller put there is
/// replaced. The console reads it to refuse self-approval.
pub const PRINCIPAL_METADATA: &str = "stepgate.principal";

/// Why a request is not authorized; each says which answer it gets.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    /// 401, a challenge without an error: the client should get a token.
    #[error("this MCP server needs a bearer token")]
    Missing,
    /// 401 `invalid_token`: the token is not one this front accepts.
    #[error("{0}")]
    InvalidToken(String),
    /// 503: the issuer's keys could not be had, so no token can be checked.
    #[error("the authorization server's signing keys cannot be fetched: {0}")]
    KeysUnavailable(String),
}

/// A configured static token: its SHA-256 (compared in constant time: equal
/// length whatever was presented) and what it grants.
struct StaticEntry {
    digest: [u8; 32],
    name: String,
    scopes: Vec<String>,
    namespace: String,
}

/// Checks bearer tokens; one per front.
pub struct Authorizer {
    statics: Vec<StaticEntry>,
    jwt: Option<JwtVerifier>,
    /// Scope → tools, as configured.
    scopes: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Error)]
pub enum AuthSetupError {
    #[error("`mcp.auth.tokens` `{name}`: {message}")]
    Token { name: String, message: String },
    #[error("`mcp.auth.algorithms`: `{0}` is not a JWS algorithm")]
    Algorithm(String),
    #[error("the HTTP client for the JWK Set")]
    Http(#[source] reqwest::Error),
}

impl Authorizer {
    /// `None` when no authorization is configured. `resource` is the audience
    /// JWTs must carry; `env` reads the static tokens' `env:` sources.
    pub fn new(
        config: &McpAuthConfig,
        resource: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Authorizer>, AuthSetupError> {
        if !config.enabled() {
            return Ok(None);
        }
        let statics = config
            .tokens
            .iter()
            .map(|t| static_entry(t, env))
            .collect::<Result<_, _>>()?;
        let jwt = match (&config.issuer, &config.jwks_url) {
            (Some(issuer), Some(jwks_url)) => {
                let mut algorithms = Vec::new();
                for a in &config.algorithms {
                    algorithms.push(
                        Algorithm::from_str(a)
                            .ok()
                            .filter(|a| a.family() != AlgorithmFamily::Hmac)
                            .ok_or_else(|| AuthSetupError::Algorithm(a.clone()))?,
                    );
                }
                Some(JwtVerifier {
                    issuer: issuer.clone(),
                    audience: resource.to_owned(),
                    algorithms,
                    leeway: config.leeway.0.as_secs(),
                    namespace_claim: config.namespace_claim.clone(),
                    keys: Jwks::new(jwks_url, config.jwks_refresh.0, config.jwks_max_stale.0)?,
                })
            }
            _ => None,
        };
        Ok(Some(Authorizer {
            statics,
            jwt,
            scopes: config.scopes.clone(),
        }))
    }

    /// Fetch the issuer's keys now (at start), so the first call does not wait
    /// for them; a failure is logged, and the keys are fetched again when needed.
    pub async fn warm_up(&self) {
        if let Some(jwt) = &self.jwt
            && let Err(e) = {
                *jwt.keys.attempted.lock().expect("jwks attempt lock") = Some(Instant::now());
                jwt.keys.refresh().await
            }
        {
            tracing::warn!(error = %e, "cannot fetch the MCP authorization server's JWK Set yet");
        }
    }

    /// Every scope that grants something, for the metadata's `scopes_supported`.
    pub fn scopes_supported(&self) -> Vec<String> {
        self.scopes.keys().cloned().collect()
    }

    /// The scopes that grant `tool`, for an `insufficient_scope` challenge.
    pub fn scopes_granting(&self, tool: &str) -> Vec<String> {
        self.scopes
            .iter()
            .filter(|(_, tools)| tools.iter().any(|t| t == "*" || t == tool))
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// The principal of an `Authorization` header's value.
    pub async fn authorize(&self, authorization: Option<&str>) -> Result<Principal, AuthError> {
        let Some(header) = authorization else {
            return Err(AuthError::Missing);
        };
        let token = match header.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            _ => {
                return Err(AuthError::InvalidToken(
                    "the Authorization header must be `Bearer <token>`".into(),
                ));
            }
        };
        if token.is_empty() {
            return Err(AuthError::Missing);
        }
        if let Some(entry) = self.static_match(token) {
            return Ok(self.principal(
                format!("token:{}", entry.name),
                entry.name.clone(),
                entry.namespace.clone(),
                entry.scopes.clone(),
            ));
        }
        match &self.jwt {
            Some(jwt) => {
                let (name, namespace, scopes) = jwt.verify(token).await?;
                Ok(self.principal(format!("jwt:{name}"), name, namespace, scopes))
            }
            None => Err(AuthError::InvalidToken(
                "the token is not known here".into(),
            )),
        }
    }

    /// The static token `token` is, compared with every one in constant time.
    fn static_match(&self, token: &str) -> Option<&StaticEntry> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for entry in &self.statics {
            if bool::from(entry.digest[..].ct_eq(&digest[..])) {
                found = Some(entry);
            }
        }
        found
    }

    fn principal(
        &self,
        key: String,
        name: String,
        namespace: String,
        scopes: Vec<String>,
    ) -> Principal {
        let mut tools = BTreeSet::new();
        let mut all = false;
        for scope in &scopes {
            for tool in self.scopes.get(scope).into_iter().flatten() {
                if tool == "*" {
                    all = true;
                } else {
                    tools.insert(tool.clone());
                }
            }
        }
        Principal {
            name,
            key,
            namespace,
            tools: if all {
                ToolGrant::All
            } else {
                ToolGrant::Only(tools)
            },
            scopes,
        }
    }
}

fn static_entry(
    t: &McpStaticToken,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StaticEntry, AuthSetupError> {
    let mut spec: HeaderSpec = t.token.clone();
    spec.resolve(env).map_err(|message| AuthSetupError::Token {
        name: t.name.clone(),
        message,
    })?;
    let value = spec.value().unwrap_or_default().trim();
    if value.len() < 16 {
        return Err(AuthSetupError::Token {
            name: t.name.clone(),
            message: "the token must be at least 16 characters".into(),
        });
    }
    Ok(StaticEntry {
        digest: Sha256::digest(value.as_bytes()).into(),
        name: t.name.clone(),
        scopes: t.scopes.clone(),
        namespace: t.namespace(),
    })
}

/// Checks JWTs of one issuer for one audience.
struct JwtVerifier {
    issuer: String,
    audience: String,
    algorithms: Vec<Algorithm>,
    leeway: u64,
    namespace_claim: String,
    keys: Jwks,
}

impl JwtVerifier {
    /// The token's principal: (name, namespace, scopes).
    async fn verify(&self, token: &str) -> Result<(String, String, Vec<String>), AuthError> {
        let invalid = |m: &str| AuthError::InvalidToken(m.to_owned());
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| invalid("the token is not a JWT this server can read"))?;
        if !self.algorithms.contains(&header.alg) {
            return Err(invalid(
                "the token is signed with an algorithm not accepted here",
            ));
        }
        let key = self.keys.key(header.kid.as_deref()).await?;
        if key.key.family() != header.alg.family() || key.alg.is_some_and(|a| a != header.alg) {
            return Err(invalid(
                "the token's algorithm does not match its signing key",
            ));
        }
        let mut validation = Validation::new(header.alg);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        validation.validate_nbf = true;
        validation.leeway = self.leeway;
        let data = jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind as K;
                invalid(match e.kind() {
                    K::ExpiredSignature => "the token has expired",
                    K::ImmatureSignature => "the token is not valid yet",
                    K::InvalidAudience => "the token was not issued for this MCP server (audience)",
                    K::InvalidIssuer => "the token is not from this server's authorization server",
                    K::MissingRequiredClaim(_) => "the token lacks `exp`, `iss` or `aud`",
                    K::InvalidSignature => "the token's signature does not verify",
                    _ => "the token is not valid here",
                })
            })?;
        let claims = data.claims;
        let text = |k: &str| {
            claims
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        let name = text("sub")
            .or_else(|| text("client_id"))
            .ok_or_else(|| invalid("the token names no subject (`sub`)"))?
            .to_owned();
        let namespace = text(&self.namespace_claim).ok_or_else(|| {
            AuthError::InvalidToken(format!(
                "the token lacks the `{}` claim, which names its workflows",
                self.namespace_claim
            ))
        })?;
        // `a` and `a/b` would make namespaces of which one holds the other.
        if namespace.contains('/') || namespace.chars().any(char::is_control) {
            return Err(AuthError::InvalidToken(format!(
                "the token's `{}` claim, which names its workflows, has a `/` or a control \
                 character in it, which this server does not accept",
                self.namespace_claim
            )));
        }
        Ok((
            name,
            format!("{JWT_NAMESPACE_ROOT}{namespace}/"),
            token_scopes(&claims),
        ))
    }
}

/// The scopes of a token: `scope` (space-separated, RFC 9068), or `scp`.
fn token_scopes(claims: &Map<String, Value>) -> Vec<String> {
    let from = |v: &Value| -> Vec<String> {
        match v {
            Value::String(s) => s.split_whitespace().map(str::to_owned).collect(),
            Value::Array(a) => a
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            _ => Vec::new(),
        }
    };
    claims
        .get("scope")
        .or_else(|| claims.get("scp"))
        .map(from)
        .unwrap_or_default()
}

/// A signing key of the issuer, and the algorithm it is for when the JWK says.
#[derive(Clone)]
struct Key {
    key: Arc<DecodingKey>,
    alg: Option<Algorithm>,
}

/// The issuer's JWK Set, fetched and cached.
struct Jwks {
    url: String,
    http: reqwest::Client,
    refresh: Duration,
    /// `jwks_max_stale`: beyond it, a set that could not be fetched again is
    /// not used.
    max_stale: Duration,
    /// [`MIN_REFETCH`] (shorter in tests).
    min_refetch: Duration,
    cache: RwLock<KeyCache>,
    /// One fetch at a time.
    fetching: tokio::sync::Mutex<()>,
    /// When a fetch was last tried, successful or not.
    attempted: std::sync::Mutex<Option<Instant>>,
}

#[derive(Default)]
struct KeyCache {
    by_kid: HashMap<String, Key>,
    /// Keys without a `kid` (usable by a token without one, if alone).
    unnamed: Vec<Key>,
    fetched_at: Option<Instant>,
}

impl Jwks {
    fn new(url: &str, refresh: Duration, max_stale: Duration) -> Result<Jwks, AuthSetupError> {
        let http = reqwest::Client::builder()
            .timeout(JWKS_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(AuthSetupError::Http)?;
        Ok(Jwks {
            url: url.to_owned(),
            http,
            refresh,
            max_stale,
            min_refetch: MIN_REFETCH,
            cache: RwLock::new(KeyCache::default()),
            fetching: tokio::sync::Mutex::new(()),
            attempted: std::sync::Mutex::new(None),
        })
    }

    /// The key a token names: from the cache while it is fresh and has it;
    /// otherwise fetched again (at most every [`MIN_REFETCH`]). A key the
    /// fetched set no longer has is not one of the issuer's, and a set older
    /// than `max_stale` (fetching it again kept failing) is not used.
    async fn key(&self, kid: Option<&str>) -> Result<Key, AuthError> {
        let (found, fetched_at) = self.lookup(kid);
        let stale = fetched_at.is_none_or(|t| t.elapsed() >= self.refresh);
        if let Some(key) = &found
            && !stale
        {
            return Ok(key.clone());
        }
        if self.may_fetch() {
            // With a (stale) key in hand, a request does not wait for a fetch
            // another is making; without one, it does.
            let one = match &found {
                Some(_) => self.fetching.try_lock().ok(),
                None => Some(self.fetching.lock().await),
            };
            // Checked again: another request may have fetched meanwhile.
            if one.is_some() && self.may_fetch() {
                *self.attempted.lock().expect("jwks attempt lock") = Some(Instant::now());
                if let Err(e) = self.refresh().await {
                    tracing::warn!(error = %e, "cannot fetch the MCP authorization server's JWK Set");
                }
            }
        }
        // The set as it is now: a fetch that succeeded meanwhile replaced
        // it, and a key it dropped is no longer the issuer's.
        let (key, fetched_at) = self.lookup(kid);
        match (key, fetched_at) {
            (_, None) => Err(AuthError::KeysUnavailable(
                "no JWK Set has been fetched yet".into(),
            )),
            (_, Some(at)) if at.elapsed() > self.max_stale => {
                Err(AuthError::KeysUnavailable(format!(
                    "the JWK Set was last fetched {} ago, longer than mcp.auth.jwks_max_stale \
                     allows, and fetching it again keeps failing",
                    humantime::format_duration(Duration::from_secs(at.elapsed().as_secs()))
                )))
            }
            (Some(key), _) => Ok(key),
            (None, Some(_)) => Err(AuthError::InvalidToken(
                "the token's signing key is not one of the issuer's".into(),
            )),
        }
    }

    /// Whether the last attempt to fetch (successful or not) is at least
    /// [`MIN_REFETCH`] ago: a failing or slow issuer is not asked by every request.
    fn may_fetch(&self) -> bool {
        self.attempted
            .lock()
            .expect("jwks attempt lock")
            .is_none_or(|t| t.elapsed() >= self.min_refetch)
    }

    fn lookup(&self, kid: Option<&str>) -> (Option<Key>, Option<Instant>) {
        let cache = self.cache.read().expect("jwks cache lock");
        let key = match kid {
            Some(kid) => cache.by_kid.get(kid).cloned(),
            None if cache.by_kid.len() + cache.unnamed.len() == 1 => {
                cache.by_kid.values().chain(&cache.unnamed).next().cloned()
            }
            None => None,
        };
        (key, cache.fetched_at)
    }

    async fn refresh(&self) -> Result<(), AuthError> {
        let response = self
            .http
            .get(&self.url)
            .send()
            .await
            .map_err(|e| AuthError::KeysUnavailable(e.without_url().to_string()))?;
        if !response.status().is_success() {
            return Err(AuthError::KeysUnavailable(format!(
                "HTTP {}",
                response.status()
            )));
        }
        // Read a chunk at a time and given up at the cap: a huge (or endless)
        // body is not held whole first.
        let too_large =
            || AuthError::KeysUnavailable(format!("larger than {MAX_JWKS_BYTES} bytes"));
        if response
            .content_length()
            .is_some_and(|n| n > MAX_JWKS_BYTES as u64)
        {
            return Err(too_large());
        }
        let mut response = response;
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| AuthError::KeysUnavailable(e.without_url().to_string()))?
        {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        let set: JwkSet = serde_json::from_slice(&body)
            .map_err(|e| AuthError::KeysUnavailable(format!("not a JWK Set: {e}")))?;
        let cache = key_cache(&set.keys);
        tracing::info!(
            keys = cache.by_kid.len() + cache.unnamed.len(),
            "fetched the MCP authorization server's JWK Set"
        );
        *self.cache.write().expect("jwks cache lock") = cache;
        Ok(())
    }
}

/// The usable keys of a JWK Set: public signing keys only (a shared secret in
/// a published set is a misconfiguration, never trusted).
fn key_cache(keys: &[Jwk]) -> KeyCache {
    let mut cache = KeyCache {
        fetched_at: Some(Instant::now()),
        ..KeyCache::default()
    };
    for jwk in keys {
        if jwk
            .common
            .public_key_use
            .as_ref()
            .is_some_and(|u| *u != jsonwebtoken::jwk::PublicKeyUse::Signature)
        {
            continue;
        }
        let Ok(key) = DecodingKey::from_jwk(jwk) else {
            continue;
        };
        if key.family() == AlgorithmFamily::Hmac {
            continue;
        }
        let alg = jwk
            .common
            .key_algorithm
            .and_then(|a| Algorithm::try_from(a).ok());
        let key = Key {
            key: Arc::new(key),
            alg,
        };
        match &jwk.common.key_id {
            Some(kid) => {
                cache.by_kid.insert(kid.clone(), key);
            }
            None => cache.unnamed.push(key),
        }
    }
    cache
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, McpStaticToken};

    fn config(tokens: Vec<McpStaticToken>) -> McpAuthConfig {
        let mut c = Config::default().mcp.auth;
        c.scopes
            .insert("tickets".into(), vec!["create_ticket".into()]);
        c.scopes.insert("admin".into(), vec!["*".into()]);
        c.tokens = tokens;
        c
    }

    fn token(name: &str, value: &str, scopes: &[&str]) -> McpStaticToken {
        McpStaticToken {
            name: name.into(),
            token: HeaderSpec::parse(value),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            namespace: None,
        }
    }

    #[tokio::test]
    async fn a_static_token_is_its_principal_with_its_scopes_and_namespace() {
        let env = |k: &str| (k == "BOT_TOKEN").then(|| "from-the-environment-0123".to_owned());
        let auth = Authorizer::new(
            &config(vec![
                token("bot", "env:BOT_TOKEN", &["tickets"]),
                token("ops", "literal-token-0123456789", &["admin"]),
            ]),
            "http://127.0.0.1:1/mcp",
            &env,
        )
        .unwrap()
        .unwrap();
        let bot = auth
            .authorize(Some("Bearer from-the-environment-0123"))
            .await
            .unwrap();
        assert_eq!(bot.name, "bot");
        assert_eq!(bot.namespace, "bot/");
        assert_eq!(bot.sender(), Some("token:bot"));
        assert!(bot.may_call("create_ticket") && !bot.may_call("search"));
        assert!(bot.may_name("bot/thread-1") && !bot.may_name("ops/thread-1"));
        let ops = auth
            .authorize(Some("bearer literal-token-0123456789"))
            .await
            .unwrap();
        assert!(ops.may_call("search"));
        assert_eq!(auth.authorize(None).await, Err(AuthError::Missing));
        for bad in [
            "Bearer literal-token-012345678",
            "Bearer literal-token-01234567890",
            "Basic literal-token-0123456789",
            "literal-token-0123456789",
        ] {
            assert!(
                matches!(
                    auth.authorize(Some(bad)).await,
                    Err(AuthError::InvalidToken(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(auth.scopes_granting("search"), vec!["admin".to_owned()]);
    }

    #[test]
    fn a_static_token_from_an_unset_variable_is_refused_at_start() {
        let r = Authorizer::new(
            &config(vec![token("bot", "env:NOT_SET", &["tickets"])]),
            "http://127.0.0.1:1/mcp",
            &|_| None,
        );
        assert!(
            matches!(&r, Err(AuthSetupError::Token { name, .. }) if name == "bot"),
            "{:?}",
            r.err()
        );
    }

    /// An RSA public key (the test's own), as a JWK with `kid`.
    fn jwk(kid: &str) -> Value {
        serde_json::json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "e": "AQAB",
            "n": "yOi4bt6DEfjYrEtfvTnR6aQTgJdB8grteBP7h3vwV5wBmpVx-W3BP5GZvz-LEe0bqCjwrDRgrup_pUWoI_9JylN-A4jiGL9qbmfUDSTQrAPL5L2tHDv3H2ex_iaEHCKSO3KeWOyQvldPDtTiCFbvk3-cqtk6OV5JPmoOHzrDq1X-lc_yOfSUxjDSFCBqaCpJf5MaxUh1WUy1FpiyHCgkok7dAmON8t_7FkIZYjeUy_DjAu_BwElkhcyK4_MZ7PCSzODuP1Bc5NhyQipRC2Z7yAy71IYxHZE39Swj-kN6BWxhRSWtsr54fNMjCIns9N4RaobPw_SK6rk8GRH1T2UZZQ"})
    }

    /// A JWK Set server answering what `answer` holds (status, body; a body
    /// of `None` is an endless stream); its URL.
    async fn jwks_server(answer: Arc<std::sync::Mutex<(u16, Option<String>)>>) -> String {
        use axum::response::IntoResponse;
        let app = axum::Router::new().route(
            "/jwks",
            axum::routing::get(move || {
                let answer = answer.clone();
                async move {
                    let (status, body) = answer.lock().unwrap().clone();
                    let status = axum::http::StatusCode::from_u16(status).unwrap();
                    match body {
                        Some(body) => (status, body).into_response(),
                        None => {
                            let chunk = bytes::Bytes::from(vec![b' '; 64 * 1024]);
                            let endless = futures::stream::repeat_with(move || {
                                Ok::<_, std::io::Error>(chunk.clone())
                            });
                            (status, axum::body::Body::from_stream(endless)).into_response()
                        }
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn set(kids: &[&str]) -> Option<String> {
        Some(
            serde_json::json!({"keys": kids.iter().map(|k| jwk(k)).collect::<Vec<_>>()})
                .to_string(),
        )
    }

    #[tokio::test]
    async fn a_key_the_refreshed_set_no_longer_has_is_refused_at_once() {
        let answer = Arc::new(std::sync::Mutex::new((200, set(&["k1"]))));
        let url = jwks_server(answer.clone()).await;
        // Every lookup finds the copy stale and may fetch again.
        let mut jwks = Jwks::new(&url, Duration::ZERO, Duration::from_secs(3600)).unwrap();
        jwks.min_refetch = Duration::ZERO;
        assert!(jwks.key(Some("k1")).await.is_ok());
        *answer.lock().unwrap() = (200, set(&["k2"]));
        // The lookup that fetched the set without k1 refuses k1.
        assert!(matches!(
            jwks.key(Some("k1")).await,
            Err(AuthError::InvalidToken(_))
        ));
        assert!(jwks.key(Some("k2")).await.is_ok());
    }

    #[tokio::test]
    async fn a_set_older_than_its_max_staleness_is_not_used() {
        let answer = Arc::new(std::sync::Mutex::new((200, set(&["k1"]))));
        let url = jwks_server(answer.clone()).await;
        let mut jwks = Jwks::new(&url, Duration::ZERO, Duration::from_millis(300)).unwrap();
        jwks.min_refetch = Duration::ZERO;
        assert!(jwks.key(Some("k1")).await.is_ok());
        // The issuer fails from now on: the copy serves until it is too old.
        *answer.lock().unwrap() = (503, Some("down".into()));
        assert!(jwks.key(Some("k1")).await.is_ok());
        tokio::time::sleep(Duration::from_millis(400)).await;
        match jwks.key(Some("k1")).await {
            Err(AuthError::KeysUnavailable(why)) => {
                assert!(why.contains("jwks_max_stale"), "{why}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a stale key was used"),
        }
        // A fetch that succeeds again ends it.
        *answer.lock().unwrap() = (200, set(&["k1"]));
        assert!(jwks.key(Some("k1")).await.is_ok());
    }

    #[tokio::test]
    async fn a_jwks_body_is_cut_at_its_cap() {
        let answer = Arc::new(std::sync::Mutex::new((200, None)));
        let url = jwks_server(answer).await;
        let jwks = Jwks::new(&url, Duration::ZERO, Duration::from_secs(3600)).unwrap();
        let started = Instant::now();
        match jwks.refresh().await {
            Err(AuthError::KeysUnavailable(why)) => {
                assert!(why.contains("larger than"), "{why}")
            }
            other => panic!("{:?}", other.err()),
        }
        // Given up at the cap, not at the fetch's timeout.
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_principal_is_recorded_by_its_kind_and_name() {
        let p = Principal {
            name: "acme".into(),
            key: "jwt:acme".into(),
            namespace: "jwt:acme/".into(),
            tools: ToolGrant::All,
            scopes: Vec::new(),
        };
        assert_eq!(p.sender(), Some("jwt:acme"));
        assert!(!p.may_name("acme/t1") && p.may_name("jwt:acme/t1"));
        assert_eq!(Principal::anonymous().sender(), None);
    }

    #[test]
    fn scopes_come_from_scope_or_scp() {
        let m = |v: Value| v.as_object().cloned().unwrap();
        assert_eq!(
            token_scopes(&m(serde_json::json!({"scope": "a b"}))),
            vec!["a", "b"]
        );
        assert_eq!(
            token_scopes(&m(serde_json::json!({"scp": ["a"]}))),
            vec!["a"]
        );
        assert!(token_scopes(&m(serde_json::json!({}))).is_empty());
    }
}
