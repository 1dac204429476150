#!/usr/bin/env bash
# The benchmarks in one command: starts the local broker if needed, builds the
# release binaries and the Kafka Streams peer, then runs `stepgate-bench all`
# (stepgate at its shipped defaults vs. an rdkafka passthrough and Kafka Streams,
# inline and calling the HTTP tool, on one workload; the sequential mode, one
# call at a time; then stepgate with 1 M and 10 M step records in its state) and
# the durable engines (Restate, DBOS) beside it.
#
# A full run (no arguments) keeps its figures in benches/ (results-<id>.json,
# durable-<id>.json, RESULTS-<id>.md) and rewrites docs/performance.md's
# generated part and README.md's performance table from them
# (`stepgate-bench render-docs`); commit the five files together.
#
#   benches/bench.sh                 # full size (~30 min on 2 cores, release build warm)
#   benches/bench.sh quick           # small sizes (~8 min), to check the setup; writes no docs
#   benches/bench.sh [quick] --intents 50000 ...   # any stepgate-bench option
#   benches/bench.sh cluster [quick]  # stepgate and the passthrough on one node (replication
#                                     # factor 1), then on deploy/local/cluster.sh's three nodes
#                                     # (replication factor 3, min.insync.replicas=2), one run,
#                                     # ratios at the end (~12 min; quick ~5)
#
# Env: KAFKA_BROKERS (default: the local broker deploy/local/kafka.sh starts),
# CARGO_TARGET_DIR, BENCH_JSON (where the figures go as JSON; default
# /tmp/stepgate-bench.json), PERF=1 (profile stepgate's flood with perf record),
# KAFKA_JVM_OPTS (the broker's JVM options when bench.sh starts it; default
# -XX:-UseCodeCacheFlushing), DURABLE=0 (skip the Restate (Python and
# TypeScript SDKs) and DBOS peers; the run then writes no docs), DURABLE_JSON
# (their figures; default /tmp/stepgate-durable.json), DOCS=0 (a full run that
# keeps its figures in /tmp only), STEPGATE_BENCH_RUN_ID (the run's id).
# Any other STEPGATE_ variable reaches every stepgate the bench starts, as a
# config override; the report and the page name each one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target="${CARGO_TARGET_DIR:-target}"

# The command as typed, for the report and the page.
typed="bash benches/bench.sh"
for a in "$@"; do
    typed+=" $(printf '%q' "$a")"
