//! For people who write tools: what stepgate sends with each call, and a
//! ledger that makes an effect and its answer one database transaction.
//!
//! stepgate sends every retry of a step with the same idempotency key
//! ([`StepHeaders::idempotency_key`]). A tool that stores that key *in the same
//! transaction as its effect* can answer a retry from what it stored, without
//! doing the effect twice — even when it crashed after committing the effect and
//! before its answer left. That turns an `unkeyed` tool into a `keyed` one.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")] {
//! use stepgate::provider::{StepHeaders, sqlite::Ledger};
//! # fn handle(conn: &mut rusqlite::Connection, call: &StepHeaders, title: &str)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! let answer = Ledger::once(conn, &call.idempotency_key, |tx| {
//!     tx.execute("INSERT INTO tickets (title) VALUES (?1)", [title])?;
//!     let id = tx.last_insert_rowid();
//!     Ok::<_, rusqlite::Error>((201, serde_json::json!({ "ticket_id": id })))
//! })?;
//! // answer.status / answer.body: the first run's answer, also on a retry
//! // (answer.replayed tells which).
//! # Ok(()) }
//! # }
//! ```
//!
//! The executor side of the same protocol is [`crate::tools`].

#[cfg(feature = "sqlite")]
pub mod sqlite;

use crate::contract::headers;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// The step a call belongs to, from the headers stepgate sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepHeaders {
    /// Stable for every retry of the step; different for each `attempt`.
    pub idempotency_key: String,
    pub workflow_id: Option<String>,
    pub step_index: Option<u64>,
    pub attempt: Option<u64>,
}

/// A call without the idempotency key: not from stepgate, or the tool's
/// `idempotency_header` names another header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the `{0}` header is missing or not text: this tool needs the step's idempotency key")]
pub struct MissingKey(pub String);

impl IntoResponse for MissingKey {
    fn into_response(self) -> Response {
        // A 4xx: a definite refusal, nothing was performed.
        (StatusCode::BAD_REQUEST, self.to_string()).into_response()
    }
}

impl StepHeaders {
    /// Read the step from request headers; `key_header` is the tool's
    /// configured `idempotency_header` (`Idempotency-Key` by default).
    pub fn from_headers(h: &HeaderMap, key_header: &str) -> Result<StepHeaders, MissingKey> {
        let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
        let idempotency_key = text(key_header)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| MissingKey(key_header.to_owned()))?
            .to_owned();
        Ok(StepHeaders {
            idempotency_key,
            workflow_id: text(headers::WORKFLOW_ID).map(str::to_owned),
            step_index: text(headers::STEP_INDEX).and_then(|v| v.parse().ok()),
            attempt: text(headers::ATTEMPT).and_then(|v| v.parse().ok()),
        })
    }
}

/// An axum extractor for handlers of tools called with the default
/// `Idempotency-Key` header.
impl<S: Send + Sync> FromRequestParts<S> for StepHeaders {
    type Rejection = MissingKey;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        StepHeaders::from_headers(&parts.headers, headers::IDEMPOTENCY_KEY)
    }
}

/// A tool's answer: the HTTP status and JSON body it sent (or sends again).
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub body: serde_json::Value,
    /// True when this is a stored answer of an earlier run: the effect was not
    /// performed again.
    pub replayed: bool,
}

/// The header a tool may add to tell a replayed answer (for logs and tests;
/// stepgate itself does not need it).
pub const REPLAYED_HEADER: &str = "Stepgate-Replayed";

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let replayed = if self.replayed { "true" } else { "false" };
        (status, [(REPLAYED_HEADER, replayed)], axum::Json(self.body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_step_from_the_headers() {
        let mut h = HeaderMap::new();
        h.insert("Idempotency-Key", "sg1-abc".parse().unwrap());
        h.insert(headers::WORKFLOW_ID, "order-1".parse().unwrap());
        h.insert(headers::STEP_INDEX, "3".parse().unwrap());
        h.insert(headers::ATTEMPT, "1".parse().unwrap());
        let call = StepHeaders::from_headers(&h, "Idempotency-Key").unwrap();
        assert_eq!(call.idempotency_key, "sg1-abc");
        assert_eq!(call.workflow_id.as_deref(), Some("order-1"));
        assert_eq!((call.step_index, call.attempt), (Some(3), Some(1)));
        assert_eq!(
            StepHeaders::from_headers(&h, "X-Request-Id"),
            Err(MissingKey("X-Request-Id".into()))
        );
    }
}
