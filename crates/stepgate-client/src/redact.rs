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
        let secretish = is_secret_query_key;
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

/// Whether a URL's query parameter is named like a credential (`api_key`,
/// `access_token`, `client_secret`, `sig`/`signature`, `auth`, …).
pub fn is_secret_query_key(name: &str) -> bool {
    let k = name.to_ascii_lowercase();
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
}

/// The credentials a URL carries, as they may appear in a text: its password
/// (or a user name standing alone), and the values of its query parameters
/// named like credentials ([`is_secret_query_key`]), each percent-encoded as
/// written and decoded. Longest first; none shorter than 4 characters (a
/// shorter one would garble a text more than it protects).
pub fn url_secrets(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    match url::Url::parse(s) {
        Ok(url) => {
            let user = url.username();
            match url.password() {
                Some(p) => out.push(p.to_owned()),
                None if !user.is_empty() => out.push(user.to_owned()),
                None => {}
            }
            if let Some(query) = url.query() {
                for pair in query.split('&') {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    let k = percent_decode(k);
                    if is_secret_query_key(&k) {
                        out.push(v.to_owned());
                    }
                }
            }
        }
        // Not a URL, but it may still hold credentials before an `@`.
        Err(_) => {
            if let (Some(scheme_end), Some(at)) = (s.find("://"), s.rfind('@'))
                && at > scheme_end
            {
                let userinfo = &s[scheme_end + 3..at];
                out.push(userinfo.to_owned());
                out.extend(userinfo.split(':').map(str::to_owned));
            }
        }
    }
    let decoded: Vec<String> = out.iter().map(|v| percent_decode(v)).collect();
    out.extend(decoded);
    out.retain(|v| v.chars().count() >= 4);
    out.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    out.dedup();
    out
}

/// `text` with the credentials of `url` redacted wherever they appear: the
/// URL itself, as configured or as an HTTP library prints it, becomes
/// [`redact_url`]'s form, and any other occurrence of one of its
/// [`url_secrets`] becomes `redacted`. For error texts that a library built
/// around a tool's endpoint (they reach answers, records and logs).
pub fn redact_url_in(text: &str, url: &str) -> String {
    let mut out = text.to_owned();
    let shown = redact_url(url);
    let mut forms = vec![url.to_owned()];
    if let Ok(u) = url::Url::parse(url) {
        forms.push(u.to_string());
    }
    for form in forms {
        if form != shown && !form.is_empty() && out.contains(&form) {
            out = out.replace(&form, &shown);
        }
    }
    for secret in url_secrets(url) {
        if out.contains(&secret) {
            out = out.replace(&secret, "redacted");
        }
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push(hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0));
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_urls_credentials_leave_any_text() {
        let url = "https://bot:pw%2Fhunter2@h.example/mcp?tenant=acme&access_token=tok-hunter3&sig=c2lnaHVudGVyNA%3D%3D";
        let text = format!(
            "error sending request for url ({}): refused pw/hunter2, token tok-hunter3, sig c2lnaHVudGVyNA==",
            url::Url::parse(url).unwrap()
        );
        let out = redact_url_in(&text, url);
        for secret in ["hunter2", "hunter3", "c2lnaHVudGVyNA"] {
            assert!(!out.contains(secret), "{out}");
        }
        assert!(
            out.contains("tenant=acme") && out.contains("h.example/mcp"),
            "{out}"
        );
        // A user name standing alone is a token; nothing to hide: unchanged.
        assert!(
            !redact_url_in("at https://tok-hunter5@h/x", "https://tok-hunter5@h/x")
                .contains("hunter5")
        );
        assert_eq!(redact_url_in("HTTP 500", "https://h/x?q=1"), "HTTP 500");
        // Not even a URL.
        assert!(
            !redact_url_in("x https://u:hunter6@/x y", "https://u:hunter6@/x").contains("hunter6")
        );
    }
}
