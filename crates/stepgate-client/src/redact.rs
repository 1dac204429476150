//! What is a secret and how it is shown: one place decides, for every output
//! (`check-config`, `Debug`, error messages). A leaf module.

use std::collections::BTreeMap;

/// What a redacted secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// Whether a librdkafka property holds a secret: `sasl.password`,
/// `ssl.key.password`, `ssl.keystore.password`, `sasl.oauthbearer.client.secret`,
/// inline key material (`ssl.key.pem`, `ssl_key`), and free-form strings that
/// may carry one (`sasl.oauthbearer.config`). A property naming a path or an
/// address (`ssl.key.location`, `sasl.kerberos.keytab`,
/// `sasl.oauthbearer.token.endpoint.url`) is shown (an address with its
/// credentials redacted).
pub fn is_secret_property(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    let names_a_place = [".location", ".file", ".keytab", ".url"]
        .iter()
        .any(|s| n.ends_with(s));
    let secret_word = [
        "password",
        "passphrase",
        "secret",
        "token",
        "credential",
        "private",
        "key",
    ]
    .iter()
    .any(|w| n.contains(w));
    (secret_word && !names_a_place) || n == "sasl.oauthbearer.config" || n == "sasl.jaas.config"
}

/// A URL with its credentials redacted: the password (`https://bot:redacted@h`),
/// a user name standing alone (often a token: `https://redacted@h`), and the
/// values of query parameters named like credentials (`?api_key=redacted`).
/// A string that is not a URL is returned as it is.
pub fn redact_url(s: &str) -> String {
    let Ok(mut url) = url::Url::parse(s) else {
        // Not a URL, but it may still look like one with credentials in it.
        return match (s.find("://"), s.rfind('@')) {
            (Some(scheme_end), Some(at)) if at > scheme_end => {
                format!("{}://redacted@{}", &s[..scheme_end], &s[at + 1..])
            }
            _ => s.to_owned(),
        };
    };
    if !url.has_host() {
        return s.to_owned();
    }
    // `<redacted>` would be percent-encoded in a URL.
    if url.password().is_some() {
        let _ = url.set_password(Some("redacted"));
    } else if !url.username().is_empty() {
        let _ = url.set_username("redacted");
    }
    if url.query().is_some() {
        let secretish = |k: &str| {
            let k = k.to_ascii_lowercase();
            [
                "key",
                "token",
                "secret",
                "password",
                "passwd",
                "auth",
                "sig",
                "credential",
            ]
            .iter()
            .any(|w| k.contains(w))
        };
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secretish(&k) {
                    "redacted".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        if pairs.iter().any(|(k, _)| secretish(k)) {
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
    }
    url.to_string()
}

/// librdkafka properties with the secret ones ([`is_secret_property`])
/// replaced by [`REDACTED`] and credentials in the others' URLs redacted.
pub fn redact_client_properties(props: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    props
        .iter()
        .map(|(k, v)| {
            let v = if is_secret_property(k) {
                REDACTED.to_owned()
            } else {
                redact_url(v)
            };
            (k.clone(), v)
        })
        .collect()
}