done
export STEPGATE_BENCH_COMMAND="$typed"
# Only a full-size run of every system rewrites the docs.
full=0
if [[ $# -eq 0 && "${DURABLE:-1}" != 0 && "${DOCS:-1}" != 0 ]]; then
    full=1
fi
overrides="$(env | grep -o '^STEPGATE_[A-Z0-9_]*' | grep -v '^STEPGATE_BENCH_' || true)"
if [[ -n "$overrides" ]]; then
    echo "bench.sh: stepgate runs with ${overrides//$'\n'/ } set, not at its shipped defaults" >&2
fi

args=()
quick=0
cluster=0
if [[ "${1:-}" == cluster ]]; then
    shift
    cluster=1
fi
if [[ "${1:-}" == quick ]]; then
    shift
    quick=1
    args+=(--intents 20000 --broker-warmup 10000 --paced 5s --sequential 50 --scale-sizes 100000,1000000 --scale-intents 20000)
fi

if [[ -z "${KAFKA_BROKERS:-}" ]]; then
    # A broker started here keeps its compiled code: JDK 17's code cache
    # sweeper otherwise throws away what went cold in the bench's quiet
    # stretches, and the next flood pays the broker's JIT again (issue #34).
    # A broker already running keeps its own options (the report names them).
    KAFKA_JVM_OPTS="${KAFKA_JVM_OPTS--XX:-UseCodeCacheFlushing}" \
        bash deploy/local/kafka.sh start >/dev/null
    export KAFKA_BROKERS=127.0.0.1:9092
fi

echo "bench.sh: building release binaries (the first build takes ~18 min on 2 cores)" >&2
# `--bin` applies to every `-p` given: name both binaries.
cargo build --release --quiet -p stepgate -p stepgate-bench --bin stepgate --bin stepgate-bench

# The broker's request and byte counters over JMX (benches/jmx), when a JDK is here.
if command -v javac >/dev/null; then
    mkdir -p "$target/jmx"
    javac -d "$target/jmx" benches/jmx/BrokerMetrics.java && export BENCH_JMX_CLASSES="$target/jmx"
fi

export STEPGATE_BENCH_RUN_ID="${STEPGATE_BENCH_RUN_ID:-sgb$(printf '%x' $(( $(date +%s) & 0xffffff )))}"
if [[ "$cluster" == 1 ]]; then
    # The three nodes' heaps are small (cluster.sh), so they fit beside the
    # single node; only one of the two is busy at a time.
    cluster_brokers="$(bash deploy/local/cluster.sh start | sed -n 's/^CLUSTER_BROKERS=//p')"
    [[ -n "$cluster_brokers" ]] || { echo "bench.sh: the cluster did not start" >&2; exit 1; }
    size=(--intents 100000 --paced 10s --sequential 200)
    if [[ "$quick" == 1 ]]; then
        size=(--intents 20000 --broker-warmup 10000 --paced 5s --sequential 50)
    fi
    exec "$target/release/stepgate-bench" cluster --cluster-brokers "$cluster_brokers" \
        --only stepgate,passthrough --executor-concurrency 1024 "${size[@]}" \
        --json "${BENCH_JSON:-/tmp/stepgate-bench-cluster.json}" "$@"
fi
if jar="$(bash benches/peers/build.sh)"; then
    args+=(--kstreams-jar "$jar")
else
    echo "bench.sh: the Kafka Streams peer did not build; running without it" >&2
fi
if [[ "${PERF:-0}" == 1 ]] && command -v perf >/dev/null; then
    args+=(--perf /tmp/stepgate-bench.perf.data)
    echo "bench.sh: profile of stepgate's flood → /tmp/stepgate-bench.perf.data (perf report -i …)" >&2
fi

results_json="${BENCH_JSON:-/tmp/stepgate-bench.json}"
durable_json="${DURABLE_JSON:-/tmp/stepgate-durable.json}"
report="$(mktemp /tmp/stepgate-bench-report.XXXXXX)"
trap 'rm -f "$report"' EXIT
"$target/release/stepgate-bench" all --fast-path --json "$results_json" "${args[@]}" "$@" | tee "$report"

# The durable-execution engines (Restate with its Python and TypeScript SDKs,
# DBOS on PostgreSQL) beside stepgate,
# and what each does with a call cut off by kill -9 (issue #17). DURABLE=0 skips.
if [[ "${DURABLE:-1}" != 0 ]]; then
    durable=(--sequential 200 --paced-rate 1000 --paced-seconds 10 --flood 5000)
    if [[ "$quick" == 1 ]]; then
        durable=(--sequential 50 --paced-rate 1000 --paced-seconds 3 --flood 2000)
    fi
    peers="$(bash benches/peers/durable/setup.sh)"
    "$peers/venv/bin/python" benches/peers/durable/run.py --peers "$peers" \
        --stepgate-bin "$target/release/stepgate" --brokers "$KAFKA_BROKERS" \
        --run-id "$STEPGATE_BENCH_RUN_ID" "${durable[@]}" \
        --json "$durable_json"
fi

if [[ "$full" == 1 ]]; then
    id="$STEPGATE_BENCH_RUN_ID"
    cp "$results_json" "benches/results-$id.json"
    cp "$durable_json" "benches/durable-$id.json"
    cp "$report" "benches/RESULTS-$id.md"
    "$target/release/stepgate-bench" render-docs "benches/results-$id.json" \
        --durable "benches/durable-$id.json"
    echo "bench.sh: commit benches/results-$id.json, benches/durable-$id.json, benches/RESULTS-$id.md, docs/performance.md and README.md together" >&2
else
    echo "bench.sh: not a full run (arguments, DURABLE=0 or DOCS=0): figures in $results_json, docs left as they are" >&2
fi
