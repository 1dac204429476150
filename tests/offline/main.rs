//! The checks that need no broker: the command line's defaults, the JSON Schemas against the types, the
//! docs' links, the configuration reference against the config's types, the deploy manifests, the demo on librdkafka's mock cluster,
//! the wheel, and the workspace's module boundaries. One test binary.

mod cli;
mod demo;
mod deploy;
mod docs;
mod performance;
mod reference;
mod schemas;
mod wheel;
mod workspace;
