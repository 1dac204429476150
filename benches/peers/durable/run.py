"""stepgate beside the durable-execution engines agent teams pick instead:
Restate (a service journaling the tool call with `ctx.run`, invoked with the
step key as its idempotency key; once with Restate's Python SDK, `restate`, and
once with its TypeScript SDK on Node, `restate-ts`, each with its own
restate-server) and DBOS Transact on PostgreSQL (a workflow per tool call, the
step key as its workflow id). Each calls the same HTTP no-op tool (tool.py),
which counts raw invocations and deduplicates by key. `--systems` picks which
run (default: all five; `stepgate-ts` is stepgate through its TypeScript
client, the sequential mode only).

Measured for each engine, the same way (an agent calling over loopback HTTP):
  - sequential: one call at a time, nothing else running — N new steps, then N
    repeats of them with rephrased arguments (each must get its first answer);
  - paced: calls started at a fixed rate for a while (latency from the planned
    start, so falling behind shows);
  - flood: many calls, a fixed number in flight (throughput);
  - CPU seconds and RSS of every process of the system during the flood;
and, for stepgate as well (through its Python client), **a cut-off call**: the
tool holds the request, the process running the call is killed with -9 and
started again, and the caller retries the same step as an agent would; for a
keyed-style tool (deduplicates by key) and an unkeyed-style one (every raw
invocation is an effect): invocations, what the caller finally received, and
whether anything said the call may have run.

Every answer is checked (one answer per call; repeats identical to the first;
invocations counted); the run exits 1 when a check fails. Prints a JSON object
(also written to --json). benches/peers/durable/setup.sh installs what it needs;
benches/bench.sh runs it after stepgate-bench.
"""
import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"run.py: CHECK FAILED: {what}", file=sys.stderr)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def retry(attempt, what, limit=60.0, pause=0.1):
    """`attempt()` until it raises no OSError (URLError is one), for `limit` seconds."""
    until = time.monotonic() + limit
    while True:
        try:
            return attempt()
        except OSError:
            if time.monotonic() > until:
                raise RuntimeError(f"{what}: not within {limit} s")
            time.sleep(pause)


def wait_port(port, limit=60.0, what=""):
    retry(lambda: socket.create_connection(("127.0.0.1", port), timeout=0.5).close(),
          f"{what or port} listening", limit)


