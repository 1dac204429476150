"""The Agents SDK's MCP client to `stepgate mcp --listen` on loopback, with the
step in each call's `_meta` from the run's durable numbering
(`mcp_step_hooks()` and a `SessionSteps`): no Kafka client in the agent's
process. Through the SDK's own `Runner.run` with a scripted model; the front is
authorized by a static token, whose namespace (`support-bot/`) the workflows
are named in."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

agents = pytest.importorskip("agents")
pytest.importorskip("agents.mcp")

from agents import Agent, Runner, SQLiteSession, set_tracing_disabled  # noqa: E402
from agents.mcp import MCPServerStreamableHttp  # noqa: E402

from harness import stepgate_bin, wait_for  # noqa: E402
from scripted import agents_model  # noqa: E402
from stepgate_client.openai_agents import (  # noqa: E402
    SessionSteps,
    SQLiteStepStore,
    StepgatePositionLost,
    mcp_step_hooks,
)

set_tracing_disabled(True)

NAMESPACE = "support-bot/"


class Front:
    def __init__(self, stack):
        self.dir = tempfile.TemporaryDirectory(prefix="stepgate-mcp-front-")
        d = Path(self.dir.name)
        self.token = secrets.token_hex(24)
        (d / "token").write_text(self.token)
        config = d / "mcp.toml"
        config.write_text(stack.config_path.read_text() + f"""
[mcp.auth.scopes]
all = ["*"]

[[mcp.auth.tokens]]
name = "support-bot"
token = "file:{d / 'token'}"
scopes = ["all"]
""")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log_path = d / "front.log"
        self.proc = subprocess.Popen(
            [stepgate_bin(), "mcp", "--config", str(config), "--listen",
             f"127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log_path, "wb"), env=stack._env())

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"stepgate mcp exited:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_for(listening, 120, "stepgate mcp listens", every=0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def server(self, hooks, timeout: float = 60.0) -> MCPServerStreamableHttp:
        return MCPServerStreamableHttp(
            name="stepgate",
            params={"url": self.url, "headers": {"Authorization": f"Bearer {self.token}"},
                    "timeout": 10, "sse_read_timeout": 300},
            client_session_timeout_seconds=timeout,
            **hooks,
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()


@pytest.fixture(scope="module")
def front(stack):
    f = Front(stack)
    yield f
    f.stop()


def texts(model):
    """The tool outputs the model was shown, as text (an MCP tool's output is
    a list of content items)."""
    return ["".join(i.get("text", "") for i in o) if isinstance(o, list) else o
            for o in model.tool_outputs()]


def caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


async def run_through(front, hooks, db, wf, turns, timeout: float = 60.0):
    """A Runner.run of the agent `support` with the front's tools, through the
    conversation's session (new session objects each time: a new process)."""
    session = SQLiteSession(wf, db)
    steps = SessionSteps(session, workflow_prefix=NAMESPACE)
    model = agents_model(turns)
    async with front.server(hooks, timeout) as server:
        result = await Runner.run(Agent(name="support", model=model, mcp_servers=[server]),
                                  "go", session=session, context=steps)
    return result, model, steps


