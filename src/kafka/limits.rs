//! Record size limits: what stepgate writes, what its topics accept, and
//! the checks that producers and existing topics agree.

use super::{KafkaSetupError, base_config};
use crate::config::KafkaConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use std::time::Duration;

/// Largest record stepgate's producers write (librdkafka `message.max.bytes`,
/// default 1 000 000) and the `max.message.bytes` of the topics that
/// `stepgate topics create` makes for what stepgate writes. Set explicitly: a
/// record over the limit fails its whole transaction, and the session would
/// meet the same input again.
pub const MESSAGE_MAX_BYTES: usize = 4 * 1024 * 1024;

/// `max.message.bytes` of the intents topic `stepgate topics create` makes:
/// agents can publish up to this (intents over `gate.max_intent_bytes` are
/// then rejected), and a dead-letter copy — the original key and headers plus
/// a bounded value ([`crate::contract::DLQ_RECORD_MAX_BYTES`]) — always fits
/// under [`MESSAGE_MAX_BYTES`].
pub const INTENTS_MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;

/// What stepgate adds around an intent's arguments in the records it writes
/// (step key, call ids, traceparent, timestamps, record framing), generously.
/// A record derived from one intent is at most `gate.max_intent_bytes` plus this.
pub const RECORD_ENVELOPE_BYTES: usize = 64 * 1024;

// A DLQ copy of the largest record `intents` accepts — its key and headers plus
// the bounded value — fits under what stepgate writes.
const _: () =
    assert!(INTENTS_MAX_MESSAGE_BYTES + crate::contract::DLQ_RECORD_MAX_BYTES < MESSAGE_MAX_BYTES);

/// The largest record stepgate's producers may write: [`MESSAGE_MAX_BYTES`]
/// unless `[kafka.client]` overrides `message.max.bytes`.
pub fn producer_max_bytes(cfg: &KafkaConfig) -> Result<usize, KafkaSetupError> {
    match cfg.client.get("message.max.bytes") {
        None => Ok(MESSAGE_MAX_BYTES),
        Some(v) => v.trim().parse().map_err(|_| {
            KafkaSetupError::Sizes(format!(
                "`kafka.client.\"message.max.bytes\"` must be a number of bytes, got `{v}`"
            ))
        }),
    }
}

/// Refuse a config whose largest intent could not be written back: every
/// record stepgate derives from an intent (the forwarded call, the step
/// record) is up to `max_intent_bytes` + [`RECORD_ENVELOPE_BYTES`], and must
/// fit under the producer's `message.max.bytes`.
pub fn check_sizes(cfg: &KafkaConfig, max_intent_bytes: usize) -> Result<(), KafkaSetupError> {
    let need = max_intent_bytes.saturating_add(RECORD_ENVELOPE_BYTES);
    let producer = producer_max_bytes(cfg)?;
    if need > producer {
        return Err(KafkaSetupError::Sizes(format!(
            "`gate.max_intent_bytes` is {max_intent_bytes}: the records stepgate writes for such an intent take up to {need} bytes (the intent + {RECORD_ENVELOPE_BYTES} of envelope), over the producer's `message.max.bytes` of {producer}. Lower `gate.max_intent_bytes` to at most {} or raise `kafka.client.\"message.max.bytes\"` (and the topics' `max.message.bytes`) to at least {need}.",
            producer.saturating_sub(RECORD_ENVELOPE_BYTES)
        )));
    }
    Ok(())
}

/// Refuse topics whose `max.message.bytes` is below what stepgate writes to
/// them (`max_intent_bytes` + envelope; for the DLQ, a copy of the largest
/// record the intents topic accepts). Topics that do not exist are left to
/// [`check_layout`]; when the broker does not answer (no DescribeConfigs
/// permission, a mock cluster), the check is skipped with a warning.
pub async fn check_topic_sizes(
    cfg: &KafkaConfig,
    max_intent_bytes: usize,
) -> Result<(), KafkaSetupError> {
    use rdkafka::admin::ResourceSpecifier;
    let t = &cfg.topics;
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let specs: Vec<ResourceSpecifier<'_>> = t
        .all()
        .iter()
        .map(|n| ResourceSpecifier::Topic(n.as_str()))
        .collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let described = match admin.describe_configs(specs.iter(), &opts).await {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the topics' max.message.bytes: not checked");
            return Ok(());
        }
    };
    let mut limits = std::collections::BTreeMap::new();
    for (name, r) in t.all().iter().zip(described) {
        let limit = r.ok().and_then(|c| {
            c.get("max.message.bytes")
                .and_then(|e| e.value.as_deref())
                .and_then(|v| v.parse::<usize>().ok())
        });
        if let Some(l) = limit {
            limits.insert(name.to_string(), l);
        }
    }
    let need = max_intent_bytes.saturating_add(RECORD_ENVELOPE_BYTES);
    let mut problems = Vec::new();
    for (name, limit) in &limits {
        if *name == t.intents {
            continue;
        }
        let need = if *name == t.dlq {
            // A DLQ record keeps the original key and headers.
            limits
                .get(&t.intents)
                .copied()
                .unwrap_or(need)
                .max(need)
                .saturating_add(crate::contract::DLQ_RECORD_MAX_BYTES)
        } else {
            need
        };
        if *limit < need {
            problems.push(format!(
                "`{name}` has max.message.bytes={limit}, stepgate may write {need}"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(KafkaSetupError::Sizes(format!(
            "records stepgate writes would not fit: {}. Raise each with `kafka-configs --alter --entity-type topics --entity-name <topic> --add-config max.message.bytes={MESSAGE_MAX_BYTES}` (what `stepgate topics create` sets), or lower `gate.max_intent_bytes` (now {max_intent_bytes}).",
            problems.join("; ")
        )))
    }
}