def http(method, url, body=None, headers=None, timeout=120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


def descendants(pid):
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            kids = []
        todo.extend(int(k) for k in kids)
    return out


def cpu_rss(pids):
    cpu, rss = 0.0, 0
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLK
            rss += int(open(f"/proc/{p}/statm").read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return cpu, rss


def pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def spawn(cmd, log, env=None, user=None):
    full_env = dict(os.environ, **(env or {}))
    if user and os.geteuid() == 0:
        cmd = ["runuser", "-u", user, "--"] + cmd
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def kill9(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Tool:
    def __init__(self, work):
        self.port = free_port()
        self.proc = spawn([sys.executable, os.path.join(HERE, "tool.py"), str(self.port)],
                          open(os.path.join(work, "tool.log"), "w"))
        wait_port(self.port, what="the tool")
        self.url = f"http://127.0.0.1:{self.port}/noop"

    def stats(self):
        return http("GET", f"http://127.0.0.1:{self.port}/stats")

    def reset(self):
        http("POST", f"http://127.0.0.1:{self.port}/reset", {})

    def stop(self):
        kill9(self.proc)


class Dbos:
    """DBOS Transact on PostgreSQL: the app process runs each call."""
    name = "DBOS (PostgreSQL)"

    def __init__(self, work, tool, peers):
        self.work, self.tool, self.peers = work, tool, peers
        self.pg_port = free_port()
        self.pgdata = os.path.join(work, "pgdata")
        os.makedirs(self.pgdata)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres", work], check=True)
        log = open(os.path.join(work, "postgres.log"), "w")
        subprocess.run(["runuser", "-u", "postgres", "--"] * (os.geteuid() == 0) +
                       [self.pg_bin("initdb"), "-D", self.pgdata, "-A", "trust", "-U", "postgres"],
                       stdout=log, stderr=subprocess.STDOUT, check=True)
        self.pg = spawn([self.pg_bin("postgres"), "-D", self.pgdata, "-p", str(self.pg_port),
                         "-k", work, "-c", "listen_addresses=127.0.0.1",
                         "-c", "max_connections=200"], log, user="postgres")
        wait_port(self.pg_port, what="PostgreSQL")
        self.db = f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres"
        self.start_app()

    @staticmethod
    def pg_bin(name):
        for d in sorted(os.listdir("/usr/lib/postgresql"), reverse=True):
            p = f"/usr/lib/postgresql/{d}/bin/{name}"
            if os.path.exists(p):
                return p
        return name

    def start_app(self):
        self.port = free_port()
        self.app = spawn([self.peers["python"], os.path.join(HERE, "dbos_app.py"), str(self.port),
                          self.db, self.tool.url],
                         open(os.path.join(self.work, "dbos-app.log"), "a"))
        wait_port(self.port, what="the DBOS app")

    def call(self, key, arguments, tool="keyed"):
        return http("POST", f"http://127.0.0.1:{self.port}/call", arguments, {"Step-Key": key})

    @staticmethod
    def same_answer(again, first):
        return again == first

    def pids(self):
        return descendants(self.pg.pid) + descendants(self.app.pid)

    def kill_runner(self):
        kill9(self.app)

    def restart_runner(self):
        self.start_app()

    def stop(self):
        kill9(self.app)
        kill9(self.pg)


class Restate:
    """restate-server, and the Python service (hypercorn) running each call."""
    name = "Restate"
    log_name = "restate-service.log"

    def __init__(self, work, tool, peers):
        self.work, self.tool, self.peers = work, tool, peers
        self.ingress, self.admin = free_port(), free_port()
        node_port = free_port()
        env = {"RESTATE_INGRESS__BIND_ADDRESS": f"127.0.0.1:{self.ingress}",
               "RESTATE_ADMIN__BIND_ADDRESS": f"127.0.0.1:{self.admin}",
               "RESTATE_BIND_ADDRESS": f"127.0.0.1:{node_port}",
               "RESTATE_ADVERTISED_ADDRESS": f"http://127.0.0.1:{node_port}",
               "RESTATE_ADMIN__QUERY_ENGINE__PGSQL_BIND_ADDRESS": f"127.0.0.1:{free_port()}",
               "RESTATE_LOG_FILTER": "warn"}
        self.server = spawn([peers["restate_server"], "--base-dir", os.path.join(work, "restate")],
                            open(os.path.join(work, "restate.log"), "w"), env=env)
        wait_port(self.admin, what="restate-server's admin API")
        wait_port(self.ingress, what="restate-server's ingress")
        self.start_service()
        retry(lambda: http("POST", f"http://127.0.0.1:{self.admin}/deployments",
                           {"uri": f"http://127.0.0.1:{self.svc_port}", "force": True}),
              "registering the Restate service", pause=0.5)

    def start_service(self, port=None):
        self.svc_port = port or free_port()
        self.svc = spawn([peers_hypercorn(self.peers), "--bind", f"127.0.0.1:{self.svc_port}",
                          "--workers", "1", "restate_service:app"],
                         open(os.path.join(self.work, self.log_name), "a"),
                         env={"TOOL_URL": self.tool.url, "PYTHONPATH": HERE})
        wait_port(self.svc_port, what="the Restate service")

    def call(self, key, arguments, tool="keyed"):
        return http("POST", f"http://127.0.0.1:{self.ingress}/Tools/call", arguments,
                    {"idempotency-key": key})

    @staticmethod
    def same_answer(again, first):
        return again == first

    def pids(self):
        return descendants(self.server.pid) + descendants(self.svc.pid)

    def kill_runner(self):
        kill9(self.svc)

    def restart_runner(self):
        self.start_service(self.svc_port)  # the deployment's address

    def stop(self):
        kill9(self.svc)
        kill9(self.server)


class RestateTs(Restate):
    """restate-server, and the same service written with Restate's TypeScript
    SDK (restate_ts/service.mjs on Node, HTTP/2 cleartext) running each call;
    started, registered, called, killed and restarted as the Python one."""
    name = "Restate (TypeScript SDK)"
    log_name = "restate-ts-service.log"

    def start_service(self, port=None):
        self.svc_port = port or free_port()
        # RESTATE_LOGGING=WARN: the SDK logs each invocation at INFO by default;
        # the Python SDK's are below Python's default level (WARNING), unwritten.
        self.svc = spawn([self.peers["node"], self.peers["restate_ts_service"], str(self.svc_port)],
                         open(os.path.join(self.work, self.log_name), "a"),
                         env={"TOOL_URL": self.tool.url, "RESTATE_LOGGING": "WARN"})
        wait_port(self.svc_port, what="the Restate TypeScript service")


def peers_hypercorn(peers):
    return os.path.join(os.path.dirname(peers["python"]), "hypercorn")


class Stepgate:
    """`stepgate run` with the tool as `keyed` and as `unkeyed`, called through
    stepgate's Python client (the sequential mode and the cut-off runs; its loads
    are stepgate-bench's, since the Python client makes one call at a time)."""
    name = "stepgate"

    def __init__(self, work, tool, peers, binary, brokers):
        self.work, self.binary = work, binary
        prefix = "sgd-" + uuid.uuid4().hex[:8]
        self.metrics = f"127.0.0.1:{free_port()}"
        self.config = os.path.join(work, "stepgate.toml")
        with open(self.config, "w") as f:
            f.write(f"""
[kafka]
brokers = "{brokers}"
gate_group = "{prefix}-gate"
instance_id = "{prefix}-0"
partitions = 2
session_timeout = "6s"
[kafka.topics]
intents = "{prefix}.intents"
results = "{prefix}.results"
dlq = "{prefix}.dlq"
progress = "{prefix}.progress"
changelog = "{prefix}.changelog"
commands = "{prefix}.commands"
approvals = "{prefix}.approvals"
[state]
path = "{os.path.join(work, 'stepgate-state')}"
[gate]
in_doubt_grace = "1s"
[http]
listen = "{self.metrics}"
[log]
level = "warn"
[tools.keyed]
category = "keyed"
url = "{tool.url}"
timeout = "5s"
retries = 0
[tools.unkeyed]
category = "unkeyed"
url = "{tool.url}"
timeout = "5s"
retries = 0
""")
        subprocess.run([binary, "topics", "create", "--config", self.config], check=True,
                       stdout=subprocess.DEVNULL)
        self.start_runner()
        self.connect(peers, brokers, prefix)

    def connect(self, peers, brokers, prefix):
        sys.path.insert(0, peers["stepgate_client"])
        from stepgate_client import Client  # the package from clients/python
        self.client = Client(brokers, intents=f"{prefix}.intents", results=f"{prefix}.results")

    def start_runner(self):
        self.gate = spawn([self.binary, "run", "--config", self.config],
                          open(os.path.join(self.work, "stepgate.log"), "a"))
        retry(lambda: urllib.request.urlopen(f"http://{self.metrics}/readyz", timeout=1).read(),
              "stepgate ready", pause=0.2)

    def call(self, key, arguments, tool="keyed"):
        wf, step = key.rsplit("/", 1)
        return self.client.call(wf, int(step), tool, arguments, timeout=120,
                                republish_after=3).to_dict()

    @staticmethod
    def same_answer(again, first):
        """A repeat's Result v1 is the first one but for its own call_id and
        `deduplicated: true`."""
        def rest(r):
            return {k: v for k, v in r.items() if k not in ("call_id", "deduplicated")}
        return (again.get("deduplicated") is True and first.get("deduplicated") is False
                and rest(again) == rest(first))

    def kill_runner(self):
        kill9(self.gate)

    def restart_runner(self):
        self.start_runner()

    def stop(self):
        kill9(self.gate)
        self.client.close()


class StepgateTs(Stepgate):
    """The same `stepgate run`, called through stepgate's TypeScript client
    (clients/typescript, over Kafka) by one Node process, stepgate_ts.mjs, that
    times each call itself: the sequential mode only."""
    name = "stepgate (TypeScript client)"

    def connect(self, peers, brokers, prefix):
        self.node, self.ts_client = peers["node"], peers["stepgate_ts_client"]
        self.brokers, self.prefix = brokers, prefix

    def sequential(self, n):
        args = {"client": self.ts_client, "brokers": self.brokers, "intents": f"{self.prefix}.intents",
                "results": f"{self.prefix}.results", "tool": "keyed", "n": n}
        done = subprocess.run([self.node, os.path.join(HERE, "stepgate_ts.mjs"), json.dumps(args)],
                              stdout=subprocess.PIPE, stderr=open(os.path.join(self.work, "stepgate-ts.log"), "a"),
                              text=True, timeout=300 + 2 * n)
        check(done.returncode == 0, f"{self.name}: stepgate_ts.mjs exited {done.returncode} (see stepgate-ts.log)")
        got = json.loads(done.stdout or '{"new_ms": [], "repeat_ms": [], "firsts": [], "repeats": []}')
        check(len(got["firsts"]) == n and len(got["repeats"]) == n, f"{self.name}: {len(got['firsts'])} of {n} calls")
        for i, (first, again) in enumerate(zip(got["firsts"], got["repeats"])):
            check(self.same_answer(again, first), f"{self.name}: a repeat of step {i} got {again}, first {first}")
        new, rep = got["new_ms"], got["repeat_ms"]
        return {"new_p50": pct(new, .5), "new_p90": pct(new, .9), "new_p99": pct(new, .99),
                "repeat_p50": pct(rep, .5), "repeat_p90": pct(rep, .9), "repeat_p99": pct(rep, .99),
                "keys": [f"step {i}" for i in range(len(new))]}

    def stop(self):
        kill9(self.gate)


def sequential(system, n):
    run = uuid.uuid4().hex[:8]
    keys = [f"seq-{run}/{i}" for i in range(n)]
    firsts, new, rep = {}, [], []
    for k in keys:
        t = time.perf_counter()
        firsts[k] = system.call(k, {"title": f"Order {k} confirmed"})
        new.append((time.perf_counter() - t) * 1000)
    for k in keys:
        t = time.perf_counter()
        again = system.call(k, {"title": f"Your order {k} is confirmed"})
        rep.append((time.perf_counter() - t) * 1000)
        check(system.same_answer(again, firsts[k]),
              f"{system.name}: a repeat of {k} got {again}, first {firsts[k]}")
    return {"new_p50": pct(new, .5), "new_p90": pct(new, .9), "new_p99": pct(new, .99),
            "repeat_p50": pct(rep, .5), "repeat_p90": pct(rep, .9), "repeat_p99": pct(rep, .99),
            "keys": keys}


def load(system, count, inflight, rate=None):
    """`count` new steps with `inflight` at most in flight; paced at `rate`/s when given."""
    run = uuid.uuid4().hex[:8]
    lat, errors = [], []
    start = time.perf_counter()

    def one(i):
        planned = start + i / rate if rate else None
        if planned:
            delay = planned - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t = planned or time.perf_counter()
        try:
            system.call(f"load-{run}/{i}", {"title": f"t{i}"})
            lat.append((time.perf_counter() - t) * 1000)
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(repr(e))

    before = cpu_rss(system.pids())
    with cf.ThreadPoolExecutor(inflight) as pool:
        list(pool.map(one, range(count)))
    elapsed = time.perf_counter() - start
    after_cpu, rss = cpu_rss(system.pids())
    check(not errors, f"{system.name}: {len(errors)} calls failed under load: {errors[:3]}")
    return {"calls": count, "elapsed_s": round(elapsed, 2), "per_s": round(count / elapsed, 1),
            "p50": pct(lat, .5), "p99": pct(lat, .99),
            "cpu_us_per_call": round((after_cpu - before[0]) / count * 1e6, 1),
            "rss_mib": round(rss / 2**20, 1)}


def cut_off(system, tool, tool_kind):
    """Kill -9 the process running a call while the tool holds it."""
    tool.reset()
    key = f"cut-{uuid.uuid4().hex[:8]}/0"
    got = {}

    def caller():
        # An agent's caller: retry the same step until it gets an answer.
        until = time.monotonic() + 120
        while time.monotonic() < until:
            try:
                got["answer"] = system.call(key, {"title": "Refund 40 EUR", "hold": 3}, tool_kind)
                return
            except Exception as e:  # noqa: BLE001 - the cut is the point
                got.setdefault("errors", []).append(type(e).__name__)
                time.sleep(1)

    t = threading.Thread(target=caller)
    t.start()
    until = time.monotonic() + 60
    while not tool.stats()["invocations"] and time.monotonic() < until:
        time.sleep(0.05)
    system.kill_runner()
    time.sleep(0.5)
    system.restart_runner()
    t.join(150)
    time.sleep(4)  # a recovered call still holding the tool is counted too
    stats = tool.stats()
    invocations = sum(stats["invocations"].values())
    answer = got.get("answer")
    if answer is None:
        status = None
    elif system.name == "stepgate":
        status = answer["status"]  # a Result v1
    else:
        status = "ok"  # the engines return the tool's output
    says = system.name == "stepgate" and status == "in_doubt"
    effects = invocations if tool_kind == "unkeyed" else stats["effects"]
    check(answer is not None, f"{system.name}: no answer to the cut-off call ({tool_kind})")
    return {"tool": tool_kind, "invocations": invocations, "effects": effects,
            "caller_got": status, "caller_errors": len(got.get("errors", [])),
            "says_may_have_run": says}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="restate,restate-ts,dbos,stepgate,stepgate-ts",
                    help="comma-separated, of restate, restate-ts, dbos, stepgate, stepgate-ts")
    ap.add_argument("--sequential", type=int, default=200)
    ap.add_argument("--paced-rate", type=int, default=1000)
    ap.add_argument("--paced-seconds", type=int, default=10)
    ap.add_argument("--flood", type=int, default=5000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--peers", required=True, help="the directory setup.sh installed into")
    ap.add_argument("--stepgate-bin")
    ap.add_argument("--brokers", default=os.environ.get("KAFKA_BROKERS", "127.0.0.1:9092"))
    ap.add_argument("--json")
    ap.add_argument("--run-id", default="")
    a = ap.parse_args()
    peers = json.load(open(os.path.join(a.peers, "peers.json")))
    work = tempfile.mkdtemp(prefix="sg-durable-")
    os.chmod(work, 0o777)
    tool = Tool(work)
    out = {"run_id": a.run_id, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "cores": os.cpu_count(), "sizes": {"sequential": a.sequential, "paced_rate": a.paced_rate,
                                              "paced_seconds": a.paced_seconds, "flood": a.flood,
                                              "inflight": a.inflight},
           "systems": {}}
    try:
        for name in a.systems.split(","):
            print(f"run.py: {name}", file=sys.stderr)
            sub = os.path.join(work, name)
            os.makedirs(sub)
            os.chmod(sub, 0o777)
            if name == "dbos":
                system = Dbos(sub, tool, peers)
            elif name == "restate":
                system = Restate(sub, tool, peers)
            elif name == "restate-ts":
                system = RestateTs(sub, tool, peers)
            elif name == "stepgate-ts":
                system = StepgateTs(sub, tool, peers, a.stepgate_bin, a.brokers)
            else:
                system = Stepgate(sub, tool, peers, a.stepgate_bin, a.brokers)
            r = {"name": system.name}
            try:
                # One Python caller, one call at a time, for all of them (stepgate
                # through its Python client; through its TypeScript client, one Node
                # caller); loads: the engines here, stepgate's from stepgate-bench
                # (its Python client makes one call at a time).
                tool.reset()
                if isinstance(system, StepgateTs):
                    r["sequential"] = system.sequential(a.sequential)
                else:
                    r["sequential"] = sequential(system, a.sequential)
                stats = tool.stats()
                check(all(n == 1 for n in stats["invocations"].values())
                      and len(stats["invocations"]) == a.sequential,
                      f"{system.name}: sequential invocations {len(stats['invocations'])} keys")
                r["sequential"].pop("keys")
                if name not in ("stepgate", "stepgate-ts"):
                    r["paced"] = load(system, a.paced_rate * a.paced_seconds, 256, a.paced_rate)
                    r["flood"] = load(system, a.flood, a.inflight)
                if name != "stepgate-ts":
                    r["cut_off"] = [cut_off(system, tool, kind) for kind in ("keyed", "unkeyed")]
            finally:
                system.stop()
            out["systems"][name] = r
    finally:
        tool.stop()
    out["checks"] = "ok" if not failures else failures
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        open(a.json, "w").write(text)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
