"""A pool worker and the tool it calls, run inside a network namespace by
test_worker_netns.py: `python netns_worker.py BROKERS POOL PREFIX TOOL_PORT LOG`.

The tool is an HTTP server on the namespace's own 127.0.0.1:TOOL_PORT —
unreachable from the gate's namespace. It appends every request to LOG (raw
invocations, with their Idempotency-Key) and answers a repeated key with its
first answer (one effect per key)."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stepgate_client.worker import Worker

brokers, pool, prefix, tool_port, log_path, key = sys.argv[1:7]
answers: dict = {}
lock = threading.Lock()


class Tool(BaseHTTPRequestHandler):
    def log_message(self, *a):  # noqa: D102
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = self.headers.get("Idempotency-Key", "")
        with lock:
            with open(log_path, "a") as f:
                f.write(json.dumps({"key": key, "body": body}) + "\n")
            answer = answers.setdefault(key, {"rendered": body.get("order"), "effect": len(answers) + 1})
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


server = ThreadingHTTPServer(("127.0.0.1", int(tool_port)), Tool)
threading.Thread(target=server.serve_forever, daemon=True).start()

worker = Worker(brokers, pool, key=key, topics_prefix=prefix, gate_group=f"{prefix}-gate",
                config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})


@worker.tool("render_invoice", category="unkeyed")
def render_invoice(order: str, call) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{tool_port}/render", data=json.dumps({"order": order}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": call.idempotency_key})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


print("READY", flush=True)
worker.run()
