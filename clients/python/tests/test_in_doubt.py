"""The structured `in_doubt` of an answer, and waiting for its resolution
(`wait_settled`), on its own and against a real broker and stepgate."""

from __future__ import annotations

import asyncio
from typing import Any, List

from stepgate_client import (
    PERSON,
    RECONCILER,
    Answer,
    InDoubt,
    await_settled,
    wait_settled,
)


def _answer(status: str, settling: str = RECONCILER, output: Any = None) -> Answer:
    d = {"workflow_id": "wf", "step_index": 3, "tool": "send_fax", "attempt": 1,
         "call_id": "c", "status": status, "deduplicated": False,
         "completed_at": "2026-11-29T08:00:00.000Z"}
    if status == "ok":
        d["output"] = output
    else:
        d["error"] = {"kind": "outcome_unknown", "message": "m"}
    if status == "in_doubt":
        d["in_doubt"] = {"version": 1, "idempotency_key": "sg1-abc",
                         "since": "2026-11-29T08:00:00.000Z", "settling": settling,
                         "until": "2026-11-29T08:10:00.000Z", "learn": "repeat_step",
                         "later_field": True}
    return Answer.from_dict(d)


class _Scripted:
    """A client whose calls answer from a script (the last answer repeats)."""

    def __init__(self, answers: List[Answer]):
        self.answers, self.calls = answers, []

    def call(self, workflow_id, step_index, tool, arguments, **kw):
        self.calls.append((workflow_id, step_index, tool, dict(arguments), kw))
        return self.answers[min(len(self.calls) - 1, len(self.answers) - 1)]


def test_an_in_doubt_answer_exposes_its_structure():
    a = _answer("in_doubt")
    assert a.in_doubt == InDoubt(version=1, idempotency_key="sg1-abc",
                                 since="2026-11-29T08:00:00.000Z", settling=RECONCILER,
                                 learn="repeat_step", until="2026-11-29T08:10:00.000Z")
    assert a.reconciling and not a.settled
    assert a.to_dict()["in_doubt"]["later_field"] is True, "a newer field stays in the record"
    assert not _answer("in_doubt", PERSON).reconciling
    ok = _answer("ok", output={"x": 1})
    assert ok.in_doubt is None and ok.settled and not ok.reconciling


def test_wait_settled_repeats_the_same_step_until_it_is_settled():
    settled = _answer("ok", output={"fax_id": "F-1"})
    c = _Scripted([_answer("in_doubt"), _answer("in_doubt"), settled])
    got = wait_settled(c, _answer("in_doubt"), {"to": "+331"}, every=0.01, within=5)
    assert got is settled
    assert len(c.calls) == 3
    for wf, step, tool, args, kw in c.calls:
        assert (wf, step, tool, args, kw["attempt"]) == ("wf", 3, "send_fax", {"to": "+331"}, 1)
    assert len({kw["call_id"] for *_, kw in c.calls}) == 3, "each repeat is a call of its own"


def test_wait_settled_is_bounded_and_does_not_wait_on_a_person_unless_asked():
    c = _Scripted([_answer("in_doubt")])
    got = wait_settled(c, _answer("in_doubt"), {}, every=0.02, within=0.2)
    assert got.status == "in_doubt" and 2 <= len(c.calls) <= 12
    c = _Scripted([_answer("ok", output=1)])
    assert wait_settled(c, _answer("in_doubt", PERSON), {}, every=0.01).status == "in_doubt"
    assert c.calls == []
    assert wait_settled(c, _answer("in_doubt", PERSON), {}, every=0.01,
                        wait_for_person=True).ok


def test_await_settled_on_a_client_runs_its_calls_off_the_loop():
    c = _Scripted([_answer("in_doubt"), _answer("ok", output=2)])
    got = asyncio.run(await_settled(c, _answer("in_doubt"), {}, every=0.01, within=5))
    assert got.ok and got.output == 2


def test_a_call_in_doubt_is_settled_by_asking_the_tool_and_waiting_returns_it(stack, wf):
    # The tool answers 503 (it may have acted): the unkeyed call is in doubt,
    # and stepgate asks its lookup, which reports the effect.
    stack.tools.statuses["doubtful"] = 503
    stack.tools.bodies["doubtful_lookup"] = {"status": "executed", "output": {"fax_id": "F-1"}}
    with stack.client() as client:
        first = client.call(wf, 0, "doubtful", {"to": "+331"})
        assert first.status == "in_doubt", first
        assert first.reconciling
        assert first.in_doubt.settling == RECONCILER and first.in_doubt.learn == "repeat_step"
        assert first.in_doubt.until
        sent = stack.tools.invocations("doubtful", wf)
        assert first.in_doubt.idempotency_key == sent[0].idempotency_key
        got = client.wait_settled(first, {"to": "+331"}, every=0.2, within=60)
    assert got.ok and got.output == {"fax_id": "F-1"}, got
    assert got.deduplicated
    assert stack.tools.count("doubtful", wf) == 1, "the tool ran once"


def test_async_wait_settled_returns_the_resolution(stack, wf):
    stack.tools.statuses["doubtful"] = 503
    stack.tools.bodies["doubtful_lookup"] = {"status": "executed", "output": {"fax_id": "F-2"}}

    async def main() -> Answer:
        async with stack.async_client() as c:
            first = await c.call(wf, 0, "doubtful", {"to": "+332"})
            assert first.reconciling, first
            return await c.wait_settled(first, {"to": "+332"}, every=0.2, within=60)

    got = asyncio.run(main())
    assert got.ok and got.output == {"fax_id": "F-2"}
