#!/usr/bin/env bash
# Restart time: kill -9 a running stepgate, start it again, and print how long
# until /readyz answers and until the first new intent is answered.
# Needs a broker (KAFKA_BROKERS, default 127.0.0.1:9092: deploy/local/kafka.sh start),
# kcat and python3. Usage: benches/restart.sh [path/to/stepgate]
set -euo pipefail
bin=${1:-target/debug/stepgate}
brokers=${KAFKA_BROKERS:-127.0.0.1:9092}
work=$(mktemp -d)
p=rst$RANDOM
trap 'pkill -f "$work/c.toml" || true; kill $tool_pid 2>/dev/null || true; rm -rf "$work"' EXIT
cat > "$work/tool.py" <<'PY'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get('content-length', 0)))
        self.send_response(200); self.send_header('content-length', '2'); self.end_headers(); self.wfile.write(b'{}')
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', 18081), H).serve_forever()
PY
python3 "$work/tool.py" & tool_pid=$!
cat > "$work/c.toml" <<TOML
[kafka]
brokers = "$brokers"
instance_id = "$p"
gate_group = "$p-gate"
[kafka.topics]
intents = "$p.intents"
results = "$p.results"
dlq = "$p.dlq"
progress = "$p.progress"
changelog = "$p.changelog"
commands = "$p.commands"
approvals = "$p.approvals"
[state]
path = "$work/state"
[http]
listen = "127.0.0.1:19465"
[tools.note]
category = "keyed"
url = "http://127.0.0.1:18081/"
TOML
now() { date +%s.%N; }
answered() { kcat -C -b "$brokers" -t "$p.results" -e -q -X isolation.level=read_committed | grep -q "\"$1\""; }
send() { echo "{\"workflow_id\":\"w$1\",\"step_index\":1,\"tool\":\"note\",\"arguments\":{},\"call_id\":\"$1\"}" | kcat -P -b "$brokers" -t "$p.intents" -k "w$1"; }
"$bin" topics create --config "$work/c.toml" >/dev/null
(setsid "$bin" run --config "$work/c.toml" >"$work/1.log" 2>&1 &)
until curl -sf localhost:19465/readyz >/dev/null; do sleep 0.05; done
send warm; until answered warm; do sleep 0.05; done
pkill -9 -f "$work/c.toml"
t0=$(now)
(setsid "$bin" run --config "$work/c.toml" >"$work/2.log" 2>&1 &)
until curl -sf localhost:19465/readyz >/dev/null; do sleep 0.02; done
t1=$(now)
send after; until answered after; do sleep 0.02; done
t2=$(now)
python3 -c "print('kill -9 → ready: %.2f s; kill -9 → first new intent answered: %.2f s' % ($t1-$t0, $t2-$t0))"
