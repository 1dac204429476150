//! The first contact with the brokers, with a clear error when it fails.
//!
//! librdkafka retries a refused login or a failed TLS handshake for ever and
//! only reports it through its error callback; a metadata request meanwhile
//! just times out ("Local: Timed out" or "Broker transport failure"), which
//! names no cause. [`topic_partitions`] watches that callback while it asks for
//! metadata and stops at the first authentication or TLS failure, naming it and
//! the settings that decide it; a broker that does not answer at all is
//! reported when `limit` runs out, with the last error librdkafka gave.

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why the brokers could not be reached at start.
#[derive(Debug, Error)]
pub enum ConnectError {
    /// The brokers refused the credentials (SASL).
    #[error(
        "the brokers at {brokers} refused this client's credentials: {detail}. Check the librdkafka properties `sasl.username`, `sasl.password` and `sasl.mechanism` (`[kafka.client]`, or STEPGATE_KAFKA_CLIENT_SASL_* in the environment)"
    )]
    Authentication { brokers: String, detail: String },
    /// The TLS handshake failed: most often a broker certificate that no CA
    /// in `ssl.ca.location` (or the system's store) signed.
    #[error(
        "the TLS handshake with the brokers at {brokers} failed: {detail}. Check `ssl.ca.location`: it must hold the CA that signed the brokers' certificates (and `security.protocol` must match the listener)"
    )]
    Tls { brokers: String, detail: String },
    /// No broker answered a metadata request in time.
    #[error("no broker at {brokers} answered within {waited:?}{}", last_error(.last))]
    Unreachable {
        brokers: String,
        waited: Duration,
        last: Option<String>,
    },
    /// The client could not be created (an invalid property).
    #[error("cannot create a Kafka client")]
    Kafka(#[from] KafkaError),
}

fn last_error(last: &Option<String>) -> String {
    last.as_ref()
        .map(|l| format!("; the last error: {l}"))
        .unwrap_or_default()
}

/// One topic in a metadata answer.
#[derive(Debug, Clone)]
pub struct TopicInfo {
    pub name: String,
    /// The broker reported no error for it (it exists and is readable).
    pub ok: bool,
    pub partitions: usize,
}

/// A cause that waiting will not mend.
enum Fatal {
    Authentication(String),
    Tls(String),
}

/// The client context that keeps what librdkafka's error callback said.
#[derive(Default)]
struct Watch {
    fatal: Mutex<Option<Fatal>>,
    last: Mutex<Option<String>>,
}

/// A refused handshake or login, read from a librdkafka `FAIL` log line.
fn fatal_in_log(message: &str) -> Option<Fatal> {
    if message.contains("SSL handshake failed") || message.contains("certificate verify failed") {
        Some(Fatal::Tls(message.into()))
    } else if message.contains("SASL authentication error") {
        Some(Fatal::Authentication(message.into()))
    } else {
        None
    }
}

impl ClientContext for Watch {
    // librdkafka reports a refused handshake or login as an error event, but
    // under load a whole check window once went by with only its `FAIL` log
    // lines and no event (CI, an untrusted CA said "no broker answered"): the
    // log is read too. Lines are logged as rdkafka's default does.
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "FAIL"
            && let Some(f) = fatal_in_log(log_message)
        {
            self.fatal.lock().expect("watch lock").get_or_insert(f);
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let fatal = match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::Authentication) => Some(Fatal::Authentication(reason.into())),
            Some(RDKafkaErrorCode::SSL) => Some(Fatal::Tls(reason.into())),
            _ => None,
        };
        match fatal {
            Some(f) => {
                let mut slot = self.fatal.lock().expect("watch lock");
                slot.get_or_insert(f);
            }
            None => *self.last.lock().expect("watch lock") = Some(format!("{error}: {reason}")),
        }
    }
}

impl ConsumerContext for Watch {}

/// Ask the brokers of `config` for the metadata of `topic` (every topic with
/// None), retrying until `limit`; a refused login or a failed TLS handshake
/// ends the wait at once with its cause. Blocking.
pub fn topic_partitions(
    config: &ClientConfig,
    topic: Option<&str>,
    limit: Duration,
) -> Result<Vec<TopicInfo>, ConnectError> {
    let brokers = config
        .get("bootstrap.servers")
        .unwrap_or_default()
        .to_owned();
    let consumer: BaseConsumer<Watch> = config.create_with_context(Watch::default())?;
    let start = Instant::now();
    loop {
        let left = limit.saturating_sub(start.elapsed());
        let answer = consumer.fetch_metadata(topic, left.min(Duration::from_millis(500)));
        // Serve the queued events: the error callback runs here (a consumer
        // without a group polls librdkafka's main queue).
        for _ in 0..1000 {
            if consumer.poll(Duration::ZERO).is_none() {
                break;
            }
        }
        let watch = consumer.context();
        if let Some(f) = watch.fatal.lock().expect("watch lock").take() {
            return Err(match f {
                Fatal::Authentication(detail) => ConnectError::Authentication { brokers, detail },
                Fatal::Tls(detail) => ConnectError::Tls { brokers, detail },
            });
        }
        match answer {
            Ok(md) => {
                return Ok(md
                    .topics()
                    .iter()
                    .map(|t| TopicInfo {
                        name: t.name().to_owned(),
                        ok: t.error().is_none(),
                        partitions: t.partitions().len(),
                    })
                    .collect());
            }
            Err(e) if start.elapsed() >= limit => {
                let last = watch.last.lock().expect("watch lock").take();
                return Err(ConnectError::Unreachable {
                    brokers,
                    waited: limit,
                    last: last.or_else(|| Some(e.to_string())),
                });
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_handshake_or_login_in_a_fail_line_is_named() {
        let tls = "sasl_ssl://127.0.0.1:9094/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified";
        assert!(matches!(fatal_in_log(tls), Some(Fatal::Tls(d)) if d == tls));
        let sasl = "sasl_ssl://127.0.0.1:9094/bootstrap: SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512";
        assert!(matches!(fatal_in_log(sasl), Some(Fatal::Authentication(_))));
        let refused =
            "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused";
        assert!(fatal_in_log(refused).is_none());
    }

    #[test]
    fn a_broker_that_is_not_there_is_reported_when_the_limit_runs_out() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", format!("127.0.0.1:{port}"));
        let start = Instant::now();
        let e = topic_partitions(&c, None, Duration::from_secs(2)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5), "bounded");
        let text = e.to_string();
        assert!(matches!(e, ConnectError::Unreachable { .. }), "{text}");
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    }
}
