//! Topics: creating them, reading their partition counts, and refusing a
//! layout that would misroute answers.

use super::{
    INTENTS_MAX_MESSAGE_BYTES, KafkaSetupError, MESSAGE_MAX_BYTES, base_config, check_connection,
};
use crate::config::KafkaConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use std::time::Duration;

/// The changelog topic's `delete.retention.ms` (how long compaction keeps a
/// tombstone readable), as the broker applies it (the topic's own, else the
/// broker's default). None, with a warning, when the broker does not say (no
/// DescribeConfigs permission, a mock cluster).
pub async fn changelog_delete_retention(cfg: &KafkaConfig) -> Option<Duration> {
    use rdkafka::admin::ResourceSpecifier;
    let read = async {
        let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
        let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let spec = ResourceSpecifier::Topic(cfg.topics.changelog.as_str());
        let described = admin.describe_configs([&spec], &opts).await?;
        let value = described
            .into_iter()
            .next()
            .and_then(|r| r.ok())
            .and_then(|c| {
                c.get("delete.retention.ms")
                    .and_then(|e| e.value.as_deref())
                    .and_then(|v| v.parse::<u64>().ok())
            });
        Ok::<_, KafkaError>(value)
    };
    match read.await {
        Ok(Some(ms)) => Some(Duration::from_millis(ms)),
        Ok(None) => {
            tracing::warn!(topic = %cfg.topics.changelog, "the changelog's delete.retention.ms is not known: Kafka's default (24 h) is assumed when judging whether a partition's local state is recent enough to resume from");
            None
        }
        Err(e) => {
            tracing::warn!(topic = %cfg.topics.changelog, error = %e, "cannot read the changelog's delete.retention.ms: Kafka's default (24 h) is assumed when judging whether a partition's local state is recent enough to resume from");
            None
        }
    }
}

/// Partition counts of the topics, or an error naming the missing one.
/// A refused login or TLS handshake fails at once, naming its cause.
pub fn partition_counts(cfg: &KafkaConfig, topics: &[&str]) -> Result<Vec<usize>, KafkaSetupError> {
    let md = stepgate_client::connect::topic_partitions(
        &base_config(cfg),
        None,
        Duration::from_secs(15),
    )?;
    topics
        .iter()
        .map(|t| {
            md.iter()
                .find(|mt| mt.name == *t && mt.ok)
                .map(|mt| mt.partitions)
                .filter(|n| *n > 0)
                .ok_or_else(|| KafkaSetupError::MissingTopic((*t).to_owned()))
        })
        .collect()
}

/// Refuse to start on a topic layout that would misroute answers.
pub fn check_layout(cfg: &KafkaConfig) -> Result<usize, KafkaSetupError> {
    check_counts(&cfg.topics, &layout_counts(cfg)?)
}

/// The partition count of each topic stepgate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub intents: usize,
    pub results: usize,
    pub dlq: usize,
    pub progress: usize,
    pub changelog: usize,
    pub commands: usize,
    pub approvals: usize,
}

/// The partition counts of every topic. Blocking.
pub fn layout_counts(cfg: &KafkaConfig) -> Result<Layout, KafkaSetupError> {
    let t = &cfg.topics;
    let names = [
        &t.intents,
        &t.results,
        &t.dlq,
        &t.progress,
        &t.changelog,
        &t.commands,
        &t.approvals,
    ]
    .map(String::as_str);
    let [
        intents,
        results,
        dlq,
        progress,
        changelog,
        commands,
        approvals,
    ] = partition_counts(cfg, &names)?[..]
    else {
        unreachable!("a count for each topic asked for");
    };
    Ok(Layout {
        intents,
        results,
        dlq,
        progress,
        changelog,
        commands,
        approvals,
    })
}

/// A [`Layout`] that would misroute answers is refused; the intents topic's
/// count otherwise.
pub fn check_counts(
    t: &crate::config::TopicsConfig,
    counts: &Layout,
) -> Result<usize, KafkaSetupError> {
    let Layout {
        intents,
        results,
        progress,
        changelog,
        commands,
        ..
    } = *counts;
    if results < intents {
        return Err(KafkaSetupError::Layout(format!(
            "`{}` has {results} partitions but `{}` has {intents}: results are written to the intent's partition number, so results needs at least as many. Add partitions to `{}` (kafka-topics --alter --partitions {intents}) or recreate both with `stepgate topics create`.",
            t.results, t.intents, t.results
        )));
    }
    if progress != intents || changelog != intents || commands != intents {
        return Err(KafkaSetupError::Layout(format!(
            "the internal topics `{}` ({progress}), `{}` ({changelog}) and `{}` ({commands}) must have as many partitions as `{}` ({intents}); `stepgate topics create` makes them equal.",
            t.progress, t.changelog, t.commands, t.intents
        )));
    }
    Ok(intents)
}

