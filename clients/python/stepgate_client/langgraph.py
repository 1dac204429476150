"""LangGraph adapter: tools for `ToolNode` whose calls go through stepgate, with
their step numbering in a checkpointed state channel of its own.

    from typing import Annotated
    from langgraph.graph import MessagesState
    from langgraph.prebuilt import ToolNode
    from pydantic import BaseModel
    from stepgate_client import Client
    from stepgate_client.langgraph import StepgateState, stepgate_tool

    class State(StepgateState):          # MessagesState + the `stepgate` channel
        ...

    class Ticket(BaseModel):
        '''Open a support ticket.'''
        title: str
        priority: int = 3

    client = Client("127.0.0.1:9092")
    tools = ToolNode([stepgate_tool(client, "create_ticket", args_schema=Ticket)])
    # ... in a StateGraph(State) compiled with a checkpointer

The step key comes from the thread's durable state, never from the model or
the message list:

- `workflow_id` is the thread's `thread_id`, then `/` and the stable part of
  the node's `checkpoint_ns` (node names, without task ids: `tools`, or
  `agent_a|tools` in a subgraph), then `@` and the lineage: 12 hex digits
  fixed when the state's numbering starts (derived from LangGraph's task id,
  so a re-run of that task after a crash finds the same one) and changed at a
  fork. A state that starts over without its numbering — a subgraph whose
  state is not kept between runs, a thread whose checkpoints were lost — is a
  new lineage: its calls are new steps, never an earlier state's answers.
- `step_index` is a counter in the `stepgate` channel (per namespace). Only
  tools advance it, so trimming (`RemoveMessage`), summarising or rewriting the
  messages never renumbers a step.
- A fork — a run from an older checkpoint (`invoke(..., {"configurable":
  {"thread_id": t, "checkpoint_id": older}})`, or after `update_state` on one)
  — starts a new lineage: its id is derived from the fork's first tool task id
  (which LangGraph derives from the fork's checkpoint, so a re-run of that task
  finds the same one), stored in the channel, and put in the `workflow_id`. The
  fork's new calls are new steps and never receive the old branch's answers.
  LangGraph marks a run as time travel with its own replay state; the adapter
  reads it from the task's config.

The calls of one model turn are numbered in the order of the turn's
`tool_calls`, from the state the turn's tools all see, so parallel calls get
distinct steps and a re-run of the turn after a crash gets the same ones. A
call whose answer did not come in time is answered "not answered yet"; its
step goes to the thread's next call of the same tool — the model's retry,
however rephrased — which gets the first call's result.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Annotated, Any, Dict, List, Optional, Tuple, Type, Union

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, StructuredTool
from langgraph.graph import MessagesState
from langgraph.prebuilt import InjectedState
from langgraph.types import Command, interrupt
from pydantic import BaseModel, Field, create_model

from .answer import answer_text
from .client import (
    AsyncClient,
    Client,
    StepgateAwaitingApproval,
    StepgateError,
    await_settled,
    hop_call_id,
    new_call_id,
    wait_settled,
)

NOT_ANSWERED = "not answered yet:"
NOT_ANSWERED_TEXT = (
    f"{NOT_ANSWERED} this call may still be running. Call the tool again to get its result; "
    "it will not be performed twice. Your next call of this tool is taken as this call's "
    "retry, even if you rephrase it; only a call that names a different target (for a tool "
    "that declares identity arguments, e.g. another recipient) is run as a new call instead."
)

StepKey = Tuple[str, int]


def merge_steps(current: Optional[Dict[str, Any]], update: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The reducer of the `stepgate` channel. Per namespace: the lineage, the
    next step index, and each tool's unanswered step keys. Updates of one
    turn's parallel calls commute: `next` is a maximum, `take` and `leave`
    name each call's own step."""
    out = dict(current or {})
    for ns, d in (update or {}).items():
        c = dict(out.get(ns) or {})
        unanswered = {t: [list(k) for k in v] for t, v in (c.get("unanswered") or {}).items()}
        for tool, keys in (d.get("take") or {}).items():
            taken = [list(k) for k in keys]
            unanswered[tool] = [k for k in unanswered.get(tool, []) if k not in taken]
        for tool, keys in (d.get("leave") or {}).items():
            for k in keys:
                if list(k) not in unanswered.setdefault(tool, []):
                    unanswered[tool].append(list(k))
        if "lineage" in d:
            c["lineage"], c["forked_at"] = d["lineage"], d.get("forked_at")
        c["next"] = max(int(c.get("next", 0)), int(d.get("next", 0)))
        c["unanswered"] = {t: v for t, v in unanswered.items() if v}
        out[ns] = c
    return out


