//! The approvals webhook (`[notify]`): tells a person's tooling (a pager, a
//! chat channel) when a call is held, escalated, about to expire, or expired.
//!
//! The gate decides those events in its transaction and writes them to
//! `approvals` (`gate/core/approvals.rs`); this task reads them back —
//! committed ones only, in a consumer group of its own
//! (`<gate_group>.notify`), so each event is sent by one gate process of the
//! group — and posts each to `notify.url`, signed:
//! `stepgate-signature: hex(HMAC-SHA256(key, "stepgate-notify-v1\n" + body))`
//! over the body exactly as sent, with `stepgate-delivery` naming the event
//! (the same on every retry, for a receiver to drop a second copy). A
//! failed try (no 2xx, a timeout, no connection) is retried with backoff
//! until `notify.give_up_after`; the event's offset is committed after it was
//! delivered or given up, so a gate that dies before that sends it again on
//! restart (at least once). An event older than `give_up_after` when read is
//! skipped: it would be given up anyway (a new group reading an old topic
//! sends nothing stale).
//!
//! The body carries the step, the times and the terms — never the call's
//! arguments or metadata, which may hold personal data or secrets (a person
//! reads them in the console or `stepgate approvals list`).

use crate::config::{Config, NotifyConfig};
use crate::contract::sign::{Signed, sign};
use crate::contract::{ApprovalEvent, ApprovalKind};
use crate::kafka;
use crate::telemetry::Metrics;
use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The header naming a notification (`<topic>:<partition>:<offset>` of its event).
pub const DELIVERY_HEADER: &str = "stepgate-delivery";

/// Notification v1: what the webhook receives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notification {
    /// 1.
    pub version: u32,
    /// `held`, `escalated`, `expiring` or `expired`.
    pub event: &'static str,
    /// The same on every retry of this notification.
    pub delivery: String,
    pub workflow_id: String,
    pub step_index: u64,
    pub tool: String,
    pub attempt: u64,
    /// When the gate decided the event (RFC 3339).
    pub at: String,
    /// When the hold expires unanswered, if it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// `held`: when it will be escalated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub escalate_at: Option<String>,
    /// `held`: what a decision approves (SHA-256 of the argument bytes, the
    /// tool's policy version).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments_sha256: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// `expired`: the hold's time to live.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
}

impl Notification {
    /// The notification of an approval event, if it is one the hook hears of.
    pub fn of(e: &ApprovalEvent, delivery: String) -> Option<Notification> {
        let mut n = Notification {
            version: 1,
            event: "held",
            delivery,
            workflow_id: e.step.workflow_id.clone(),
            step_index: e.step.step_index,
            tool: e.step.tool.clone(),
            attempt: e.step.attempt,
            at: e.at.clone(),
            expires_at: None,
            escalate_at: None,
            arguments_sha256: None,
            policy_version: None,
            ttl: None,
        };
        match &e.event {
            ApprovalKind::Requested {
                arguments_sha256,
                policy_version,
                expires_at,
                escalate_at,
                ..
            } => {
                n.arguments_sha256 = arguments_sha256.clone();
                n.policy_version = policy_version.clone();
                n.expires_at = expires_at.clone();
                n.escalate_at = escalate_at.clone();
            }
            ApprovalKind::Escalated { expires_at } => {
                n.event = "escalated";
                n.expires_at = expires_at.clone();
            }
            ApprovalKind::Expiring { expires_at } => {
                n.event = "expiring";
                n.expires_at = Some(expires_at.clone());
            }
            ApprovalKind::Expired { ttl } => {
                n.event = "expired";
                n.ttl = Some(ttl.clone());
            }
            ApprovalKind::Approved { .. } | ApprovalKind::Denied { .. } => return None,
        }
        Some(n)
    }
}

