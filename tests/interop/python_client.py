#!/usr/bin/env python3
"""The pip-installed Python client (clients/python) against a running stepgate.

usage: python_client.py BROKERS INTENTS RESULTS TOOL
Prints one JSON line per check for tests/python_client.rs.
"""
import json
import sys

from stepgate import Client, partition_for

brokers, intents, results, tool = sys.argv[1:5]
print(json.dumps({"partitions": {w: partition_for(w, 4) for w in
                                 ["wf-kcat", "a", "abc", "abcd", "abcde", "", "support-thread-42", "é-ü"]}}))

with Client(brokers, intents=intents, results=results) as client:
    run = client.workflow("py-client-1")
    first = run.call(tool, {"title": "Subject: Order confirmed"}, call_id="model-call-1")
    # The answer was lost; the model regenerates the call, rephrased, with a new id.
    again = run.again(0, tool, {"title": "Subject: Your order is confirmed"}, call_id="model-call-1b")
    # Two legitimately identical steps: both run.
    one = run.call(tool, {"title": "Same title"})
    two = run.call(tool, {"title": "Same title"})
    print(json.dumps({"first": first, "again": again, "one": one, "two": two, "next_step": run.next_step}))
