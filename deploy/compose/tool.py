"""An example HTTP tool for the compose stack: every POST is an effect, logged
with its Idempotency-Key; a repeated key returns the stored answer."""
import http.server
import json

seen = {}


class Tool(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        key = self.headers.get("Idempotency-Key", "")
        if key not in seen:
            seen[key] = {"id": f"{self.path.strip('/')}-{len(seen) + 1}", "echo": body}
            print(f"effect {seen[key]['id']} key={key}", flush=True)
        out = json.dumps(seen[key]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Tool).serve_forever()
