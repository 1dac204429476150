//! `[traces]`: OpenTelemetry traces of each step, exported over OTLP/HTTP.

use super::ConfigError;
use crate::duration::Dur;
use crate::redact::{REDACTED, redact_url};
use crate::tools::validate::is_http;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `[traces]`: where and how much to export. Without `endpoint`, nothing is.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracesConfig {
    /// The OTLP/HTTP traces URL, protobuf encoding, e.g.
    /// `"http://127.0.0.1:4318/v1/traces"` (an OpenTelemetry Collector,
    /// Jaeger, Tempo, Langfuse's `/api/public/otel/v1/traces`, …), used as
    /// given. Unset: no traces, and no cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The share of new traces kept, 0 to 1 (by trace id, so a trace is kept
    /// or dropped whole).
    pub sample_ratio: f64,
    /// Follow the agent's decision when its `traceparent` has one (its
    /// sampled flag): `sample_ratio` then applies only to intents without a
    /// `traceparent`.
    pub parent_based: bool,
    /// `service.name` of the spans.
    pub service_name: String,
    /// How often finished spans are sent (in batches, from a thread of their own).
    pub export_interval: Dur,
    /// How long one export may take.
    pub timeout: Dur,
    /// HTTP headers of every export request (an `Authorization` for a hosted
    /// backend). Values are secrets: set them from the environment
    /// (`STEPGATE_TRACES_HEADERS_AUTHORIZATION`); `check-config` prints them
    /// redacted.
    pub headers: BTreeMap<String, String>,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            endpoint: None,
            sample_ratio: 1.0,
            parent_based: true,
            service_name: "stepgate".into(),
            export_interval: crate::duration::dur("5s"),
            timeout: crate::duration::dur("10s"),
            headers: BTreeMap::new(),
        }
    }
}

impl TracesConfig {
    /// Checks serde cannot express, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            field: format!("traces.{field}"),
            message,
        };
        if let Some(e) = &self.endpoint {
            match reqwest::Url::parse(e) {
                Ok(u) if is_http(&u) => {}
                _ => {
                    return Err(invalid(
                        "endpoint",
                        format!(
                            "must be the http(s) URL of an OTLP/HTTP traces endpoint, e.g. \"http://127.0.0.1:4318/v1/traces\", got `{}`",
                            redact_url(e)
                        ),
                    ));
                }
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid(
                "sample_ratio",
                format!("must be from 0 to 1, got {}", self.sample_ratio),
            ));
        }
        if self.service_name.trim().is_empty() {
            return Err(invalid("service_name", "must not be empty".into()));
        }
        if self.export_interval.0.is_zero() || self.timeout.0.is_zero() {
            return Err(invalid(
                "export_interval",
                "`traces.export_interval` and `traces.timeout` must be longer than 0".into(),
            ));
        }
        for name in self.headers.keys() {
            if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(invalid(
                    &format!("headers.{name}"),
                    "is not a valid HTTP header name".into(),
                ));
            }
        }
        Ok(())
    }

    /// The same with header values and credentials in the URL redacted.
    pub fn redacted(&self) -> TracesConfig {
        TracesConfig {
            endpoint: self.endpoint.as_deref().map(redact_url),
            headers: self
                .headers
                .keys()
                .map(|k| (k.clone(), REDACTED.to_owned()))
                .collect(),
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for TracesConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("TracesConfig")
            .field("endpoint", &r.endpoint)
            .field("sample_ratio", &r.sample_ratio)
            .field("parent_based", &r.parent_based)
            .field("service_name", &r.service_name)
            .field("export_interval", &r.export_interval)
            .field("timeout", &r.timeout)
            .field("headers", &r.headers)
            .finish()
    }
}
