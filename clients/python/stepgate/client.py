"""Intents out, answers in, over Kafka (confluent-kafka)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, Dict, Optional

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (as its Java clients and stepgate use), as an unsigned 32-bit int."""
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    mask = 0xFFFFFFFF
    h = (seed ^ len(data)) & mask
    n = len(data) // 4
    for i in range(n):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    tail = data[4 * n :]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def partition_for(workflow_id: str, partitions: int) -> int:
    """The partition that owns a workflow: murmur2 of its id, sign bit cleared."""
    if partitions <= 0:
        return 0
    return (murmur2(workflow_id.encode("utf-8")) & 0x7FFFFFFF) % partitions


class StepgateTimeout(TimeoutError):
    """No answer within the timeout. The step may still be answered later: call
    again with the same step key (a repeat never runs the tool twice)."""


class Client:
    """Publishes intents and waits for their answers.

    Each workflow is read from its own results partition only (the one its
    intents go to), from where the client joins it, so an agent never holds
    other agents' answers; answers for call_ids nobody waits for are dropped.
    A call that hears nothing for `republish_after` seconds publishes the same
    intent again (same call_id): harmless, it is the same step.
    """

    def __init__(
        self,
        brokers: str,
        intents: str = "stepgate.intents",
        results: str = "stepgate.results",
        config: Optional[Dict[str, Any]] = None,
    ):
        self.intents, self.results = intents, results
        extra = dict(config or {})
        # murmur2 of the key, as stepgate checks: librdkafka's default (CRC32)
        # would put a step's retries where it does not own them.
        self._producer = Producer(
            {"bootstrap.servers": brokers, "linger.ms": 0, "partitioner": "murmur2_random", **extra}
        )
        self._consumer = Consumer(
            {
                "bootstrap.servers": brokers,
                "group.id": f"stepgate-client-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                **extra,
            }
        )
        meta = self._consumer.list_topics(results, timeout=10).topics.get(results)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaException(f"topic {results} not found")
        self._partitions = len(meta.partitions)
        self._assigned: set = set()
        self._waiting: Dict[str, Optional[dict]] = {}
        self._lock = threading.Lock()

    def workflow(self, workflow_id: str, next_step: int = 0) -> "Workflow":
        """A workflow (an agent run, a thread) numbering its tool calls from `next_step`."""
        return Workflow(self, workflow_id, next_step)

    def _follow(self, partition: int) -> None:
        if partition in self._assigned:
            return
        tp = TopicPartition(self.results, partition)
        _, high = self._consumer.get_watermark_offsets(tp, timeout=10)
        self._consumer.incremental_assign([TopicPartition(self.results, partition, high)])
        self._assigned.add(partition)

    def call(
        self,
        workflow_id: str,
        step_index: int,
        tool: str,
        arguments: Dict[str, Any],
        attempt: int = 0,
        call_id: Optional[str] = None,
        timeout: float = 60.0,
        republish_after: float = 10.0,
        headers: Optional[Dict[str, str]] = None,
    ) -> dict:
        """Publish one tool call and return its answer (a Result v1 object)."""
        call_id = call_id or uuid.uuid4().hex
        intent = {
            "workflow_id": workflow_id,
            "step_index": step_index,
            "tool": tool,
            "attempt": attempt,
            "arguments": arguments,
            "call_id": call_id,
        }
        value = json.dumps(intent, separators=(",", ":"))
        with self._lock:
            # Follow the answers' partition before the intent can be answered.
            self._follow(partition_for(workflow_id, self._partitions))
            self._waiting[call_id] = None
            try:
                deadline = time.monotonic() + timeout
                published = 0.0
                while True:
                    now = time.monotonic()
                    if now - published >= republish_after:
                        self._producer.produce(
                            self.intents, key=workflow_id, value=value, headers=headers
                        )
                        self._producer.flush(10)
                        published = now
                    found = self._waiting.get(call_id)
                    if found is not None:
                        return found
                    if time.monotonic() >= deadline:
                        raise StepgateTimeout(
                            f"no answer for step {step_index} of {workflow_id} ({tool}) in {timeout} s"
                        )
                    msg = self._consumer.poll(min(0.1, max(0.0, deadline - time.monotonic())))
                    if msg is not None and not msg.error():
                        try:
                            answer = json.loads(msg.value())
                        except (TypeError, ValueError):  # a null value, or not JSON
                            answer = None
                        if isinstance(answer, dict) and answer.get("call_id") in self._waiting:
                            self._waiting[answer["call_id"]] = answer
            finally:
                self._waiting.pop(call_id, None)

    def close(self) -> None:
        self._producer.flush(10)
        self._consumer.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Workflow:
    """One agent run: its tool calls numbered in the order the run makes them.

    Persist `next_step` with the run to resume it (a resumed run must number
    its calls as before, so a call made again is recognised as the same step).
    """

    def __init__(self, client: Client, workflow_id: str, next_step: int = 0):
        self.client, self.workflow_id, self.next_step = client, workflow_id, next_step

    def call(self, tool: str, arguments: Dict[str, Any], **kw) -> dict:
        """The run's next tool call."""
        step = self.next_step
        self.next_step += 1
        return self.client.call(self.workflow_id, step, tool, arguments, **kw)

    def again(self, step_index: int, tool: str, arguments: Dict[str, Any], **kw) -> dict:
        """A call of an earlier step again (after a lost answer): its first answer."""
        return self.client.call(self.workflow_id, step_index, tool, arguments, **kw)
