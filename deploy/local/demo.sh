#!/usr/bin/env bash
# The zero-setup demo: installs what is missing, builds, and runs `stepgate demo`
# (an in-process Kafka, the gate, an executor, demo tools and a scripted agent).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/deps.sh
exec cargo run --quiet -- demo "$@"
