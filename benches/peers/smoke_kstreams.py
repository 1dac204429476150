#!/usr/bin/env python3
"""Smoke test of the Kafka Streams dedup peer against a real broker.

    python3 benches/peers/smoke_kstreams.py [eos|alos] [--http] [--bootstrap 127.0.0.1:9092]

Builds the jar (benches/peers/build.sh), creates its own uniquely named topics,
runs the peer, sends intents (first calls, repeats, a rephrased repeat, a new
attempt, malformed input) and checks every Result v1. Then stops it with
SIGTERM, restarts it on an EMPTY state dir (so the store must be restored from
its changelog) and checks a later repeat is still deduplicated. With --http the
peer calls a local HTTP tool (--tool-url) for each new step: once per step, with
stepgate's Idempotency-Key, and the tool's JSON body as the answer's output.
Needs python3-confluent-kafka and a broker (deploy/local/kafka.sh start).
"""
import hashlib, http.server, json, os, re, signal, struct, subprocess, sys, tempfile, threading, time, uuid
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

mode = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "eos"
bootstrap = sys.argv[sys.argv.index("--bootstrap") + 1] if "--bootstrap" in sys.argv else "127.0.0.1:9092"
use_http = "--http" in sys.argv
tool_calls = {}  # Idempotency-Key -> calls


class Tool(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        json.loads(body or b"{}")
        key = self.headers.get("Idempotency-Key", "")
        tool_calls[key] = tool_calls.get(key, 0) + 1
        out = b'{"sent": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def sg_key(wf, step, tool, attempt):
    """stepgate's Idempotency-Key (src/contract: StepKey::idempotency_key)."""
    h = hashlib.sha256(wf.encode() + b"\0" + struct.pack(">Q", step) + tool.encode() + b"\0" + struct.pack(">Q", attempt))
    return "sg1-" + h.hexdigest()


tool_url = None
if use_http:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tool)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tool_url = f"http://127.0.0.1:{server.server_address[1]}/noop"
here = os.path.dirname(os.path.abspath(__file__))
jar = subprocess.run(["bash", os.path.join(here, "build.sh")], check=True,
                     capture_output=True, text=True).stdout.strip()

run = f"kdsmoke-{mode}{'-http' if use_http else ''}-{uuid.uuid4().hex[:8]}"
t_in, t_out = f"{run}.intents", f"{run}.results"
admin = AdminClient({"bootstrap.servers": bootstrap})
for f in admin.create_topics([NewTopic(t, num_partitions=3, replication_factor=1) for t in (t_in, t_out)]).values():
    f.result(30)

