"""OpenAI Agents SDK adapter: function tools whose calls go through stepgate.

    from agents import Agent, Runner
    from stepgate_client import AsyncClient
    from stepgate_client.openai_agents import StepgateRun, stepgate_function_tool

    client = AsyncClient("127.0.0.1:9092")

    @stepgate_function_tool(client)
    def create_ticket(title: str, priority: int = 3) -> dict:
        '''Open a support ticket.'''          # the body never runs here: stepgate's tool does

    @dataclass
    class AppContext:                          # the app's own context ...
        user_id: str
        stepgate: StepgateRun                  # ... with the run's step numbering in it

    run = StepgateRun.resume(saved) if saved else StepgateRun("support-thread-42", save=store)
    await Runner.run(Agent(name="support", tools=[create_ticket]), "...",
                     context=AppContext("u-1", run))

The tool itself runs behind stepgate (its HTTP endpoint in stepgate's config);
the agent's process only publishes the call and returns stepgate's answer to
the model. The step key comes from the run, never from the model:
`workflow_id` is the run's id, `step_index` its tool calls counted in order, in
a `StepgateRun` the app keeps in its context (the context itself, its
`stepgate` attribute, or its `"stepgate"` key) and persists with the rest of
the conversation (`run.state()`; `save=` is called with it whenever it changes,
*before* a call is published).

Every agent of a run — after a handoff, or run as another agent's tool —
reaches the same StepgateRun through the run's context, so their calls are
numbered in one sequence and never share a step; independent runs that go on
at the same time need workflow ids of their own.

A call whose answer did not come in time leaves its step to the next call of
the same tool in the run — the model's retry, however it rephrased the
arguments — which then gets the first call's answer, and the tool runs once.
A call that was published when the process died is such a call too, once the
run is resumed from the state `save` was given.

A run that cannot prove its position refuses: when a *new* step (one this
run's state never published) is answered as a repeat, the step was used by
another life of this workflow — a run restarted without its state, or two
runs sharing one id. The tool raises `StepgatePositionLost` (the run stops),
and the model never sees the other call's answer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

from agents import FunctionTool
from agents.tool_context import ToolContext

from .answer import MAX_CONFLICT_HOPS, Answer, answer_text
from .client import (
    AsyncClient,
    Client,
    StepgateAwaitingApproval,
    StepgateError,
    StepgateTimeout,
)

NOT_ANSWERED = (
    "not answered yet: this call may still be running. Call the tool again to get "
    "its result; it will not be performed twice. Your next call of this tool is taken "
    "as this call's retry, even if you rephrase it; only a call that names a different "
    "target (for a tool that declares identity arguments, e.g. another recipient) is "
    "run as a new call instead."
)

SaveHook = Callable[[Dict[str, Any]], Union[None, Awaitable[None]]]


class StepgatePositionLost(StepgateError):
    """A new step of a run was answered as a repeat: the run's state is not its
    workflow's. Resume the run from its saved state, or use a new workflow id."""


