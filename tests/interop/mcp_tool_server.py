"""An existing MCP tool server (FastMCP, Streamable HTTP) put behind stepgate by
tests/broker/mcp.rs. It counts where effects happen: every raw invocation of
`create_ticket` is recorded with the idempotency key it carried in `_meta`, and
a key seen before returns the ticket it already created (the deduplication a
keyed provider does), so a test can tell a repeated invocation from a repeated
effect. A title containing "slow" takes 3 s (a call whose answer a client gives
up on). The record is rewritten to COUNTS_FILE (JSON) after every call.

Two tools for tests/broker/mcp_tool.rs, where calls share one MCP session:
`held_ticket` is recorded in `held` when it arrives and answers only once the
file COUNTS_FILE + ".release" exists (a call kept in flight while another
times out); `stuck_ticket` takes 60 s (a call that times out).

usage: mcp_tool_server.py PORT COUNTS_FILE
"""
import asyncio
import json
import os
import sys

from fastmcp import Context, FastMCP

port, counts_file = int(sys.argv[1]), sys.argv[2]
server = FastMCP("tickets")
invocations = []  # the key of every raw invocation, in order
tickets = {}  # key -> the ticket its first invocation created
held = []  # the key of every `held_ticket` call that arrived
release_file = counts_file + ".release"


def save():
    tmp = counts_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"invocations": invocations, "tickets": tickets, "held": held}, f)
    os.replace(tmp, counts_file)


def key_of(ctx: Context):
    meta = ctx.request_context.meta or {}
    return meta.get("idempotency_key") if isinstance(meta, dict) else None


@server.tool
async def create_ticket(title: str, ctx: Context) -> dict:
    meta = ctx.request_context.meta or {}
    key = meta.get("idempotency_key") if isinstance(meta, dict) else None
    invocations.append(key)
    if "slow" in title:
        await asyncio.sleep(3)
    if key is None or key not in tickets:
        ticket = {"ticket": len(tickets) + 1, "title": title}
        if key is None:
            key = f"no-key-{len(invocations)}"
        tickets[key] = ticket
    save()
    return tickets[key]


@server.tool
async def held_ticket(title: str, ctx: Context) -> dict:
    key = key_of(ctx)
    held.append(key)
    save()
    while not os.path.exists(release_file):
        await asyncio.sleep(0.02)
    return {"held": title, "key": key}


@server.tool
async def stuck_ticket(title: str, ctx: Context) -> dict:
    await asyncio.sleep(60)
    return {"stuck": title}


save()
server.run(transport="http", host="127.0.0.1", port=port, show_banner=False)
