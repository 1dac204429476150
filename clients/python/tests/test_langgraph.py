"""The LangGraph adapter through real graphs (a model node, a ToolNode, a
checkpointer) with a scripted model, against a running stepgate."""

from __future__ import annotations

import asyncio
import json
from typing import List, Optional

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import (  # noqa: E402
    HumanMessage,
    RemoveMessage,
    ToolMessage,
)
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from scripted import langgraph_model  # noqa: E402
from stepgate_client import AsyncClient  # noqa: E402
from stepgate_client.langgraph import StepgateState, stepgate_tool  # noqa: E402

TITLE = {"title": {"type": "string"}}


def agent_graph(tools, model, history: Optional[str] = None):
    """START -> [history] -> agent <-> tools. `history`: "trim" keeps only the
    newest message, "summarise" replaces the history by one summary."""

    def agent(state):
        return {"messages": [model.invoke(state["messages"])]}

    async def aagent(state):
        return {"messages": [await model.ainvoke(state["messages"])]}

    def trim(state):
        return {"messages": [RemoveMessage(id=m.id) for m in state["messages"][:-1]]}

    def summarise(state):
        old = state["messages"][:-1]
        if not old:
            return {}
        return {"messages": [RemoveMessage(id=m.id) for m in state["messages"]]
                + [HumanMessage(f"(summary of {len(old)} messages)"), state["messages"][-1]]}

    g = StateGraph(StepgateState)
    g.add_node("agent", agent if not isinstance(model, AsyncModelMarker) else aagent)
    g.add_node("tools", ToolNode(tools))
    if history:
        g.add_node("history", {"trim": trim, "summarise": summarise}[history])
        g.add_edge(START, "history")
        g.add_edge("history", "agent")
    else:
        g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g


class AsyncModelMarker:
    pass


def tool_outputs(messages) -> List[str]:
    return [m.content for m in messages if isinstance(m, ToolMessage)]


def echoed(text: str):
    return json.loads(text)["echo"]


@pytest.mark.parametrize("history", ["trim", "summarise"])
def test_a_new_call_after_the_history_was_trimmed_or_summarised_runs(stack, wf, history):
    with stack.client() as client:
        tool = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
        model = langgraph_model([[("create_ticket", {"title": "the first ticket"})], "done",
                                 [("create_ticket", {"title": "a brand new ticket"})], "done"])
        app = agent_graph([tool], model, history).compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": wf}}
        app.invoke({"messages": [HumanMessage("open one")]}, config)
        out = app.invoke({"messages": [HumanMessage("open another")]}, config)
    assert echoed(tool_outputs(out["messages"])[-1]) == {"title": "a brand new ticket"}
    bodies = [c.body["title"] for c in stack.tools.invocations("create_ticket")
              if c.workflow_id.startswith(wf)]
    assert bodies == ["the first ticket", "a brand new ticket"]
    steps = [c.step_index for c in stack.tools.invocations("create_ticket")
             if c.workflow_id.startswith(wf)]
    assert steps == [0, 1]


def test_a_fork_from_an_older_checkpoint_is_a_new_lineage(stack, wf):
    with stack.client() as client:
        tool = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
        model = langgraph_model([
            [("create_ticket", {"title": "a"})], "done",
            [("create_ticket", {"title": "b"})], "done",
            [("create_ticket", {"title": "forked"})], "done"])
        app = agent_graph([tool], model).compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": wf}}
        app.invoke({"messages": [HumanMessage("one")]}, config)
        after_first = app.get_state(config).config
        app.invoke({"messages": [HumanMessage("two")]}, config)
        # Time travel: run again from the checkpoint after the first turn.
        out = app.invoke({"messages": [HumanMessage("instead")]}, after_first)
    assert echoed(tool_outputs(out["messages"])[-1]) == {"title": "forked"}
    calls = [c for c in stack.tools.invocations("create_ticket") if c.workflow_id.startswith(wf)]
    assert [c.body["title"] for c in calls] == ["a", "b", "forked"]
    # The fork's step 1 is not the old branch's step 1.
    assert calls[2].step_index == 1 and calls[2].workflow_id != calls[1].workflow_id


