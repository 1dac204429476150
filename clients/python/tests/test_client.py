"""`Client` and `AsyncClient` against a real broker and a running stepgate."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import stepgate_client
from stepgate_client import (
    Answer,
    AsyncClient,
    Client,
    StepgateAwaitingApproval,
    StepgateClosed,
    StepgateTimeout,
    StepgateTopicError,
    partition_for,
)

from harness import REPO, Stack, wait_for


def test_partition_for_is_kafkas_murmur2():
    # Reference values from Kafka's own Utils.murmur2 / the default partitioner
    # (see crates/stepgate-client/src/contract/partition.rs).
    assert stepgate_client.murmur2(b"21") == (-973932308) & 0xFFFFFFFF
    assert partition_for("order-7781", 7) == 3
    assert partition_for("abcd", 7) == 5
    assert partition_for("", 4) == 1


def test_the_package_has_a_version_and_ships_py_typed():
    assert isinstance(stepgate_client.__version__, str) and stepgate_client.__version__
    assert (Path(stepgate_client.__file__).parent / "py.typed").is_file()
    site = os.environ.get("PYTEST_STEPGATE_CLIENT_SITE")
    if site:  # run by tests/broker/python_client.rs: the pip-installed package is under test
        assert Path(stepgate_client.__file__).resolve().is_relative_to(Path(site).resolve())
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return
    try:
        assert version("stepgate-client") == stepgate_client.__version__
    except PackageNotFoundError:
        assert not site, "the installed package has its metadata"  # else: the source tree


def test_a_rephrased_retry_gets_the_first_answer_typed_and_the_tool_runs_once(stack, wf):
    with stack.client() as client:
        run = client.workflow(wf)
        first = run.call("create_ticket", {"title": "Subject: Order confirmed"}, call_id=f"{wf}-1")
        again = run.again(0, "create_ticket", {"title": "Subject: Your order is confirmed"},
                          call_id=f"{wf}-1b")
    assert isinstance(first, Answer) and isinstance(again, Answer)
    assert first.ok and first.status == "ok" and first.error is None
    assert first.deduplicated is False and again.deduplicated is True
    assert (first.workflow_id, first.step_index, first.tool, first.attempt) == (wf, 0, "create_ticket", 0)
    assert first.output["echo"] == {"title": "Subject: Order confirmed"}
    assert again.output == first.output and again.call_id == f"{wf}-1b"
    # The record as stepgate wrote it: every field of Result v1.
    required = json.loads((REPO / "schemas" / "result.v1.json").read_text())["required"]
    assert set(required) <= set(first.to_dict())
    assert {k: v for k, v in again.to_dict().items() if k not in ("call_id", "deduplicated")} == \
        {k: v for k, v in first.to_dict().items() if k not in ("call_id", "deduplicated")}
    assert stack.tools.count("create_ticket", wf) == 1


def test_identical_arguments_at_two_steps_both_run(stack, wf):
    with stack.client() as client:
        run = client.workflow(wf)
        one = run.call("create_ticket", {"title": "Same"})
        two = run.call("create_ticket", {"title": "Same"})
    assert (one.step_index, two.step_index, run.next_step) == (0, 1, 2)
    assert not one.deduplicated and not two.deduplicated
    assert stack.tools.count("create_ticket", wf) == 2


def test_a_failed_call_is_a_typed_error_answer(stack, wf):
    stack.tools.statuses["fails"] = 400
    with stack.client() as client:
        answer = client.call(wf, 0, "fails", {"x": 1})
    assert answer.status == "error" and not answer.ok
    assert answer.error is not None and answer.error.kind and answer.error.message
    assert answer.output is None


def test_a_call_that_timed_out_is_answered_on_its_repeat_without_a_second_run(stack, wf):
    stack.tools.delays["slow"] = 0.5
    with stack.client() as client:
        with pytest.raises(StepgateTimeout):
            client.call(wf, 0, "slow", {"n": 1}, timeout=0.0)
        wait_for(lambda: stack.tools.count("slow", wf) == 1, 60, "the lost call ran")
        answer = client.call(wf, 0, "slow", {"n": 1, "rephrased": True})
    assert answer.ok and answer.output["echo"] == {"n": 1}
    assert stack.tools.count("slow", wf) == 1


def test_one_client_serves_eight_calls_from_eight_threads_at_once(stack, wf):
    # The tool holds each call until all 8 are inside together (or 25 s pass):
    # a client that serves one call at a time never gets there.
    stack.tools.meet("meet", 8, 25.0)
    with stack.client() as client:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda i: client.call(f"{wf}-{i}", 0, "meet", {"i": i}, timeout=120), range(8)))
    assert [a.output["echo"]["i"] for a in answers] == list(range(8))
    assert stack.tools.most_inside["meet"] == 8, "the 8 calls were in the tool together"


def test_one_workflow_s_concurrent_calls_take_distinct_steps(stack, wf):
    stack.tools.meet("meet", 4, 25.0)
    with stack.client() as client:
        run = client.workflow(wf)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: run.call("meet", {"i": i}, timeout=120), range(4)))
    assert sorted(a.step_index for a in answers) == [0, 1, 2, 3]
    assert stack.tools.most_inside["meet"] == 4


def test_async_client_serves_eight_calls_at_once_without_a_thread_each(stack, wf):
    def threads():
        # The client's own two, and the default executor's (asyncio_N): the
        # first call of a partition reads its watermark there. (The tool
        # server in this process has a thread per request: not counted.)
        return sorted(t.name for t in threading.enumerate()
                      if t.name.startswith(("asyncio_", "stepgate-")))

    async def main():
        client = await AsyncClient.connect(stack.brokers, intents=stack.intents,
                                           results=stack.results)  # approvals: derived
        async with client:
            seen = []
            for step in (0, 1):
                stack.tools.meet("meet_async", 8, 25.0)
                answers = await asyncio.gather(*[
                    client.call(f"{wf}-{i}", step, "meet_async", {"i": i}, timeout=120)
                    for i in range(8)])
                assert [a.output["echo"]["i"] for a in answers] == list(range(8))
                assert stack.tools.most_inside["meet_async"] == 8, "8 calls in the tool together"
                seen.append(threads())
            again = await client.workflow(f"{wf}-0").again(0, "meet_async", {"i": "again"})
        return seen, again

    seen, again = asyncio.run(main())
    # The same workflows again (their partitions followed): not one more thread.
    assert seen[0] == seen[1], seen
    assert len([t for t in seen[0] if t.startswith("stepgate-")]) == 2
    assert len([t for t in seen[0] if t.startswith("asyncio_")]) <= 5  # connect + 4 partitions
    assert again.deduplicated and again.output["echo"] == {"i": 0}


def test_closing_the_client_ends_a_waiting_call(stack, wf):
    stack.tools.delays["slow"] = 0.5
    client = stack.client()
    outcome = {}

    def call():
        try:
            outcome["answer"] = client.call(wf, 0, "slow", {}, timeout=120)
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e

    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: client._core.in_flight() == 1, 30, "the call waits")
    client.close()
    t.join(30)
    assert isinstance(outcome.get("error"), StepgateClosed), outcome


def test_answers_come_to_the_intent_s_partition_number_with_more_results_partitions(wf):
    """4 intents and 8 results partitions (allowed: results >= intents): the gate
    answers in the intent's partition number, so every workflow is answered."""
    s = Stack(intents_partitions=4, results_partitions=8).start()
    try:
        with s.client() as client:
            assert client.partitions == 4
            ids = [f"{wf}-{i}" for i in range(16)]
            # Workflows whose partition differs between the two counts are
            # the ones a client reading the results topic's count would miss.
            assert any(partition_for(w, 4) != partition_for(w, 8) for w in ids)
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(
                    lambda w: client.call(w, 0, "create_ticket", {"w": w}, timeout=60), ids))
        assert [a.workflow_id for a in answers] == ids
        assert all(a.ok for a in answers)
    finally:
        s.stop()


