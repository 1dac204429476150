//! The checks of one tool's config (`[tools.<name>]`) that serde cannot
//! express: its name, its URL, its limits and its headers, each naming its key.

use super::tool::{HeaderSource, RESERVED_HEADERS, ToolConfig};
use crate::redact::redact_url;

/// A key of `[tools.<name>]` that fails a check, and why; the config reports
/// it as `ConfigError::Invalid`.
#[derive(Debug)]
pub(crate) struct InvalidTool {
    /// The key, e.g. `tools.pay.timeout`.
    pub field: String,
    pub message: String,
}

/// An http(s) URL with a host (what every URL stepgate calls must be).
pub(crate) fn is_http(u: &reqwest::Url) -> bool {
    matches!(u.scheme(), "http" | "https") && u.host().is_some()
}

/// A tool's `url` (or `mcp`), named `key`: an http(s) URL with a host. It
/// may carry credentials: echoed redacted.
fn check_tool_url(key: &str, url: &str) -> Result<(), InvalidTool> {
    let invalid = |message: String| InvalidTool {
        field: key.to_owned(),
        message,
    };
    match reqwest::Url::parse(url) {
        Ok(u) if is_http(&u) => Ok(()),
        Ok(_) => Err(invalid(format!(
            "must be an http(s) URL with a host, got `{}`",
            redact_url(url)
        ))),
        Err(e) => Err(invalid(format!(
            "must be an http(s) URL; what is configured is not a URL ({e})"
        ))),
    }
}

impl ToolConfig {
    /// The checks serde cannot express of the tool `name` (`Config::validate`
    /// runs them for each tool), the first that fails named.
    pub(crate) fn validate(&self, name: &str) -> Result<(), InvalidTool> {
        let invalid = |field: &str, message: &str| InvalidTool {
            field: field.to_owned(),
            message: message.to_owned(),
        };
        if !crate::contract::valid_tool_name(name) {
            return Err(invalid(
                &format!("tools.{name}"),
                "tool names are 1 to 128 of [A-Za-z0-9_.:-]",
            ));
        }
        // A pool tool has no address here: its workers hold it.
        let url_key = match (&self.pool, &self.mcp_tool) {
            (Some(_), _) => None,
            (None, Some(_)) => Some(format!("tools.{name}.mcp")),
            (None, None) => Some(format!("tools.{name}.url")),
        };
        // The URL may carry credentials: echoed redacted, or not at all.
        if let Some(url_key) = url_key {
            check_tool_url(&url_key, &self.url)?;
        }
        if reqwest::header::HeaderName::from_bytes(self.idempotency_header.as_bytes()).is_err() {
            return Err(invalid(
                &format!("tools.{name}.idempotency_header"),
                &format!(
                    "`{}` is not a valid HTTP header name",
                    self.idempotency_header
                ),
            ));
        }
        if self
            .idempotency_field
            .as_ref()
            .is_some_and(|f| f.split('.').any(str::is_empty))
        {
            return Err(invalid(
                &format!("tools.{name}.idempotency_field"),
                "must be a dotted path like \"metadata.idempotency_key\"",
            ));
        }
        if self.timeout.0.is_zero() {
            return Err(invalid(
                &format!("tools.{name}.timeout"),
                "must be longer than 0",
            ));
        }
        if self.max_output_bytes == 0 {
            return Err(invalid(
                &format!("tools.{name}.max_output_bytes"),
                "must be at least 1",
            ));
        }
        if self.max_concurrency == Some(0) {
            return Err(invalid(
                &format!("tools.{name}.max_concurrency"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if self.queue_timeout.0.is_zero() {
            return Err(invalid(
                &format!("tools.{name}.queue_timeout"),
                "must be longer than 0",
            ));
        }
        for (i, (header, spec)) in self.headers.iter().enumerate() {
            let field = format!("tools.{name}.headers.{header}");
            if reqwest::header::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(invalid(&field, "is not a valid HTTP header name"));
            }
            if self
                .headers
                .keys()
                .skip(i + 1)
                .any(|other| other.eq_ignore_ascii_case(header))
            {
                return Err(invalid(
                    &field,
                    "is given twice (header names are case-insensitive)",
                ));
            }
            if let Some(reserved) = RESERVED_HEADERS
                .iter()
                .copied()
                .chain([self.idempotency_header.as_str()])
                .find(|r| r.eq_ignore_ascii_case(header))
            {
                return Err(invalid(
                    &field,
                    &format!(
                        "cannot be set: stepgate sends `{reserved}` itself on every call \
                         (the protocol's headers and the request's framing are not configurable)"
                    ),
                ));
            }
            // Only what the spec names, never a value.
            match &spec.source {
                HeaderSource::Env(var) if var.is_empty() => {
                    return Err(invalid(
                        &field,
                        "`env:` needs a variable name, e.g. \"env:PAY_TOKEN\"",
                    ));
                }
                HeaderSource::File(path) if path.as_os_str().is_empty() => {
                    return Err(invalid(
                        &field,
                        "`file:` needs a path, e.g. \"file:/run/secrets/pay_key\"",
                    ));
                }
                HeaderSource::Literal(v)
                    if v.trim().is_empty()
                        || reqwest::header::HeaderValue::from_str(v.trim()).is_err() =>
                {
                    return Err(invalid(
                        &field,
                        "is empty or not a valid HTTP header value (write \"env:NAME\" or \"file:/path\" to read it from the environment or a file)",
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}
