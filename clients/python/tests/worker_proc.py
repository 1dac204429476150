"""A pool worker process for test_worker.py: `python worker_proc.py BROKERS POOL PREFIX LOG KEY`.

Its tools append each invocation (tool, idempotency key, arguments) to LOG, a
JSON-lines file, before doing anything else — the raw count of invocations.
`hang` blocks forever (to be killed mid-call); `boom` raises; `refuse` raises
ToolRefused; `echo`/`echo_async` return their arguments."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from stepgate_client.worker import ToolRefused, Worker

brokers, pool, prefix, log_path, key = sys.argv[1:6]
# A short session, so a killed worker's partitions move on within seconds.
worker = Worker(brokers, pool, key=key, topics_prefix=prefix, gate_group=f"{prefix}-gate",
                config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})
lock = threading.Lock()


def record(tool, call, args):
    with lock, open(log_path, "a") as f:
        f.write(json.dumps({"tool": tool, "key": call.idempotency_key,
                            "dispatch": call.dispatch, "args": args}) + "\n")


@worker.tool("echo_unkeyed", category="unkeyed")
def echo_unkeyed(call, **args):
    record("echo_unkeyed", call, args)
    return {"echo": args}


@worker.tool("echo_keyed", category="keyed")
async def echo_keyed(call, **args):
    record("echo_keyed", call, args)
    await asyncio.sleep(0)
    return {"echo": args, "key": call.idempotency_key}


@worker.tool("hang_unkeyed", category="unkeyed")
def hang_unkeyed(call, **args):
    record("hang_unkeyed", call, args)
    threading.Event().wait()


@worker.tool("hang_keyed", category="keyed")
def hang_keyed(call, **args):
    record("hang_keyed", call, args)
    if args.get("hang_once") and sum(1 for _ in open(log_path)) == 1:
        threading.Event().wait()
    return {"done": True}


@worker.tool("boom", category="unkeyed")
def boom(call, **args):
    record("boom", call, args)
    raise RuntimeError("the printer caught fire")


@worker.tool("refuse", category="keyed")
def refuse(title: str, call=None):
    record("refuse", call, {"title": title})
    raise ToolRefused("No ticket was opened: the title is empty. Ask the user for a title.")


print("READY", flush=True)
worker.run()
