"""LangGraph adapter: a tool for `ToolNode` whose calls go through stepgate.

    from langgraph.prebuilt import ToolNode
    from stepgate_client import Client
    from stepgate_client.langgraph import stepgate_tool

    client = Client("127.0.0.1:9092")
    create_ticket = stepgate_tool(client, "create_ticket", "Open a support ticket.",
                                  {"title": {"type": "string"}})
    tools = ToolNode([create_ticket])    # in a graph compiled with a checkpointer

The step key comes from the thread, never from the model: `workflow_id` is the
thread's `thread_id`, `step_index` the call's position among the thread's tool
calls, read from its checkpointed messages — so a resumed thread numbers its
calls as before. A call whose answer did not come in time is answered "not
answered yet"; the thread's next call of the same tool — the model's retry,
however rephrased — takes that call's step and gets the first call's result.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Dict, List, Optional, Tuple

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, StructuredTool
from langgraph.prebuilt import InjectedState
from pydantic import create_model

from .client import Client, StepgateTimeout
from .answer import answer_text

NOT_ANSWERED = "not answered yet:"


def step_of(messages: List[Any], tool_call_id: str) -> int:
    """The step index of a tool call, from the thread's messages.

    Tool calls are numbered in order; a call of a tool whose earlier call was
    answered NOT_ANSWERED takes that earlier call's step instead of a new one.
    """
    answers: Dict[str, str] = {}
    for m in messages:
        if isinstance(m, ToolMessage):
            answers[m.tool_call_id] = str(m.content)
    next_step = 0
    unanswered: Dict[str, List[int]] = {}
    for m in messages:
        if not isinstance(m, AIMessage):
            continue
        for call in m.tool_calls:
            waiting = unanswered.get(call["name"])
            if waiting:
                step = waiting.pop(0)
            else:
                step = next_step
                next_step += 1
            if call["id"] == tool_call_id:
                return step
            if answers.get(call["id"], "").startswith(NOT_ANSWERED):
                unanswered.setdefault(call["name"], []).append(step)
    raise ValueError(f"tool call {tool_call_id} is not in the thread's messages")


def stepgate_tool(
    client: Client,
    name: str,
    description: str,
    properties: Dict[str, Dict[str, Any]],
    timeout: float = 60.0,
) -> StructuredTool:
    """A tool for LangGraph's ToolNode whose calls go through stepgate.

    `properties`: the JSON Schema of each argument, by name (all required).
    """
    fields: Dict[str, Tuple[Any, Any]] = {
        k: (_py_type(v), ...) for k, v in properties.items()
    }
    fields["state"] = (Annotated[dict, InjectedState], ...)
    fields["tool_call_id"] = (Annotated[str, InjectedToolCallId], ...)
    Args = create_model(f"{name}_args", **fields)

    def call(state: dict, tool_call_id: str, config: RunnableConfig, **arguments: Any) -> str:
        thread = (config.get("configurable") or {}).get("thread_id")
        if not thread:
            raise ValueError("run the graph with config={'configurable': {'thread_id': ...}}")
        step = step_of(state["messages"], tool_call_id)
        try:
            answer = client.call(str(thread), step, name, arguments,
                                 call_id=tool_call_id, timeout=timeout)
        except StepgateTimeout:
            return (f"{NOT_ANSWERED} this call may still be running. Call the tool again "
                    "to get its result; it will not be performed twice.")
        return answer_text(answer)

    return StructuredTool.from_function(
        func=call, name=name, description=description, args_schema=Args
    )


def _py_type(schema: Dict[str, Any]) -> Any:
    return {"string": str, "integer": int, "number": float, "boolean": bool,
            "object": dict, "array": list}.get(schema.get("type", "string"), Any)
