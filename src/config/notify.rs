//! `[notify]`: the webhook told about calls held for approval — held,
//! escalated, about to expire, expired — signed with a key of its own.
//! Without `url`, nothing is sent (the events are still on `approvals`).

use super::{ConfigError, HeaderSource, HeaderSpec, REDACTED};
use crate::contract::sign::MIN_POOL_KEY_BYTES;
use crate::duration::{Dur, dur};
use crate::redact::redact_url;
use serde::{Deserialize, Serialize};

/// The lifecycle events a webhook can be told of.
pub const NOTIFY_EVENTS: [&str; 4] = ["held", "escalated", "expiring", "expired"];

/// `[notify]`: where approval lifecycle events are posted, and how hard to try.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NotifyConfig {
    /// The webhook's `http://…` or `https://…` URL: each event is a `POST`
    /// of JSON, signed (docs/operations.md "Notifications"). Unset: none is
    /// sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The key that signs each notification (HMAC-SHA256, header
    /// `stepgate-signature`), shared with the receiver: `"env:NAME"`,
    /// `"file:/path"`, or the key itself (discouraged). At least 32 bytes.
    /// Required with `url`. Read once at start; never logged or printed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<HeaderSpec>,
    /// Which events are sent, among `held`, `escalated`, `expiring`, `expired`.
    pub events: Vec<String>,
    /// How long before a held call's expiry (`approval_ttl`) the `expiring`
    /// event is sent; not sent for a hold shorter than this.
    pub expiring_before: Dur,
    /// How long one try may take.
    pub timeout: Dur,
    /// The wait before the first retry of a failed try; doubles each time, at
    /// most 10 × this.
    pub backoff: Dur,
    /// A notification not delivered within this (every try refused, failed or
    /// timed out) is given up: logged and counted
    /// (`stepgate_notifications_total{outcome="failed"}`).
    pub give_up_after: Dur,
}

impl Default for NotifyConfig {
    fn default() -> Self {
        NotifyConfig {
            url: None,
            key: None,
            events: NOTIFY_EVENTS.iter().map(|e| (*e).to_owned()).collect(),
            expiring_before: dur("15m"),
            timeout: dur("5s"),
            backoff: dur("1s"),
            give_up_after: dur("5m"),
        }
    }
}

impl NotifyConfig {
    /// Whether notifications are sent at all.
    pub fn enabled(&self) -> bool {
        self.url.is_some()
    }

    /// The key's bytes, once resolved ([`NotifyConfig::resolve_key`]).
    pub fn key_bytes(&self) -> Option<&[u8]> {
        self.key.as_ref()?.value().map(str::as_bytes)
    }

    /// The URL's credentials redacted, a literal key replaced by [`REDACTED`].
    pub fn redacted(&self) -> NotifyConfig {
        NotifyConfig {
            url: self.url.as_deref().map(redact_url),
            key: self.key.as_ref().map(|k| match &k.source {
                HeaderSource::Literal(_) => HeaderSpec::parse(REDACTED),
                _ => HeaderSpec::parse(&k.shown()),
            }),
            ..self.clone()
        }
    }

    /// Checks serde cannot express, naming the field.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: format!("notify.{field}"),
            message,
        };
        if let Some(e) = self
            .events
            .iter()
            .find(|e| !NOTIFY_EVENTS.contains(&e.as_str()))
        {
            return Err(invalid(
                "events",
                format!("lists {e:?}: the events are {}", NOTIFY_EVENTS.join(", ")),
            ));
        }
        for (field, d) in [
            ("timeout", self.timeout),
            ("backoff", self.backoff),
            ("give_up_after", self.give_up_after),
        ] {
            if d.0.is_zero() {
                return Err(invalid(field, "must be longer than 0".into()));
            }
        }
        let Some(url) = &self.url else {
            return Ok(());
        };
        if !reqwest::Url::parse(url).is_ok_and(|u| crate::tools::validate::is_http(&u)) {
            return Err(invalid("url", "must be an http:// or https:// URL".into()));
        }
        if self.key.is_none() {
            return Err(invalid(
                "key",
                format!(
                    "is required with `notify.url`: the key (at least {MIN_POOL_KEY_BYTES} bytes) that signs each notification, as `\"env:<VARIABLE>\"` or `\"file:<path>\"`, shared with the receiver"
                ),
            ));
        }
        Ok(())
    }

    /// Read the key from its source, once, at start. The error names the
    /// source, never the key.
    pub(super) fn resolve_key(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        let Some(key) = self.key.as_mut() else {
            return Ok(()); // `validate` refuses it
        };
        let invalid = |message: String| ConfigError::Invalid {
            field: "notify.key".into(),
            message,
        };
        key.resolve(env).map_err(invalid)?;
        let len = key.value().map_or(0, str::len);
        if len < MIN_POOL_KEY_BYTES {
            return Err(invalid(format!(
                "is {len} bytes long: it must be at least {MIN_POOL_KEY_BYTES} bytes (`openssl rand -hex 32` makes one of 64)"
            )));
        }
        Ok(())
    }
}
