"""The OpenAI Agents SDK adapter through the SDK's own `Runner.run`, with a
scripted model, against a running stepgate."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

agents = pytest.importorskip("agents")

from agents import Agent, Runner, set_tracing_disabled  # noqa: E402

from harness import wait_for  # noqa: E402
from scripted import agents_model  # noqa: E402
from stepgate_client import AsyncClient  # noqa: E402
from stepgate_client.openai_agents import (  # noqa: E402
    StepgatePositionLost,
    StepgateRun,
    stepgate_function_tool,
    stepgate_tool,
)

set_tracing_disabled(True)

TITLE = {"type": "object", "properties": {"title": {"type": "string"}},
         "required": ["title"], "additionalProperties": False}


@dataclass
class AppContext:
    """An app's own run context, with stepgate's numbering as one attribute."""

    user: str
    stepgate: StepgateRun


def run(coro):
    return asyncio.run(coro)


def caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


async def connect(stack) -> AsyncClient:
    return await AsyncClient.connect(stack.brokers, intents=stack.intents, results=stack.results)


def test_the_app_keeps_its_own_context_and_the_steps_are_numbered_in_it(stack, wf):
    async def main():
        async with await connect(stack) as client:
            tool = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
            model = agents_model([[("create_ticket", {"title": "one"})],
                                  [("create_ticket", {"title": "two"})], "done"])
            ctx = AppContext("u-1", StepgateRun(wf))
            result = await Runner.run(Agent(name="support", model=model, tools=[tool]),
                                      "open two tickets", context=ctx)
            return result, ctx, model

    result, ctx, model = run(main())
    assert result.final_output == "done"
    assert ctx.stepgate.next_step == 2
    assert sorted(c.step_index for c in stack.tools.invocations("create_ticket", wf)) == [0, 1]
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"title": "two"}


def test_a_run_restarted_without_its_state_refuses_and_never_gets_an_old_answer(stack, wf):
    async def main():
        async with await connect(stack) as client:
            tool = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
            first = agents_model([[("create_ticket", {"title": "the first ticket"})], "done"])
            await Runner.run(Agent(name="support", model=first, tools=[tool]), "go",
                             context=StepgateRun(wf))
            # The process restarts and the app forgets to resume the state.
            again = agents_model([[("create_ticket", {"title": "a brand new ticket"})], "done"])
            with pytest.raises(Exception) as e:
                await Runner.run(Agent(name="support", model=again, tools=[tool]), "go",
                                 context=StepgateRun(wf))
            return e.value, again

    error, model = run(main())
    assert caused_by(error, StepgatePositionLost), repr(error)
    assert "StepgateRun.resume" in str(error), str(error)
    # The model was never shown the first ticket as the new one's answer.
    assert len(model.inputs) == 1
    assert [c.body for c in stack.tools.invocations("create_ticket", wf)] == \
        [{"title": "the first ticket"}]


def test_a_run_that_died_mid_call_resumes_and_its_retry_gets_the_answer(stack, wf):
    """The state is saved before the call is published; the run dies while it
    waits; resumed from the saved state, the model's rephrased retry gets the
    first call's answer and the tool ran once."""
    stack.tools.delays["slow"] = 1.0
    saved = {}

    async def main():
        async with await connect(stack) as client:
            tool = stepgate_tool(client, "slow", "Slow.", TITLE)
            first = agents_model([[("slow", {"title": "Refund issued"})], "done"])
            task = asyncio.create_task(Runner.run(
                Agent(name="a", model=first, tools=[tool]), "go",
                context=AppContext("u", StepgateRun(wf, save=lambda s: saved.update(s)))))
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("slow", wf) == 1, 60,
                                    "the call reached the tool")
            task.cancel()  # the process dies
            with pytest.raises(asyncio.CancelledError):
                await task
            state = json.loads(json.dumps(saved))  # as persisted
            retry = agents_model([[("slow", {"title": "Your refund was issued"})], "done"])
            ctx = AppContext("u", StepgateRun.resume(state))
            await Runner.run(Agent(name="a", model=retry, tools=[tool]), "go on", context=ctx)
            return state, retry, ctx

    state, model, ctx = run(main())
    assert state["unanswered"] == {"slow": [0]}, state
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"title": "Refund issued"}
    assert stack.tools.count("slow", wf) == 1
    assert ctx.stepgate.state()["unanswered"] == {"slow": []}


