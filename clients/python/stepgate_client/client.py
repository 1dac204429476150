"""Intents out, answers in, over Kafka (confluent-kafka).

One `Client` (threads) or `AsyncClient` (asyncio) serves any number of calls
at once: each call registers a waiter under its step key and `call_id`,
publishes its intent, and waits; one consumer thread per client reads the
answers and hands each to the waiters of exactly that step key and `call_id`.
A `call_id` alone names nothing: two workflows may use the same one (a model's
`tool_call_id` repeats across threads, forks and replayed conversations), and
an answer must never reach another workflow's caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from .answer import MAX_CONFLICT_HOPS, RECONCILER, Answer


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


class StepgateTopicError(StepgateError, KafkaException):
    """A topic the client needs is missing (or laid out so that answers would
    be missed): the message names the topic and the option that names it.
    Raised by the constructor, before any call is made. (Also a
    `KafkaException`, as a missing topic was before.)"""


# A waiter is told its outcome once: an answer (dict) or an exception.
Deliver = Callable[[Any], None]

#: What an answer (or an approval event) is delivered by: the step key
#: (workflow_id, step_index, tool, attempt) and the `call_id` of the intent.
CallKey = Tuple[str, int, str, int, str]

DEFAULT_TOPICS_PREFIX = "stepgate"


def new_call_id() -> str:
    """A fresh wire `call_id` (random, 32 hex digits) for one call. A
    `call_id` names one call for its answer; it is not the step's identity,
    and a model's `tool_call_id` must not be used as one (models repeat them)."""
    return uuid.uuid4().hex


def hop_call_id(call_id: Optional[str], hop: int) -> Optional[str]:
    """The `call_id` of a call's `hop`-th step: the call's own at hop 0, then
    `<call_id>~<hop>`, so that each intent of a workflow (a call moved on past
    an identity conflict is sent again at the next step) has one of its own."""
    if hop and call_id:
        return f"{call_id}~{hop}"
    return call_id


def _key_of(record: Any) -> Optional[CallKey]:
    """The step key and `call_id` an answer or approval event names, or None
    when it names no call fully (it is then nobody's here)."""
    if not isinstance(record, dict):
        return None
    wf, step, tool = record.get("workflow_id"), record.get("step_index"), record.get("tool")
    attempt, call_id = record.get("attempt", 0), record.get("call_id")
    if not (isinstance(wf, str) and isinstance(tool, str) and isinstance(call_id, str)):
        return None
    if type(step) is not int or type(attempt) is not int:  # noqa: E721 (bool is no index)
        return None
    return (wf, step, tool, attempt, call_id)


_TOOL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


def _check_step(workflow_id: Any, step_index: Any, tool: Any, attempt: Any) -> None:
    """Refuse, at once, a step key stepgate would refuse: its answer could not
    name this call (Intent v1's rules, schemas/intent.v1.json)."""
    if not isinstance(workflow_id, str) or not workflow_id:
        raise ValueError(f"workflow_id must be a non-empty string, not {workflow_id!r}")
    if len(workflow_id.encode("utf-8")) > 255:
        raise ValueError("workflow_id must be at most 255 bytes (UTF-8)")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in workflow_id):
        raise ValueError(f"workflow_id must not contain control characters: {workflow_id!r}")
    for name, value in (("step_index", step_index), ("attempt", attempt)):
        if type(value) is not int or value < 0:  # noqa: E721
            raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
    if not isinstance(tool, str) or not 1 <= len(tool) <= 128 or not set(tool) <= _TOOL_CHARS:
        raise ValueError(f"tool must be 1 to 128 of A-Z a-z 0-9 _ . : -, not {tool!r}")


class _Unset:
    def __repr__(self) -> str:
        return "<derived>"


#: The default of a topic option: derived (see `topic_names`).
DERIVED: Any = _Unset()


