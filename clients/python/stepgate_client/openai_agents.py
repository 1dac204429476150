"""OpenAI Agents SDK adapter: function tools whose calls go through stepgate.

    from agents import Agent, Runner
    from stepgate_client import Client
    from stepgate_client.openai_agents import StepgateRun, stepgate_tool

    client = Client("127.0.0.1:9092")
    create_ticket = stepgate_tool(client, "create_ticket", "Open a support ticket.",
                                  {"type": "object", "properties": {"title": {"type": "string"}},
                                   "required": ["title"], "additionalProperties": False})
    agent = Agent(name="support", tools=[create_ticket])
    run = StepgateRun("support-thread-42")        # persist run.state() with the thread
    await Runner.run(agent, "The printer is on fire", context=run)

The tool itself runs behind stepgate (its HTTP endpoint in stepgate's config);
the agent's process only publishes the call and returns stepgate's answer to
the model. The step key comes from the run, never from the model:
`workflow_id` is the run's id, `step_index` its tool calls counted in order. A
call whose answer did not come in time leaves its step index to the next call
of the same tool in the run — the model's retry, however it rephrased the
arguments — which then gets the first call's answer, and the tool runs once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List, Optional, Union

from agents import FunctionTool
from agents.tool_context import ToolContext

from .answer import Answer, answer_text
from .client import AsyncClient, Client, StepgateTimeout


class StepgateRun:
    """The step numbering of one agent run (pass it as the run's `context`)."""

    def __init__(self, workflow_id: str, next_step: int = 0,
                 unanswered: Optional[Dict[str, List[int]]] = None):
        self.workflow_id = workflow_id
        self.next_step = next_step
        self.unanswered: Dict[str, List[int]] = {k: list(v) for k, v in (unanswered or {}).items()}

    def take_step(self, tool: str) -> int:
        """The step index of a new call of `tool`: an unanswered one first."""
        waiting = self.unanswered.get(tool)
        if waiting:
            return waiting.pop(0)
        step = self.next_step
        self.next_step += 1
        return step

    def leave_unanswered(self, tool: str, step: int) -> None:
        self.unanswered.setdefault(tool, []).append(step)

    def state(self) -> dict:
        """What to persist with the run to resume it."""
        return {"workflow_id": self.workflow_id, "next_step": self.next_step,
                "unanswered": self.unanswered}

    @classmethod
    def resume(cls, state: dict) -> "StepgateRun":
        return cls(state["workflow_id"], state["next_step"], state.get("unanswered"))


async def call_async(client: Union[Client, AsyncClient], *args: Any, **kw: Any) -> Answer:
    """A call on either client from a coroutine: awaited on an `AsyncClient`,
    on a worker thread on a `Client`."""
    if isinstance(client, AsyncClient):
        return await client.call(*args, **kw)
    return await asyncio.to_thread(client.call, *args, **kw)


def stepgate_tool(
    client: Union[Client, AsyncClient],
    name: str,
    description: str,
    params_json_schema: Dict[str, Any],
    timeout: float = 60.0,
) -> FunctionTool:
    """A function tool for `Agent(tools=[...])` whose calls go through stepgate."""

    async def invoke(ctx: ToolContext[Any], input_json: str) -> str:
        run = ctx.context
        if not isinstance(run, StepgateRun):
            raise TypeError("run the agent with context=StepgateRun(workflow_id)")
        arguments = json.loads(input_json or "{}")
        step = run.take_step(name)
        try:
            answer = await call_async(
                client, run.workflow_id, step, name, arguments,
                call_id=ctx.tool_call_id, timeout=timeout,
            )
        except StepgateTimeout:
            run.leave_unanswered(name, step)
            return ("not answered yet: this call may still be running. Call the tool "
                    "again to get its result; it will not be performed twice.")
        return answer_text(answer)

    return FunctionTool(
        name=name,
        description=description,
        params_json_schema=params_json_schema,
        on_invoke_tool=invoke,
    )
