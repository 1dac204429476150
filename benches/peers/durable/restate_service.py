"""The Restate peer: a service whose handler journals the tool call with
`ctx.run` — what a Restate user writes for "a tool call runs once". Callers
invoke it through Restate's ingress with the step key as the invocation's
`idempotency-key`, so a repeated step gets the first invocation's result.

Served by hypercorn: TOOL_URL=… hypercorn --bind 127.0.0.1:PORT restate_service:app
"""
import os

import restate

import tool_client

TOOL_URL = os.environ["TOOL_URL"]
tools = restate.Service("Tools")


def post(arguments: dict, key: str) -> dict:
    return tool_client.post(TOOL_URL, arguments, key)


@tools.handler()
async def call(ctx: restate.Context, arguments: dict) -> dict:
    # The invocation's own idempotency key (the step key), stable across the
    # retries of this invocation; its id when it was submitted without one.
    request = ctx.request()
    key = request.idempotency_key or request.id
    return await ctx.run_typed("tool", post, arguments=arguments, key=key)


app = restate.app([tools])