class StepgateState(MessagesState):
    """MessagesState with the `stepgate` channel the tools number their steps in."""

    stepgate: Annotated[dict, merge_steps]


def _stable_ns(checkpoint_ns: str) -> str:
    """`a:task|b:task` -> `a|b`: the node names, without per-run task ids."""
    return "|".join(part.split(":", 1)[0] for part in checkpoint_ns.split("|") if part)


def _turn(messages: List[Any], tool_call_id: str) -> AIMessage:
    for m in reversed(messages):
        if isinstance(m, AIMessage) and any(c.get("id") == tool_call_id for c in m.tool_calls):
            return m
    raise ValueError(f"tool call {tool_call_id} is not in the state's messages")


class _Step:
    """Where one call of a turn stands: its step key and the channel update."""

    def __init__(self, state: Dict[str, Any], config: RunnableConfig, tool_call_id: str,
                 name: str, channel: str):
        conf = config.get("configurable") or {}
        thread = conf.get("thread_id")
        if not thread:
            raise ValueError("run the graph with config={'configurable': {'thread_id': ...}} "
                             "and a checkpointer")
        if channel not in state:
            raise ValueError(
                f"the graph's state has no `{channel}` channel: build it on StepgateState, or "
                f"add `{channel}: Annotated[dict, merge_steps]` to the state schema")
        self.ns = _stable_ns(str(conf.get("checkpoint_ns") or ""))
        ch = (state.get(channel) or {}).get(self.ns) or {}
        lineage, forked_at = ch.get("lineage", ""), ch.get("forked_at")
        replay = conf.get("__pregel_replay_state")
        replayed_from = getattr(replay, "checkpoint_id", None)
        task = str(conf.get("__pregel_task_id") or "")
        if not ch:
            # No numbering yet in this state: a new lineage, so that a state
            # started over (a fresh subgraph run, a lost checkpointer) never
            # reuses the steps of an earlier one. The task id is LangGraph's,
            # derived from the checkpoint: a re-run of this task finds it again.
            lineage = hashlib.sha256(f"new|{task}".encode()).hexdigest()[:12]
            forked_at = replayed_from
        elif replayed_from and replayed_from != forked_at:
            # Time travel: this branch's steps must not be the old branch's.
            lineage = hashlib.sha256(
                f"{lineage}|{replayed_from}|{task}".encode()).hexdigest()[:12]
            forked_at = replayed_from
        self.workflow_id = str(thread) + (f"/{self.ns}" if self.ns else "") + f"@{lineage}"
        pool = {t: [tuple(k) for k in v] for t, v in (ch.get("unanswered") or {}).items()}
        nxt = int(ch.get("next", 0))
        mine: Optional[Tuple[StepKey, bool, int]] = None
        for position, call in enumerate(_turn(state["messages"], tool_call_id).tool_calls):
            waiting = pool.get(call["name"])
            if waiting:
                key, taken = waiting.pop(0), True
            else:
                key, taken = (self.workflow_id, nxt), False
                nxt += 1
            if call["id"] == tool_call_id:
                mine = (key, taken, position)
        assert mine is not None
        (self.key, self.taken, position) = mine
        # Where this call goes if its step is another call's: named by the
        # task and the call's place in its turn — the same on a re-run of
        # the task, and no other call's (the model's id may repeat).
        self.moved = f"{self.workflow_id}#" + hashlib.sha256(
            f"moved|{task or tool_call_id}|{position}".encode()).hexdigest()[:12]
        self.name, self.tool_call_id, self.channel = name, tool_call_id, channel
        self.delta: Dict[str, Any] = {"lineage": lineage, "forked_at": forked_at, "next": nxt}
        if self.taken:
            self.delta["take"] = {name: [list(self.key)]}

    def conflicted(self) -> bool:
        """The step taken for this call is another call's (an identity
        conflict): that step stays open for its real retry, and this call
        moves to a step of its own, `<workflow_id>#<12 hex digits>` step 0,
        named by LangGraph's task id and the call's place in its turn — the
        same on a re-run of this task, and no other call's (never by the
        model's `tool_call_id`, which another call may carry)."""
        if self.key[0] == self.moved:
            return False
        self.delta.pop("take", None)
        self.taken = False
        self.key = (self.moved, 0)
        return True

    def result(self, text: str, unanswered: bool = False) -> Command:
        if unanswered:
            self.delta["leave"] = {self.name: [list(self.key)]}
        return Command(update={
            "messages": [ToolMessage(content=text, tool_call_id=self.tool_call_id, name=self.name)],
            self.channel: {self.ns: self.delta},
        })