FIELDS = ["workflow_id", "step_index", "tool", "attempt", "call_id", "status",
          "output", "deduplicated", "completed_at"]
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def start(state_dir):
    p = subprocess.Popen(["java", "-jar", jar, "--bootstrap", bootstrap, "--input", t_in,
                          "--output", t_out, "--app-id", run, "--state-dir", state_dir,
                          "--mode", mode, "--commit-ms", "100"] + (["--tool-url", tool_url] if tool_url else []),
                         stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    line = p.stdout.readline().strip()  # blocks until READY (or exit)
    check(line == "READY", f"peer printed READY ({time.time() - t0:.1f}s), got {line!r}")
    return p


def stop(p):
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    check(p.returncode in (0, 143), f"peer exited on SIGTERM (rc {p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


prod = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
partition_of = {}  # call_id -> intent partition


def send(wf, value, call_id=None, headers=None):
    def dr(err, msg):
        assert err is None, err
        partition_of[call_id] = msg.partition()
    v = value if isinstance(value, str) else json.dumps(value)
    prod.produce(t_in, key=wf.encode() if wf else None, value=v.encode(), headers=headers, on_delivery=dr)


def intent(wf, step, call_id, args, attempt=None, **extra):
    d = {"workflow_id": wf, "step_index": step, "tool": "send_email", "arguments": args}
    if attempt is not None:
        d["attempt"] = attempt
    if call_id is not None:
        d["call_id"] = call_id
    d.update(extra)
    send(wf, d, call_id)


cons = Consumer({"bootstrap.servers": bootstrap, "group.id": run + "-check",
                 "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
cons.subscribe([t_out])


def collect(n, timeout=60):
    got, deadline = [], time.time() + timeout
    while len(got) < n and time.time() < deadline:
        m = cons.poll(0.5)
        if m is None or m.error():
            continue
        got.append((m.partition(), m.key().decode(), json.loads(m.value()), dict(m.headers() or [])))
    return got


state1 = tempfile.mkdtemp(prefix="kdsmoke-")
peer = start(state1)
intent("wf-a", 0, "c1", {"to": "a@example.com"})
prod.flush(10)
time.sleep(0.3)  # c1 strictly first, so it is the one executed
intent("wf-a", 0, "c2", {"to": "a@example.com"})                     # exact repeat
intent("wf-a", 0, "c3", {"recipient": "a@example.com", "x": [1]})    # rephrased repeat
intent("wf-a", 0, "c4", {"to": "a@example.com"}, attempt=1)          # deliberate re-execution
intent("wf-a", 1, None, {"to": "a@example.com"}, metadata={"m": 1})  # no call_id
intent("wf-b", 0, "c6", {})
for i in range(4):  # more workflows, so several partitions are exercised
    intent(f"wf-n{i}", 0, f"n{i}", {})
send("wf-x", "this is not json", "bad")
send("wf-y", json.dumps({"workflow_id": "wf-y", "tool": "t", "arguments": {}}), "bad")  # no step_index
send("wf-z", json.dumps({"workflow_id": "wf-z", "step_index": -1, "tool": "t", "arguments": {}}), "bad")
intent("wf-a", 0, "c9", {"to": "b@example.com"}, attempt=0)           # explicit attempt 0
send("wf-b", json.dumps({"workflow_id": "wf-b", "step_index": 0, "tool": "send_email",
                         "arguments": {}, "call_id": "c10", "unknown_field": True}),
     "c10", headers=[("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")])
prod.flush(10)

res = collect(12)
check(len(res) == 12, f"12 results for 12 valid intents (got {len(res)})")
print("partitions used:", sorted({r[0] for r in res}))
by_call = {r[2]["call_id"]: r for r in res}
first = by_call.get("c1")
for p, key, r, h in res:
    check(list(r) == FIELDS, f"{r['call_id']}: Result v1 fields in order")
    check(key == r["workflow_id"], f"{r['call_id']}: keyed by workflow_id")
    want_out = {"sent": True} if use_http else {}
    check(r["status"] == "ok" and r["output"] == want_out and TS.match(r["completed_at"]),
          f"{r['call_id']}: status ok, output {want_out}, completed_at {r['completed_at']}")
    check(p == partition_of[r["call_id"]], f"{r['call_id']}: same partition as its intent ({p})")
expect = {"n0": False, "n1": False, "n2": False, "n3": False, "c1": False, "c2": True, "c3": True, "c4": False, None: False, "c6": False, "c9": True, "c10": True}
for cid, dedup in expect.items():
    check(cid in by_call and by_call[cid][2]["deduplicated"] is dedup, f"{cid}: deduplicated={dedup}")
for cid in ("c2", "c3", "c9"):
    r = by_call[cid][2]
    check({**r, "call_id": "c1", "deduplicated": False} == first[2], f"{cid}: identical to c1's answer but call_id/deduplicated")
check(by_call["c4"][2]["attempt"] == 1 and by_call["c4"][2]["completed_at"] >= first[2]["completed_at"], "c4: attempt 1 executed anew")
check(by_call[None][2]["step_index"] == 1, "no call_id: call_id null")
check(by_call["c10"][3].get("traceparent", b"").startswith(b"00-4bf9"), "c10: traceparent header carried")
counters = stop(peer)
print("counters:", counters)
check(counters == {"processed": 15, "new": 8, "repeats": 4, "malformed": 3, "tool_calls": 8 if use_http else 0},
      "counters 15/8/4/3, tool calls " + ("8" if use_http else "0"))
if use_http:
    check(len(tool_calls) == 8 and set(tool_calls.values()) == {1}, f"tool called once for each of 8 steps ({tool_calls})")
    check(tool_calls.get(sg_key("wf-a", 0, "send_email", 0)) == 1
          and tool_calls.get(sg_key("wf-a", 0, "send_email", 1)) == 1, "Idempotency-Key as stepgate's (attempt 0 and 1)")

# Restart on an empty state dir: the store must come back from its changelog.
state2 = tempfile.mkdtemp(prefix="kdsmoke-")
peer = start(state2)
intent("wf-a", 0, "c11", {"again": True})
prod.flush(10)
res = collect(1)
check(len(res) == 1 and res[0][2]["deduplicated"] is True and res[0][2]["call_id"] == "c11"
      and res[0][2]["completed_at"] == first[2]["completed_at"],
      "after restart with empty state dir: repeat answered from restored store")
counters = stop(peer)
print("counters:", counters)
cons.close()
admin.delete_topics([t_in, t_out])
subprocess.run(["rm", "-rf", state1, state2])
print(f"{mode}: {'PASS' if not failures else 'FAILED: ' + '; '.join(failures)}")
sys.exit(1 if failures else 0)
