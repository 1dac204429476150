#!/usr/bin/env python3
"""How many calls one Python client serves at once: a benchmark, not a test.

Starts its own `stepgate run` (topics of its own on the broker at
KAFKA_BROKERS, default 127.0.0.1:9092; the binary at STEPGATE_BIN or
target/debug/stepgate) in front of a tool that answers after DELAY (250 ms),
then times, per round: one call alone; 8 calls one after another; 8 calls at
once on one `Client` (8 threads); 8 calls at once on one `AsyncClient`
(asyncio.gather). Prints the median and the spread of each over the rounds.

    python3 clients/python/bench/concurrency.py [--rounds 7] [--calls 8] [--delay 0.25]

Every call is a new step (its own workflow), so each one runs the tool.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the test harness: Stack, ToolServer
if "stepgate_client" not in sys.modules:
    try:
        import stepgate_client  # noqa: F401  (an installed package first)
    except ImportError:
        sys.path.insert(0, str(HERE.parent))

import stepgate_client  # noqa: E402
from harness import Stack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--delay", type=float, default=0.25, help="the tool's delay, seconds")
    a = ap.parse_args()

    stack = Stack(tools=[("slow", "unkeyed", "30s")]).start()
    stack.tools.delays["slow"] = a.delay
    run = uuid.uuid4().hex[:8]
    n = 0

    def wf() -> str:
        nonlocal n
        n += 1
        return f"bench-{run}-{n}"

    times = {"one call alone": [], f"{a.calls} calls one after another": [],
             f"{a.calls} at once, Client (threads)": [],
             f"{a.calls} at once, AsyncClient (gather)": []}
    keys = list(times)
    try:
        client = stack.client()
        pool = ThreadPoolExecutor(a.calls)

        async def async_rounds():
            aclient = await stepgate_client.AsyncClient.connect(
                stack.brokers, intents=stack.intents, results=stack.results)
            await asyncio.gather(*[aclient.call(wf(), 0, "slow", {}) for _ in range(a.calls)])
            out = []
            for _ in range(a.rounds):
                t = time.perf_counter()
                answers = await asyncio.gather(
                    *[aclient.call(wf(), 0, "slow", {"i": i}) for i in range(a.calls)])
                out.append(time.perf_counter() - t)
                assert all(x.ok and not x.deduplicated for x in answers), answers
            await aclient.close()
            return out

        # Warm up: every partition followed, connections open.
        list(pool.map(lambda _: client.call(wf(), 0, "slow", {}), range(a.calls)))
        for _ in range(a.rounds):
            t = time.perf_counter()
            assert client.call(wf(), 0, "slow", {}).ok
            times[keys[0]].append(time.perf_counter() - t)

            t = time.perf_counter()
            for i in range(a.calls):
                assert client.call(wf(), 0, "slow", {"i": i}).ok
            times[keys[1]].append(time.perf_counter() - t)

            t = time.perf_counter()
            answers = list(pool.map(lambda i: client.call(wf(), 0, "slow", {"i": i}),
                                    range(a.calls)))
            times[keys[2]].append(time.perf_counter() - t)
            assert all(x.ok and not x.deduplicated for x in answers), answers
        times[keys[3]] = asyncio.run(async_rounds())
        pool.shutdown()
        client.close()
    finally:
        stack.stop()

    invocations = stack.tools.count("slow")
    print(f"stepgate_client {stepgate_client.__version__}: tool delay {a.delay * 1000:.0f} ms, "
          f"{a.rounds} rounds, {invocations} tool invocations")
    print(f"{'':42} {'median':>9} {'min':>9} {'max':>9}")
    for k in keys:
        v = times[k]
        print(f"{k:42} {statistics.median(v) * 1000:7.0f}ms {min(v) * 1000:7.0f}ms "
              f"{max(v) * 1000:7.0f}ms")


if __name__ == "__main__":
    main()
