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

The numbering can instead be kept with the SDK's `Session`: with
`context=SessionSteps(session)` each agent's `StepgateRun` (workflow
`<session_id>/<agent name>`) is stored beside the session's items — for an
`SQLiteSession`, in a `stepgate_steps` table of its database file — so a
conversation resumed through its session continues its numbering, and trimming
or summarising its items never renumbers a step.

Through `stepgate mcp` (no Kafka client in the agent's process), the SDK's MCP
servers get the step of each call in `_meta` from the same numbering:
`MCPServerStreamableHttp(..., **mcp_step_hooks())` (see `MCPStepHooks`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Awaitable, Callable, Collection, Dict, List, Optional, Tuple, Union

from agents import FunctionTool
from agents.tool_context import ToolContext

from .answer import MAX_CONFLICT_HOPS, Answer, answer_text
from .client import (
    AsyncClient,
    Client,
    StepgateAwaitingApproval,
    StepgateError,
    StepgateTimeout,
    await_settled,
    hop_call_id,
    new_call_id,
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

    def take_step(self, tool: str, skip: "Collection[int]" = ()) -> "tuple[int, bool]":
        """The step of a new call of `tool`: an unanswered one first (but none
        in `skip`). Returns (step, fresh): fresh when the step was never
        published by this run."""
        waiting = self.unanswered.get(tool)
        for i, step in enumerate(waiting or ()):
            if step not in skip:
                return waiting.pop(i), False
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
    attribute, or its `attribute` key. (A `SessionSteps` there: see
    `resolve_run`.)"""
    if isinstance(context, StepgateRun):
        return context
    found = getattr(context, attribute, None)
    if found is None and isinstance(context, dict):
        found = context.get(attribute)
    if isinstance(found, StepgateRun):
        return found
    raise TypeError(
        f"stepgate tools need a StepgateRun (or SessionSteps) in the run's context: pass "
        f"context=StepgateRun(...) or SessionSteps(session), or a context with a `{attribute}` "
        f"attribute (or key) holding one; got {type(context).__name__}"
    )


# ---------------------------------------------------------------------------
# The counter kept next to the app's Agents SDK Session.


STEPS_TABLE = "stepgate_steps"


class SQLiteStepStore:
    """The step numbering of sessions in a SQLite file: one row per (session
    id, agent name) in the table `stepgate_steps`, next to (never among) the
    session's items — `SessionSteps`' store for an `SQLiteSession` with a file,
    in that session's own database file.

    Each write carries a version and replaces the row only if newer, so writes
    that land out of order never step the counter back.
    """

    def __init__(self, path: "Union[str, Any]", table: str = STEPS_TABLE):
        if str(path) == ":memory:":
            raise ValueError("SQLiteStepStore needs a file (an in-memory database is not durable)")
        self.path = str(path)
        self.table = table
        self._ready = False

    def _connect(self):
        import sqlite3

        conn = sqlite3.connect(self.path, timeout=30.0)
        if not self._ready:
            with conn:
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {self.table} ("
                    "session_id TEXT NOT NULL, agent TEXT NOT NULL, state TEXT NOT NULL, "
                    "version INTEGER NOT NULL, updated_at TEXT DEFAULT CURRENT_TIMESTAMP, "
                    "PRIMARY KEY (session_id, agent))")
            self._ready = True
        return conn

    def load(self, session_id: str, agent: str) -> Optional[Tuple[Dict[str, Any], int]]:
        """(state, version) of the session's agent, or None if it has none."""
        conn = self._connect()
        try:
            row = conn.execute(f"SELECT state, version FROM {self.table} "
                               "WHERE session_id = ? AND agent = ?", (session_id, agent)).fetchone()
        finally:
            conn.close()
        return (json.loads(row[0]), int(row[1])) if row else None

    def save(self, session_id: str, agent: str, state: Dict[str, Any], version: int) -> None:
        conn = self._connect()
        try:
            with conn:
                conn.execute(
                    f"INSERT INTO {self.table} (session_id, agent, state, version) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (session_id, agent) DO UPDATE SET "
                    "state = excluded.state, version = excluded.version, "
                    "updated_at = CURRENT_TIMESTAMP "
                    f"WHERE excluded.version > {self.table}.version",
                    (session_id, agent, json.dumps(state), version))
        finally:
            conn.close()

    def delete(self, session_id: str, agent: Optional[str] = None) -> None:
        """Forget a session's numbering (every agent's, or one). Its workflows'
        steps stay recorded in stepgate: a run of that session afterwards
        cannot prove its position and refuses (`StepgatePositionLost`)."""
        conn = self._connect()
        try:
            with conn:
                if agent is None:
                    conn.execute(f"DELETE FROM {self.table} WHERE session_id = ?", (session_id,))
                else:
                    conn.execute(f"DELETE FROM {self.table} WHERE session_id = ? AND agent = ?",
                                 (session_id, agent))
        finally:
            conn.close()


class _SessionMemoryStore:
    """For an in-memory `SQLiteSession`: the numbering lives as long as the
    session object, exactly as durable as its items."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[str, str], Tuple[Dict[str, Any], int]] = {}

    def load(self, session_id: str, agent: str) -> Optional[Tuple[Dict[str, Any], int]]:
        row = self.rows.get((session_id, agent))
        return (json.loads(json.dumps(row[0])), row[1]) if row else None

    def save(self, session_id: str, agent: str, state: Dict[str, Any], version: int) -> None:
        row = self.rows.get((session_id, agent))
        if row is None or version > row[1]:
            self.rows[(session_id, agent)] = (json.loads(json.dumps(state)), version)

    def delete(self, session_id: str, agent: Optional[str] = None) -> None:
        for key in [k for k in self.rows if k[0] == session_id and agent in (None, k[1])]:
            del self.rows[key]


def _default_store(session: Any) -> Any:
    try:
        from agents.memory import SQLiteSession
    except ImportError:  # pragma: no cover - every SDK with Session has it
        SQLiteSession = ()  # type: ignore[assignment]
    if isinstance(session, SQLiteSession):
        if str(session.db_path) == ":memory:":
            store = getattr(session, "_stepgate_steps", None)
            if store is None:
                store = _SessionMemoryStore()
                session._stepgate_steps = store  # bound to the session object: as durable
            return store
        return SQLiteStepStore(session.db_path)
    raise TypeError(
        f"SessionSteps keeps an SQLiteSession's numbering in its database file; for a "
        f"{type(session).__name__}, pass store= (an object with load(session_id, agent) -> "
        "(state, version) | None and save(session_id, agent, state, version), kept as "
        "durably as the session, e.g. SQLiteStepStore(path))"
    )


class SessionSteps:
    """The step numbering of a conversation kept with its Agents SDK `Session`.

        session = SQLiteSession("thread-42", "conversations.db")
        steps = SessionSteps(session)        # put in the run's context (or as it)
        await Runner.run(agent, "...", session=session, context=steps)

    Each agent of the session (by name) has its own workflow,
    `<workflow_prefix><session_id>/<agent name>`, and its counter is a
    `StepgateRun` kept in `store` — for an `SQLiteSession`, the table
    `stepgate_steps` in the session's own database file, keyed by the session
    id and the agent's name. The counter is kept beside the session's items,
    never among them: the items are the model's input, which apps trim
    (`pop_item`), clear (`clear_session`) and replace with summaries, and a
    counter that lived in them would be lost or rolled back with them. So a
    conversation resumed through its session in a new process continues its
    numbering, and no trimming ever renumbers a step.

    It is saved (before each call is published) as `StepgateRun.save` is. A
    session whose numbering was lost (another database, a deleted row) starts
    again at 0 and cannot prove its position: its first call that another life
    of the workflow already made raises `StepgatePositionLost`.

    `agent=` keeps one counter under that name for every agent (needed by
    `approval=True` tools, which the SDK asks about without naming the agent).
    One run of a session at a time, as for the session itself.
    """

    def __init__(self, session: Any, store: Any = None, workflow_prefix: str = "",
                 agent: Optional[str] = None):
        self.session = session
        self.session_id: str = session.session_id
        self.store = store if store is not None else _default_store(session)
        self.workflow_prefix = workflow_prefix
        self.agent = agent
        self.runs: Dict[str, StepgateRun] = {}
        self._versions: Dict[str, int] = {}

    def workflow_id(self, agent: str) -> str:
        return f"{self.workflow_prefix}{self.session_id}/{agent}"

    async def _store(self, method: str, *args: Any) -> Any:
        f = getattr(self.store, method)
        if inspect.iscoroutinefunction(f):
            return await f(*args)
        return await asyncio.to_thread(f, *args)

    async def run(self, agent: Optional[str] = None) -> StepgateRun:
        """The StepgateRun of `agent` (default: `agent=` given at creation),
        loaded from the store on first use."""
        name = agent if agent is not None else self.agent
        if not name:
            raise TypeError("SessionSteps.run: which agent's numbering? (pass agent=)")
        run = self.runs.get(name)
        if run is not None:
            return run
        row = await self._store("load", self.session_id, name)
        if name in self.runs:  # loaded meanwhile by a parallel call
            return self.runs[name]
        if row is None:
            run, version = StepgateRun(self.workflow_id(name)), 0
        else:
            state, version = row
            if state.get("workflow_id") != self.workflow_id(name):
                raise StepgateError(
                    f"the stored numbering of session {self.session_id!r}, agent {name!r}, is "
                    f"for workflow {state.get('workflow_id')!r}, not {self.workflow_id(name)!r} "
                    "(another workflow_prefix?)")
            run = StepgateRun.resume(state)
        self._versions[name] = version
        run.save = self._saver(name)
        self.runs[name] = run
        return run

    def _saver(self, name: str) -> SaveHook:
        def save(state: Dict[str, Any]) -> Awaitable[None]:
            # The version is taken now, in the order the states were made, so
            # the store keeps the newest however the writes are scheduled.
            self._versions[name] += 1
            return self._store("save", self.session_id, name, state, self._versions[name])
        return save

    def state(self) -> Dict[str, Dict[str, Any]]:
        """The loaded agents' `StepgateRun.state()`, by agent name."""
        return {name: run.state() for name, run in self.runs.items()}


def _in_context(context: Any, attribute: str) -> Any:
    if isinstance(context, (StepgateRun, SessionSteps)):
        return context
    found = getattr(context, attribute, None)
    if found is None and isinstance(context, dict):
        found = context.get(attribute)
    return found


async def resolve_run(wrapper: Any, attribute: str = "stepgate") -> StepgateRun:
    """The StepgateRun of a tool call from its run context wrapper (a
    `ToolContext`): a StepgateRun, or the calling agent's numbering in a
    `SessionSteps` — the context itself, its `attribute` attribute or key."""
    found = _in_context(wrapper.context, attribute)
    if isinstance(found, StepgateRun):
        return found
    if isinstance(found, SessionSteps):
        if found.agent is not None:
            return await found.run()
        agent = getattr(wrapper, "agent", None)
        if agent is None:
            raise TypeError(
                "this tool call does not name its agent (the SDK asks approval tools without "
                "one): give SessionSteps(..., agent=\"<name>\") to number every agent's calls "
                "under one name")
        return await found.run(agent.name)
    return run_of(wrapper.context, attribute)  # raises, saying what is expected


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
        "withheld. Resume the run with StepgateRun.resume(saved_state) (with a SessionSteps: "
        "from the session's stored numbering), or start it under a new workflow id."
    )


def _correlation(tool_call_id: Optional[str]) -> Optional[Dict[str, Any]]:
    """The intent's metadata: the model's id of the call, for correlation
    only (models repeat their ids: it is never the wire `call_id`)."""
    return {"tool_call_id": tool_call_id} if tool_call_id else None


async def invoke_step(client: Union[Client, AsyncClient], run: StepgateRun, name: str,
                      arguments: Dict[str, Any], tool_call_id: Optional[str],
                      timeout: float, in_doubt_wait: float = 0.0) -> str:
    """One tool call of a run through stepgate: the text for the model.
    `tool_call_id` is the model's id of the call: it finds a call whose step
    was taken before an approval interruption, and goes in the intent's
    metadata; each intent gets a wire `call_id` of its own. With
    `in_doubt_wait`, a call in doubt while stepgate asks the tool what
    happened is repeated until settled, at most that many seconds."""
    if tool_call_id is not None and tool_call_id in run.calls:
        # A call whose step was taken before it was held for approval.
        step, fresh = run.calls.pop(tool_call_id), False
    else:
        step, fresh = run.take_step(name)
    base = new_call_id()
    for hop in range(MAX_CONFLICT_HOPS):
        run.pending[step] = name
        await run._saved()
        try:
            answer = await call_async(client, run.workflow_id, step, name, arguments,
                                      call_id=hop_call_id(base, hop), timeout=timeout,
                                      metadata=_correlation(tool_call_id))
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
    if in_doubt_wait > 0 and answer.reconciling:
        try:
            answer = await await_settled(client, answer, arguments, within=in_doubt_wait,
                                         timeout=timeout, metadata=_correlation(tool_call_id))
        except StepgateError:
            pass  # the in-doubt answer stands: it says how to learn more
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
    in_doubt_wait: float = 0.0,
) -> FunctionTool:
    """A function tool for `Agent(tools=[...])` whose calls go through stepgate.

    `in_doubt_wait`: seconds to wait for the resolution of a call in doubt
    while stepgate asks the tool what happened (`Answer.reconciling`): its
    step is repeated until settled, and the model gets the settled answer. 0
    (the default): the model gets the in-doubt answer, which says a repeat
    returns the outcome once known.

    `approval=True`, for a tool whose stepgate policy is `approval`: each call
    is published when the SDK asks whether it needs approval; if stepgate
    holds it for a person, the run stops with the call among its
    interruptions (`needs_approval`). Once the person has approved it in
    stepgate (`stepgate approvals approve`), approve the interruption
    (`state.approve(item)`) and run the state again: the call keeps its step
    and gets its answer.
    """
    # Answers given while the SDK asked about approval, by (workflow, the
    # model's call id): the tool serves many runs, whose models' ids repeat.
    answered: Dict[Tuple[str, str], Answer] = {}

    async def invoke(ctx: ToolContext[Any], input_json: str) -> str:
        run = await resolve_run(ctx, context_attribute)
        found = answered.pop((run.workflow_id, ctx.tool_call_id), None)
        if found is not None:
            return answer_text(found)
        arguments = json.loads(input_json or "{}")
        return await invoke_step(client, run, name, arguments, ctx.tool_call_id, timeout,
                                 in_doubt_wait)

    async def needs_approval(ctx: Any, arguments: Dict[str, Any], tool_call_id: str) -> bool:
        run = await resolve_run(ctx, context_attribute)
        if tool_call_id in run.calls:
            return False  # asked again after its interruption: invoke waits for it
        step, fresh = run.take_step(name)
        run.calls[tool_call_id] = step
        await run._saved()
        try:
            answer = await call_async(client, run.workflow_id, step, name, arguments,
                                      call_id=new_call_id(), timeout=timeout,
                                      on_approval="raise",
                                      metadata=_correlation(tool_call_id))
        except StepgateAwaitingApproval:
            return True
        except StepgateError:
            return False  # invoke asks again, at the same step
        run.calls.pop(tool_call_id, None)
        await run._saved()
        if fresh and (answer.deduplicated or answer.identity_conflict):
            raise _position_lost(run, step, name)
        answered[(run.workflow_id, tool_call_id)] = answer
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
    in_doubt_wait: float = 0.0,
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
                             strict_json_schema=schema.strict_json_schema,
                             in_doubt_wait=in_doubt_wait)

    return make(func) if func is not None else make


