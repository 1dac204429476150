"""The DBOS peer: one tool call per workflow, the workflow id being the step
key, the tool called from a DBOS step — what a DBOS Transact user writes for
"a tool call runs once". Served over HTTP so that a caller (the bench's agent)
and the process running the call are apart, as with Restate and stepgate:
`POST /call` with the step key in `Step-Key` and the arguments as the body.
A workflow id seen before returns that workflow's result without running it.

usage: dbos_app.py PORT DATABASE_URL TOOL_URL
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dbos import DBOS, SetWorkflowID

import tool_client

port, database_url, tool_url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
DBOS(config={"name": "stepgate-peer", "system_database_url": database_url,
             "log_level": "WARNING", "sys_db_pool_size": 40})


@DBOS.step(retries_allowed=False)
def call_tool(arguments: dict, key: str) -> dict:
    return tool_client.post(tool_url, arguments, key)


@DBOS.workflow()
def tool_call(arguments: dict) -> dict:
    return call_tool(arguments, DBOS.workflow_id)


class Front(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        with SetWorkflowID(self.headers["Step-Key"]):
            result = tool_call(json.loads(body or b"{}"))
        out = json.dumps(result).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_):
        pass


DBOS.launch()  # recovers workflows a killed process left pending
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 1024
ThreadingHTTPServer(("127.0.0.1", port), Front).serve_forever()