def test_through_stepgate_mcp_two_calls_run_twice_and_a_retry_of_a_step_runs_once(
        stack, front, wf, tmp_path):
    db = str(tmp_path / "conversations.db")
    workflow = f"{NAMESPACE}{wf}/support"
    hooks = mcp_step_hooks()

    async def main():
        # Two calls with the same arguments: two steps, both run.
        first, model, _ = await run_through(front, hooks, db, wf, [
            [("create_ticket", {"title": "Same"})], [("create_ticket", {"title": "Same"})],
            "done"])
        twice = texts(model)[-2:]
        # A call whose answer is lost: the client gives up while the tool runs.
        stack.tools.hold("slow")
        try:
            lost, lost_model, _ = await run_through(
                front, hooks, db, wf, [[("slow", {"title": "Refund issued"})], "done"],
                timeout=3.0)
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("slow", workflow) == 1,
                                    60, "the lost call reached the tool")
        finally:
            stack.tools.release("slow")
        # The model's rephrased retry, in a new run (and a new MCP session).
        retry, retry_model, steps = await run_through(front, hooks, db, wf, [
            [("slow", {"title": "Your refund was issued"})], "done"])
        return twice, lost_model, retry_model, steps

    twice, lost_model, retry_model, steps = asyncio.run(main())
    tickets = stack.tools.invocations("create_ticket", workflow)
    assert sorted(c.step_index for c in tickets) == [0, 1], front.log()
    assert [c.body for c in tickets] == [{"title": "Same"}] * 2
    assert all(json.loads(o)["echo"] == {"title": "Same"} for o in twice), twice
    # The lost call: the model was told of an error, not given an answer.
    assert "echo" not in texts(lost_model)[-1], texts(lost_model)
    # Its retry got the first call's answer; the tool ran once.
    assert json.loads(texts(retry_model)[-1])["echo"] == {"title": "Refund issued"}
    slow = stack.tools.invocations("slow", workflow)
    assert [(c.step_index, c.body) for c in slow] == [(2, {"title": "Refund issued"})]
    assert steps.state()["support"]["next_step"] == 3
    assert steps.state()["support"]["unanswered"] == {"slow": []}


def test_through_stepgate_mcp_a_session_whose_numbering_was_lost_refuses(
        stack, front, wf, tmp_path):
    db = str(tmp_path / "conversations.db")
    workflow = f"{NAMESPACE}{wf}/support"
    hooks = mcp_step_hooks()

    async def main():
        await run_through(front, hooks, db, wf,
                          [[("create_ticket", {"title": "the first ticket"})], "done"])
        SQLiteStepStore(db).delete(wf)
        model = agents_model([[("create_ticket", {"title": "a brand new ticket"})], "done"])
        session = SQLiteSession(wf, db)
        async with front.server(hooks) as server:
            with pytest.raises(Exception) as e:
                await Runner.run(Agent(name="support", model=model, mcp_servers=[server]),
                                 "go", session=session,
                                 context=SessionSteps(session, workflow_prefix=NAMESPACE))
        return e.value, model

    error, model = asyncio.run(main())
    assert caused_by(error, StepgatePositionLost), repr(error)
    assert len(model.inputs) == 1
    assert [c.body for c in stack.tools.invocations("create_ticket", workflow)] == \
        [{"title": "the first ticket"}]


def test_through_stepgate_mcp_another_recipient_never_takes_a_lost_call_s_step(
        stack, front, wf, tmp_path):
    """`mail` declares identity = ["to"]. alice's call is lost; bob's call takes
    its step, is refused (identity_conflict) and gives it back; bob's repeat
    runs as a new step, and alice's retry gets her answer: each sent once."""
    db = str(tmp_path / "conversations.db")
    workflow = f"{NAMESPACE}{wf}/support"
    hooks = mcp_step_hooks()

    async def main():
        stack.tools.hold("mail")
        try:
            await run_through(front, hooks, db, wf,
                              [[("mail", {"to": "alice", "subject": "Hi"})], "done"], timeout=3.0)
            await asyncio.to_thread(wait_for, lambda: stack.tools.count("mail", workflow) == 1,
                                    60, "alice's email reached the tool")
        finally:
            stack.tools.release("mail")
        _, model, steps = await run_through(front, hooks, db, wf, [
            [("mail", {"to": "bob", "subject": "Hi"})],
            [("mail", {"to": "bob", "subject": "Hi"})],
            [("mail", {"to": "alice", "subject": "Hello again"})], "done"])
        return model, steps

    model, steps = asyncio.run(main())
    outputs = texts(model)[-3:]
    assert "echo" not in outputs[0], outputs       # bob's first call: refused, not run
    assert json.loads(outputs[1])["echo"]["to"] == "bob", outputs
    assert json.loads(outputs[2])["echo"] == {"to": "alice", "subject": "Hi"}, outputs
    sent = sorted((c.step_index, c.body["to"]) for c in stack.tools.invocations("mail", workflow))
    assert sent == [(0, "alice"), (1, "bob")], sent
    assert steps.state()["support"]["unanswered"] == {"mail": []}
