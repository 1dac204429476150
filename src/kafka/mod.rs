//! Kafka plumbing, by chore: client configs ([`clients`]), the gate
//! consumer's rebalance context ([`context`]), the group's members and
//! their assignments ([`group`]), record size limits
//! ([`limits`]), reading topics to their end ([`reading`]), creating and
//! checking topics ([`topics`]), and transactions ([`txn`]). Everything is
//! re-exported here: callers say `kafka::<item>`.

use rdkafka::error::KafkaError;
use thiserror::Error;

mod clients;
mod context;
mod group;
mod limits;
mod reading;
mod topics;
mod txn;

pub use clients::*;
pub use context::*;
pub use group::*;
pub use limits::*;
pub use reading::*;
pub use topics::*;
pub use txn::*;

#[derive(Debug, Error)]
pub enum KafkaSetupError {
    #[error("Kafka")]
    Kafka(#[from] KafkaError),
    /// The brokers could not be reached, or refused the login or the TLS
    /// handshake ([`stepgate_client::connect`]).
    #[error(transparent)]
    Connect(#[from] stepgate_client::ConnectError),
    #[error(
        "topic `{0}` does not exist: create the topics with `stepgate topics create --config <file>`"
    )]
    MissingTopic(String),
    #[error("{0}")]
    Layout(String),
    #[error("{0}")]
    Sizes(String),
}

/// Run a blocking client call off the async threads.
pub async fn blocking<T: Send + 'static, E: From<KafkaError> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| E::from(KafkaError::Canceled))?
}

#[cfg(test)]
mod tests;
