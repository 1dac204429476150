"""Intents out, answers in, over Kafka (confluent-kafka).

One `Client` (threads) or `AsyncClient` (asyncio) serves any number of calls
at once: each call registers a waiter under its `call_id`, publishes its
intent, and waits; one consumer thread per client reads the answers and hands
each to the waiters of its `call_id`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from .answer import MAX_CONFLICT_HOPS, Answer


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


class StepgateError(Exception):
    """Base of the client's own errors (an answer with a non-ok status is not one)."""


class StepgateTimeout(StepgateError, TimeoutError):
    """No answer within the timeout. The step may still be answered later: call
    again with the same step key (a repeat never runs the tool twice)."""


class StepgatePublishError(StepgateError):
    """The intent could not be published (Kafka refused or timed out). It may or
    may not have reached stepgate: call again with the same step key."""


class StepgateAwaitingApproval(StepgateError):
    """The call is held for a person's approval (its tool's policy is
    `approval`): raised instead of waiting when the call asked for it
    (`on_approval="raise"`). The step is recorded; call it again with the same
    step key to get its answer once a person has decided. `event` is the
    approval event (schemas/approval.v1.json)."""

    def __init__(self, message: str, event: Dict[str, Any]):
        super().__init__(message)
        self.event = event


class StepgateClosed(StepgateError):
    """The client was closed while the call waited. Call again with the same step
    key on another client to get the answer."""


# A waiter is told its outcome once: an answer (dict) or an exception.
Deliver = Callable[[Any], None]