/// Create every topic stepgate uses (existing ones are left as they are).
/// Returns (topic, created?) pairs.
pub async fn create_topics(
    cfg: &KafkaConfig,
    state: &crate::config::StateConfig,
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    check_connection(cfg).await?;
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let t = &cfg.topics;
    let retention_ms = state.retention.0.as_millis().max(1).to_string();
    // Operators' decisions outlive the steps they settled: the audit shows them.
    let decisions_ms = state
        .decisions_retention
        .as_ref()
        .map_or_else(|| "-1".to_owned(), |d| d.0.as_millis().max(1).to_string());
    let (intents_max, others_max) = (
        INTENTS_MAX_MESSAGE_BYTES.to_string(),
        MESSAGE_MAX_BYTES.to_string(),
    );
    let (intents_max, others_max) = (intents_max.as_str(), others_max.as_str());
    let names = t.all();
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| {
            let topic = NewTopic::new(
                n,
                cfg.partitions,
                TopicReplication::Fixed(cfg.replication_factor),
            );
            // Explicit record size limits (see MESSAGE_MAX_BYTES): the
            // broker's default (1 MiB) is below what stepgate may write.
            let topic = topic.set(
                "max.message.bytes",
                if *n == &t.intents {
                    intents_max
                } else {
                    others_max
                },
            );
            if *n == &t.changelog {
                // Latest value per key; tombstones remove purged records.
                topic.set("cleanup.policy", "compact")
            } else if *n == &t.commands {
                topic.set("retention.ms", &decisions_ms)
            } else {
                // Kept at least as long as steps are remembered, so a late repeat
                // and an audit can still be traced through them.
                topic.set("retention.ms", &retention_ms)
            }
        })
        .collect();
    let out = create_each(&admin, &topics, false).await?;
    // Creation returns before every broker's metadata shows the topics: wait for
    // them, so that what runs next (a layout check, stepgate itself) sees them.
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    wait_for_topics(cfg, names).await?;
    Ok(out)
}

/// Create the calls topic of each worker pool (docs/design.md "Worker
/// pools"): `kafka.partitions` partitions (independent of `intents`: workers
/// scale apart from the gates), kept as long as steps. Existing ones are left
/// as they are. Returns (topic, created?) pairs.
pub async fn create_pool_topics(
    cfg: &KafkaConfig,
    state: &crate::config::StateConfig,
    pools: &[String],
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    if pools.is_empty() {
        return Ok(Vec::new());
    }
    let admin: AdminClient<DefaultClientContext> = base_config(cfg).create()?;
    let retention_ms = state.retention.0.as_millis().max(1).to_string();
    let max_bytes = MESSAGE_MAX_BYTES.to_string();
    let names: Vec<String> = pools.iter().map(|p| cfg.topics.calls_for(p)).collect();
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| {
            NewTopic::new(
                n,
                cfg.partitions,
                TopicReplication::Fixed(cfg.replication_factor),
            )
            .set("max.message.bytes", &max_bytes)
            .set("retention.ms", &retention_ms)
        })
        .collect();
    // A gate or worker granted no Create (docs/deploying.md: an admin makes
    // the topics) goes on when they exist; the wait below says if they do not.
    let out = create_each(&admin, &topics, true).await?;
    // Seen in the metadata before anyone produces to or subscribes to them.
    wait_for_topics(cfg, names).await?;
    Ok(out)
}

/// Create `topics`: each name, and whether it was made now (false: it
/// existed, or — `unauthorized_ok` — this principal may not create it).
async fn create_each(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[NewTopic<'_>],
    unauthorized_ok: bool,
) -> Result<Vec<(String, bool)>, KafkaSetupError> {
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let mut out = Vec::new();
    for r in admin.create_topics(topics.iter(), &opts).await? {
        match r {
            Ok(name) => out.push((name, true)),
            Err((name, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {
                out.push((name, false))
            }
            Err((
                name,
                rdkafka::types::RDKafkaErrorCode::TopicAuthorizationFailed
                | rdkafka::types::RDKafkaErrorCode::ClusterAuthorizationFailed,
            )) if unauthorized_ok => out.push((name, false)),
            Err((name, code)) => {
                return Err(KafkaSetupError::Layout(format!(
                    "could not create topic `{name}`: {code}"
                )));
            }
        }
    }
    Ok(out)
}

/// Wait (up to 30 s) until the brokers' metadata shows every topic of `names`.
async fn wait_for_topics(cfg: &KafkaConfig, names: Vec<String>) -> Result<(), KafkaSetupError> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match partition_counts(&cfg, &refs) {
                Err(KafkaSetupError::MissingTopic(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}