class StepgateRun:
    """The step numbering of one agent run, kept in (or as) the run's context.

    `state()` is what to persist; `StepgateRun.resume(state)` continues it.
    `save`, when given, is called (and awaited if it returns an awaitable)
    with `state()` whenever it changes — before a new call is published — so
    a run that dies mid-call resumes knowing that call.
    """

    def __init__(self, workflow_id: str, next_step: int = 0,
                 unanswered: Optional[Dict[str, List[int]]] = None,
                 pending: Optional[Dict[str, str]] = None,
                 save: Optional[SaveHook] = None,
                 calls: Optional[Dict[str, int]] = None):
        self.workflow_id = workflow_id
        self.next_step = next_step
        self.unanswered: Dict[str, List[int]] = {k: list(v) for k, v in (unanswered or {}).items()}
        # Steps published and not yet answered to the model: {step: tool}.
        # Restored as unanswered on resume.
        self.pending: Dict[int, str] = {int(k): v for k, v in (pending or {}).items()}
        # Steps already given to a model call id (held calls, asked again
        # after an interruption): the same call keeps its step.
        self.calls: Dict[str, int] = dict(calls or {})
        self.save = save

    def take_step(self, tool: str) -> "tuple[int, bool]":
        """The step of a new call of `tool`: an unanswered one first. Returns
        (step, fresh): fresh when the step was never published by this run."""
        waiting = self.unanswered.get(tool)
        if waiting:
            return waiting.pop(0), False
        step = self.next_step
        self.next_step += 1
        return step, True

    def leave_unanswered(self, tool: str, step: int) -> None:
        self.unanswered.setdefault(tool, []).append(step)

    def state(self) -> dict:
        """What to persist with the run to resume it (JSON-serialisable)."""
        unanswered = {k: list(v) for k, v in self.unanswered.items()}
        # A published call whose answer was never handed over is unanswered.
        for step, tool in sorted(self.pending.items()):
            if step not in unanswered.setdefault(tool, []):
                unanswered[tool].append(step)
        out = {"workflow_id": self.workflow_id, "next_step": self.next_step,
               "unanswered": {k: sorted(v) for k, v in unanswered.items()}}
        if self.calls:
            out["calls"] = dict(self.calls)
        return out

    @classmethod
    def resume(cls, state: dict, save: Optional[SaveHook] = None) -> "StepgateRun":
        return cls(state["workflow_id"], state["next_step"], state.get("unanswered"),
                   state.get("pending"), save=save, calls=state.get("calls"))

    async def _saved(self) -> None:
        if self.save is not None:
            r = self.save(self.state())
            if inspect.isawaitable(r):
                await r


def serialize_context(context: Any) -> Dict[str, Any]:
    """A `context_serializer` for `RunState.to_json` when the run's context is
    a StepgateRun: the numbering travels inside the SDK's own RunState. (An
    app context of its own: put `run.state()` in its serializer.)"""
    if not isinstance(context, StepgateRun):
        raise TypeError(f"serialize_context: a StepgateRun context, not {type(context).__name__}")
    return {"stepgate": context.state()}


def deserialize_context(data: Any) -> StepgateRun:
    """The `context_deserializer` for `RunState.from_json`, after
    `serialize_context`."""
    return StepgateRun.resume(dict(data)["stepgate"])


def run_of(context: Any, attribute: str = "stepgate") -> StepgateRun:
    """The StepgateRun of a run context: the context itself, its `attribute`
    attribute, or its `attribute` key."""
    if isinstance(context, StepgateRun):
        return context
    found = getattr(context, attribute, None)
    if found is None and isinstance(context, dict):
        found = context.get(attribute)
    if isinstance(found, StepgateRun):
        return found
    raise TypeError(
        f"stepgate tools need a StepgateRun in the run's context: pass context=StepgateRun(...), "
        f"or a context with a `{attribute}` attribute (or key) holding one; got "
        f"{type(context).__name__}"
    )


async def call_async(client: Union[Client, AsyncClient], *args: Any, **kw: Any) -> Answer:
    """A call on either client from a coroutine: awaited on an `AsyncClient`,
    on a worker thread on a `Client`."""
    if isinstance(client, AsyncClient):
        return await client.call(*args, **kw)
    return await asyncio.to_thread(client.call, *args, **kw)


def _position_lost(run: StepgateRun, step: int, tool: str) -> StepgatePositionLost:
    return StepgatePositionLost(
        f"step {step} of workflow {run.workflow_id!r} was already used by another run of "
        f"this workflow (a run restarted without its saved state, or two runs with one id): "
        f"its {tool!r} call was not performed, and the other call's answer is "
        "withheld. Resume the run with StepgateRun.resume(saved_state), or start it under "
        "a new workflow id."
    )


