"""The Agents SDK adapter's numbering kept with the app's `Session`
(`SessionSteps`): through the SDK's own `Runner.run` with a scripted model and
a file-backed `SQLiteSession`, against a running stepgate. Each "new process"
is new objects over the same database file (or a real process of its own)."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

agents = pytest.importorskip("agents")

from agents import Agent, Runner, SQLiteSession, set_tracing_disabled  # noqa: E402

from harness import wait_for  # noqa: E402
from scripted import agents_model  # noqa: E402
from stepgate_client import AsyncClient  # noqa: E402
from stepgate_client.openai_agents import (  # noqa: E402
    SessionSteps,
    SQLiteStepStore,
    StepgatePositionLost,
    stepgate_tool,
)

set_tracing_disabled(True)

TITLE = {"type": "object", "properties": {"title": {"type": "string"}},
         "required": ["title"], "additionalProperties": False}
HERE = Path(__file__).resolve().parent


def caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


async def connect(stack) -> AsyncClient:
    return await AsyncClient.connect(stack.brokers, intents=stack.intents, results=stack.results)


async def life(stack, db, wf, turns, agent="support", tool="create_ticket"):
    """One life of the conversation: new session and SessionSteps objects over
    the database file, one Runner.run through the session."""
    session = SQLiteSession(wf, db)
    steps = SessionSteps(session)
    async with await connect(stack) as client:
        t = stepgate_tool(client, tool, "A tool.", TITLE)
        model = agents_model(turns)
        result = await Runner.run(Agent(name=agent, model=model, tools=[t]), "go",
                                  session=session, context=steps)
    return result, model, steps, session


def stored(db, wf, agent="support"):
    with sqlite3.connect(db) as c:
        row = c.execute("SELECT state FROM stepgate_steps WHERE session_id = ? AND agent = ?",
                        (wf, agent)).fetchone()
    return json.loads(row[0]) if row else None


def test_a_conversation_resumed_through_its_session_continues_its_numbering(stack, wf, tmp_path):
    db = str(tmp_path / "conversations.db")

    async def main():
        await life(stack, db, wf, [[("create_ticket", {"title": "one"})], "done"])
        # Another agent of the same session counts apart, in its own workflow.
        await life(stack, db, wf, [[("create_ticket", {"title": "billing"})], "done"],
                   agent="billing")
        # A new process: the conversation resumed through its session.
        return await life(stack, db, wf, [[("create_ticket", {"title": "two"})], "done"])

    result, model, steps, session = asyncio.run(main())
    assert result.final_output == "done"
    # The resumed run saw the conversation so far (the session is real) ...
    assert "one" in json.dumps(model.inputs[0]), model.inputs[0]
    # ... and its new call is a new step, run.
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"title": "two"}
    calls = stack.tools.invocations("create_ticket")
    mine = sorted((c.workflow_id, c.step_index, c.body["title"]) for c in calls
                  if c.workflow_id.startswith(f"{wf}/"))
    assert mine == [(f"{wf}/billing", 0, "billing"), (f"{wf}/support", 0, "one"),
                    (f"{wf}/support", 1, "two")]
    assert stored(db, wf)["next_step"] == 2
    assert stored(db, wf, "billing")["next_step"] == 1


def test_trimming_or_summarising_the_session_never_renumbers(stack, wf, tmp_path):
    db = str(tmp_path / "conversations.db")

    async def main():
        await life(stack, db, wf, [[("create_ticket", {"title": "one"})],
                                   [("create_ticket", {"title": "two"})], "done"])
        session = SQLiteSession(wf, db)
        popped = [await session.pop_item() for _ in range(3)]  # trimmed
        assert all(p is not None for p in popped)
        await session.clear_session()                          # and summarised
        await session.add_items([{"role": "user", "content": "Summary: two tickets opened."}])
        return await life(stack, db, wf, [[("create_ticket", {"title": "three"})], "done"])

    result, model, steps, session = asyncio.run(main())
    # The model saw the summary only: the history is gone, the numbering is not.
    seen = json.dumps(model.inputs[0])
    assert "Summary: two tickets opened." in seen and '"one"' not in seen, seen
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"title": "three"}
    assert sorted((c.step_index, c.body["title"]) for c in
                  stack.tools.invocations("create_ticket", f"{wf}/support")) == \
        [(0, "one"), (1, "two"), (2, "three")]
    # Nothing of stepgate's among the session's items.
    items = asyncio.run(SQLiteSession(wf, db).get_items())
    assert "next_step" not in json.dumps(items), items


def test_a_lost_call_s_retry_in_a_resumed_process_gets_its_answer_and_runs_nothing(
        stack, wf, tmp_path):
    """The process dies (killed) while its call is at the tool; the
    conversation is resumed through its session in this process: the model's
    rephrased retry takes the lost call's step and gets its answer, and the
    tool ran once."""
    db = str(tmp_path / "conversations.db")
    stack.tools.hold("slow")
    cfg = {"brokers": stack.brokers, "intents": stack.intents, "results": stack.results,
           "db": db, "session_id": wf, "agent": "support",
           "turns": [[["slow", {"title": "Refund issued"}]], "done"]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.Popen([sys.executable, str(HERE / "agents_life.py"), json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_for(lambda: stack.tools.count("slow", f"{wf}/support") == 1
                 or proc.poll() is not None, 120, "the first life's call reached the tool")
        assert proc.poll() is None, proc.communicate()
        proc.kill()  # the process dies with its call unanswered
        proc.wait(60)
    finally:
        stack.tools.release("slow")
    assert stored(db, wf)["unanswered"] == {"slow": [0]}, stored(db, wf)

    result, model, steps, _ = asyncio.run(life(
        stack, db, wf, [[("slow", {"title": "Your refund was issued"})], "done"], tool="slow"))
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"title": "Refund issued"}
    raw = stack.tools.invocations("slow", f"{wf}/support")
    assert [c.step_index for c in raw] == [0], [(c.step_index, c.body) for c in raw]
    assert stored(db, wf)["unanswered"] == {"slow": []}
    assert stored(db, wf)["next_step"] == 1


def test_a_session_whose_numbering_was_lost_refuses_and_never_gets_an_old_answer(
        stack, wf, tmp_path):
    db = str(tmp_path / "conversations.db")

    async def main():
        await life(stack, db, wf, [[("create_ticket", {"title": "the first ticket"})], "done"])
        SQLiteStepStore(db).delete(wf)  # the numbering is lost; the session is not
        model = agents_model([[("create_ticket", {"title": "a brand new ticket"})], "done"])
        session = SQLiteSession(wf, db)
        async with await connect(stack) as client:
            t = stepgate_tool(client, "create_ticket", "A tool.", TITLE)
            with pytest.raises(Exception) as e:
                await Runner.run(Agent(name="support", model=model, tools=[t]), "go",
                                 session=session, context=SessionSteps(session))
        return e.value, model

    error, model = asyncio.run(main())
    assert caused_by(error, StepgatePositionLost), repr(error)
    assert len(model.inputs) == 1  # the other call's answer was never shown
    assert [c.body for c in stack.tools.invocations("create_ticket", f"{wf}/support")] == \
        [{"title": "the first ticket"}]


def test_parallel_calls_save_the_newest_numbering(stack, wf, tmp_path):
    """Three calls in one turn save concurrently: the stored state is the
    last one, whatever order the writes landed in."""
    db = str(tmp_path / "conversations.db")
    stack.tools.meet("meet_async", 3, 25.0)
    result, model, steps, _ = asyncio.run(life(
        stack, db, wf, [[("meet_async", {"title": str(i)}) for i in range(3)], "done"],
        tool="meet_async"))
    assert sorted(c.step_index for c in stack.tools.invocations("meet_async", f"{wf}/support")) \
        == [0, 1, 2]
    assert stored(db, wf) == {"workflow_id": f"{wf}/support", "next_step": 3, "unanswered": {}}


def test_a_held_approval_call_keeps_its_step_in_the_session_s_numbering(stack, wf, tmp_path):
    """`approval=True` tools are asked about without their agent: with
    `SessionSteps(session, agent=...)` the held call's step is stored, and the
    run resumed in a new process after the person approved gets its answer."""
    from agents import RunState

    db = str(tmp_path / "conversations.db")
    AMOUNT = {"type": "object", "properties": {"amount": {"type": "integer"}},
              "required": ["amount"], "additionalProperties": False}

    async def main():
        async with await AsyncClient.connect(stack.brokers, intents=stack.intents,
                                             results=stack.results,
                                             approvals=f"{stack.prefix}.approvals") as client:
            tool = stepgate_tool(client, "wire_approved", "Wire money.", AMOUNT, approval=True)
            model = agents_model([[("wire_approved", {"amount": 7})], "paid"])
            agent = Agent(name="payments", model=model, tools=[tool])
            session = SQLiteSession(wf, db)
            first = await Runner.run(agent, "pay", session=session,
                                     context=SessionSteps(session, agent="payments"))
            assert len(first.interruptions) == 1
            saved = json.dumps(first.to_state().to_json(context_serializer=lambda c: {}))
            held = stored(db, wf, "payments")
            ok = await asyncio.to_thread(stack.cli, "approvals", "approve", f"{wf}/payments", "0",
                                         "wire_approved", "--by", "alice")
            assert ok.returncode == 0, ok.stdout + ok.stderr
            # A new process: the numbering from the session's database only.
            session = SQLiteSession(wf, db)
            steps = SessionSteps(session, agent="payments")
            state = await RunState.from_json(agent, json.loads(saved),
                                             context_deserializer=lambda _: steps)
            state.approve(state.get_interruptions()[0])
            second = await Runner.run(agent, state, session=session)
            return held, second, model

    held, second, model = asyncio.run(main())
    assert list(held["calls"].values()) == [0], held
    assert second.final_output == "paid"
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"amount": 7}
    assert [c.step_index for c in stack.tools.invocations("wire_approved", f"{wf}/payments")] \
        == [0]
    assert "calls" not in stored(db, wf, "payments")


def test_an_approval_tool_without_a_named_agent_says_what_to_do(stack, wf, tmp_path):
    db = str(tmp_path / "conversations.db")

    async def main():
        async with await connect(stack) as client:
            tool = stepgate_tool(client, "wire_approved", "Wire money.", TITLE, approval=True)
            session = SQLiteSession(wf, db)
            with pytest.raises(Exception) as e:
                await Runner.run(Agent(name="a", model=agents_model([[("wire_approved",
                                                                       {"title": "x"})]]),
                                       tools=[tool]),
                                 "pay", session=session, context=SessionSteps(session))
            return e.value

    error = asyncio.run(main())
    chain, e = [], error
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any('SessionSteps(..., agent="<name>")' in m for m in chain), chain
    assert stack.tools.count("wire_approved", f"{wf}/a") == 0