def test_many_clients_on_one_partition_each_get_their_own_answers(stack, wf):
    # Two clients follow the same partition: each sees the other's answers and
    # keeps only its own calls'.
    with stack.client() as a, stack.client() as b:
        with ThreadPoolExecutor(4) as pool:
            fa = [pool.submit(a.call, wf, i, "create_ticket", {"by": "a", "i": i}) for i in range(2)]
            fb = [pool.submit(b.call, wf, i + 2, "create_ticket", {"by": "b", "i": i}) for i in range(2)]
            ra = [f.result() for f in fa]
            rb = [f.result() for f in fb]
    assert [r.output["echo"]["by"] for r in ra] == ["a", "a"]
    assert [r.output["echo"]["by"] for r in rb] == ["b", "b"]
    assert stack.tools.count("create_ticket", wf) == 4


def test_a_client_refuses_a_missing_topic():
    from confluent_kafka import KafkaException

    from harness import brokers

    with pytest.raises(KafkaException, match="not found") as e:
        Client(brokers(), intents="sgpy-no-such-topic.intents",
               results="sgpy-no-such-topic.results", metadata_timeout=5)
    assert isinstance(e.value, StepgateTopicError)
    assert "sgpy-no-such-topic.intents" in str(e.value) and "intents=" in str(e.value)


