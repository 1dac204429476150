#!/usr/bin/env python3
"""An LLM tool loop on stepgate, with Python's confluent-kafka.

Where the step key comes from, in a typical agent framework:

- workflow_id = the conversation / thread / run id. It is stable across agent
  restarts, so a run resumed next morning keeps its identity.
- step_index  = the position of the tool call in that thread, counted by the
  runtime (here: how many tool calls the thread has issued before this one).
  The runtime persists it with the thread; the model never sees it.
- attempt     = 0, unless the runtime *decides* to run a step again.

The model's own `tool_call_id` is NOT the key: when a call times out and the
model regenerates it, it invents a new tool_call_id and may rephrase the
arguments — yet it is the same step, and must not run twice. Nor is it the
intent's `call_id`, which names one call for its answer: models repeat their
ids (every conversation of a local model starts at `call_0`), so each intent
gets a fresh `call_id`, its answer is the one with that step key and
`call_id`, and the model's id goes in the intent's `metadata`.

usage: agent_loop.py [--brokers 127.0.0.1:9092] [--intents stepgate.intents]
                     [--results stepgate.results] [--thread THREAD_ID]
Needs a running stepgate with `search` and `send_email` tools.
"""
import argparse
import json
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition


class StepgateTools:
    """The tool-call hook of an agent runtime, backed by stepgate."""

    def __init__(self, brokers, intents, results):
        self.intents = intents
        # murmur2 of the key, as Kafka's Java clients and stepgate's own client do:
        # librdkafka's default partitioner (CRC32) would put this thread's retries
        # in another partition than a Java or Rust client's, where they are not
        # deduplicated. ("_random" only concerns null keys; ours never are.)
        self.producer = Producer({"bootstrap.servers": brokers, "linger.ms": 0,
                                  "partitioner": "murmur2_random"})
        self.consumer = Consumer({"bootstrap.servers": brokers, "group.id": f"agent-{uuid.uuid4().hex}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed"})
        parts = self.consumer.list_topics(results, timeout=10).topics[results].partitions
        self.consumer.assign([TopicPartition(results, p, self.consumer.get_watermark_offsets(
            TopicPartition(results, p), timeout=10)[1]) for p in parts])
        self.answers = {}

    def call(self, thread_id, step_index, tool, arguments, model_call_id, timeout=30.0):
        call_id = uuid.uuid4().hex  # this call's own: the model's id may repeat
        intent = {"workflow_id": thread_id, "step_index": step_index, "tool": tool,
                  "attempt": 0, "arguments": arguments, "call_id": call_id,
                  "metadata": {"tool_call_id": model_call_id}}
        mine = (thread_id, step_index, tool, 0, call_id)
        self.producer.produce(self.intents, key=thread_id, value=json.dumps(intent))
        self.producer.flush(10)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if mine in self.answers:
                return self.answers.pop(mine)
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                v = json.loads(msg.value())
                key = (v.get("workflow_id"), v.get("step_index"), v.get("tool"),
                       v.get("attempt"), v.get("call_id"))
                self.answers[key] = v
        raise TimeoutError(f"no answer for step {step_index} of {thread_id}")


class Thread:
    """A conversation: the runtime numbers its tool calls."""

    def __init__(self, thread_id, tools):
        self.id, self.tools, self.tool_calls_so_far = thread_id, tools, 0

    def run_tool_call(self, tool, arguments, model_call_id, step_index=None):
        if step_index is None:  # a new tool call of the model: the next step
            step_index = self.tool_calls_so_far
            self.tool_calls_so_far += 1
        result = self.tools.call(self.id, step_index, tool, arguments, model_call_id)
        shown = result.get("output") if result["status"] == "ok" else result["error"]["message"]
        print(f"  step {step_index} {tool:<10} tool_call_id={model_call_id:<8} status={result['status']:<8} "
              f"deduplicated={result['deduplicated']!s:<5} {json.dumps(shown)[:80]}")
        return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--intents", default="stepgate.intents")
    ap.add_argument("--results", default="stepgate.results")
    ap.add_argument("--thread", default=f"thread-{uuid.uuid4().hex[:8]}")
    args = ap.parse_args()
    thread = Thread(args.thread, StepgateTools(args.brokers, args.intents, args.results))

    print(f"turn 1 of {thread.id}: the model asks for two tool calls")
    thread.run_tool_call("search", {"q": "order 7781"}, "call_a1")
    first = thread.run_tool_call("send_email", {"to": "a@example.com", "subject": "Order confirmed"}, "call_a2")

    print("the runtime lost the answer to step 1 (say it timed out); the model regenerates the call,")
    print("with a new tool_call_id and rephrased arguments. The runtime knows it is still step 1:")
    again = thread.run_tool_call("send_email", {"to": "a@example.com", "subject": "Your order is confirmed"},
                                 "call_b7", step_index=1)
    assert again["deduplicated"] and again["output"] == first["output"], (first, again)
    print("=> same answer, the email was sent once.")


if __name__ == "__main__":
    main()
