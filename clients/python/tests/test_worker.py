"""The worker SDK against a real broker, speaking the pool protocol
(docs/design.md "Worker pools"): the tests play the gate's part — they publish
Call v1 records and read Outcome v1 ones — and run workers as processes, so
that one can be killed with SIGKILL mid-call. Effects are counted where they
happen: each tool appends its invocation to a file before doing anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from harness import brokers, wait_for
from stepgate_client.worker import Worker, signature

HERE = Path(__file__).resolve().parent
PROGRESS_PARTITIONS = 4


class Pool:
    """A pool's topics, the worker processes, and the gate's side of the protocol."""

    def __init__(self) -> None:
        self.prefix = f"sgpw-{uuid.uuid4().hex[:10]}"
        self.pool = "p"
        self.calls = f"{self.prefix}.calls.{self.pool}"
        self.progress = f"{self.prefix}.progress"
        # The pool's key: the tests sign calls with it, as a gate does.
        self.key = f"pytest-pool-key-{uuid.uuid4().hex}"
        self.dir = tempfile.TemporaryDirectory(prefix="stepgate-worker-")
        self.log = Path(self.dir.name) / "invocations.jsonl"
        self.log.touch()
        admin = AdminClient({"bootstrap.servers": brokers()})
        fs = admin.create_topics([NewTopic(self.calls, 2, 1),
                                  NewTopic(self.progress, PROGRESS_PARTITIONS, 1)])
        for f in fs.values():
            f.result(60)
        self.procs = []
        self.producer = Producer({"bootstrap.servers": brokers()})
        self.reader = Consumer({"bootstrap.servers": brokers(), "group.id": f"{self.prefix}-r",
                                "auto.offset.reset": "earliest", "enable.auto.commit": False})
        self.reader.subscribe([self.progress])
        self.outcomes = []

    def start_worker(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.Popen([sys.executable, str(HERE / "worker_proc.py"), brokers(),
                              self.pool, self.prefix, str(self.log), self.key],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        assert p.stdout.readline().strip() == "READY"
        self.procs.append(p)
        return p

    def call(self, tool: str, category: str, args: dict, *, step: int = 0,
             take_within: float = 120.0, dispatch: int = 1,
             key: "str | None" = "pool", on: "int | None" = None) -> dict:
        """Publish a Call v1, signed as a gate does with the pool's key (`key`:
        "pool"), with another key, or not at all (None); to partition `on` of
        the calls topic, or by its key."""
        c = {"step": {"workflow_id": f"wf-{uuid.uuid4().hex[:8]}", "step_index": step,
                      "tool": tool, "attempt": 0},
             "dispatch": dispatch, "partition": 1, "category": category, "arguments": args,
             "idempotency_key": f"sg1-{uuid.uuid4().hex}",
             "take_by_ms": int((time.time() + take_within) * 1000), "call_id": "c1",
             "token": uuid.uuid4().hex}
        value = json.dumps(c).encode()
        headers = []
        if key is not None:
            k = self.key if key == "pool" else key
            headers = [("stepgate-signature", signature(k.encode(), "call", value).encode())]
        where = {} if on is None else {"partition": on}
        self.producer.produce(self.calls, key=c["step"]["workflow_id"], value=value,
                              headers=headers, **where)
        assert self.producer.flush(30) == 0
        return c

    def read_outcomes(self) -> list:
        while True:
            m = self.reader.poll(0.1)
            if m is None:
                return self.outcomes
            if m.error():
                continue
            # The gate takes an outcome only signed with the pool's key.
            sent = dict(m.headers() or []).get("stepgate-signature")
            assert sent == signature(self.key.encode(), "outcome", m.value()).encode(), \
                f"an outcome not signed with the pool's key: {m.value()!r}"
            self.outcomes.append((m.partition(), json.loads(m.value())))

    def events(self, call: dict) -> list:
        return [(p, o) for p, o in self.read_outcomes() if o["step"] == call["step"]]

    def finished(self, call: dict, limit: float = 60.0) -> dict:
        def done():
            fs = [o for _, o in self.events(call) if o["event"] == "finished"]
            return fs[0] if fs else None
        return wait_for(done, limit, f"the outcome of {call['step']}")

    def invocations(self, tool=None) -> list:
        lines = [json.loads(l) for l in self.log.read_text().splitlines() if l.strip()]
        return [l for l in lines if tool is None or l["tool"] == tool]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.reader.close()
        AdminClient({"bootstrap.servers": brokers()}).delete_topics(
            [self.calls, self.progress], operation_timeout=30)
        self.dir.cleanup()


@pytest.fixture
def pool():
    p = Pool()
    yield p
    p.close()


def test_the_signature_is_the_one_rust_computes():
    # The vector of crates/stepgate-client/src/contract/sign.rs and docs/tools.md.
    key = b"0123456789abcdef0123456789abcdef"
    value = (b'{"step":{"workflow_id":"order-7781","step_index":3,"tool":"render_invoice",'
             b'"attempt":0},"dispatch":1,"token":"5f1d3a0b9c8e7f6a5b4c3d2e1f0a9b8c"}')
    assert signature(key, "call", value) == \
        "643949ffd1e8884f9730ef1ce5f53d9c3eb81e6fde1e7c2d6413218ce77d3d6d"
    assert signature(key, "outcome", value) == \
        "73d676881e0d7c09187e616e0458698db0d48bca7295f482d6c60b036f44c7b5"


def test_a_worker_needs_its_pool_s_key():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        Worker(brokers(), "p", key="short")


def test_a_call_not_signed_with_the_pool_s_key_is_never_run(pool):
    pool.start_worker()
    unsigned = pool.call("echo_unkeyed", "unkeyed", {"forged": "unsigned"}, key=None, on=0)
    other = pool.call("echo_unkeyed", "unkeyed", {"forged": "other key"},
                      key=f"another-pools-key-{uuid.uuid4().hex}", on=0)
    real = pool.call("echo_unkeyed", "unkeyed", {"forged": False}, on=0)
    pool.finished(real)  # read after the two others, in their partition
    assert [i["args"] for i in pool.invocations()] == [{"forged": False}]
    assert pool.events(unsigned) == [] and pool.events(other) == []


def test_a_call_is_started_then_finished_on_its_partition(pool):
    pool.start_worker()
    call = pool.call("echo_unkeyed", "unkeyed", {"title": "Printer on fire"})
    out = pool.finished(call)
    assert out["outcome"] == {"status": "ok", "output": {"echo": {"title": "Printer on fire"}}}
    assert out["dispatch"] == 1
    # Each outcome echoes the call's token (and is signed: `read_outcomes`).
    assert {o["token"] for _, o in pool.events(call)} == {call["token"]}
    events = pool.events(call)
    # `started` first, both on the partition the call names.
    assert [o["event"] for _, o in events] == ["started", "finished"]
    assert {p for p, _ in events} == {1}
    assert len(pool.invocations("echo_unkeyed")) == 1
    # An async tool gets the step's key.
    k = pool.call("echo_keyed", "keyed", {"n": 1})
    assert pool.finished(k)["outcome"]["output"]["key"] == k["idempotency_key"]


def test_failures_become_model_readable_answers(pool):
    pool.start_worker()
    refused = pool.finished(pool.call("refuse", "keyed", {"title": ""}))["outcome"]
    assert refused["status"] == "error" and refused["error"]["kind"] == "tool_refused"
    assert "No ticket was opened" in refused["error"]["message"]
    # An effectful tool that raised may have acted: in doubt, said so.
    boom = pool.finished(pool.call("boom", "unkeyed", {}))["outcome"]
    assert boom["status"] == "in_doubt" and boom["error"]["kind"] == "outcome_unknown"
    assert "may or may not have taken effect" in boom["error"]["message"]
    # Wrong arguments: nothing performed, the tool never invoked.
    bad = pool.finished(pool.call("refuse", "keyed", {"subject": "x"}))["outcome"]
    assert bad["error"]["kind"] == "tool_refused"
    assert "does not take these arguments" in bad["error"]["message"]
    # A tool the worker does not have, and a category that disagrees.
    missing = pool.finished(pool.call("nope", "keyed", {}))["outcome"]
    assert "has no tool `nope`" in missing["error"]["message"]
    wrong = pool.finished(pool.call("echo_keyed", "unkeyed", {}))["outcome"]
    assert "declared `unkeyed` to stepgate but `keyed`" in wrong["error"]["message"]
    assert len(pool.invocations("refuse")) == 1 and not pool.invocations("echo_keyed")


def test_a_call_past_its_take_by_is_not_taken(pool):
    late = pool.call("echo_unkeyed", "unkeyed", {"late": True}, take_within=-1)
    pool.start_worker()
    on_time = pool.call("echo_unkeyed", "unkeyed", {"late": False})
    pool.finished(on_time)
    assert pool.events(late) == []
    assert [i["args"] for i in pool.invocations()] == [{"late": False}]


def test_an_unkeyed_call_cut_off_by_kill_is_never_invoked_again(pool):
    first = pool.start_worker()
    call = pool.call("hang_unkeyed", "unkeyed", {"to": "a@example.com"})
    wait_for(lambda: pool.invocations("hang_unkeyed"), 60, "the unkeyed call invoked")
    wait_for(lambda: [o for _, o in pool.events(call) if o["event"] == "started"], 30,
             "its started outcome")
    first.kill()
    first.wait()
    pool.start_worker()
    after = pool.call("echo_unkeyed", "unkeyed", {"after": True})
    pool.finished(after)  # the new worker has the group's partitions and reads on
    assert len(pool.invocations("hang_unkeyed")) == 1
    assert not [o for _, o in pool.events(call) if o["event"] == "finished"]


def test_a_keyed_call_cut_off_by_kill_runs_again_with_its_key(pool):
    first = pool.start_worker()
    call = pool.call("hang_keyed", "keyed", {"hang_once": True})
    wait_for(lambda: pool.invocations("hang_keyed"), 60, "the keyed call invoked")
    first.kill()
    first.wait()
    pool.start_worker()
    out = pool.finished(call, limit=90)
    assert out["outcome"] == {"status": "ok", "output": {"done": True}}
    runs = pool.invocations("hang_keyed")
    assert len(runs) == 2 and {r["key"] for r in runs} == {call["idempotency_key"]}