def topic_names(
    topics_prefix: Optional[str] = None,
    intents: Optional[str] = None,
    results: Optional[str] = None,
    approvals: Any = DERIVED,
) -> Tuple[str, str, Optional[str]]:
    """The (intents, results, approvals) topics a client uses.

    A topic given by name is that name. One not given is
    `<prefix>.intents` / `.results` / `.approvals`, where the prefix is
    `topics_prefix` if given, else the prefix of a given `intents` (or
    `results`) name of that shape (`acme.intents` -> `acme`), else `stepgate`
    — as the gate's `kafka.topics` derive from one prefix. So a deployment
    named by its intents and results topics reads approvals from its own
    `approvals` topic. `approvals=None` reads no approval events."""
    prefix = topics_prefix
    if prefix is None:
        for name, suffix in ((intents, ".intents"), (results, ".results")):
            if name and name.endswith(suffix) and len(name) > len(suffix):
                prefix = name[: -len(suffix)]
                break
        else:
            prefix = DEFAULT_TOPICS_PREFIX
    return (
        intents or f"{prefix}.intents",
        results or f"{prefix}.results",
        f"{prefix}.approvals" if approvals is DERIVED else approvals,
    )


class _Core:
    """What `Client` and `AsyncClient` share: the producer, the one consumer
    thread that dispatches answers by step key and call_id, and the followed
    partitions."""

    def __init__(
        self,
        brokers: str,
        intents: str,
        results: str,
        config: Optional[Dict[str, Any]],
        metadata_timeout: float,
        approvals: Optional[str],
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
            self.intent_partitions, self.result_partitions = self._check_topics(
                brokers, metadata_timeout, intents, results, approvals)
        except BaseException:
            self.consumer.close()
            self._meta.close()
            raise
        # Approval events (a call held for a person) come in the step's
        # partition of `approvals`.
        self.approvals = approvals
        self.metadata_timeout = metadata_timeout
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._followed: set = set()
        self._to_assign: List[TopicPartition] = []
        self._waiting: Dict[CallKey, List[Deliver]] = {}
        self._held: Dict[CallKey, List[Deliver]] = {}
        self._closed = threading.Event()
        self._consumer_thread = threading.Thread(
            target=self._consume, name="stepgate-answers", daemon=True
        )
        self._producer_thread = threading.Thread(
            target=self._serve_producer, name="stepgate-deliveries", daemon=True
        )
        self._consumer_thread.start()
        self._producer_thread.start()

    def _check_topics(self, brokers: str, metadata_timeout: float, intents: str, results: str,
                      approvals: Optional[str]) -> Tuple[int, int]:
        """The partition counts of intents and results; a missing topic, or a
        layout whose answers would be missed, raises StepgateTopicError."""
        md = self._meta.list_topics(timeout=metadata_timeout).topics

        def count(topic: str) -> Optional[int]:
            meta = md.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                return None
            return len(meta.partitions)

        counts = []
        for topic, option in ((intents, "intents"), (results, "results")):
            n = count(topic)
            if n is None:
                raise StepgateTopicError(
                    f"topic {topic} not found on {brokers}: name the gate's "
                    f"kafka.topics.{option} with {option}=..., or all of its topics at once "
                    "with topics_prefix=... (the prefix of its kafka.topics names)")
            counts.append(n)
        n_intents, n_results = counts
        # The gate answers in the partition *number* its intent was in, so the
        # answer's partition is the intent's: the intents topic's count decides.
        if n_results < n_intents:
            raise StepgateTopicError(
                f"{results} has {n_results} partitions, fewer than {intents}'s {n_intents}: "
                "stepgate answers in the intent's partition number and refuses to run on "
                "this layout")
        if approvals is not None:
            n = count(approvals)
            if n is None:
                raise StepgateTopicError(
                    f"the approvals topic {approvals} not found on {brokers}: a call held for "
                    "a person's approval would only time out. Name the gate's "
                    "kafka.topics.approvals with approvals=..., or all of its topics at once "
                    "with topics_prefix=...; approvals=None reads no approval events (a held "
                    "call then waits for the decision)")
            if n < n_intents:
                raise StepgateTopicError(
                    f"the approvals topic {approvals} has {n} partitions, fewer than "
                    f"{intents}'s {n_intents}: is it the gate's kafka.topics.approvals? Name "
                    "it with approvals=... or topics_prefix=...")
        return n_intents, n_results

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

    def register(self, key: CallKey, deliver: Deliver) -> None:
        with self._lock:
            if self._closed.is_set():
                raise StepgateClosed("the client is closed")
            self._waiting.setdefault(key, []).append(deliver)

    def unregister(self, key: CallKey, deliver: Deliver) -> None:
        with self._lock:
            waiters = self._waiting.get(key)
            if waiters is None:
                return
            try:
                waiters.remove(deliver)
            except ValueError:
                pass
            if not waiters:
                del self._waiting[key]

    def watch_held(self, key: CallKey, notify: Deliver) -> None:
        """`notify(event)` when the call is held for approval."""
        with self._lock:
            self._held.setdefault(key, []).append(notify)

    def unwatch_held(self, key: CallKey, notify: Deliver) -> None:
        with self._lock:
            watchers = self._held.get(key)
            if watchers and notify in watchers:
                watchers.remove(notify)
            if not watchers:
                self._held.pop(key, None)

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiting.values())

    def _dispatch(self, answer: Any) -> None:
        # Only the waiters of this step key *and* call_id: another workflow's
        # call may carry the same call_id.
        key = _key_of(answer)
        if key is None:
            return
        with self._lock:
            waiters = self._waiting.pop(key, None)
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
        key = _key_of(event)
        if key is None or event.get("event") != "requested":
            return
        with self._lock:
            watchers = list(self._held.get(key, ()))
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