def _held(step: "_Step", held: StepgateAwaitingApproval) -> Dict[str, Any]:
    """The interrupt's value for a call held for a person's approval."""
    return {
        "stepgate": "awaiting_approval",
        "workflow_id": step.key[0],
        "step_index": step.key[1],
        "tool": step.name,
        "arguments": held.event.get("arguments"),
        "approve": f"stepgate approvals approve {step.key[0]} {step.key[1]} {step.name} --by <you>",
    }


def _json_args(arguments: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in arguments.items():
        out[k] = v.model_dump(mode="json", exclude_unset=True) if isinstance(v, BaseModel) else v
    return json.loads(json.dumps(out, default=str))


def _schema_model(name: str, properties: Optional[Dict[str, Dict[str, Any]]],
                  required: Optional[List[str]]) -> Type[BaseModel]:
    """A pydantic model for JSON Schema properties: nested objects and arrays
    stay dicts and lists; only `required` ones are required (all by default)."""
    props = properties or {}
    req = set(props) if required is None else set(required)
    fields: Dict[str, Any] = {}
    for k, v in props.items():
        t = _py_type(v)
        desc = v.get("description")
        if k in req:
            fields[k] = (t, Field(..., description=desc))
        else:
            fields[k] = (Optional[t], Field(None, description=desc))
    return create_model(f"{name}_args", **fields)


def stepgate_tool(
    client: Union[Client, AsyncClient],
    name: str,
    description: Optional[str] = None,
    properties: Optional[Dict[str, Dict[str, Any]]] = None,
    *,
    required: Optional[List[str]] = None,
    args_schema: Optional[Type[BaseModel]] = None,
    timeout: float = 60.0,
    channel: str = "stepgate",
    in_doubt_wait: float = 0.0,
) -> StructuredTool:
    """A tool for LangGraph's ToolNode whose calls go through stepgate.

    The arguments' schema: a pydantic model (`args_schema`, its docstring the
    default description), or JSON Schema `properties` (with `required`; all
    required when not given). The graph's state needs the `stepgate` channel
    (`StepgateState`).

    `in_doubt_wait`: seconds to wait for the resolution of a call that is in
    doubt while stepgate asks the tool what happened (`Answer.reconciling`):
    its step is repeated until settled (`wait_settled`), and the model gets
    the settled answer. 0 (the default): the model gets the in-doubt answer,
    which tells it a repeat returns the outcome once known.
    """
    base = args_schema or _schema_model(name, properties, required)
    if description is None:
        description = (base.__doc__ or "").strip() or name
    Args = create_model(
        f"{name}_stepgate_args",
        __base__=base,
        state=(Annotated[dict, InjectedState], ...),
        tool_call_id=(Annotated[str, InjectedToolCallId], ...),
    )

    def run(state: dict, tool_call_id: str, config: RunnableConfig, **arguments: Any) -> Command:
        if isinstance(client, AsyncClient):
            raise TypeError("an AsyncClient's tools run in an async graph (ainvoke/astream); "
                            "use a Client for invoke/stream")
        step = _Step(state, config, tool_call_id, name, channel)
        args = _json_args(arguments)
        # The wire call_id is this call's own: the model's id repeats (forks
        # of one checkpoint replay it), so it only goes in the metadata.
        base, metadata = new_call_id(), {"tool_call_id": tool_call_id}
        for hop in range(2):
            wf, index = step.key
            kw = dict(timeout=timeout, call_id=hop_call_id(base, hop), metadata=metadata)
            try:
                try:
                    answer = client.call(wf, index, name, args, on_approval="raise", **kw)
                except StepgateAwaitingApproval as held:
                    # The graph pauses here until resumed (Command(resume=...));
                    # resumed, the tool runs again: the same step, its answer.
                    interrupt(_held(step, held))
                    answer = client.call(wf, index, name, args, **kw)
            except StepgateError:  # a timeout, or a publish whose fate is unknown
                return step.result(NOT_ANSWERED_TEXT, unanswered=True)
            if not (answer.identity_conflict and step.conflicted()):
                break
        if in_doubt_wait > 0 and answer.reconciling:
            try:
                answer = wait_settled(client, answer, args, within=in_doubt_wait,
                                      timeout=timeout, metadata=metadata)
            except StepgateError:
                pass  # the in-doubt answer stands: it says how to learn more
        return step.result(answer_text(answer))

    async def arun(state: dict, tool_call_id: str, config: RunnableConfig,
                   **arguments: Any) -> Command:
        step = _Step(state, config, tool_call_id, name, channel)
        args = _json_args(arguments)
        base, metadata = new_call_id(), {"tool_call_id": tool_call_id}
        for hop in range(2):
            wf, index = step.key
            kw = dict(timeout=timeout, call_id=hop_call_id(base, hop), metadata=metadata)

            async def call(on_approval: str) -> Any:
                if isinstance(client, AsyncClient):
                    return await client.call(wf, index, name, args, on_approval=on_approval, **kw)
                return await asyncio.to_thread(client.call, wf, index, name, args,
                                               on_approval=on_approval, **kw)

            try:
                try:
                    answer = await call("raise")
                except StepgateAwaitingApproval as held:
                    interrupt(_held(step, held))
                    answer = await call("wait")
            except StepgateError:
                return step.result(NOT_ANSWERED_TEXT, unanswered=True)
            if not (answer.identity_conflict and step.conflicted()):
                break
        if in_doubt_wait > 0 and answer.reconciling:
            try:
                answer = await await_settled(client, answer, args, within=in_doubt_wait,
                                             timeout=timeout, metadata=metadata)
            except StepgateError:
                pass
        return step.result(answer_text(answer))

    return StructuredTool.from_function(
        func=run, coroutine=arun, name=name, description=description, args_schema=Args
    )


def stepgate_tool_from(
    client: Union[Client, AsyncClient],
    tool: Any,
    *,
    timeout: float = 60.0,
    channel: str = "stepgate",
    in_doubt_wait: float = 0.0,
) -> StructuredTool:
    """`stepgate_tool` from a `@tool` (a LangChain tool) or a typed function:
    its name, description and argument schema, as LangChain derives them.
    The function's body never runs here: stepgate's tool of that name runs."""
    from langchain_core.tools import BaseTool

    if not isinstance(tool, BaseTool):
        tool = StructuredTool.from_function(tool)
    schema = tool.args_schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise TypeError(f"{tool.name}: its argument schema is not a pydantic model")
    return stepgate_tool(client, tool.name, tool.description, args_schema=schema,
                         timeout=timeout, channel=channel, in_doubt_wait=in_doubt_wait)


def _py_type(schema: Dict[str, Any]) -> Any:
    return {"string": str, "integer": int, "number": float, "boolean": bool,
            "object": dict, "array": list}.get(schema.get("type", "string"), Any)