def test_a_turn_s_parallel_tool_calls_wait_side_by_side(stack, wf):
    stack.tools.meet("meet_async", 3, 25.0)

    async def main():
        async with await connect(stack) as client:
            tool = stepgate_tool(client, "meet_async", "Meet.", TITLE)
            model = agents_model([[("meet_async", {"title": str(i)}) for i in range(3)], "done"])
            await Runner.run(Agent(name="a", model=model, tools=[tool]), "go",
                             context=StepgateRun(wf))
            return model

    model = run(main())
    assert stack.tools.most_inside["meet_async"] == 3
    assert sorted(c.step_index for c in stack.tools.invocations("meet_async", wf)) == [0, 1, 2]
    assert sorted(json.loads(o)["echo"]["title"] for o in model.tool_outputs()) == ["0", "1", "2"]


def test_a_tool_from_a_typed_function_carries_its_schema_and_arguments(stack, wf):
    async def main():
        async with await connect(stack) as client:
            @stepgate_function_tool(client)
            def create_ticket(title: str, priority: int = 3) -> dict:
                """Open a support ticket.

                Args:
                    title: What the ticket is about.
                    priority: 1 (urgent) to 5.
                """
                raise AssertionError("never run in the agent's process")

            model = agents_model([[("create_ticket", {"title": "t", "priority": 1})], "done"])
            await Runner.run(Agent(name="a", model=model, tools=[create_ticket]), "go",
                             context={"stepgate": StepgateRun(wf)})
            return create_ticket

    tool = run(main())
    assert tool.name == "create_ticket" and tool.description.startswith("Open a support ticket")
    assert set(tool.params_json_schema["properties"]) == {"title", "priority"}
    assert [c.body for c in stack.tools.invocations("create_ticket", wf)] == \
        [{"title": "t", "priority": 1}]


MAIL = {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
        "required": ["to", "subject"], "additionalProperties": False}


def test_alice_then_bob_both_emails_are_sent_once_and_alice_s_retry_gets_hers(stack, wf):
    """`mail` declares identity = ["to"]. alice's call is lost; the model then
    mails bob, which takes the lost call's slot: a conflict, so the adapter
    runs bob as a new step and keeps the slot for alice's real retry."""
    stack.tools.delays["mail"] = 0.3

    async def main():
        async with await connect(stack) as client:
            quick = stepgate_tool(client, "mail", "Send an email.", MAIL, timeout=0.0)
            tool = stepgate_tool(client, "mail", "Send an email.", MAIL)
            ctx = StepgateRun(wf)
            lost = agents_model([[("mail", {"to": "alice", "subject": "Hi"})], "done"])
            await Runner.run(Agent(name="a", model=lost, tools=[quick]), "mail alice", context=ctx)
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("mail", wf) == 1, 60,
                                    "alice's email was sent")
            model = agents_model([[("mail", {"to": "bob", "subject": "Hi"})],
                                  [("mail", {"to": "alice", "subject": "Hello again"})], "done"])
            await Runner.run(Agent(name="a", model=model, tools=[tool]), "mail bob, then alice",
                             context=ctx)
            outputs = [o for inp in model.inputs for o in
                       [i["output"] for i in inp if isinstance(i, dict)
                        and i.get("type") == "function_call_output"]]
            return lost, outputs, ctx

    lost, outputs, ctx = run(main())
    assert sorted(c.body["to"] for c in stack.tools.invocations("mail", wf)) == ["alice", "bob"]
    seen = [json.loads(o)["echo"]["to"] for o in outputs[-2:]]
    assert seen == ["bob", "alice"], outputs
    # What the model read when it gave up waiting says what its next call means.
    assert lost.tool_outputs()[0].startswith("not answered yet")
    assert "different target" in lost.tool_outputs()[0]
    assert ctx.state()["unanswered"] == {"mail": []}


def test_a_call_held_for_approval_is_an_sdk_interruption_and_the_approved_run_gets_its_answer(
        stack, wf):
    AMOUNT = {"type": "object", "properties": {"amount": {"type": "integer"}},
              "required": ["amount"], "additionalProperties": False}

    async def main():
        async with await AsyncClient.connect(stack.brokers, intents=stack.intents,
                                             results=stack.results,
                                             approvals=f"{stack.prefix}.approvals") as client:
            tool = stepgate_tool(client, "wire_approved", "Wire money.", AMOUNT, approval=True)
            model = agents_model([[("wire_approved", {"amount": 900})], "paid"])
            agent = Agent(name="a", model=model, tools=[tool])
            ctx = AppContext("u", StepgateRun(wf))
            first = await Runner.run(agent, "pay", context=ctx)
            interruptions = list(first.interruptions)
            ran_before = stack.tools.count("wire_approved", wf)
            ok = await asyncio.to_thread(stack.cli, "approvals", "approve", wf, "0",
                                         "wire_approved", "--by", "alice")
            assert ok.returncode == 0, ok.stdout + ok.stderr
            state = first.to_state()
            state.approve(interruptions[0])
            second = await Runner.run(agent, state)
            return interruptions, ran_before, second, model

    interruptions, ran_before, second, model = run(main())
    assert len(interruptions) == 1 and ran_before == 0
    assert second.final_output == "paid"
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"amount": 900}
    assert [c.step_index for c in stack.tools.invocations("wire_approved", wf)] == [0]


