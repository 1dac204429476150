"""The HTTP no-op tool every system calls in benches/peers/durable/run.py.

It counts where effects happen: each raw invocation is recorded with its
`Idempotency-Key`, and a key seen before gets the answer it got the first time
(the deduplication a keyed provider does), so a run can tell invocations from
effects. A body with `"hold": seconds` is held that long before the answer (a
call cut off while the tool holds it). `GET /stats` returns the record;
`POST /reset` clears it.

usage: tool.py PORT
"""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock = threading.Lock()
invocations = {}  # key -> raw invocations
answers = {}  # key -> the first answer


class Tool(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The headers and the body go out in two writes: with Nagle's algorithm the
    # second waits for the ACK of the first, which a keep-alive client delays
    # (~40 ms) — a stall of the tool server's, not of the system calling it.
    disable_nagle_algorithm = True

    def reply(self, body):
        out = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        with lock:
            self.reply({"invocations": dict(invocations), "effects": len(answers)})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        if self.path == "/reset":
            with lock:
                invocations.clear()
                answers.clear()
            return self.reply({})
        key = self.headers.get("Idempotency-Key") or f"no-key-{time.monotonic_ns()}"
        args = json.loads(body or b"{}")
        with lock:
            invocations[key] = invocations.get(key, 0) + 1
        if isinstance(args, dict) and args.get("hold"):
            time.sleep(float(args["hold"]))
        with lock:
            if key not in answers:
                answers[key] = {"ok": True, "effect": len(answers) + 1, "echo": args}
            answer = answers[key]
        self.reply(answer)

    def log_message(self, *_):
        pass


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 1024
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Tool).serve_forever()
