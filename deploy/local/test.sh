#!/usr/bin/env bash
# The test command: installs what is missing, starts a real single-node Apache
# Kafka broker (KRaft, 127.0.0.1), then runs fmt, clippy and every test against it.
set -euo pipefail
cd "$(dirname "$0")/../.."

# A `time:` line after each step (its seconds, and the total so far), so that
# CI runs can be compared step by step.
begun=$SECONDS
timed() {
  local name=$1 at=$SECONDS
  shift
  "$@"
  echo "time: $name $((SECONDS - at)) s (total $((SECONDS - begun)) s)"
}

timed deps env STEPGATE_NEED_KAFKA=1 bash deploy/local/deps.sh

# The tests' topics are disposable (random names, a set per test). A broker
# this script starts begins empty: a data dir that kept every run's topics grew
# to 12 416 partitions and the broker ran out of heap (OutOfMemoryError) mid-run.
# A broker already running (yours) is used as it is.
if ! bash deploy/local/kafka.sh status >/dev/null 2>&1; then
  bash deploy/local/kafka.sh stop --wipe
fi
at=$SECONDS
coordinates="$(bash deploy/local/kafka.sh start)"
echo "time: broker $((SECONDS - at)) s (total $((SECONDS - begun)) s)"
export KAFKA_BROKERS="127.0.0.1:${KAFKA_PORT:-9092}"
# Its SASL_SSL listener's address, user, password and CA (tests/broker/secured.rs).
export "$(grep '^KAFKA_SASL_SSL_ENV=' <<<"$coordinates")"
if [[ "${STEPGATE_KEEP_KAFKA:-0}" != 1 ]]; then
  trap 'bash deploy/local/kafka.sh stop' EXIT
fi

timed fmt cargo fmt --check
# `test-hooks`: the fault-injection hooks (STEPGATE_TEST_*) the crash and
# recovery tests drive; release builds never have them.
timed clippy cargo clippy --all-targets --features test-hooks -- -D warnings
# `cargo test` (default targets) builds the examples as programs, which
# --all-targets builds only as test harnesses: tests/broker/tool_ledger.rs runs
# examples/ticket_tool.
timed build cargo test --no-run --features test-hooks
# A CI report shows only the end of a long output, where a failure's backtrace
# hides its message: on a failure the messages are printed again, last.
all_tests() {
  local out status=0
  out="$(mktemp)"
  cargo test --all-targets --no-fail-fast --features test-hooks 2>&1 | tee "$out" || status=$?
  if ((status != 0)); then
    echo "--- the failures' messages again, without their backtraces ---"
    awk '/panicked at/ { n = 60 }
         n > 0 && (/^stack backtrace:/ || /^note: /) { n = 0 }
         n > 0 { print; n-- }' "$out"
  fi
  rm -f "$out"
  return "$status"
}
timed test all_tests
# And that without the feature the hooks' variables do nothing.
timed hook_tests cargo test --lib -- hook_tests
# The TypeScript client (clients/typescript): its dependencies from the npm
# registry as its lockfile pins them (`npm ci`), then its own tests (node's test
# runner) against the broker above and the debug stepgate the test step built.
# @confluentinc/kafka-javascript is a native module whose prebuilt binary comes
# from outside the npm registry: where that cannot be fetched, it is built from
# source against the system's OpenSSL, zlib and SASL (CKJS_LINKING=dynamic,
# about 3 min on 2 cores). The installed node_modules is kept per lockfile in
# $STEPGATE_NPM_CACHE, so a later run with the same lockfile skips both.
ts_client() (
  cd clients/typescript
  local cache=${STEPGATE_NPM_CACHE:-/var/cache/stepgate/npm} lock kept
  lock=$(sha256sum package-lock.json | cut -c1-16)
  kept="$cache/ts-client-$lock"
  if [[ ! -e node_modules && -d "$kept/node_modules/@confluentinc/kafka-javascript/build/Release" ]]; then
    echo "node_modules: kept for this lockfile ($kept)"
    ln -s "$kept/node_modules" node_modules
  elif [[ ! -d node_modules/@confluentinc/kafka-javascript/build/Release ]]; then
    CKJS_LINKING=dynamic npm ci --no-audit --no-fund --loglevel=error
    if mkdir -p "$cache" 2>/dev/null && [[ -w "$cache" ]]; then
      rm -rf "$kept.tmp" "$kept" && mkdir -p "$kept.tmp" &&
        cp -a node_modules "$kept.tmp/" && mv "$kept.tmp" "$kept"
    fi
  fi
  npm test
)
timed ts_client ts_client