def test_the_numbering_travels_in_the_sdk_s_run_state_across_a_process_restart(stack, wf):
    """A run interrupted for an approval is saved as the SDK's RunState JSON
    (the StepgateRun inside it), and resumed from that JSON alone with a new
    StepgateRun object: the held call keeps its step and gets its answer."""
    from agents import RunState

    from stepgate_client.openai_agents import deserialize_context, serialize_context

    AMOUNT = {"type": "object", "properties": {"amount": {"type": "integer"}},
              "required": ["amount"], "additionalProperties": False}

    async def main():
        async with await AsyncClient.connect(stack.brokers, intents=stack.intents,
                                             results=stack.results,
                                             approvals=f"{stack.prefix}.approvals") as client:
            tool = stepgate_tool(client, "wire_approved", "Wire money.", AMOUNT, approval=True)
            model = agents_model([[("create_ticket", {"title": "before"})],
                                  [("wire_approved", {"amount": 42})], "paid"])
            tickets = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
            agent = Agent(name="a", model=model, tools=[tool, tickets])
            first = await Runner.run(agent, "pay", context=StepgateRun(wf))
            saved = json.dumps(first.to_state().to_json(context_serializer=serialize_context))
            assert len(first.interruptions) == 1
            ok = await asyncio.to_thread(stack.cli, "approvals", "approve", wf, "1",
                                         "wire_approved", "--by", "alice")
            assert ok.returncode == 0, ok.stdout + ok.stderr
            # A new process: the state from its JSON only.
            state = await RunState.from_json(agent, json.loads(saved),
                                             context_deserializer=deserialize_context)
            state.approve(state.get_interruptions()[0])
            second = await Runner.run(agent, state)
            return saved, second, model

    saved, second, model = run(main())
    # The StepgateRun's state, with the held call's step, is in the RunState.
    assert '"stepgate": {"workflow_id": ' in saved and '"calls": {' in saved, saved[:2000]
    assert second.final_output == "paid"
    assert json.loads(model.tool_outputs()[-1])["echo"] == {"amount": 42}
    assert [c.step_index for c in stack.tools.invocations("wire_approved", wf)] == [1]
    assert [c.step_index for c in stack.tools.invocations("create_ticket", wf)] == [0]


def test_two_runs_whose_models_number_their_calls_alike_each_get_their_own_answer(stack, wf):
    """Two runs at once on one client; both models call their first tool call
    `call_0` (as local models do). Run A's call waits in its tool while run B's
    is answered: each model is shown its own call's result."""
    a_wf, b_wf = f"{wf}-A", f"{wf}-B"

    async def main():
        async with await connect(stack) as client:
            tools = [stepgate_tool(client, "slow", "Slow.", TITLE),
                     stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)]
            model_a = agents_model([[("slow", {"title": "A"}, "call_0")], "done"])
            model_b = agents_model([[("create_ticket", {"title": "B"}, "call_0")], "done"])
            run_a = asyncio.ensure_future(Runner.run(
                Agent(name="a", model=model_a, tools=tools), "go", context=StepgateRun(a_wf)))
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("slow", a_wf) == 1, 60,
                                    "run A's call is in the tool")
            await Runner.run(Agent(name="b", model=model_b, tools=tools), "go",
                             context=StepgateRun(b_wf))
            stack.tools.release("slow")
            await run_a
            return model_a, model_b

    stack.tools.hold("slow")
    try:
        model_a, model_b = run(main())
    finally:
        stack.tools.release("slow")
    assert json.loads(model_b.tool_outputs()[-1])["echo"] == {"title": "B"}
    assert json.loads(model_a.tool_outputs()[-1])["echo"] == {"title": "A"}
    assert [c.body for c in stack.tools.invocations("slow", a_wf)] == [{"title": "A"}]
    assert [c.body for c in stack.tools.invocations("create_ticket", b_wf)] == [{"title": "B"}]
