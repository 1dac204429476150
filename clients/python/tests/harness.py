"""A real `stepgate run` for the package's tests and benchmark.

Environment:
- `KAFKA_BROKERS` (default 127.0.0.1:9092): a broker with transactions
  (`bash deploy/local/kafka.sh start`).
- `STEPGATE_BIN`: the stepgate binary; by default `$CARGO_TARGET_DIR/debug/stepgate`
  or the clone's `target/debug/stepgate` (`cargo build` first).

Each stack gets its own random topics, state directory and tool server (a
small HTTP server here that counts invocations), so tests and runs never see
each other's records. Tests share a stack and tell their calls apart by their
workflow ids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[3]


def brokers() -> str:
    return os.environ.get("KAFKA_BROKERS", "127.0.0.1:9092")


def stepgate_bin() -> str:
    if os.environ.get("STEPGATE_BIN"):
        return os.environ["STEPGATE_BIN"]
    candidates = []
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(Path(os.environ["CARGO_TARGET_DIR"]) / "debug" / "stepgate")
    candidates.append(REPO / "target" / "debug" / "stepgate")
    for c in candidates:
        if c.is_file():
            return str(c)
    raise RuntimeError(
        "no stepgate binary: run `cargo build` (or set STEPGATE_BIN); looked at "
        + ", ".join(map(str, candidates))
    )


def wait_for(cond, limit: float, what: str, every: float = 0.05):
    """Wait for `cond()` to be truthy (polled), or fail after `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {limit} s waiting for: {what}")
        time.sleep(every)


class Invocation:
    def __init__(self, tool: str, headers: Dict[str, str], body: Any):
        self.tool, self.headers, self.body = tool, headers, body

    @property
    def workflow_id(self) -> str:
        return self.headers.get("stepgate-workflow-id", "")

    @property
    def step_index(self) -> int:
        return int(self.headers.get("stepgate-step-index", "-1"))

    @property
    def idempotency_key(self) -> str:
        return self.headers.get("idempotency-key", "")


class ToolServer:
    """An HTTP tool for stepgate: `POST /t/<tool>` answers `{"tool", "echo": body}`.

    Per tool: a delay, a fixed status, or a rendezvous (each call waits until
    `n` calls of that tool are inside at once, or `limit` seconds pass, then
    all answer with how many were inside together).
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.calls: List[Invocation] = []
        self.delays: Dict[str, float] = {}
        self.statuses: Dict[str, int] = {}
        self.rendezvous: Dict[str, Tuple[int, float]] = {}
        self.inside: Dict[str, int] = {}
        self.most_inside: Dict[str, int] = {}
        self.held: Dict[str, float] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                name = self.path.rsplit("/", 1)[-1]
                n = int(self.headers.get("content-length", "0"))
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    body = None
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, out = server.handle(name, headers, body)
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/t"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, name: str, headers: Dict[str, str], body: Any):
        with self.lock:
            self.calls.append(Invocation(name, headers, body))
            self.inside[name] = self.inside.get(name, 0) + 1
            self.most_inside[name] = max(self.most_inside.get(name, 0), self.inside[name])
            self.lock.notify_all()
            together = self.inside[name]
            if name in self.held:
                limit = self.held[name]
                self.lock.wait_for(lambda: name not in self.held, timeout=limit)
            if name in self.rendezvous:
                n, limit = self.rendezvous[name]
                self.lock.wait_for(lambda: self.inside[name] >= n or self.most_inside[name] >= n,
                                   timeout=limit)
                together = self.most_inside[name]
        try:
            if name in self.delays:
                time.sleep(self.delays[name])
            if name in self.statuses:
                return self.statuses[name], {"error": f"status {self.statuses[name]}"}
            return 200, {"tool": name, "echo": body, "together": together}
        finally:
            with self.lock:
                self.inside[name] -= 1

    def meet(self, tool: str, n: int, limit: float) -> None:
        """Calls of `tool` wait until `n` are inside at once (or `limit` s pass)."""
        with self.lock:
            self.rendezvous[tool] = (n, limit)
            self.most_inside[tool] = 0

    def hold(self, tool: str, limit: float = 60.0) -> None:
        """Calls of `tool` wait inside until `release(tool)` (or `limit` s pass)."""
        with self.lock:
            self.held[tool] = limit

    def release(self, tool: str) -> None:
        with self.lock:
            self.held.pop(tool, None)
            self.lock.notify_all()

    def invocations(self, tool: Optional[str] = None, workflow_id: Optional[str] = None):
        with self.lock:
            return [c for c in self.calls
                    if (tool is None or c.tool == tool)
                    and (workflow_id is None or c.workflow_id == workflow_id)]

    def count(self, tool: Optional[str] = None, workflow_id: Optional[str] = None) -> int:
        return len(self.invocations(tool, workflow_id))

    def close(self) -> None:
        self.httpd.shutdown()


DEFAULT_TOOLS = [
    ("create_ticket", "unkeyed", "10s"),
    ("send_email", "keyed", "10s"),
    ("slow", "unkeyed", "10s"),
    ("fails", "keyed", "10s"),
    ("meet", "unkeyed", "30s"),
    ("meet_async", "unkeyed", "30s"),
    ("search", "read_only", "10s"),
    # A tool whose calls are named by their recipient: a repeat to another
    # recipient is another call (identity_conflict), not a retry.
    ("mail", "keyed", "10s", 'identity = ["to"]\n'),
    # Every call waits for a person's approval (`stepgate approvals approve`).
    ("wire_approved", "unkeyed", "10s", 'policy = "approval"\n'),
]


class Stack:
    """Topics, a tool server and a running `stepgate run`."""

    def __init__(self, tools=DEFAULT_TOOLS, intents_partitions: int = 4,
                 results_partitions: Optional[int] = None):
        self.prefix = f"sgpy-{uuid.uuid4().hex[:10]}"
        self.dir = tempfile.TemporaryDirectory(prefix="stepgate-pytest-")
        self.tools = ToolServer()
        self.intents = f"{self.prefix}.intents"
        self.results = f"{self.prefix}.results"
        self.brokers = brokers()
        self.http = f"127.0.0.1:{_free_port()}"
        self.proc: Optional[subprocess.Popen] = None
        d = Path(self.dir.name)
        self.config_path = d / "stepgate.toml"
        topics = "\n".join(f'{k} = "{self.prefix}.{k}"' for k in
                           ["intents", "results", "dlq", "progress", "changelog", "commands",
                            "approvals"])
        # Tools run by a worker pool (`pool = "…"` among their extra lines)
        # have no URL here: their workers hold it.
        self.pools = sorted({line.split('"')[1] for _n, _c, _t, *more in tools
                             for line in "".join(more).splitlines()
                             if line.startswith("pool =")})
        if self.pools:
            topics += f'\npool_calls = "{self.prefix}.calls.{{pool}}"'
        # Each pool's key, shared with its workers (`Worker(key=...)`).
        self.pool_key = f"pytest-pool-key-{uuid.uuid4().hex}"
        pools = "".join(f'\n[pools.{p}]\nkey = "{self.pool_key}"\n' for p in self.pools)
        tables = "".join(
            f'\n[tools.{n}]\ncategory = "{c}"\n'
            + ("" if "pool =" in "".join(more) else f'url = "{self.tools.base}/{n}"\n')
            + f'timeout = "{t}"\nretries = 1\nbackoff = "50ms"\n{"".join(more)}'
            for n, c, t, *more in tools)
        self.config_path.write_text(f"""[kafka]
brokers = "{self.brokers}"
gate_group = "{self.prefix}-gate"
instance_id = "{self.prefix}-0"
partitions = {intents_partitions}
session_timeout = "10s"
transaction_timeout = "10s"

[kafka.topics]
{topics}

[state]
path = "{d / 'state'}"

[gate]
in_doubt_grace = "1s"

[http]
listen = "{self.http}"

[log]
level = "info,rdkafka=warn"
{tables}{pools}""")
        if results_partitions is not None and results_partitions != intents_partitions:
            self._create_topic(self.results, results_partitions)
        out = self._stepgate("topics", "create")
        assert out.returncode == 0, f"stepgate topics create: {out.stdout}\n{out.stderr}"

    def _env(self) -> Dict[str, str]:
        # The config file is the whole config: no STEPGATE_* from the caller.
        return {k: v for k, v in os.environ.items() if not k.startswith("STEPGATE_")}

    def _stepgate(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([stepgate_bin(), *args, "--config", str(self.config_path)],
                              capture_output=True, text=True, env=self._env(), timeout=180)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """Another stepgate command against this stack's config."""
        return self._stepgate(*args)

    def _create_topic(self, name: str, partitions: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.brokers})
        # The record size limit `stepgate topics create` sets (it checks it).
        topic = NewTopic(name, partitions, 1, config={"max.message.bytes": "4194304"})
        admin.create_topics([topic])[name].result(60)

    def start(self) -> "Stack":
        log = open(Path(self.dir.name) / "stepgate.log", "wb")
        self.proc = subprocess.Popen([stepgate_bin(), "run", "--config", str(self.config_path)],
                                     stdout=subprocess.DEVNULL, stderr=log, env=self._env())

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"stepgate exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://{self.http}/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(ready, 120, "stepgate's /readyz", every=0.1)
        return self

    def log(self) -> str:
        p = Path(self.dir.name) / "stepgate.log"
        return p.read_text(errors="replace")[-20000:] if p.exists() else ""

    def client(self, **kw: Any):
        """A `Client` of this stack's topics (all named by their prefix)."""
        from stepgate_client import Client

        return Client(self.brokers, topics_prefix=self.prefix, **kw)

    def async_client(self, **kw: Any):
        from stepgate_client import AsyncClient

        return AsyncClient(self.brokers, topics_prefix=self.prefix, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tools.close()
        self.dir.cleanup()
        self._delete_topics()

    def _delete_topics(self) -> None:
        """The stack's topics are its own (random names): gone with it, so a
        long-lived broker does not collect every run's partitions."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.brokers})
        names = [f"{self.prefix}.{k}" for k in ("intents", "results", "dlq", "progress",
                                                 "changelog", "commands", "approvals")]
        names += [f"{self.prefix}.calls.{p}" for p in self.pools]
        for f in admin.delete_topics(names, operation_timeout=30).values():
            try:
                f.result(60)
            except Exception:  # noqa: BLE001  (best effort: already gone, or never made)
                pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
