"""Drives `stepgate mcp` with the official MCP Python SDK's client, as an MCP
host would: over Streamable HTTP with the step in `_meta`; with the SDK's
high-level `Client` (which probes `server/discover` first) and no `_meta`, as a
host that knows nothing of stepgate; and over stdio with no step at all (the
session's identity). Prints one JSON object with what it saw; tests/broker/mcp.rs
checks it (and the tool's own count of invocations).

usage: mcp_client.py HTTP_URL STEPGATE_BIN CONFIG
"""
import asyncio
import json
import logging
import sys

from mcp import Client, ClientSession, StdioServerParameters
from mcp.client import advertise
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

url, stepgate_bin, config = sys.argv[1:4]


def seen(result):
    """What a model (content) and a program (structured content, _meta) read."""
    return {
        "text": [c.text for c in result.content if getattr(c, "type", "") == "text"],
        "structured": result.structured_content,
        "is_error": bool(result.is_error),
        "meta": result.meta or {},
    }


async def over_http(out):
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as s:
            init = await s.initialize()
            out["http_protocol"] = init.protocol_version
            tools = await s.list_tools()
            out["tools"] = {
                t.name: {
                    "description": t.description,
                    "schema": t.input_schema,
                    "annotations": t.annotations.model_dump(by_alias=True, exclude_none=True)
                    if t.annotations else None,
                }
                for t in tools.tools
            }

            def step(i, attempt=None):
                m = {"workflow_id": "mcp-wf-A", "step_index": i}
                if attempt is not None:
                    m["attempt"] = attempt
                return m

            call = s.call_tool
            out["first"] = seen(await call("create_ticket", {"title": "Printer jammed"}, meta=step(0)))
            # The model's retry after a lost answer, rephrased: the same step.
            out["again"] = seen(await call("create_ticket", {"title": "The printer is jammed"}, meta=step(0)))
            # Two steps with identical arguments are two tickets.
            out["same_a"] = seen(await call("create_ticket", {"title": "Same"}, meta=step(1)))
            out["same_b"] = seen(await call("create_ticket", {"title": "Same"}, meta=step(2)))
            # A deliberate re-run: the next attempt of step 0.
            out["rerun"] = seen(await call("create_ticket", {"title": "Printer jammed"}, meta=step(0, 1)))
            out["bad_meta"] = seen(await call("create_ticket", {"title": "x"}, meta={"workflow_id": "mcp-wf-A"}))
            out["no_meta_http"] = seen(await call("create_ticket", {"title": "no step"}))
            out["read_only"] = seen(await call("search", {"q": "printers"}, meta=step(3)))


class Warnings(logging.Handler):
    """The SDK's warnings (e.g. "Session termination failed: 202")."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


async def with_high_level_client(out):
    """`mcp.Client(url)` as a host uses it: it negotiates the revision itself
    (mode "auto": `server/discover`, then the initialize handshake if the
    server offers no sessionless revision) and sends no `_meta`."""
    warnings = Warnings()
    logging.getLogger("mcp").addHandler(warnings)
    async with Client(url) as c:
        out["client_protocol"] = c.protocol_version
        info = c.server_info
        out["server_info"] = {"name": info.name, "version": info.version} if info else None
        out["client_first"] = seen(await c.call_tool("create_ticket", {"title": "host call 1"}))
        out["client_second"] = seen(await c.call_tool("create_ticket", {"title": "host call 2"}))
    out["client_warnings"] = list(warnings.seen)
    # A client that declares it names its steps is offered the sessionless revision.
    async with Client(url, extensions=[advertise("stepgate/steps")]) as c:
        out["steps_protocol"] = c.protocol_version
        out["steps_call"] = seen(await c.call_tool(
            "create_ticket", {"title": "named"}, meta={"workflow_id": "mcp-wf-B", "step_index": 0}))
    # Pinned to the sessionless revision without a step: refused, with the text.
    async with Client(url, mode="2026-07-28") as c:
        out["pinned_no_meta"] = seen(await c.call_tool("create_ticket", {"title": "unnumbered"}))
    logging.getLogger("mcp").removeHandler(warnings)
    out["all_warnings"] = list(warnings.seen)


async def over_stdio(out):
    params = StdioServerParameters(command=stepgate_bin, args=["mcp", "--config", config])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            init = await s.initialize()
            out["stdio_protocol"] = init.protocol_version
            # No step in _meta: the session and the call's ordinal name it.
            # The client gives up on this one before the tool answers...
            try:
                r = await s.call_tool("create_ticket", {"title": "slow refund"}, read_timeout_seconds=1.0)
                out["lost"] = {"unexpected": seen(r)}
            except Exception as e:  # noqa: BLE001 - the timeout is the point
                out["lost"] = {"error": type(e).__name__}
            # ...and the model retries, rephrased: the session's next call of
            # the tool is taken as that step's retry and gets its answer.
            out["retry"] = seen(await s.call_tool("create_ticket", {"title": "a slow refund, again"}))
            out["next"] = seen(await s.call_tool("create_ticket", {"title": "Other"}))


async def main():
    out = {}
    await over_http(out)
    await with_high_level_client(out)
    await over_stdio(out)
    print(json.dumps(out))


asyncio.run(main())