# Two workflows whose calls carry one call_id, as model ids repeat (every
# conversation of a local model starts at `call_0`): the slow one waits in the
# tool while the fast one is answered.
def _collide(wf):
    return f"{wf}-collide-A", f"{wf}-collide-B"


def test_two_workflows_sharing_a_call_id_each_get_their_own_answer(stack, wf):
    a_wf, b_wf = _collide(wf)
    stack.tools.hold("slow")
    try:
        with stack.client() as client, ThreadPoolExecutor(1) as pool:
            slow = pool.submit(client.call, a_wf, 0, "slow", {"who": "A"}, call_id="call_0",
                               timeout=60)
            wait_for(lambda: stack.tools.count("slow", a_wf) == 1, 60, "A's call is in the tool")
            fast = client.call(b_wf, 0, "create_ticket", {"who": "B"}, call_id="call_0",
                               timeout=60)
            assert (fast.workflow_id, fast.output["echo"]) == (b_wf, {"who": "B"})
            # B's answer (call_0) came while A waited on call_0: not A's.
            assert not slow.done() or slow.result().workflow_id == a_wf, slow.result()
            stack.tools.release("slow")
            a = slow.result(60)
    finally:
        stack.tools.release("slow")
    assert (a.workflow_id, a.tool, a.output["echo"]) == (a_wf, "slow", {"who": "A"})
    assert stack.tools.count("slow", a_wf) == 1 and stack.tools.count("create_ticket", b_wf) == 1


def test_async_two_workflows_sharing_a_call_id_each_get_their_own_answer(stack, wf):
    a_wf, b_wf = _collide(wf)

    async def main():
        async with await AsyncClient.connect(stack.brokers, topics_prefix=stack.prefix) as client:
            slow = asyncio.ensure_future(
                client.call(a_wf, 0, "slow", {"who": "A"}, call_id="call_0", timeout=60))
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("slow", a_wf) == 1, 60,
                                    "A's call is in the tool")
            fast = await client.call(b_wf, 0, "create_ticket", {"who": "B"}, call_id="call_0",
                                     timeout=60)
            early = slow.result() if slow.done() else None
            stack.tools.release("slow")
            return fast, early, await slow

    stack.tools.hold("slow")
    try:
        fast, early, a = asyncio.run(main())
    finally:
        stack.tools.release("slow")
    assert (fast.workflow_id, fast.output["echo"]) == (b_wf, {"who": "B"})
    assert early is None or early.workflow_id == a_wf, early
    assert (a.workflow_id, a.tool, a.output["echo"]) == (a_wf, "slow", {"who": "A"})


def test_a_call_held_for_approval_stops_only_its_own_waiter(stack, wf):
    """A's call is held for approval; B's, in another workflow with the same
    call_id, waits in its tool: only A is told it is held."""
    a_wf, b_wf = _collide(wf)
    stack.tools.hold("slow")
    try:
        with stack.client() as client, ThreadPoolExecutor(1) as pool:
            b = pool.submit(client.call, b_wf, 0, "slow", {"who": "B"}, call_id="call_0",
                            timeout=60, on_approval="raise")
            wait_for(lambda: stack.tools.count("slow", b_wf) == 1, 60, "B's call is in the tool")
            with pytest.raises(StepgateAwaitingApproval) as held:
                client.call(a_wf, 0, "wire_approved", {"amount": 1}, call_id="call_0",
                            timeout=60, on_approval="raise")
            assert held.value.event["workflow_id"] == a_wf
            stack.tools.release("slow")
            answer = b.result(60)
    finally:
        stack.tools.release("slow")
    assert (answer.workflow_id, answer.output["echo"]) == (b_wf, {"who": "B"})