class _Call:
    """One call's intent and what its answer and approval event are
    delivered by, checked before anything is published."""

    def __init__(
        self,
        workflow_id: str,
        step_index: int,
        tool: str,
        arguments: Mapping[str, Any],
        attempt: int,
        call_id: Optional[str],
        metadata: Optional[Mapping[str, Any]],
        on_approval: str,
    ):
        _check_step(workflow_id, step_index, tool, attempt)
        if not isinstance(arguments, Mapping):
            raise ValueError(f"arguments must be a mapping (a JSON object), not "
                             f"{type(arguments).__name__}")
        if on_approval not in ("wait", "raise"):
            raise ValueError(f'on_approval must be "wait" or "raise", not {on_approval!r}')
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"call_id must be a string or None, not {call_id!r}")
        self.workflow_id, self.step_index, self.tool = workflow_id, step_index, tool
        self.call_id = call_id or new_call_id()
        self.key: CallKey = (workflow_id, step_index, tool, attempt, self.call_id)
        self.raise_when_held = on_approval == "raise"
        intent: Dict[str, Any] = {
            "workflow_id": workflow_id,
            "step_index": step_index,
            "tool": tool,
            "attempt": attempt,
            "arguments": dict(arguments),
            "call_id": self.call_id,
        }
        if metadata is not None:
            intent["metadata"] = dict(metadata)
        self.value = json.dumps(intent, separators=(",", ":")).encode("utf-8")

    def watch(self, core: _Core, deliver: Deliver) -> Optional[Deliver]:
        """Register `deliver` for the answer (and, with on_approval="raise",
        for the approval event); returns the held watcher to unwatch."""
        core.register(self.key, deliver)
        if not self.raise_when_held:
            return None

        def held(event: Any) -> None:
            deliver(StepgateAwaitingApproval(
                f"step {self.step_index} of {self.workflow_id} ({self.tool}) is held for a "
                "person's approval; call it again with the same step key for its answer once "
                "they decide", event))

        core.watch_held(self.key, held)
        return held

    def unwatch(self, core: _Core, deliver: Deliver, held: Optional[Deliver]) -> None:
        core.unregister(self.key, deliver)
        if held is not None:
            core.unwatch_held(self.key, held)

    def timeout(self, seconds: float) -> StepgateTimeout:
        return StepgateTimeout(
            f"no answer for step {self.step_index} of {self.workflow_id} ({self.tool}) in "
            f"{seconds} s")


