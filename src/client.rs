//! The agent side: the `stepgate-client` crate (a light crate of its own, no
//! RocksDB or server dependencies), re-exported, and its options read from a
//! stepgate config.

use crate::config::Config;
pub use stepgate_client::{Client, ClientError, ClientOptions, StepCall, Workflow};

/// Client options for the deployment a stepgate config describes: its brokers,
/// topics and librdkafka client properties (TLS, SASL, …).
pub fn options_from_config(config: &Config) -> ClientOptions {
    ClientOptions {
        intents_topic: config.kafka.topics.intents.clone(),
        results_topic: config.kafka.topics.results.clone(),
        kafka: config.kafka.client.clone(),
        ..ClientOptions::new(&config.kafka.brokers)
    }
}
