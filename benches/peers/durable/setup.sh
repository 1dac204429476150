#!/usr/bin/env bash
# Installs the durable-execution peers of benches/peers/durable/run.py, as a new
# user would, from the package registries: PostgreSQL (Debian's package, for
# DBOS), a Python venv with dbos, restate-sdk, hypercorn and confluent-kafka, and
# the Restate server (npm's @restatedev/restate-server, a prebuilt binary), and
# the TypeScript-SDK Restate service (restate_ts/: its package.json and
# service.mjs are copied to $dir/restate_ts and its dependencies installed there,
# not in the repo), and stepgate's TypeScript client (clients/typescript, built
# in place).
# Prints the directory it installed into (peers.json there names the pieces).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
dir="${STEPGATE_PEERS_DIR:-$HOME/.cache/stepgate/durable-peers}"
mkdir -p "$dir"

if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]]; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "setup.sh: install PostgreSQL (sudo apt-get install postgresql)" >&2
    exit 1
  fi
fi
command -v npm >/dev/null || { echo "setup.sh: npm is needed (apt-get install npm)" >&2; exit 1; }

if [[ ! -x "$dir/venv/bin/python" ]]; then
  python3 -m venv "$dir/venv" >&2
fi
"$dir/venv/bin/pip" install -q "dbos==3.4.0" "restate-sdk==1.2.0" "hypercorn==0.18.0" confluent-kafka >&2
if [[ ! -x "$dir/node/node_modules/@restatedev/restate-server-linux-x64/bin/restate-server" ]]; then
  mkdir -p "$dir/node"
  (cd "$dir/node" && npm install --silent --no-audit --no-fund "@restatedev/restate-server@1.7.12" >&2)
fi
node="$(command -v node)" || { echo "setup.sh: node is needed" >&2; exit 1; }
ts="$dir/restate_ts"
mkdir -p "$ts"
if ! cmp -s "$here/restate_ts/package.json" "$ts/package.json" \
    || [[ ! -f "$ts/node_modules/@restatedev/restate-sdk/package.json" ]]; then
  cp "$here/restate_ts/package.json" "$ts/package.json"
  (cd "$ts" && npm install --silent --no-audit --no-fund >&2) || { rm -f "$ts/package.json"; exit 1; }
fi
cp "$here/restate_ts/service.mjs" "$ts/service.mjs"  # beside its node_modules
# stepgate's TypeScript client, built in its checkout as deploy/local/test.sh
# builds it (its lockfile's dependencies; the native Kafka client from source
# where its prebuilt binary cannot be fetched).
tsc="$repo/clients/typescript"
if [[ ! -d "$tsc/node_modules/@confluentinc/kafka-javascript/build/Release" ]]; then
  (cd "$tsc" && CKJS_LINKING=dynamic npm ci --no-audit --no-fund --loglevel=error >&2)
fi
(cd "$tsc" && npm run --silent build >&2)
server="$(find "$dir/node/node_modules/@restatedev" -path '*/bin/restate-server' -type f | head -1)"
cat > "$dir/peers.json" <<JSON
{"python": "$dir/venv/bin/python", "restate_server": "$server",
 "node": "$node", "restate_ts_service": "$ts/service.mjs",
 "stepgate_client": "$repo/clients/python", "stepgate_ts_client": "$tsc"}
JSON
echo "$dir"