class Client:
    """Publishes intents and waits for their answers; safe to share between threads.

    Many calls may wait at once (from as many threads): one background thread
    reads the answers and wakes each call by its step key and call_id. Each
    workflow's answers are read from its own partition only (the number of the
    intents partition its intents go to), from where the client first needs it,
    so an agent never holds other agents' answers. A call that hears nothing for
    `republish_after` seconds publishes the same intent again (same call_id):
    harmless, it is the same step.
    """

    def __init__(
        self,
        brokers: str,
        intents: Optional[str] = None,
        results: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Any = DERIVED,
        *,
        topics_prefix: Optional[str] = None,
    ):
        """Connect to `brokers` (`host:port,...`).

        Topics (the gate's `[kafka.topics]`): `topics_prefix` names all three
        as `<prefix>.intents`, `<prefix>.results` and `<prefix>.approvals`
        (the gate's defaults: `stepgate`); `intents=`, `results=` and
        `approvals=` name one each. A topic not named takes the prefix: the
        one given, else that of a given `intents=`/`results=` name of that
        shape (`acme.intents` -> `acme`), else `stepgate`. A missing topic
        raises StepgateTopicError naming it and its option, so a client never
        waits on a topic that is not there. `approvals=None` reads no approval
        events: a call held for a person then waits for the decision, even
        with `on_approval="raise"`.

        `config`: more librdkafka properties for both of the client's Kafka
        clients (TLS, SASL, ...). `metadata_timeout`: seconds to wait for the
        broker's topic metadata (and a partition's offsets).
        """
        intents, results, approvals = topic_names(topics_prefix, intents, results, approvals)
        self._core = _Core(brokers, intents, results, config, metadata_timeout, approvals)
        self.intents, self.results, self.approvals = intents, results, approvals

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

        `call_id` names this call for its answer (a fresh one by default); it
        is not the step's identity. Give one of your own only if it is unique
        to this call — never a model's `tool_call_id`, which repeats; put that
        in `metadata` to correlate. A call of an `approval` tool waits for a
        person's decision; with `on_approval="raise"` it raises
        StepgateAwaitingApproval as soon as stepgate holds it (the step stays
        recorded: call again later)."""
        core = self._core
        call = _Call(workflow_id, step_index, tool, arguments, attempt, call_id, metadata,
                     on_approval)
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

        held = call.watch(core, deliver)
        try:
            deadline = time.monotonic() + timeout
            while True:
                while not core.publish(workflow_id, call.value, headers, deliver):
                    core.producer.poll(0.05)
                    if time.monotonic() >= deadline:
                        raise call.timeout(timeout)
                left = deadline - time.monotonic()
                try:
                    return Answer.from_dict(fut.result(max(0.0, min(left, republish_after))))
                except concurrent.futures.TimeoutError:
                    if time.monotonic() >= deadline:
                        raise call.timeout(timeout) from None
        finally:
            call.unwatch(core, deliver, held)

    def wait_settled(self, answer: Answer, arguments: Mapping[str, Any], **kw: Any) -> Answer:
        """Repeat `answer`'s in-doubt step until it is settled (bounded); see
        `wait_settled` (the module function) for the options."""
        return wait_settled(self, answer, arguments, **kw)

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
        intents: Optional[str] = None,
        results: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Any = DERIVED,
        *,
        topics_prefix: Optional[str] = None,
    ):
        """Connect to `brokers`; the options are `Client`'s. Blocking (the
        topics' metadata): from a coroutine, `await AsyncClient.connect(...)`."""
        intents, results, approvals = topic_names(topics_prefix, intents, results, approvals)
        self._core = _Core(brokers, intents, results, config, metadata_timeout, approvals)
        self.intents, self.results, self.approvals = intents, results, approvals
        self._following: Dict[int, "asyncio.Future[None]"] = {}

    @classmethod
    async def connect(
        cls,
        brokers: str,
        intents: Optional[str] = None,
        results: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
        metadata_timeout: float = 10.0,
        approvals: Any = DERIVED,
        *,
        topics_prefix: Optional[str] = None,
    ) -> "AsyncClient":
        """The constructor (same options), with its metadata read off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, lambda: cls(brokers, intents, results, config, metadata_timeout, approvals,
                              topics_prefix=topics_prefix)
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
        """Publish one tool call and await its answer (as `Client.call`)."""
        core = self._core
        loop = asyncio.get_running_loop()
        call = _Call(workflow_id, step_index, tool, arguments, attempt, call_id, metadata,
                     on_approval)
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

        held = call.watch(core, deliver)
        try:
            deadline = loop.time() + timeout
            while True:
                while not core.publish(workflow_id, call.value, headers, deliver):
                    if loop.time() >= deadline:
                        raise call.timeout(timeout)
                    await asyncio.sleep(0.05)
                left = deadline - loop.time()
                try:
                    outcome = await asyncio.wait_for(
                        asyncio.shield(fut), max(0.0, min(left, republish_after))
                    )
                    return Answer.from_dict(outcome)
                except asyncio.TimeoutError:
                    if loop.time() >= deadline:
                        raise call.timeout(timeout) from None
        finally:
            call.unwatch(core, deliver, held)
            if not fut.done():
                fut.cancel()

    async def wait_settled(self, answer: Answer, arguments: Mapping[str, Any],
                           **kw: Any) -> Answer:
        """`Client.wait_settled`, awaited (see `await_settled`)."""
        return await await_settled(self, answer, arguments, **kw)

    async def close(self) -> None:
        """Stop reading answers; calls still waiting raise StepgateClosed."""
        await asyncio.get_running_loop().run_in_executor(None, self._core.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _keeps_waiting(answer: Answer, wait_for_person: bool) -> bool:
    """In doubt, and someone is expected to settle it while we wait."""
    if answer.status != "in_doubt":
        return False
    return wait_for_person or (answer.in_doubt is not None
                               and answer.in_doubt.settling == RECONCILER)


def wait_settled(client: Client, answer: Answer, arguments: Mapping[str, Any], *,
                 within: float = 300.0, every: float = 2.0, wait_for_person: bool = False,
                 **kw: Any) -> Answer:
    """Learn how an in-doubt step was settled: repeat it — same workflow, step
    index, tool and attempt, each repeat a call of its own (`call_id`) — every
    `every` seconds, until its answer is no longer `in_doubt`, and return that
    answer. At most `within` seconds: then the last (in-doubt) answer.

    A repeat is what the answer's `in_doubt.learn` (`"repeat_step"`) says to
    do: it returns the same in-doubt answer until the step is settled, then
    the settled one — the tool's result if the call took effect, or, if it
    did not, the result of running it once then (with the same key). An
    answer that is not in doubt is returned at once. Without
    `wait_for_person`, a step a person settles (`in_doubt.settling ==
    "person"`: no tool lookup, or the lookups could not tell) is returned at
    once too: nobody knows when a person decides. `kw` goes to each
    `Client.call` (`timeout`, `metadata`, ...).
    """
    deadline = time.monotonic() + within
    while _keeps_waiting(answer, wait_for_person) and time.monotonic() < deadline:
        time.sleep(max(0.0, min(every, deadline - time.monotonic())))
        answer = client.call(answer.workflow_id, answer.step_index, answer.tool, arguments,
                             attempt=answer.attempt, **dict(kw, call_id=new_call_id()))
    return answer


async def await_settled(client: Union[Client, "AsyncClient"], answer: Answer,
                        arguments: Mapping[str, Any], *, within: float = 300.0,
                        every: float = 2.0, wait_for_person: bool = False,
                        **kw: Any) -> Answer:
    """`wait_settled` from a coroutine, on either client (a `Client`'s calls
    run on a worker thread)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while _keeps_waiting(answer, wait_for_person) and loop.time() < deadline:
        await asyncio.sleep(max(0.0, min(every, deadline - loop.time())))
        args = (answer.workflow_id, answer.step_index, answer.tool, arguments)
        call_kw = dict(kw, attempt=answer.attempt, call_id=new_call_id())
        if isinstance(client, AsyncClient):
            answer = await client.call(*args, **call_kw)
        else:
            answer = await asyncio.to_thread(client.call, *args, **call_kw)
    return answer


def _at_hop(kw: Dict[str, Any], hop: int) -> Dict[str, Any]:
    """A workflow call's keywords for its `hop`-th step: its own call_id there."""
    return dict(kw, call_id=hop_call_id(kw["call_id"], hop)) if kw.get("call_id") else kw


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
                                      **_at_hop(kw, hop))
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
                                            **_at_hop(kw, hop))
            if not answer.identity_conflict:
                break
        return answer

    async def again(
        self, step_index: int, tool: str, arguments: Mapping[str, Any], **kw: Any
    ) -> Answer:
        return await self.client.call(self.workflow_id, step_index, tool, arguments, **kw)