async def invoke_step(client: Union[Client, AsyncClient], run: StepgateRun, name: str,
                      arguments: Dict[str, Any], call_id: Optional[str],
                      timeout: float) -> str:
    """One tool call of a run through stepgate: the text for the model."""
    if call_id is not None and call_id in run.calls:
        # A call whose step was taken before it was held for approval.
        step, fresh = run.calls.pop(call_id), False
    else:
        step, fresh = run.take_step(name)
    for hop in range(MAX_CONFLICT_HOPS):
        run.pending[step] = name
        await run._saved()
        try:
            answer = await call_async(client, run.workflow_id, step, name, arguments,
                                      call_id=f"{call_id}~{hop}" if hop and call_id else call_id,
                                      timeout=timeout)
        except StepgateTimeout:
            del run.pending[step]
            run.leave_unanswered(name, step)
            await run._saved()
            return NOT_ANSWERED
        if not answer.identity_conflict or fresh:
            break
        # The unanswered step this call took belongs to another call (its
        # identity arguments differ): it stays open for that call's real
        # retry, and this call runs as a new step.
        del run.pending[step]
        run.unanswered.setdefault(name, []).insert(0, step)
        step, fresh = run.next_step, True
        run.next_step += 1
    if fresh and (answer.deduplicated or answer.identity_conflict):
        # Never published by this run, yet answered as a repeat: another life
        # of this workflow used the step. Its answer is not this call's.
        del run.pending[step]
        await run._saved()
        raise _position_lost(run, step, name)
    del run.pending[step]
    await run._saved()
    return answer_text(answer)


def stepgate_tool(
    client: Union[Client, AsyncClient],
    name: str,
    description: str,
    params_json_schema: Dict[str, Any],
    timeout: float = 60.0,
    context_attribute: str = "stepgate",
    strict_json_schema: bool = True,
    approval: bool = False,
) -> FunctionTool:
    """A function tool for `Agent(tools=[...])` whose calls go through stepgate.

    `approval=True`, for a tool whose stepgate policy is `approval`: each call
    is published when the SDK asks whether it needs approval; if stepgate
    holds it for a person, the run stops with the call among its
    interruptions (`needs_approval`). Once the person has approved it in
    stepgate (`stepgate approvals approve`), approve the interruption
    (`state.approve(item)`) and run the state again: the call keeps its step
    and gets its answer.
    """
    answered: Dict[str, Answer] = {}

    async def invoke(ctx: ToolContext[Any], input_json: str) -> str:
        found = answered.pop(ctx.tool_call_id, None)
        if found is not None:  # answered while the SDK asked about approval
            return answer_text(found)
        run = run_of(ctx.context, context_attribute)
        arguments = json.loads(input_json or "{}")
        return await invoke_step(client, run, name, arguments, ctx.tool_call_id, timeout)

    async def needs_approval(ctx: Any, arguments: Dict[str, Any], call_id: str) -> bool:
        run = run_of(ctx.context, context_attribute)
        if call_id in run.calls:
            return False  # asked again after its interruption: invoke waits for it
        step, fresh = run.take_step(name)
        run.calls[call_id] = step
        await run._saved()
        try:
            answer = await call_async(client, run.workflow_id, step, name, arguments,
                                      call_id=call_id, timeout=timeout, on_approval="raise")
        except StepgateAwaitingApproval:
            return True
        except StepgateError:
            return False  # invoke asks again, at the same step
        run.calls.pop(call_id, None)
        await run._saved()
        if fresh and (answer.deduplicated or answer.identity_conflict):
            raise _position_lost(run, step, name)
        answered[call_id] = answer
        return False

    return FunctionTool(
        name=name,
        description=description,
        params_json_schema=params_json_schema,
        on_invoke_tool=invoke,
        strict_json_schema=strict_json_schema,
        needs_approval=needs_approval if approval else False,
    )


def stepgate_function_tool(
    client: Union[Client, AsyncClient],
    func: Optional[Callable[..., Any]] = None,
    *,
    name: Optional[str] = None,
    description: Optional[str] = None,
    timeout: float = 60.0,
    context_attribute: str = "stepgate",
) -> Any:
    """A function tool from a typed Python function's signature and docstring
    (the SDK's own `function_schema`), whose calls go through stepgate: the
    function's body is never run here; stepgate's tool of that name runs.

    Use as `stepgate_function_tool(client, f)` or `@stepgate_function_tool(client)`.
    """
    from agents.function_schema import function_schema

    def make(f: Callable[..., Any]) -> FunctionTool:
        schema = function_schema(f, name_override=name, description_override=description)
        return stepgate_tool(client, schema.name, schema.description or "",
                             schema.params_json_schema, timeout=timeout,
                             context_attribute=context_attribute,
                             strict_json_schema=schema.strict_json_schema)

    return make(func) if func is not None else make