# ---------------------------------------------------------------------------
# `stepgate mcp` from the Agents SDK's MCP servers: the step in `_meta`.


def _caused_by(error: BaseException, kind: type) -> bool:
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _fingerprint(arguments: Any) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)


class StepgateMetaIgnored(StepgateError):
    """The MCP server did not answer the step sent in `_meta` (not `stepgate
    mcp`, or one that does not read `_meta`): nothing it answers is a step."""


class MCPStepHooks:
    """The step of each call to `stepgate mcp` through an Agents SDK MCP server
    (`MCPServerStreamableHttp`, `MCPServerStdio`, …), from the run's durable
    numbering — a `StepgateRun` or `SessionSteps` in the run's context, as for
    `stepgate_tool` — with no Kafka client in the agent's process:

        hooks = mcp_step_hooks()
        async with MCPServerStreamableHttp(name="stepgate", params={...}, **hooks) as stepgate:
            agent = Agent(name="support", mcp_servers=[stepgate])
            await Runner.run(agent, "...", session=session, context=SessionSteps(session))

    Three hooks, all needed (`hooks.kwargs()`, or `**hooks`):

    - `tool_meta_resolver`: takes the call's step as `stepgate_tool` does (the
      first unanswered step of that tool, else the next one), saves the
      numbering with the step pending, and returns stepgate's `_meta`:
      `workflow_id`, `step_index`, `attempt` (0).
    - `custom_data_extractor`: reads the result's `_meta` (`stepgate/status`,
      `stepgate/deduplicated`, …). An answer settles the step. A result
      without stepgate's answer (stepgate had none in time, the call was
      refused) leaves the step to the next call of the tool — the model's
      retry — which gets its answer. A fresh step answered as a repeat raises
      `StepgatePositionLost`; a retry whose identity arguments differ
      (`identity_conflict`) gives the step back for its real retry, and the
      same arguments never take that step again.
    - `failure_error_function`: a call that failed in the client (a timeout,
      a lost connection) leaves its step to the model's retry as well; the
      model reads `failure_error_function`'s text (the SDK's default unless
      given). `StepgatePositionLost` is never turned into text: the run stops.
    """

    def __init__(self, context_attribute: str = "stepgate",
                 failure_error_function: Optional[Callable[[Any, Exception], Any]] = None):
        self.context_attribute = context_attribute
        self._failure_text = failure_error_function
        # Calls resolved and not yet settled, by (workflow, the model's call
        # id) — one server serves many runs, whose models' ids repeat:
        # {(workflow_id, tool_call_id): (run, step, fresh, tool, args)}.
        self.inflight: Dict[Tuple[str, str], Tuple[StepgateRun, int, bool, str, str]] = {}
        # Steps a call conflicted with: {(workflow_id, step): {argument fingerprints}}.
        self.conflicts: Dict[Tuple[str, int], set] = {}

    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments for an Agents SDK MCP server."""
        return {"tool_meta_resolver": self.tool_meta_resolver,
                "custom_data_extractor": self.custom_data_extractor,
                "failure_error_function": self.failure_error_function}

    def keys(self):  # `**hooks`
        return self.kwargs().keys()

    def __getitem__(self, key: str) -> Any:
        return self.kwargs()[key]

    async def tool_meta_resolver(self, ctx: Any) -> Dict[str, Any]:
        wrapper = ctx.run_context
        call_id = getattr(wrapper, "tool_call_id", None)
        if not call_id:
            raise StepgateError("stepgate's MCP hooks need the SDK's tool call id (ToolContext)")
        run = await resolve_run(wrapper, self.context_attribute)
        tool = ctx.tool_name
        args = _fingerprint(ctx.arguments or {})
        skip = {step for (wf, step), seen in self.conflicts.items()
                if wf == run.workflow_id and args in seen}
        step, fresh = run.take_step(tool, skip)
        run.pending[step] = tool
        self.inflight[(run.workflow_id, call_id)] = (run, step, fresh, tool, args)
        await run._saved()  # before the call is sent
        return {"workflow_id": run.workflow_id, "step_index": step, "attempt": 0}

    async def _inflight_key(self, wrapper: Any) -> Optional[Tuple[str, str]]:
        """The `inflight` key of a call from its ToolContext, if it has one."""
        call_id = getattr(wrapper, "tool_call_id", None)
        if not call_id:
            return None
        try:
            run = await resolve_run(wrapper, self.context_attribute)
        except TypeError:  # no numbering in this run's context: not ours
            return None
        return (run.workflow_id, call_id)

    async def _unanswered(self, key: Tuple[str, str], front: bool = False) -> None:
        entry = self.inflight.pop(key, None)
        if entry is None:
            return
        run, step, _, tool, _ = entry
        run.pending.pop(step, None)
        waiting = run.unanswered.setdefault(tool, [])
        if step not in waiting:
            waiting.insert(0, step) if front else waiting.append(step)
        await run._saved()

    async def custom_data_extractor(self, ctx: Any) -> None:
        key = await self._inflight_key(ctx.run_context)
        entry = self.inflight.get(key) if key else None
        if key is None or entry is None:
            return None
        run, step, fresh, tool, args = entry
        meta = dict(ctx.result_meta or {})
        if "stepgate/status" not in meta:
            # No answer of stepgate's: not answered in time, or refused
            # before it was asked. The step goes to the model's retry.
            await self._unanswered(key)
            return None
        if (meta.get("stepgate/workflow_id"), meta.get("stepgate/step_index")) != \
                (run.workflow_id, step):
            await self._unanswered(key)
            raise StepgateMetaIgnored(
                f"the MCP server answered {tool!r} as step {meta.get('stepgate/step_index')} of "
                f"{meta.get('stepgate/workflow_id')!r}, not the step sent in _meta (step {step} of "
                f"{run.workflow_id!r}): is it `stepgate mcp`, and does it read _meta?")
        conflict = meta.get("stepgate/error_kind") == "identity_conflict"
        if conflict and not fresh:
            # The unanswered step belongs to another call (its identity
            # arguments differ): it stays open for that call's real retry.
            self.conflicts.setdefault((run.workflow_id, step), set()).add(args)
            await self._unanswered(key, front=True)
            return None
        del self.inflight[key]
        run.pending.pop(step, None)
        await run._saved()
        if fresh and (meta.get("stepgate/deduplicated") or conflict):
            raise _position_lost(run, step, tool)
        self.conflicts.pop((run.workflow_id, step), None)
        return None

    async def failure_error_function(self, ctx: Any, error: Exception) -> Optional[str]:
        if _caused_by(error, StepgatePositionLost) or _caused_by(error, StepgateMetaIgnored):
            return None  # not text for the model: the run stops
        key = await self._inflight_key(ctx)
        if key is not None:
            await self._unanswered(key)
        if self._failure_text is None:
            from agents.tool import default_tool_error_function

            return default_tool_error_function(ctx, error)
        text = self._failure_text(ctx, error)
        return await text if inspect.isawaitable(text) else text


def mcp_step_hooks(context_attribute: str = "stepgate",
                   failure_error_function: Optional[Callable[[Any, Exception], Any]] = None
                   ) -> MCPStepHooks:
    """stepgate's hooks for an Agents SDK MCP server connected to `stepgate
    mcp`: `MCPServerStreamableHttp(..., **mcp_step_hooks())`. See
    `MCPStepHooks`."""
    return MCPStepHooks(context_attribute, failure_error_function)



def mcp_handshake_client_factory(headers: Optional[Dict[str, str]] = None, timeout: Any = None,
                                 auth: Any = None) -> Any:
    """An `httpx_client_factory` for `MCPServerStreamableHttp` (in `params`)
    that has the SDK connect to `stepgate mcp` with MCP's initialize handshake.

    With the MCP Python SDK 2.x, the Agents SDK first probes `server/discover`
    and, when the server answers it, speaks protocol 2026-07-28. `stepgate mcp`
    (rmcp 3.11) answers it, but its results lack the `resultType` field the
    Python SDK requires at that version, so listing the tools fails
    (`ListToolsResult: resultType Field required`). This client answers the
    probe itself with "method not found", so the SDK uses the handshake
    (2025-11-25), which both speak. Every other request goes to the server.
    With the MCP Python SDK 1.x (no probe) it is a plain client.
    """
    from importlib.metadata import version

    v2 = int(version("mcp").split(".")[0]) >= 2
    httpx = __import__("httpx2" if v2 else "httpx")
    kw: Dict[str, Any] = {"headers": headers, "auth": auth, "follow_redirects": True}
    if timeout is not None:
        kw["timeout"] = timeout
    if not v2:
        return httpx.AsyncClient(**kw)

    class NoDiscover(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            if request.method == "POST":
                try:
                    body = json.loads(request.content or b"null")
                except ValueError:
                    body = None
                if isinstance(body, dict) and body.get("method") == "server/discover":
                    return httpx.Response(200, request=request, json={
                        "jsonrpc": "2.0", "id": body.get("id"),
                        "error": {"code": -32601, "message": "Method not found"}})
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    return httpx.AsyncClient(transport=NoDiscover(), **kw)