/// Read committed approval events and post each to the webhook, until
/// `shutdown`. Never fails the process: a Kafka error is logged and the
/// consumer goes on (librdkafka reconnects by itself).
pub async fn run(config: Arc<Config>, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let n = &config.notify;
    let (Some(url), Some(key)) = (n.url.clone(), n.key_bytes().map(<[u8]>::to_vec)) else {
        return;
    };
    let k = &config.kafka;
    let group = format!("{}.notify", k.gate_group);
    let consumer: StreamConsumer = match kafka::worker_consumer_config(k, &group, None).create() {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "the approvals notifier could not start: no notification is sent");
            return;
        }
    };
    if let Err(e) = consumer.subscribe(&[&k.topics.approvals]) {
        warn!(error = %e, "the approvals notifier could not subscribe: no notification is sent");
        return;
    }
    let http = match reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(n.timeout.0)
        .build()
    {
        Ok(h) => h,
        Err(e) => {
            warn!(error = %e, "the approvals notifier's HTTP client: no notification is sent");
            return;
        }
    };
    info!(url = %crate::redact::redact_url(&url), group, "sending approval notifications");
    let hook = Hook {
        http,
        url,
        key,
        config: n.clone(),
        metrics,
    };
    loop {
        let m = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = consumer.recv() => m,
        };
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "the approvals notifier's consumer (it goes on)");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let delivery = format!("{}:{}:{}", m.topic(), m.partition(), m.offset());
        let notice = m
            .payload()
            .and_then(|p| serde_json::from_slice::<ApprovalEvent>(p).ok())
            .and_then(|e| Notification::of(&e, delivery))
            .filter(|n| hook.config.events.iter().any(|e| e == n.event))
            .filter(|n| !hook.stale(n));
        if let Some(notice) = notice {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                () = hook.deliver(&notice) => {}
            }
        }
        if let Err(e) = consumer.store_offset_from_message(&m) {
            warn!(error = %e, "the approvals notifier could not store its offset");
        }
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Async) {
            warn!(error = %e, "the approvals notifier could not commit its offset");
        }
    }
    let _ = consumer.commit_consumer_state(CommitMode::Sync);
}

struct Hook {
    http: reqwest::Client,
    url: String,
    key: Vec<u8>,
    config: NotifyConfig,
    metrics: Arc<Metrics>,
}

impl Hook {
    /// Older than `give_up_after` when read: it would be given up anyway.
    fn stale(&self, n: &Notification) -> bool {
        chrono::DateTime::parse_from_rfc3339(&n.at).is_ok_and(|at| {
            let age = chrono::Utc::now().signed_duration_since(at);
            age.to_std()
                .is_ok_and(|age| age > self.config.give_up_after.0)
        })
    }

    /// Post `n`, retrying with backoff until it is delivered or
    /// `give_up_after` has passed.
    async fn deliver(&self, n: &Notification) {
        let body = serde_json::to_vec(n).expect("a notification serialises");
        let signature = sign(&self.key, Signed::Notify, &body);
        let until = tokio::time::Instant::now() + self.config.give_up_after.0;
        let backoff = self.config.backoff.0;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let sent = self
                .http
                .post(&self.url)
                .timeout(self.config.timeout.0)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(crate::contract::headers::SIGNATURE, &signature)
                .header(DELIVERY_HEADER, &n.delivery)
                .body(body.clone())
                .send()
                .await;
            let why = match sent {
                Ok(r) if r.status().is_success() => {
                    self.metrics.notification(n.event, true, "");
                    return;
                }
                Ok(r) => format!("HTTP {}", r.status().as_u16()),
                Err(e) if e.is_timeout() => "timed out".to_owned(),
                Err(e) if e.is_connect() => "no connection".to_owned(),
                Err(_) => "the request failed".to_owned(),
            };
            let wait = (backoff * (1u32 << (tries - 1).min(16))).min(backoff * 10);
            if tokio::time::Instant::now() + wait >= until {
                let detail = format!("{tries} tries, the last: {why}");
                self.metrics.notification(n.event, false, &detail);
                return;
            }
            tokio::time::sleep(wait).await;
        }
    }
}
