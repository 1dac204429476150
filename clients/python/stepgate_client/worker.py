"""Tools as plain Python functions, run by a worker of a stepgate pool.

A tool declared `pool = "<name>"` in the gate's config is not called by the
gate: the gate records its step `started` and publishes a Call v1 on the pool's
calls topic in the same Kafka transaction, and the pool's workers — a consumer
group with no state of its own — take the calls, run them and publish Outcome
v1 records on `progress` (docs/design.md, "Worker pools"; schemas/call.v1.json
and schemas/outcome.v1.json).

    import os
    from stepgate_client.worker import Worker, ToolRefused

    worker = Worker("127.0.0.1:9092", pool="billing",
                    key=os.environ["BILLING_POOL_KEY"])

    @worker.tool("render_invoice", category="unkeyed")
    def render_invoice(order: str, call) -> dict:
        return {"invoice": make_invoice(order, key=call.idempotency_key)}

    worker.run()          # until SIGTERM/SIGINT, or worker.stop()

The function gets the call's arguments as keyword arguments, and the call
itself (`WorkerCall`: the step key, the `Idempotency-Key`, the dispatch) as
`call` if it takes a parameter of that name. It may be `async`. Its return
value is the output (anything JSON can encode). Raising `ToolRefused(text)`
says the tool definitely did nothing (the model reads `text`); any other
exception is reported as a failure of a tool that is safe to call again for
`read_only`/`idempotent` tools, and as `in_doubt` (it may have taken effect)
for `keyed`/`unkeyed` ones — a silently wrong "not performed" is worse than an
honest doubt.

The guarantee, as the protocol has it:

- `unkeyed`: the call's offset is committed (synchronously) and `started` is
  acknowledged **before** the function is called. A worker killed mid-call
  leaves the step to the gate's deadline (`in_doubt`); the call is never given
  to another worker.
- `keyed`, `idempotent`, `read_only`: `started`, the call, the outcome, and
  only then the offset. A worker killed mid-call leaves the call to the next
  member of the group, which runs it again with the same `Idempotency-Key`.
- A call not taken by its `take_by_ms` is left alone (the gate answers it
  `no_worker`).

Trust: `key` is the pool's key, the one the gates' config gives
`[pools.<pool>] key` (at least 32 bytes). A call is run only when its
`stepgate-signature` header verifies under it (only gates hold the key: a
record anyone else wrote on the calls topic is logged, counted in
`calls_refused` and committed past, never run); every outcome is signed with
it and echoes the call's `token`, without which the gate settles nothing.
`signature()` is the scheme (schemas/call.v1.json, docs/tools.md).

One worker runs one call at a time; run more workers (up to the calls topic's
partition count) for more at once. The call's offset is committed synchronously
on the thread that polled it, before the next poll: a rebalance's revocation
runs only inside poll, and a worker the group has moved on from (a new
generation) gets its commit refused — it raises, and nothing is invoked — so
two workers never both take an `unkeyed` call.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

log = logging.getLogger("stepgate_client.worker")

CATEGORIES = ("read_only", "idempotent", "keyed", "unkeyed")

SIGNATURE_HEADER = "stepgate-signature"
MIN_KEY_BYTES = 32
_LABELS = {"call": b"stepgate-call-v1\n", "outcome": b"stepgate-outcome-v1\n"}


def signature(key: bytes, kind: str, value: bytes) -> str:
    """The `stepgate-signature` of a record's value: HMAC-SHA256 under the
    pool's key over a label for `kind` ("call": a Call v1, signed by the gate;
    "outcome": an Outcome v1, signed by the worker), a newline, and the value
    exactly as sent; 64 lowercase hex characters."""
    return hmac.new(key, _LABELS[kind] + value, hashlib.sha256).hexdigest()


class ToolRefused(Exception):
    """The tool definitely did nothing (bad arguments, a business rule): the
    step ends `error` with this text, which the model reads — say what was
    wrong and what to do instead."""

    def __init__(self, message: str, kind: str = "tool_refused"):
        super().__init__(message)
        self.message = message
        self.kind = kind


@dataclass(frozen=True)
class StepKey:
    workflow_id: str
    step_index: int
    tool: str
    attempt: int

    def as_dict(self) -> Dict[str, Any]:
        return {"workflow_id": self.workflow_id, "step_index": self.step_index,
                "tool": self.tool, "attempt": self.attempt}


@dataclass(frozen=True)
class WorkerCall:
    """A Call v1, as a tool function sees it."""

    step: StepKey
    dispatch: int
    partition: int
    category: str
    arguments: Dict[str, Any]
    idempotency_key: str
    take_by_ms: int
    call_id: Optional[str] = None
    traceparent: Optional[str] = None
    # The dispatch's token, echoed in each outcome (the gate checks it).
    token: str = ""

    @staticmethod
    def parse(value: bytes) -> "WorkerCall":
        c = json.loads(value)
        s = c["step"]
        step = StepKey(str(s["workflow_id"]), int(s["step_index"]), str(s["tool"]),
                       int(s["attempt"]))
        if c["category"] not in CATEGORIES:
            raise ValueError(f"unknown category {c['category']!r}")
        if not isinstance(c["arguments"], dict):
            raise ValueError("arguments is not an object")
        if not isinstance(c["token"], str) or not c["token"]:
            raise ValueError("token is not a string")
        return WorkerCall(step=step, dispatch=int(c["dispatch"]), partition=int(c["partition"]),
                          category=c["category"], arguments=c["arguments"],
                          idempotency_key=str(c["idempotency_key"]),
                          take_by_ms=int(c["take_by_ms"]), call_id=c.get("call_id"),
                          traceparent=c.get("traceparent"), token=c["token"])


@dataclass
class _Tool:
    name: str
    category: str
    fn: Callable[..., Any]
    wants_call: bool


def _now_ms() -> int:
    return int(time.time() * 1000)


class Worker:
    """One member of a pool's worker group (see the module's text)."""

    def __init__(
        self,
        brokers: str,
        pool: str,
        *,
        key: Union[str, bytes],
        topics_prefix: str = "stepgate",
        gate_group: str = "stepgate-gate",
        calls_topic: Optional[str] = None,
        progress_topic: Optional[str] = None,
        group: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
    ) -> None:
        """`brokers`; `key`, the pool's key (the gates' `[pools.<pool>] key`,
        at least 32 bytes; a `str` is taken as its UTF-8 bytes); and the names
        the gate's config uses: its `kafka.topics.pool_calls` with `{pool}`
        replaced (default `<topics_prefix>.calls.<pool>`),
        `kafka.topics.progress` (default `<topics_prefix>.progress`) and
        `kafka.gate_group` (the workers' group is `<gate_group>.pool.<pool>`).
        Set `topics_prefix` and `gate_group` whenever the gate's config
        changes them, or the worker reads a topic no gate writes. `config`:
        more librdkafka properties for both clients (TLS, SASL)."""
        self._key = key.encode() if isinstance(key, str) else bytes(key)
        if len(self._key) < MIN_KEY_BYTES:
            raise ValueError(
                f"the key of pool {pool!r} is {len(self._key)} bytes: give the pool's key, the "
                f"gates' `[pools.{pool}] key`, of at least {MIN_KEY_BYTES} bytes")
        self.pool = pool
        self.calls_topic = calls_topic or f"{topics_prefix}.calls.{pool}"
        self.progress_topic = progress_topic or f"{topics_prefix}.progress"
        self.group = group or f"{gate_group}.pool.{pool}"
        self._common = {"bootstrap.servers": brokers, **(config or {})}
        self._tools: Dict[str, _Tool] = {}
        self._stop = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.calls_run = 0
        # Records of the calls topic not run: not signed with the pool's key.
        self.calls_refused = 0

    def tool(self, name: str, *, category: str = "keyed") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register a function as the pool's tool `name`. `category` must be the
        one the gate's config gives the tool (it decides when the call is
        committed as taken); a call whose category differs is refused."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, not {category!r}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            wants_call = "call" in inspect.signature(fn).parameters
            self._tools[name] = _Tool(name, category, fn, wants_call)
            return fn

        return register

    def stop(self) -> None:
        """Stop after the call in hand (from any thread or a signal handler)."""
        self._stop.set()

    def run(self, *, handle_signals: bool = True) -> None:
        """Take and run calls until `stop()` (or SIGTERM/SIGINT when
        `handle_signals` and on the main thread)."""
        if not self._tools:
            raise ValueError("no tools: register some with @worker.tool(...)")
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        consumer = Consumer({
            **self._common,
            "group.id": self.group,
            # Only calls whose `started` record committed are visible.
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        })
        producer = Producer({**self._common, "enable.idempotence": True, "linger.ms": 0})
        self._loop = asyncio.new_event_loop()
        consumer.subscribe([self.calls_topic])
        log.info("worker of pool %s consuming %s as group %s (outcomes to %s), tools: %s",
                 self.pool, self.calls_topic, self.group, self.progress_topic,
                 ", ".join(sorted(self._tools)))
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("calls topic: %s", msg.error())
                    continue
                self._handle(consumer, producer, msg)
        finally:
            producer.flush(30)
            consumer.close()
            self._loop.close()

    # One call, in the order the protocol asks for.
    def _handle(self, consumer: Consumer, producer: Producer, msg: Message) -> None:
        value = msg.value() or b""
        sent = dict(msg.headers() or []).get(SIGNATURE_HEADER) or b""
        if not hmac.compare_digest(sent, signature(self._key, "call", value).encode()):
            # Only gates hold the key: never run, and committed past so that
            # it cannot hold the partition up.
            self.calls_refused += 1
            log.warning("a record of %s[%d]@%d is not a call signed with pool %s's key "
                        "(not written by a gate): not run (%d refused so far)", msg.topic(),
                        msg.partition(), msg.offset(), self.pool, self.calls_refused)
            consumer.commit(message=msg, asynchronous=False)
            return
        try:
            call = WorkerCall.parse(value)
        except (ValueError, KeyError, TypeError) as e:
            # Not a Call v1 this worker can read: nothing to answer it with.
            log.error("unreadable call at %s[%d]@%d: %s", msg.topic(), msg.partition(),
                      msg.offset(), e)
            consumer.commit(message=msg, asynchronous=False)
            return
        if _now_ms() > call.take_by_ms:
            # Too late to take: the gate answers it `no_worker`.
            log.warning("call of %s (workflow %s, step %d) past take_by; left to the gate",
                        call.step.tool, call.step.workflow_id, call.step.step_index)
            consumer.commit(message=msg, asynchronous=False)
            return
        tool = self._tools.get(call.step.tool)
        unkeyed = call.category == "unkeyed"
        if unkeyed:
            # Taken before invoked: from here no other worker gets this call.
            consumer.commit(message=msg, asynchronous=False)
        self._publish(producer, call, "started", None)
        outcome = self._invoke(tool, call)
        self._publish(producer, call, "finished", outcome)
        if not unkeyed:
            consumer.commit(message=msg, asynchronous=False)
        self.calls_run += 1

    def _invoke(self, tool: Optional[_Tool], call: WorkerCall) -> Dict[str, Any]:
        name = call.step.tool
        if tool is None:
            return _error("tool_refused",
                          f"Nothing was performed: the `{self.pool}` worker that took this call "
                          f"has no tool `{name}`. Do not call `{name}` again until it is "
                          f"deployed; tell the user the tool is unavailable.")
        if tool.category != call.category:
            return _error("tool_refused",
                          f"Nothing was performed: `{name}` is declared `{call.category}` to "
                          f"stepgate but `{tool.category}` by its worker, so it was not run. "
                          f"Tell the user the tool is misconfigured; do not call it again.")
        kwargs = dict(call.arguments)
        if tool.wants_call:
            kwargs["call"] = call
        try:
            inspect.signature(tool.fn).bind(**kwargs)
        except TypeError as e:
            return _error("tool_refused",
                          f"Nothing was performed: `{name}` does not take these arguments "
                          f"({e}). Call it again with the arguments its schema names.")
        try:
            out = tool.fn(**kwargs)
            if inspect.isawaitable(out):
                out = self._loop.run_until_complete(out)  # type: ignore[union-attr]
            json.dumps(out)
            return {"status": "ok", "output": out}
        except ToolRefused as e:
            return _error(e.kind, e.message)
        except Exception as e:  # noqa: BLE001  (every failure becomes a model-readable answer)
            what = f"{type(e).__name__}: {e}"[:500]
            if call.category in ("read_only", "idempotent"):
                return _error("tool_failed",
                              f"The call to `{name}` failed ({what}). It is safe to call "
                              f"`{name}` again.")
            log.exception("tool %s raised during an effectful call", name)
            return {"status": "in_doubt", "error": {
                "kind": "outcome_unknown",
                "message": f"The call to `{name}` failed partway ({what}), so it may or may "
                           f"not have taken effect. Do not call `{name}` again for this step: "
                           f"repeating it returns this same answer. Tell the user the outcome "
                           f"is unconfirmed and a person must check it."}}

    def _publish(self, producer: Producer, call: WorkerCall, event: str,
                 outcome: Optional[Dict[str, Any]]) -> None:
        record: Dict[str, Any] = {"step": call.step.as_dict(), "dispatch": call.dispatch,
                                  "at_ms": _now_ms(), "token": call.token, "event": event}
        if outcome is not None:
            record["outcome"] = outcome
        value = json.dumps(record).encode()
        headers = [(SIGNATURE_HEADER, signature(self._key, "outcome", value).encode())]
        failed: list = []
        producer.produce(self.progress_topic, key=call.step.workflow_id.encode(),
                         value=value, partition=call.partition, headers=headers,
                         on_delivery=lambda err, _m: failed.append(err) if err else None)
        # Acknowledged before the next move: `started` before the tool is
        # called, the outcome before the call's offset is committed.
        if producer.flush(60) > 0 or failed:
            raise KafkaException(failed[0] if failed else KafkaError(KafkaError._TIMED_OUT))


def _error(kind: str, message: str) -> Dict[str, Any]:
    return {"status": "error", "error": {"kind": kind, "message": message}}