def test_a_client_naming_intents_and_results_finds_their_approvals_topic(stack, wf):
    """The gate's topics named as `<prefix>.intents` and `<prefix>.results`,
    without `approvals=`: a held call is still reported as held."""
    with Client(stack.brokers, intents=stack.intents, results=stack.results) as client:
        assert client.approvals == f"{stack.prefix}.approvals"
        with pytest.raises(StepgateAwaitingApproval):
            client.call(wf, 0, "wire_approved", {"amount": 5}, on_approval="raise", timeout=30)


def test_a_missing_approvals_topic_is_named_at_once(stack):
    with pytest.raises(StepgateTopicError) as e:
        Client(stack.brokers, intents=stack.intents, results=stack.results,
               approvals="sgpy-no-such-topic.approvals", metadata_timeout=5)
    text = str(e.value)
    assert "sgpy-no-such-topic.approvals" in text and "approvals=" in text, text
    assert "topics_prefix=" in text, text


def test_a_step_key_stepgate_would_refuse_is_refused_before_it_is_sent(stack, wf):
    with stack.client() as client:
        for bad in [dict(step_index=-1), dict(attempt=-1), dict(attempt=True),
                    dict(tool="no spaces"), dict(workflow_id="")]:
            key = dict(dict(workflow_id=wf, step_index=0, tool="create_ticket", attempt=0), **bad)
            with pytest.raises(ValueError, match=next(iter(bad))):
                client.call(key["workflow_id"], key["step_index"], key["tool"], {},
                            attempt=key["attempt"], timeout=5)
    assert stack.tools.count("create_ticket", wf) == 0


def test_a_different_call_in_a_lost_call_s_step_moves_on_and_the_real_retry_gets_its_answer(
        stack, wf):
    """alice then bob, `identity = ["to"]`: alice's call is lost; a resumed run
    that numbers bob's call where alice's was gets a conflict at that step and
    moves on; alice's rephrased retry still gets alice's answer. Each email is
    sent once."""
    stack.tools.delays["mail"] = 0.3
    with stack.client() as client:
        with pytest.raises(StepgateTimeout):
            client.workflow(wf).call("mail", {"to": "alice", "subject": "Hi"}, timeout=0.0)
        wait_for(lambda: stack.tools.count("mail", wf) == 1, 60, "alice's email was sent")
        resumed = client.workflow(wf, next_step=0)  # numbering bob where alice was
        bob = resumed.call("mail", {"to": "bob", "subject": "Hi"}, call_id=f"{wf}-bob")
        alice = resumed.again(0, "mail", {"to": "alice", "subject": "Hello again"})
        conflict = client.call(wf, 0, "mail", {"to": "carol", "subject": "Hi"})
    assert bob.ok and bob.step_index == 1 and bob.output["echo"]["to"] == "bob"
    assert resumed.next_step == 2
    assert alice.ok and alice.deduplicated and alice.output["echo"]["to"] == "alice"
    assert conflict.identity_conflict and "alice" in conflict.error.message
    assert sorted(c.body["to"] for c in stack.tools.invocations("mail", wf)) == ["alice", "bob"]


def test_a_call_held_for_approval_raises_when_asked_and_its_repeat_gets_the_answer(stack, wf):
    from stepgate_client import StepgateAwaitingApproval

    with stack.client() as client:
        with pytest.raises(StepgateAwaitingApproval) as held:
            client.call(wf, 0, "wire_approved", {"amount": 900}, on_approval="raise",
                        timeout=60)
        assert held.value.event["event"] == "requested"
        assert held.value.event["arguments"] == {"amount": 900}
        assert stack.tools.count("wire_approved", wf) == 0
        ok = stack.cli("approvals", "approve", wf, "0", "wire_approved", "--by", "alice")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        answer = client.call(wf, 0, "wire_approved", {"amount": 900}, timeout=60)
    assert answer.ok and answer.output["echo"] == {"amount": 900}
    assert stack.tools.count("wire_approved", wf) == 1
