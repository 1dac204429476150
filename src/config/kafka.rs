//! `[kafka]`: the brokers, the topics, this process's identity and the
//! librdkafka pass-through, with the properties it refuses (the guarantee rests on them).

use super::default_instance_id;
use crate::duration::{Dur, dur};
use crate::redact::redact_client_properties;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `[kafka]`: the brokers, the gates' consumer group, this process's
/// identity, the topics, and the properties of every Kafka client stepgate
/// makes. Every command reads it: `run`, `mcp`, `console`, `call`, the
/// operator commands.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated.
    pub brokers: String,
    pub topics: TopicsConfig,
    /// Consumer group of the gates.
    pub gate_group: String,
    /// Stable identity of this process: static group membership
    /// (`group.instance.id`) and transactional ids derive from it, so a restarted
    /// process takes its partitions back at once instead of after a session timeout.
    /// Must be unique per running process. Default: the host's name
    /// ([`default_instance_id`]), which differs between hosts and pods and stays
    /// the same across restarts of one.
    pub instance_id: String,
    /// Partitions of every topic that `stepgate topics create` makes.
    pub partitions: i32,
    /// Replication factor of the topics that `stepgate topics create` makes.
    pub replication_factor: i32,
    /// Consumer session timeout: a gate that sends no heartbeat for this long
    /// loses its partitions to the others.
    ///
    /// Advanced: a restarted gate takes its partitions back at once (static
    /// membership), whatever this is; a dead one's wait this long, and the
    /// others learn of the move within a heartbeat (a thirtieth of this, at
    /// most 3 s).
    pub session_timeout: Dur,
    /// Transaction timeout (bounds how long a dead process's open transaction can
    /// block read_committed consumers).
    ///
    /// Advanced: the broker caps it (`transaction.max.timeout.ms`, 15 minutes
    /// by default).
    pub transaction_timeout: Dur,
    /// Any librdkafka property (TLS, SASL, …), applied to every client, except
    /// those stepgate sets itself (the table below).
    pub client: BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topics: TopicsConfig::default(),
            gate_group: "stepgate-gate".into(),
            instance_id: default_instance_id(),
            partitions: 4,
            replication_factor: 1,
            session_timeout: dur("30s"),
            transaction_timeout: dur("30s"),
            client: BTreeMap::new(),
        }
    }
}

/// `[kafka.client]` properties that stepgate sets itself, because the
/// guarantee rests on them or because a key of its own sets them: each is
/// refused at start ([`Config::validate`](super::Config::validate)) with why, and what to do instead.
/// Everything else (TLS, SASL, timeouts, `message.max.bytes`, `partitioner`:
/// every record stepgate writes names its partition, only DLQ copies do not,
/// …) passes through to every client.
pub const REFUSED_CLIENT_PROPERTIES: &[(&str, &str)] = &[
    (
        "isolation.level",
        "stepgate reads only committed records (read_committed); read_uncommitted would act on intents, outcomes and state of transactions that were aborted. Remove it.",
    ),
    (
        "enable.auto.commit",
        "the gate commits its input offsets inside each transaction, with the records they caused; an automatic commit would move past inputs whose outcome was never written. Remove it.",
    ),
    (
        "enable.auto.offset.store",
        "the gate stores its input offsets only inside each transaction; an automatic store would let a commit skip inputs whose outcome was never written. Remove it.",
    ),
    (
        "auto.offset.reset",
        "stepgate chooses where each reader starts (the gate at the beginning of a partition with no committed offset, a restore at its stored offset or nowhere); `latest` would skip intents published before the group first committed. Remove it.",
    ),
    (
        "partition.assignment.strategy",
        "the gate needs range assignment, which gives partition p of `intents` and of `progress` to the same process; another strategy splits a workflow's inputs between two gates. Remove it.",
    ),
    (
        "group.protocol",
        "the gate uses the classic group protocol with range assignment, which keeps co-partitioned topics on one process; the broker-side protocol (KIP-848) assigns partitions by its own rule. Remove it.",
    ),
    (
        "group.remote.assignor",
        "the gate uses the classic group protocol with range assignment; a broker-side assignor would split co-partitioned topics between processes. Remove it.",
    ),
    (
        "group.id",
        "stepgate names every consumer group itself (the gates', and one per restore or operator read); set `kafka.gate_group` instead.",
    ),
    (
        "group.instance.id",
        "stepgate derives the static membership of each consumer from `kafka.instance_id`, which must differ between processes; set `kafka.instance_id` instead.",
    ),
    (
        "transactional.id",
        "stepgate derives the transactional id from `kafka.instance_id`, so that a restarted process fences its predecessor's transactions; a fixed id shared by processes would fence live gates or let a zombie commit. Set `kafka.instance_id` instead.",
    ),
    (
        "enable.idempotence",
        "stepgate's transactions and operator commands need the idempotent producer (no duplicate or reordered record on a retry). Remove it.",
    ),
    (
        "acks",
        "a transaction must commit only records every in-sync replica has (acks=all), or a broker failover loses an outcome that was answered. Remove it.",
    ),
    (
        "request.required.acks",
        "a transaction must commit only records every in-sync replica has (acks=all), or a broker failover loses an outcome that was answered. Remove it.",
    ),
    (
        "max.in.flight.requests.per.connection",
        "the idempotent producer keeps records in order only with at most 5 requests in flight, which librdkafka's default already is. Remove it.",
    ),
    (
        "max.in.flight",
        "the idempotent producer keeps records in order only with at most 5 requests in flight, which librdkafka's default already is. Remove it.",
    ),
    (
        "transaction.timeout.ms",
        "stepgate sets it from `kafka.transaction_timeout`; set that instead.",
    ),
    (
        "session.timeout.ms",
        "stepgate sets it from `kafka.session_timeout`; set that instead.",
    ),
    (
        "bootstrap.servers",
        "stepgate sets it from `kafka.brokers` (which its clients and checks all read); set that instead.",
    ),
];