def test_two_subgraphs_on_one_thread_number_their_steps_apart(stack, wf):
    with stack.client() as client:
        tool = stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE)
        subs = {}
        for name in ("billing", "shipping"):
            model = langgraph_model([[("create_ticket", {"title": f"{name} ticket"})], "done"])
            subs[name] = agent_graph([tool], model).compile()

        parent = StateGraph(StepgateState)
        for name, sub in subs.items():
            def node(state, sub=sub, name=name):
                # Each subgraph keeps its own message list.
                out = sub.invoke({"messages": [HumanMessage(f"{name}: open one")]})
                return {"messages": [HumanMessage(tool_outputs(out["messages"])[-1])]}
            parent.add_node(name, node)
        parent.add_edge(START, "billing")
        parent.add_edge("billing", "shipping")
        parent.add_edge("shipping", END)
        app = parent.compile(checkpointer=InMemorySaver())
        out = app.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": wf}})
    answers = [echoed(m.content)["title"] for m in out["messages"][1:]]
    assert answers == ["billing ticket", "shipping ticket"]
    calls = [c for c in stack.tools.invocations("create_ticket") if c.workflow_id.startswith(wf)]
    assert sorted(c.body["title"] for c in calls) == ["billing ticket", "shipping ticket"]
    assert len({c.workflow_id for c in calls}) == 2


def test_a_lost_answer_s_rephrased_retry_gets_the_first_result(stack, wf):
    stack.tools.delays["slow"] = 0.5
    with stack.client() as client:
        quick = stepgate_tool(client, "slow", "Slow.", TITLE, timeout=0.0)
        patient = stepgate_tool(client, "slow", "Slow.", TITLE)
        saver = InMemorySaver()
        config = {"configurable": {"thread_id": wf}}
        first = langgraph_model([[("slow", {"title": "Refund issued"})], "done"])
        out = agent_graph([quick], first).compile(checkpointer=saver).invoke(
            {"messages": [HumanMessage("refund")]}, config)
        assert tool_outputs(out["messages"])[-1].startswith("not answered yet")
        retry = langgraph_model([[("slow", {"title": "Your refund was issued"})], "done",
                                 [("slow", {"title": "Another refund"})], "done"])
        app = agent_graph([patient], retry, "trim").compile(checkpointer=saver)
        out = app.invoke({"messages": [HumanMessage("did it work?")]}, config)
        assert echoed(tool_outputs(out["messages"])[-1]) == {"title": "Refund issued"}
        out = app.invoke({"messages": [HumanMessage("one more")]}, config)
        assert echoed(tool_outputs(out["messages"])[-1]) == {"title": "Another refund"}
    calls = [c for c in stack.tools.invocations("slow") if c.workflow_id.startswith(wf)]
    assert [c.body["title"] for c in calls] == ["Refund issued", "Another refund"]
    assert out["stepgate"]["tools"]["unanswered"] == {}


def test_a_turn_s_parallel_calls_take_distinct_steps_and_run_side_by_side(stack, wf):
    stack.tools.meet("meet_async", 3, 25.0)

    class Model(AsyncModelMarker):
        def __init__(self):
            self.m = langgraph_model(
                [[("meet_async", {"title": str(i)}) for i in range(3)], "done"])

        async def ainvoke(self, messages):
            return await self.m.ainvoke(messages)

    async def main():
        async with await AsyncClient.connect(stack.brokers, intents=stack.intents,
                                             results=stack.results) as client:
            tool = stepgate_tool(client, "meet_async", "Meet.", TITLE)
            app = agent_graph([tool], Model()).compile(checkpointer=InMemorySaver())
            return await app.ainvoke({"messages": [HumanMessage("go")]},
                                     {"configurable": {"thread_id": wf}})

    out = asyncio.run(main())
    assert sorted(echoed(t)["title"] for t in tool_outputs(out["messages"])) == ["0", "1", "2"]
    calls = [c for c in stack.tools.invocations("meet_async") if c.workflow_id.startswith(wf)]
    assert sorted(c.step_index for c in calls) == [0, 1, 2]
    assert stack.tools.most_inside["meet_async"] == 3


