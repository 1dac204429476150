"""How a peer calls the bench's HTTP tool: one POST of the arguments with the
step's key as `Idempotency-Key` (shared by dbos_app.py and restate_service.py)."""
import json
import urllib.request


def post(tool_url: str, arguments: dict, key: str) -> dict:
    req = urllib.request.Request(tool_url, data=json.dumps(arguments).encode(), headers={
        "Content-Type": "application/json", "Idempotency-Key": key})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())