/// Why a `[kafka.client]` property may not be set, when it may not.
pub fn refused_client_property(name: &str) -> Option<&'static str> {
    let name = name.trim().to_ascii_lowercase();
    REFUSED_CLIENT_PROPERTIES
        .iter()
        .find(|(refused, _)| *refused == name)
        .map(|(_, why)| *why)
}

/// `[kafka.topics]`: the names of stepgate's topics. Public ones are read or
/// written by agents and people's tools; internal ones by stepgate alone.
/// `stepgate topics create` makes them all.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicsConfig {
    /// Agents' intents (public).
    pub intents: String,
    /// Final answers (public).
    pub results: String,
    /// Refused inputs with their reasons (public).
    pub dlq: String,
    /// The calls topic of each worker pool (tools declared `pool = "…"`):
    /// `{pool}` is replaced by the pool's name (internal; read by its workers).
    pub pool_calls: String,
    /// Outcomes of calls whose partition moved to another gate while they ran,
    /// handed to the partition's owner (internal).
    pub progress: String,
    /// The gate's state changes, compacted: restores a partition's state on a new
    /// owner or disk (internal).
    pub changelog: String,
    /// Operators → gate: resolutions of in-doubt steps, approvals and denials
    /// (written by `stepgate resolve` / `stepgate approvals`).
    pub commands: String,
    /// Gate → operators: calls waiting for a person's approval, and the
    /// decisions (public: an approval UI can read it).
    pub approvals: String,
}

impl TopicsConfig {
    /// Defaults under a name prefix (tests use a random one).
    pub fn with_prefix(prefix: &str) -> Self {
        TopicsConfig {
            intents: format!("{prefix}.intents"),
            results: format!("{prefix}.results"),
            dlq: format!("{prefix}.dlq"),
            pool_calls: format!("{prefix}.calls.{{pool}}"),
            progress: format!("{prefix}.progress"),
            changelog: format!("{prefix}.changelog"),
            commands: format!("{prefix}.commands"),
            approvals: format!("{prefix}.approvals"),
        }
    }

    /// The calls topic of worker pool `pool`.
    pub fn calls_for(&self, pool: &str) -> String {
        self.pool_calls.replace("{pool}", pool)
    }

    /// Every topic name, public ones first.
    pub fn all(&self) -> [&String; 7] {
        [
            &self.intents,
            &self.results,
            &self.dlq,
            &self.progress,
            &self.changelog,
            &self.commands,
            &self.approvals,
        ]
    }
}

impl Default for TopicsConfig {
    fn default() -> Self {
        TopicsConfig::with_prefix("stepgate")
    }
}