class Address(BaseModel):
    city: str
    zip: Optional[str] = None


class Shipment(BaseModel):
    """Ship an order."""

    order: str
    to: Address
    express: bool = False


def test_a_pydantic_schema_keeps_nested_types_and_optional_fields(stack, wf):
    with stack.client() as client:
        tool = stepgate_tool(client, "create_ticket", args_schema=Shipment)
        schema = tool.tool_call_schema.model_json_schema()
        assert tool.description == "Ship an order."
        assert set(schema["properties"]) == {"order", "to", "express"}
        assert schema.get("required") == ["order", "to"]
        model = langgraph_model([[("create_ticket", {"order": "o-1", "to": {"city": "Oslo"}})],
                                 "done"])
        app = agent_graph([tool], model).compile(checkpointer=InMemorySaver())
        out = app.invoke({"messages": [HumanMessage("ship")]},
                         {"configurable": {"thread_id": wf}})
    # As LangGraph validated them: the schema's defaults filled in.
    assert echoed(tool_outputs(out["messages"])[-1]) == \
        {"order": "o-1", "to": {"city": "Oslo"}, "express": False}
    optional = stepgate_tool(client, "x", "X.", {"a": {"type": "string"}, "b": {"type": "object"}},
                             required=["a"])
    s = optional.tool_call_schema.model_json_schema()
    assert s.get("required") == ["a"]


MAIL = {"to": {"type": "string"}, "subject": {"type": "string"}}


def test_alice_then_bob_both_emails_are_sent_once_and_alice_s_retry_gets_hers(stack, wf):
    """`mail` declares identity = ["to"]: bob's call in alice's lost slot is a
    conflict, so it runs as a step of its own; alice's retry gets hers."""
    stack.tools.delays["mail"] = 0.3
    with stack.client() as client:
        saver = InMemorySaver()
        config = {"configurable": {"thread_id": wf}}
        lost = langgraph_model([[("mail", {"to": "alice", "subject": "Hi"})], "done"])
        quick = stepgate_tool(client, "mail", "Send an email.", MAIL, timeout=0.0)
        out = agent_graph([quick], lost).compile(checkpointer=saver).invoke(
            {"messages": [HumanMessage("mail alice")]}, config)
        assert tool_outputs(out["messages"])[-1].startswith("not answered yet")
        from harness import wait_for
        wait_for(lambda: len([c for c in stack.tools.invocations("mail")
                              if c.workflow_id.startswith(wf)]) == 1, 60, "alice's email sent")
        model = langgraph_model([[("mail", {"to": "bob", "subject": "Hi"})], "done",
                                 [("mail", {"to": "alice", "subject": "Hello again"})], "done"])
        app = agent_graph([stepgate_tool(client, "mail", "Send an email.", MAIL)],
                          model).compile(checkpointer=saver)
        bob = app.invoke({"messages": [HumanMessage("mail bob")]}, config)
        alice = app.invoke({"messages": [HumanMessage("mail alice again")]}, config)
    assert echoed(tool_outputs(bob["messages"])[-1])["to"] == "bob"
    assert echoed(tool_outputs(alice["messages"])[-1])["to"] == "alice"
    calls = [c for c in stack.tools.invocations("mail") if c.workflow_id.startswith(wf)]
    assert sorted(c.body["to"] for c in calls) == ["alice", "bob"]
    assert alice["stepgate"]["tools"]["unanswered"] == {}


