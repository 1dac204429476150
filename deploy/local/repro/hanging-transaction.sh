#!/usr/bin/env bash
# Reproduces, with librdkafka alone (no stepgate), what docs/guarantees.md
# "Faults and bad input" describes: a single Kafka broker SIGKILLed while a
# transactional producer commits can come back with an acknowledged
# transaction's commit marker missing on its partition — the transaction hangs
# there, its records invisible to read_committed readers.
#   bash deploy/local/repro/hanging-transaction.sh [trials]   # ~40 s a trial
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KAFKA_PORT=39092 KAFKA_CONTROLLER_PORT=39093
for i in $(seq 1 "${1:-5}"); do
  dir="$(mktemp -d)"; export KAFKA_DATA_DIR="$dir"
  bash "$here/../kafka.sh" start >/dev/null
  python3 "$here/txn_commit_loop.py" 127.0.0.1:39092 "$dir/acked" >/dev/null 2>&1 &
  sleep $((8 + i))
  kill -9 "$(cat "$dir/kafka.pid")"; sleep 2
  bash "$here/../kafka.sh" start >/dev/null
  wait || true
  echo "trial $i: $(python3 "$here/read_committed_check.py" 127.0.0.1:39092 "$dir/acked")"
  bash "$here/../kafka.sh" stop >/dev/null
  rm -rf "$dir"
done
