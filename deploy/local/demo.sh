#!/usr/bin/env bash
# The zero-setup demo: installs what is missing, builds, and runs `stepgate demo`
# (an in-process Kafka, the gate, which calls the tools itself, demo tools and a
# scripted agent).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/deps.sh
# Built with --all-targets so the demo and the tests share one build of RocksDB
# (a plain `cargo run` resolves features without dev-dependencies and would
# compile RocksDB a second time).
cargo build --all-targets --quiet
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -e 's/.*"target_directory":"\([^"]*\)".*/\1/')
exec "$target_dir/debug/stepgate" demo "$@"