def test_two_calls_that_conflict_with_one_lost_step_under_one_model_id_both_run(stack, wf):
    """alice's call is lost; bob's, then carol's take its step in turn and
    conflict. The model numbers each turn's call `call_1`: each moved call
    still gets a step of its own, so all three emails are sent and each call
    is answered with its own."""
    from harness import wait_for

    stack.tools.delays["mail"] = 0.3
    with stack.client() as client:
        saver = InMemorySaver()
        config = {"configurable": {"thread_id": wf}}
        lost = langgraph_model([[("mail", {"to": "alice", "subject": "Hi"}, "call_0")], "done"])
        quick = stepgate_tool(client, "mail", "Send an email.", MAIL, timeout=0.0)
        agent_graph([quick], lost).compile(checkpointer=saver).invoke(
            {"messages": [HumanMessage("mail alice")]}, config)
        wait_for(lambda: len([c for c in stack.tools.invocations("mail")
                              if c.workflow_id.startswith(wf)]) == 1, 60, "alice's email sent")
        model = langgraph_model([[("mail", {"to": "bob", "subject": "Hi"}, "call_1")], "done",
                                 [("mail", {"to": "carol", "subject": "Hi"}, "call_1")], "done"])
        app = agent_graph([stepgate_tool(client, "mail", "Send an email.", MAIL)],
                          model).compile(checkpointer=saver)
        bob = app.invoke({"messages": [HumanMessage("mail bob")]}, config)
        carol = app.invoke({"messages": [HumanMessage("mail carol")]}, config)
    assert echoed(tool_outputs(bob["messages"])[-1])["to"] == "bob"
    assert tool_outputs(carol["messages"])[-1].startswith("{"), tool_outputs(carol["messages"])
    assert echoed(tool_outputs(carol["messages"])[-1])["to"] == "carol"
    calls = [c for c in stack.tools.invocations("mail") if c.workflow_id.startswith(wf)]
    assert sorted(c.body["to"] for c in calls) == ["alice", "bob", "carol"]


def test_a_tool_from_a_tool_decorated_function_keeps_its_name_schema_and_docstring(stack, wf):
    from langchain_core.tools import tool as lc_tool

    from stepgate_client.langgraph import stepgate_tool_from

    @lc_tool
    def create_ticket(title: str, to: Address, priority: int = 3) -> dict:
        """Open a support ticket."""
        raise AssertionError("never run in the agent's process")

    with stack.client() as client:
        tool = stepgate_tool_from(client, create_ticket)
        assert (tool.name, tool.description) == ("create_ticket", "Open a support ticket.")
        schema = tool.tool_call_schema.model_json_schema()
        assert set(schema["properties"]) == {"title", "to", "priority"}
        assert schema.get("required") == ["title", "to"]
        model = langgraph_model([[("create_ticket", {"title": "t", "to": {"city": "Oslo"}})],
                                 "done"])
        app = agent_graph([tool], model).compile(checkpointer=InMemorySaver())
        out = app.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": wf}})
    assert echoed(tool_outputs(out["messages"])[-1]) == \
        {"title": "t", "to": {"city": "Oslo"}, "priority": 3}


def test_a_call_held_for_approval_is_an_interrupt_and_the_resumed_graph_gets_its_answer(
        stack, wf):
    from langgraph.types import Command

    with stack.client() as client:
        tool = stepgate_tool(client, "wire_approved", "Wire money.",
                             {"amount": {"type": "integer"}})
        model = langgraph_model([[("wire_approved", {"amount": 900})], "done"])
        app = agent_graph([tool], model).compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": wf}}
        out = app.invoke({"messages": [HumanMessage("pay")]}, config)
        held = out["__interrupt__"][0].value
        assert held["stepgate"] == "awaiting_approval" and held["arguments"] == {"amount": 900}
        assert stack.tools.count("wire_approved") == len(
            [c for c in stack.tools.invocations("wire_approved") if not c.workflow_id.startswith(wf)])
        ok = stack.cli("approvals", "approve", held["workflow_id"], str(held["step_index"]),
                       "wire_approved", "--by", "alice")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        out = app.invoke(Command(resume="approved"), config)
    assert echoed(tool_outputs(out["messages"])[-1]) == {"amount": 900}
    calls = [c for c in stack.tools.invocations("wire_approved") if c.workflow_id.startswith(wf)]
    assert len(calls) == 1


