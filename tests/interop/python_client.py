#!/usr/bin/env python3
"""The pip-installed Python client (clients/python) against a running stepgate.

usage: python_client.py BROKERS INTENTS RESULTS TOOL
Prints one JSON line per check for tests/broker/python_client.rs.
"""
import json
import sys

from stepgate_client import Client, partition_for

brokers, intents, results, tool = sys.argv[1:5]
print(json.dumps({"partitions": {w: partition_for(w, 4) for w in
                                 ["wf-kcat", "a", "abc", "abcd", "abcde", "", "support-thread-42", "é-ü"]}}))

with Client(brokers, intents=intents, results=results) as client:
    run = client.workflow("py-client-1")
    first = run.call(tool, {"title": "Subject: Order confirmed"}, call_id="model-call-1")
    # The answer was lost; the model regenerates the call, rephrased, with a new id.
    again = run.again(0, tool, {"title": "Subject: Your order is confirmed"}, call_id="model-call-1b")
    # Two legitimately identical steps: both run.
    one = run.call(tool, {"title": "Same title"})
    two = run.call(tool, {"title": "Same title"})
    print(json.dumps({"first": first.to_dict(), "again": again.to_dict(), "one": one.to_dict(),
                      "two": two.to_dict(), "next_step": run.next_step}))

# The OpenAI Agents SDK adapter, driven as the SDK's runner drives a tool.
try:
    import asyncio

    from agents.tool_context import ToolContext

    from stepgate_client.openai_agents import StepgateRun, stepgate_tool
except ImportError as e:
    print(json.dumps({"agents": f"not installed: {e}"}))
    sys.exit(0)


async def agents_sdk():
    with Client(brokers, intents=intents, results=results) as client:
        t = stepgate_tool(client, tool, "Open a ticket.",
                          {"type": "object", "properties": {"title": {"type": "string"}}})
        run = StepgateRun("py-agents-1")

        def ctx(call_id, args):
            return ToolContext(context=run, tool_name=tool, tool_call_id=call_id, tool_arguments=args)

        first = await t.on_invoke_tool(ctx("tc-1", '{"title": "Order confirmed"}'),
                                       '{"title": "Order confirmed"}')
        # A call whose answer is lost (no time to wait), then the model's rephrased retry.
        quick = stepgate_tool(client, tool, "Open a ticket.", {"type": "object"}, timeout=0.0)
        lost = await quick.on_invoke_tool(ctx("tc-2", '{"title": "Refund issued"}'),
                                          '{"title": "Refund issued"}')
        retry = await t.on_invoke_tool(ctx("tc-3", '{"title": "Your refund was issued"}'),
                                       '{"title": "Your refund was issued"}')
        same_a = await t.on_invoke_tool(ctx("tc-4", '{"title": "Same"}'), '{"title": "Same"}')
        same_b = await t.on_invoke_tool(ctx("tc-5", '{"title": "Same"}'), '{"title": "Same"}')
        print(json.dumps({"agents": {"first": first, "lost": lost, "retry": retry,
                                     "same_a": same_a, "same_b": same_b, "state": run.state()}}))


asyncio.run(agents_sdk())

# The LangGraph adapter, through LangGraph's own ToolNode, in a graph with a
# checkpointer: the step numbers kept in the state's `stepgate` channel.
try:
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.prebuilt import ToolNode

    from stepgate_client.langgraph import StepgateState
    from stepgate_client.langgraph import stepgate_tool as lg_tool
except ImportError as e:
    print(json.dumps({"langgraph": f"not installed: {e}"}))
    sys.exit(0)

with Client(brokers, intents=intents, results=results) as client:
    props = {"title": {"type": "string"}}
    saver = InMemorySaver()

    def graph(tool_node):
        g = StateGraph(StepgateState)
        g.add_node("tools", tool_node)
        g.add_edge(START, "tools")
        g.add_edge("tools", END)
        return g.compile(checkpointer=saver)

    node = graph(ToolNode([lg_tool(client, tool, "Open a ticket.", props)]))
    quick = graph(ToolNode([lg_tool(client, tool, "Open a ticket.", props, timeout=0.0)]))
    config = {"configurable": {"thread_id": "py-langgraph-1"}}

    def turn(g, calls):
        ai = AIMessage(content="", tool_calls=[
            {"id": i, "name": tool, "args": {"title": t}, "type": "tool_call"} for i, t in calls])
        out = g.invoke({"messages": [ai]}, config)["messages"]
        ids = {i for i, _ in calls}
        return [m.content for m in out if isinstance(m, ToolMessage) and m.tool_call_id in ids]

    first = turn(node, [("lg-1", "Order confirmed")])
    lost = turn(quick, [("lg-2", "Refund issued")])
    retry = turn(node, [("lg-3", "Your refund was issued")])
    same = turn(node, [("lg-4", "Same"), ("lg-5", "Same")])
    print(json.dumps({"langgraph": {"first": first, "lost": lost, "retry": retry, "same": same}}))