class _Core:
    """What `Client` and `AsyncClient` share: the producer, the one consumer
    thread that dispatches answers by call_id, and the followed partitions."""

    def __init__(
        self,
        brokers: str,
        intents: str,
        results: str,
        config: Optional[Dict[str, Any]],
        metadata_timeout: float,
        approvals: Optional[str] = None,
    ):
        self.intents, self.results = intents, results
        extra = dict(config or {})
        # Intents are produced to the partition computed here (murmur2, as the
        # gate checks); the partitioner only matters to other code sharing it.
        self.producer = Producer(
            {
                "bootstrap.servers": brokers,
                "linger.ms": 0,
                "partitioner": "murmur2_random",
                **extra,
            }
        )
        consumer_config = {
            "bootstrap.servers": brokers,
            "group.id": f"stepgate-client-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            **extra,
        }
        # The consumer belongs to the consumer thread: confluent-kafka serialises
        # a consumer's calls, so another thread's call would wait behind its
        # polls. Watermarks and metadata come from a second handle that is never
        # polled.
        self.consumer = Consumer(consumer_config)
        self._meta = Consumer(consumer_config)
        try:
            md = self._meta.list_topics(timeout=metadata_timeout).topics
            counts = []
            for topic in (intents, results):
                meta = md.get(topic)
                if meta is None or meta.error is not None or not meta.partitions:
                    raise KafkaException(f"topic {topic} not found")
                counts.append(len(meta.partitions))
            # Approval events (a call held for a person) come in the step's
            # partition of `approvals`, when that topic exists.
            meta = md.get(approvals) if approvals else None
            self.approvals = approvals if meta is not None and meta.error is None \
                and len(meta.partitions or {}) >= counts[0] else None
        except BaseException:
            self.consumer.close()
            self._meta.close()
            raise
        # The gate answers in the partition *number* its intent was in, so the
        # answer's partition is the intent's: the intents topic's count decides.
        self.intent_partitions, self.result_partitions = counts
        if self.result_partitions < self.intent_partitions:
            self.consumer.close()
            self._meta.close()
            raise KafkaException(
                f"{results} has {self.result_partitions} partitions, fewer than "
                f"{intents}'s {self.intent_partitions}: stepgate answers in the intent's "
                "partition number and refuses to run on this layout"
            )
        self.metadata_timeout = metadata_timeout
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._followed: set = set()
        self._to_assign: List[TopicPartition] = []
        self._waiting: Dict[str, List[Deliver]] = {}
        self._held: Dict[str, List[Deliver]] = {}
        self._closed = threading.Event()
        self._consumer_thread = threading.Thread(
            target=self._consume, name="stepgate-answers", daemon=True
        )
        self._producer_thread = threading.Thread(
            target=self._serve_producer, name="stepgate-deliveries", daemon=True
        )
        self._consumer_thread.start()
        self._producer_thread.start()

    # -- partitions

    def partition(self, workflow_id: str) -> int:
        """The intents partition of a workflow, which is also its answers' partition."""
        return partition_for(workflow_id, self.intent_partitions)

    def is_followed(self, partition: int) -> bool:
        return partition in self._followed

    def follow(self, partition: int) -> None:
        """Read answers from `partition`, from its current end on (blocking: one
        watermark request the first time a partition is followed)."""
        if partition in self._followed:
            return
        with self._follow_lock:
            if partition in self._followed:
                return
            starts = []
            for topic in (self.results, self.approvals):
                if topic is None:
                    continue
                tp = TopicPartition(topic, partition)
                deadline = time.monotonic() + self.metadata_timeout
                while True:
                    try:
                        _, high = self._meta.get_watermark_offsets(
                            tp, timeout=self.metadata_timeout)
                        break
                    except KafkaException:
                        # A new topic's leader may not be known yet: ask again.
                        if time.monotonic() >= deadline:
                            raise
                        time.sleep(0.1)
                # Every answer to an intent published after this point is at
                # or after `high`: reading from there misses none of them,
                # however late the consumer thread takes the assignment up.
                starts.append(TopicPartition(topic, partition, high))
            with self._lock:
                self._to_assign.extend(starts)
            self._followed.add(partition)

    # -- waiters

    def register(self, call_id: str, deliver: Deliver) -> None:
        with self._lock:
            if self._closed.is_set():
                raise StepgateClosed("the client is closed")
            self._waiting.setdefault(call_id, []).append(deliver)

    def unregister(self, call_id: str, deliver: Deliver) -> None:
        with self._lock:
            waiters = self._waiting.get(call_id)
            if waiters is None:
                return
            try:
                waiters.remove(deliver)
            except ValueError:
                pass
            if not waiters:
                del self._waiting[call_id]

    def watch_held(self, call_id: str, notify: Deliver) -> None:
        """`notify(event)` when the call is held for approval."""
        with self._lock:
            self._held.setdefault(call_id, []).append(notify)

    def unwatch_held(self, call_id: str, notify: Deliver) -> None:
        with self._lock:
            watchers = self._held.get(call_id)
            if watchers and notify in watchers:
                watchers.remove(notify)
            if not watchers:
                self._held.pop(call_id, None)

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiting.values())

    def _dispatch(self, answer: Any) -> None:
        if not isinstance(answer, dict):
            return
        call_id = answer.get("call_id")
        if not isinstance(call_id, str):
            return
        with self._lock:
            waiters = self._waiting.pop(call_id, None)
        for deliver in waiters or ():
            deliver(answer)

    def _consume(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                assign, self._to_assign = self._to_assign, []
            if assign:
                self.consumer.incremental_assign(assign)
            # Wait for one answer, then take what else has arrived without
            # waiting: a batch `consume` waits out its whole timeout to fill
            # the batch (confluent-kafka 2.16), which put a 50 ms floor under
            # every call.
            try:
                first = self.consumer.poll(0.05)
                if first is None:
                    continue
                msgs = [first, *self.consumer.consume(num_messages=499, timeout=0)]
            except RuntimeError:  # closed under us
                return
            except KafkaException:
                continue
            for msg in msgs:
                if msg.error():
                    continue
                try:
                    value = json.loads(msg.value())
                except (TypeError, ValueError):  # a null value, or not JSON
                    continue
                if self.approvals is not None and msg.topic() == self.approvals:
                    self._held_event(value)
                else:
                    self._dispatch(value)

    def _held_event(self, event: Any) -> None:
        if not isinstance(event, dict) or event.get("event") != "requested":
            return
        with self._lock:
            watchers = list(self._held.get(str(event.get("call_id")), ()))
        for notify in watchers:
            notify(event)

    # -- publishing

    def _serve_producer(self) -> None:
        while not self._closed.is_set():
            self.producer.poll(0.2)

    def publish(
        self,
        workflow_id: str,
        value: bytes,
        headers: Optional[Mapping[str, str]],
        on_error: Callable[[Exception], None],
    ) -> bool:
        """Enqueue an intent; False when the local queue is full (retry shortly)."""

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                on_error(
                    StepgatePublishError(
                        f"publishing the intent of {workflow_id} failed: {err}. It may or "
                        "may not have reached stepgate: call again with the same step key."
                    )
                )

        try:
            self.producer.produce(
                self.intents,
                key=workflow_id.encode("utf-8"),
                value=value,
                partition=self.partition(workflow_id),
                headers=list(headers.items()) if headers else None,
                on_delivery=delivered,
            )
        except BufferError:
            return False
        return True

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            waiting, self._waiting = self._waiting, {}
        self._consumer_thread.join()
        self._producer_thread.join()
        self.producer.flush(timeout)
        self.consumer.close()
        self._meta.close()
        for waiters in waiting.values():
            for deliver in waiters:
                deliver(StepgateClosed("the client was closed while the call waited"))


def _intent(
    workflow_id: str,
    step_index: int,
    tool: str,
    arguments: Mapping[str, Any],
    attempt: int,
    call_id: str,
    metadata: Optional[Mapping[str, Any]],
) -> bytes:
    intent: Dict[str, Any] = {
        "workflow_id": workflow_id,
        "step_index": step_index,
        "tool": tool,
        "attempt": attempt,
        "arguments": dict(arguments),
        "call_id": call_id,
    }
    if metadata is not None:
        intent["metadata"] = dict(metadata)
    return json.dumps(intent, separators=(",", ":")).encode("utf-8")


def _held_notifier(on_approval: str, deliver: Deliver, workflow_id: str, step_index: int,
                   tool: str) -> Optional[Deliver]:
    """With on_approval="raise", what ends the call when it is held for approval."""
    if on_approval == "wait":
        return None
    if on_approval != "raise":
        raise ValueError(f'on_approval must be "wait" or "raise", not {on_approval!r}')

    def held(event: Any) -> None:
        deliver(StepgateAwaitingApproval(
            f"step {step_index} of {workflow_id} ({tool}) is held for a person's approval; "
            "call it again with the same step key for its answer once they decide", event))

    return held


def _timeout_text(workflow_id: str, step_index: int, tool: str, timeout: float) -> str:
    return f"no answer for step {step_index} of {workflow_id} ({tool}) in {timeout} s"


class Client:
    """Publishes intents and waits for their answers; safe to share between threads.

    Many calls may wait at once (from as many threads): one background thread
    reads the answers and wakes each call by its call_id. Each workflow's
    answers are read from its own partition only (the number of the intents
    partition its intents go to), from where the client first needs it, so an
    agent never holds other agents' answers. A call that hears nothing for
    `republish_after` seconds publishes the same intent again (same call_id):
    harmless, it is the same step.
    """

    def __init__(
        self,
        brokers: str,
        intents: str = "stepgate.intents",
        results: str = "stepgate.results",
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Optional[str] = "stepgate.approvals",
    ):
        self._core = _Core(brokers, intents, results, config, metadata_timeout, approvals)
        self.intents, self.results = intents, results

    @property
    def partitions(self) -> int:
        """Partitions of the intents topic (a workflow's answers come in the same number)."""
        return self._core.intent_partitions

    def workflow(self, workflow_id: str, next_step: int = 0) -> "Workflow":
        """A workflow (an agent run, a thread) numbering its tool calls from `next_step`."""
        return Workflow(self, workflow_id, next_step)

    def call(
        self,
        workflow_id: str,
        step_index: int,
        tool: str,
        arguments: Mapping[str, Any],
        attempt: int = 0,
        call_id: Optional[str] = None,
        timeout: float = 60.0,
        republish_after: float = 10.0,
        headers: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        on_approval: str = "wait",
    ) -> Answer:
        """Publish one tool call and wait for its answer.

        A call of an `approval` tool waits for a person's decision; with
        `on_approval="raise"` it raises StepgateAwaitingApproval as soon as
        stepgate holds it (the step stays recorded: call again later)."""
        core = self._core
        call_id = call_id or uuid.uuid4().hex
        value = _intent(workflow_id, step_index, tool, arguments, attempt, call_id, metadata)
        # Follow the answers' partition before the intent can be answered.
        core.follow(core.partition(workflow_id))
        fut: "concurrent.futures.Future[Any]" = concurrent.futures.Future()

        def deliver(outcome: Any) -> None:
            if not fut.done():
                try:
                    if isinstance(outcome, BaseException):
                        fut.set_exception(outcome)
                    else:
                        fut.set_result(outcome)
                except concurrent.futures.InvalidStateError:
                    pass

        core.register(call_id, deliver)
        held = _held_notifier(on_approval, deliver, workflow_id, step_index, tool)
        if held is not None:
            core.watch_held(call_id, held)
        try:
            deadline = time.monotonic() + timeout
            while True:
                while not core.publish(workflow_id, value, headers, deliver):
                    core.producer.poll(0.05)
                    if time.monotonic() >= deadline:
                        raise StepgateTimeout(_timeout_text(workflow_id, step_index, tool, timeout))
                left = deadline - time.monotonic()
                try:
                    return Answer.from_dict(fut.result(max(0.0, min(left, republish_after))))
                except concurrent.futures.TimeoutError:
                    if time.monotonic() >= deadline:
                        raise StepgateTimeout(
                            _timeout_text(workflow_id, step_index, tool, timeout)
                        ) from None
        finally:
            core.unregister(call_id, deliver)
            if held is not None:
                core.unwatch_held(call_id, held)

    def close(self) -> None:
        """Stop reading answers; calls still waiting raise StepgateClosed."""
        self._core.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio: `await client.call(...)`, no thread per call.

    Every call is an asyncio future, resolved from the client's one consumer
    thread through `loop.call_soon_threadsafe`. The constructor reads topic
    metadata (blocking, once); `await AsyncClient.connect(...)` does it off the
    event loop.
    """

    def __init__(
        self,
        brokers: str,
        intents: str = "stepgate.intents",
        results: str = "stepgate.results",
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Optional[str] = "stepgate.approvals",
    ):
        self._core = _Core(brokers, intents, results, config, metadata_timeout, approvals)
        self.intents, self.results = intents, results
        self._following: Dict[int, "asyncio.Future[None]"] = {}

    @classmethod
    async def connect(
        cls,
        brokers: str,
        intents: str = "stepgate.intents",
        results: str = "stepgate.results",
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Optional[str] = "stepgate.approvals",
    ) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, lambda: cls(brokers, intents, results, config, metadata_timeout, approvals)
        )

    @property
    def partitions(self) -> int:
        return self._core.intent_partitions

    def workflow(self, workflow_id: str, next_step: int = 0) -> "AsyncWorkflow":
        return AsyncWorkflow(self, workflow_id, next_step)

    async def call(
        self,
        workflow_id: str,
        step_index: int,
        tool: str,
        arguments: Mapping[str, Any],
        attempt: int = 0,
        call_id: Optional[str] = None,
        timeout: float = 60.0,
        republish_after: float = 10.0,
        headers: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        on_approval: str = "wait",
    ) -> Answer:
        """Publish one tool call and await its answer."""
        core = self._core
        loop = asyncio.get_running_loop()
        call_id = call_id or uuid.uuid4().hex
        value = _intent(workflow_id, step_index, tool, arguments, attempt, call_id, metadata)
        partition = core.partition(workflow_id)
        if not core.is_followed(partition):
            # One watermark request (in the default executor), the first time
            # this partition is needed; calls arriving meanwhile wait for it.
            following = self._following.get(partition)
            if following is None or (following.done() and following.exception() is not None):
                following = loop.run_in_executor(None, core.follow, partition)
                self._following[partition] = following
            await asyncio.shield(following)
        fut: "asyncio.Future[Any]" = loop.create_future()

        def settle(outcome: Any) -> None:
            if fut.done():
                return
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

        def deliver(outcome: Any) -> None:  # from the consumer or producer thread
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        core.register(call_id, deliver)
        held = _held_notifier(on_approval, deliver, workflow_id, step_index, tool)
        if held is not None:
            core.watch_held(call_id, held)
        try:
            deadline = loop.time() + timeout
            while True:
                while not core.publish(workflow_id, value, headers, deliver):
                    if loop.time() >= deadline:
                        raise StepgateTimeout(_timeout_text(workflow_id, step_index, tool, timeout))
                    await asyncio.sleep(0.05)
                left = deadline - loop.time()
                try:
                    outcome = await asyncio.wait_for(
                        asyncio.shield(fut), max(0.0, min(left, republish_after))
                    )
                    return Answer.from_dict(outcome)
                except asyncio.TimeoutError:
                    if loop.time() >= deadline:
                        raise StepgateTimeout(
                            _timeout_text(workflow_id, step_index, tool, timeout)
                        ) from None
        finally:
            core.unregister(call_id, deliver)
            if held is not None:
                core.unwatch_held(call_id, held)
            if not fut.done():
                fut.cancel()

    async def close(self) -> None:
        """Stop reading answers; calls still waiting raise StepgateClosed."""
        await asyncio.get_running_loop().run_in_executor(None, self._core.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _hop_call_id(kw: Dict[str, Any], hop: int) -> Dict[str, Any]:
    """The call's keywords for its `hop`-th step: a call_id of its own, so that
    no late answer to an earlier step's intent can answer this one."""
    if hop and kw.get("call_id"):
        return dict(kw, call_id=f"{kw['call_id']}~{hop}")
    return kw


class Workflow:
    """One agent run: its tool calls numbered in the order the run makes them.

    Persist `next_step` with the run to resume it (a resumed run must number
    its calls as before, so a call made again is recognised as the same step).
    Calls of one workflow may run concurrently: each takes its step when it is
    made.
    """

    def __init__(self, client: Client, workflow_id: str, next_step: int = 0):
        self.client, self.workflow_id, self.next_step = client, workflow_id, next_step
        self._lock = threading.Lock()

    def take_step(self) -> int:
        with self._lock:
            step = self.next_step
            self.next_step += 1
            return step

    def call(self, tool: str, arguments: Mapping[str, Any], **kw: Any) -> Answer:
        """The run's next tool call. A call the gate finds to be another call
        than the one recorded at its step (`identity_conflict`: e.g. the retry
        slot of a lost call, taken by a different call) is sent again as the
        step after, and so on: the recorded call's step stays its own."""
        for hop in range(MAX_CONFLICT_HOPS):
            answer = self.client.call(self.workflow_id, self.take_step(), tool, arguments,
                                      **_hop_call_id(kw, hop))
            if not answer.identity_conflict:
                break
        return answer

    def again(self, step_index: int, tool: str, arguments: Mapping[str, Any], **kw: Any) -> Answer:
        """A call of an earlier step again (after a lost answer): its first answer."""
        return self.client.call(self.workflow_id, step_index, tool, arguments, **kw)


class AsyncWorkflow:
    """`Workflow` for `AsyncClient`."""

    def __init__(self, client: AsyncClient, workflow_id: str, next_step: int = 0):
        self.client, self.workflow_id, self.next_step = client, workflow_id, next_step

    def take_step(self) -> int:
        step = self.next_step
        self.next_step += 1
        return step

    async def call(self, tool: str, arguments: Mapping[str, Any], **kw: Any) -> Answer:
        """The run's next tool call (identity conflicts as in `Workflow.call`)."""
        for hop in range(MAX_CONFLICT_HOPS):
            answer = await self.client.call(self.workflow_id, self.take_step(), tool, arguments,
                                            **_hop_call_id(kw, hop))
            if not answer.identity_conflict:
                break
        return answer

    async def again(
        self, step_index: int, tool: str, arguments: Mapping[str, Any], **kw: Any
    ) -> Answer:
        return await self.client.call(self.workflow_id, step_index, tool, arguments, **kw)