impl KafkaConfig {
    /// The `[kafka.client]` pass-through redacted ([`redact_client_properties`]).
    pub fn redacted(&self) -> KafkaConfig {
        KafkaConfig {
            client: redact_client_properties(&self.client),
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("KafkaConfig")
            .field("brokers", &r.brokers)
            .field("topics", &r.topics)
            .field("gate_group", &r.gate_group)
            .field("instance_id", &r.instance_id)
            .field("partitions", &r.partitions)
            .field("replication_factor", &r.replication_factor)
            .field("session_timeout", &r.session_timeout)
            .field("transaction_timeout", &r.transaction_timeout)
            .field("client", &r.client)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::env_schema::env_part;
    use crate::config::tests::env;

    #[test]
    fn client_properties_that_break_the_guarantee_are_refused() {
        // Each refused property, with what its message must say.
        let cases = [
            ("isolation.level", "read_uncommitted", "read_committed"),
            ("enable.auto.commit", "true", "inside each transaction"),
            (
                "enable.auto.offset.store",
                "true",
                "only inside each transaction",
            ),
            ("auto.offset.reset", "latest", "would skip intents"),
            (
                "partition.assignment.strategy",
                "roundrobin",
                "range assignment",
            ),
            ("group.protocol", "consumer", "KIP-848"),
            ("group.remote.assignor", "uniform", "broker-side assignor"),
            ("group.id", "g", "set `kafka.gate_group` instead"),
            ("group.instance.id", "i", "set `kafka.instance_id` instead"),
            ("transactional.id", "t", "fences its predecessor"),
            ("enable.idempotence", "false", "idempotent producer"),
            ("acks", "1", "acks=all"),
            ("request.required.acks", "1", "acks=all"),
            ("max.in.flight.requests.per.connection", "20", "at most 5"),
            ("max.in.flight", "20", "at most 5"),
            ("transaction.timeout.ms", "60000", "set that instead"),
            ("session.timeout.ms", "60000", "`kafka.session_timeout`"),
            ("bootstrap.servers", "h:9092", "`kafka.brokers`"),
        ];
        assert_eq!(cases.len(), REFUSED_CLIENT_PROPERTIES.len());
        for (name, value, says) in cases {
            let e = Config::from_toml_str(
                &format!("[kafka.client]\n\"{name}\" = \"{value}\"\n"),
                env(&[]),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(&format!("kafka.client.\"{name}\"")), "{e}");
            assert!(
                e.contains("cannot be set") && e.contains(says),
                "{name}: {e}"
            );
            // From the environment too.
            let var = format!("STEPGATE_KAFKA_CLIENT_{}", env_part(&[name]));
            let e = Config::from_toml_str("", env(&[(var.as_str(), value)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{var}: {e}");
        }
        // In any case.
        let e = Config::from_toml_str("[kafka.client]\n\"ACKS\" = \"1\"\n", env(&[])).unwrap_err();
        assert!(e.to_string().contains("acks=all"), "{e}");
        // What stepgate does not rely on passes through.
        let c = Config::from_toml_str(
            "[kafka.client]\n\"security.protocol\" = \"ssl\"\npartitioner = \"murmur2_random\"\n\
             \"message.max.bytes\" = \"2000000\"\n\"linger.ms\" = \"5\"\n",
            env(&[]),
        )
        .unwrap();
        assert_eq!(c.kafka.client["partitioner"], "murmur2_random");
    }

    #[test]
    fn a_gate_heartbeats_every_thirtieth_of_its_session_timeout() {
        let heartbeat = |session: &str| {
            let k = KafkaConfig {
                session_timeout: dur(session),
                ..KafkaConfig::default()
            };
            crate::kafka::txn_consumer_config(&k, "g", "i")
                .get("heartbeat.interval.ms")
                .map(str::to_owned)
        };
        assert_eq!(heartbeat("30s").as_deref(), Some("1000"));
        assert_eq!(heartbeat("6s").as_deref(), Some("200"));
        // Never longer than librdkafka's own default.
        assert_eq!(heartbeat("300s").as_deref(), Some("3000"));
    }

    #[test]
    fn every_property_stepgate_sets_is_refused_or_tunable() {
        // What stepgate sets that an operator may tune (performance, not the
        // guarantee). Anything else it sets must be refused in `[kafka.client]`.
        const TUNABLE: [&str; 9] = [
            // Names the gate's consumer after its instance unless set
            // (`gate::standby` then cannot fence a departed gate's producers).
            "client.id",
            "heartbeat.interval.ms",
            "linger.ms",
            "message.max.bytes",
            "max.poll.interval.ms",
            "statistics.interval.ms",
            "fetch.wait.max.ms",
            "queued.max.messages.kbytes",
            "fetch.queue.backoff.ms",
        ];
        let k = KafkaConfig::default();
        let consumer = crate::kafka::txn_consumer_config(&k, "g", "i");
        let producer = crate::kafka::txn_producer_config(&k, "t");
        for (name, _) in consumer
            .config_map()
            .into_iter()
            .chain(producer.config_map())
        {
            assert!(
                TUNABLE.contains(&name) || refused_client_property(name).is_some(),
                "stepgate sets `{name}`: refuse it in [kafka.client] (REFUSED_CLIENT_PROPERTIES) or list it as tunable here"
            );
        }
    }
}