def test_two_forks_of_one_checkpoint_replaying_one_tool_call_id_each_get_their_own_answer(
        stack, wf):
    """Two branches forked from one checkpoint, run at once on one client; their
    models give their calls the same id (`call_1`). Fork A's call waits in its
    tool while fork B's is answered: each fork's ToolMessage is its own."""
    from concurrent.futures import ThreadPoolExecutor

    from harness import wait_for

    with stack.client() as client:
        tools = [stepgate_tool(client, "create_ticket", "Open a ticket.", TITLE),
                 stepgate_tool(client, "slow", "Slow.", TITLE)]
        saver = InMemorySaver()
        config = {"configurable": {"thread_id": wf}}
        base = langgraph_model([[("create_ticket", {"title": "first"}, "call_0")], "done"])
        agent_graph(tools, base).compile(checkpointer=saver).invoke(
            {"messages": [HumanMessage("one")]}, config)
        fork_point = saver.get_tuple(config).config
        fork_a = agent_graph(tools, langgraph_model(
            [[("slow", {"title": "A"}, "call_1")], "done"])).compile(checkpointer=saver)
        fork_b = agent_graph(tools, langgraph_model(
            [[("create_ticket", {"title": "B"}, "call_1")], "done"])).compile(checkpointer=saver)

        def mine(c):
            return c.workflow_id.startswith(wf)

        stack.tools.hold("slow")
        try:
            with ThreadPoolExecutor(1) as pool:
                a = pool.submit(fork_a.invoke, {"messages": [HumanMessage("A")]}, fork_point)
                wait_for(lambda: any(mine(c) for c in stack.tools.invocations("slow")), 60,
                         "fork A's call is in the tool")
                out_b = fork_b.invoke({"messages": [HumanMessage("B")]}, fork_point)
                stack.tools.release("slow")
                out_a = a.result(120)
        finally:
            stack.tools.release("slow")
    assert echoed(tool_outputs(out_b["messages"])[-1]) == {"title": "B"}
    assert echoed(tool_outputs(out_a["messages"])[-1]) == {"title": "A"}
    slow = [c for c in stack.tools.invocations("slow") if mine(c)]
    tickets = [c for c in stack.tools.invocations("create_ticket") if mine(c)]
    assert [c.body["title"] for c in slow] == ["A"]
    assert [c.body["title"] for c in tickets] == ["first", "B"]
    # Two forks, two lineages: neither is the other's step.
    assert slow[0].workflow_id != tickets[1].workflow_id


def test_a_held_call_is_an_interrupt_with_a_client_that_names_two_topics(stack, wf):
    """The client names the stack's intents and results topics and not its
    approvals topic: the held call is still an interrupt, not a timeout."""
    from stepgate_client import Client

    with Client(stack.brokers, intents=stack.intents, results=stack.results) as client:
        tool = stepgate_tool(client, "wire_approved", "Wire money.",
                             {"amount": {"type": "integer"}}, timeout=20)
        model = langgraph_model([[("wire_approved", {"amount": 7})], "done"])
        app = agent_graph([tool], model).compile(checkpointer=InMemorySaver())
        out = app.invoke({"messages": [HumanMessage("pay")]}, {"configurable": {"thread_id": wf}})
    assert "__interrupt__" in out, tool_outputs(out["messages"])
    assert out["__interrupt__"][0].value["stepgate"] == "awaiting_approval"
