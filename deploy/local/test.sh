#!/usr/bin/env bash
# The test command: installs what is missing, starts a real single-node Apache
# Kafka broker (KRaft, 127.0.0.1), then runs fmt, clippy and every test against it.
set -euo pipefail
cd "$(dirname "$0")/../.."

STEPGATE_NEED_KAFKA=1 bash deploy/local/deps.sh

bash deploy/local/kafka.sh start
export KAFKA_BROKERS="127.0.0.1:${KAFKA_PORT:-9092}"
if [[ "${STEPGATE_KEEP_KAFKA:-0}" != 1 ]]; then
  trap 'bash deploy/local/kafka.sh stop' EXIT
fi

cargo fmt --check
cargo clippy --all-targets -- -D warnings
# `cargo test` (default targets) builds the examples as programs, which
# --all-targets builds only as test harnesses: tests/tool_ledger.rs runs
# examples/ticket_tool.
cargo test --no-run
cargo test --all-targets
