//! What is a secret and how it is shown. The config's rules (properties,
//! URLs) come from the client crate ([`stepgate_client::redact`], re-exported
//! here); this module adds the one rule for everything that shows a call's
//! arguments, answers and rephrasings to a person: the console, `stepgate
//! approvals list`, `stepgate steps show` and `stepgate audit` all use
//! [`Redactor`], so none shows what another hides.
//!
//! Two things are hidden:
//! - **configured secrets** (tool header values, the console's and the MCP
//!   front's tokens): wherever they appear, whole or as any of their words of
//!   8 characters or more (the token of `Bearer <token>`); never revealed;
//! - **values of fields named like credentials** (`password`, `api_key`,
//!   `payment_token`, …), at any depth, in objects and in a rephrasing's
//!   diff (by the path of the change). These may be revealed to a person
//!   allowed to decide the call ([`Redactor::reveal`]), and every view says
//!   how many are hidden and where ([`hidden_paths`]): nothing is hidden
//!   silently.

pub use stepgate_client::redact::*;

use serde_json::Value;

/// Argument (and output) field names whose values are credentials.
pub fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "passphrase",
        "passwd",
        "secret",
        "token",
        "api_key",
        "apikey",
        "authorization",
        "credential",
        "private_key",
        "access_key",
        "cookie",
    ]
    .iter()
    .any(|w| n.contains(w))
}

/// Whether a dotted path (`card.cvc_token`) passes through a field named like
/// a credential: its value, and everything under it, is hidden.
pub fn is_secret_path(path: &str) -> bool {
    path.split('.').any(is_secret_name)
}

/// The shortest configured secret (or word of one) that is looked for: a
/// shorter one would garble texts more than it protects.
const MIN_SECRET: usize = 4;
/// Words of a configured value looked for on their own (`Bearer <token>`).
const MIN_WORD: usize = 8;

/// Redacts what people are shown. Cheap to clone; build it once per process.
#[derive(Debug, Clone, Default)]
pub struct Redactor {
    /// Every configured secret and its long words, longest first.
    secrets: Vec<String>,
}

impl Redactor {
    /// A redactor for these configured secret values (tool header values,
    /// tokens); each value's words of [`MIN_WORD`] characters or more are
    /// looked for on their own too.
    pub fn new(values: impl IntoIterator<Item = String>) -> Redactor {
        let mut secrets: Vec<String> = Vec::new();
        for v in values {
            let v = v.trim().to_owned();
            secrets.extend(
                v.split_whitespace()
                    .filter(|w| w.len() >= MIN_WORD && *w != v)
                    .map(str::to_owned),
            );
            secrets.push(v);
        }
        secrets.retain(|s| s.len() >= MIN_SECRET);
        secrets.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        secrets.dedup();
        Redactor { secrets }
    }

    /// `s` with every configured secret replaced by [`REDACTED`].
    pub fn text(&self, s: &str) -> String {
        let mut out = s.to_owned();
        for secret in &self.secrets {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), REDACTED);
            }
        }
        out
    }

    /// `v` with configured secrets replaced in every string (and key), and the
    /// values of fields named like credentials replaced by [`REDACTED`].
    pub fn json(&self, v: &Value) -> Value {
        self.walk(v, true)
    }

    /// `v` with only the configured secrets replaced: what a person allowed to
    /// decide the call may reveal.
    pub fn reveal(&self, v: &Value) -> Value {
        self.walk(v, false)
    }

    fn walk(&self, v: &Value, by_name: bool) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .map(|(k, v)| {
                        let shown = if by_name && is_secret_name(k) && !v.is_null() {
                            Value::String(REDACTED.into())
                        } else {
                            self.walk(v, by_name)
                        };
                        (self.text(k), shown)
                    })
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(|v| self.walk(v, by_name)).collect()),
            Value::String(s) => Value::String(self.text(s)),
            v => v.clone(),
        }
    }

    /// One side of a change at `path` (a rephrasing's diff): hidden whole when
    /// the path passes through a field named like a credential.
    pub fn at_path(&self, path: &str, v: &Value) -> Value {
        if is_secret_path(path) && !v.is_null() {
            Value::String(REDACTED.into())
        } else {
            self.json(v)
        }
    }

    /// Pretty JSON, redacted ([`Redactor::json`]).
    pub fn pretty(&self, v: &Value) -> String {
        serde_json::to_string_pretty(&self.json(v)).unwrap_or_default()
    }
}

/// The paths of the values [`Redactor::json`] hides by their field's name
/// (`card.cvc_token`), in order: what a view says it hid.
pub fn hidden_paths(v: &Value) -> Vec<String> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    if is_secret_name(k) && !v.is_null() {
                        out.push(p);
                    } else {
                        walk(&p, v, out);
                    }
                }
            }
            Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    walk(&format!("{prefix}[{i}]"), v, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", v, &mut out);
    out
}

/// `s` cut to at most `max` bytes (at a character boundary), and how many
/// bytes were left out.
pub fn cut(s: &str, max: usize) -> (&str, usize) {
    if s.len() <= max {
        return (s, 0);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (&s[..end], s.len() - end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn configured_secrets_go_whole_and_by_word() {
        let r = Redactor::new(["Bearer s3cr3t-token-value-123".to_owned()]);
        assert_eq!(
            r.text("sent Bearer s3cr3t-token-value-123 ok"),
            "sent <redacted> ok"
        );
        // The bare token, as a tool that echoes its key writes it.
        assert_eq!(r.text("key s3cr3t-token-value-123"), "key <redacted>");
        // Short words (`Bearer`) are left.
        assert_eq!(r.text("Bearer x"), "Bearer x");
    }

    #[test]
    fn named_fields_are_hidden_at_any_depth_and_may_be_revealed() {
        let r = Redactor::new(["sk-live-0123456789".to_owned()]);
        let v = json!({"to": "alice", "payment_token": "tok_1", "card": {"cvc_token": "9"},
            "memo": "auth sk-live-0123456789", "password": null});
        assert_eq!(
            r.json(&v),
            json!({"to": "alice", "payment_token": "<redacted>", "card": {"cvc_token": "<redacted>"},
                "memo": "auth <redacted>", "password": null})
        );
        assert_eq!(hidden_paths(&v), vec!["card.cvc_token", "payment_token"]);
        // Revealed: the named values, never a configured secret.
        assert_eq!(
            r.reveal(&v),
            json!({"to": "alice", "payment_token": "tok_1", "card": {"cvc_token": "9"},
                "memo": "auth <redacted>", "password": null})
        );
    }

    #[test]
    fn a_change_is_hidden_by_its_path() {
        let r = Redactor::default();
        assert_eq!(
            r.at_path("password", &json!("hunter2")),
            json!("<redacted>")
        );
        assert_eq!(r.at_path("auth.api_key", &json!(1)), json!("<redacted>"));
        assert_eq!(r.at_path("amount", &json!(5)), json!(5));
        assert_eq!(
            r.at_path("card", &json!({"token": "x", "last4": "1234"})),
            json!({"token": "<redacted>", "last4": "1234"})
        );
    }

    #[test]
    fn cut_keeps_characters_whole() {
        assert_eq!(cut("héllo", 2), ("h", 5));
        assert_eq!(cut("abc", 3), ("abc", 0));
    }
}
