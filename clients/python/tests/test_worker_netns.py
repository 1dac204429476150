"""A tool only a worker can reach (issue #31): the tool and a Python pool
worker run in a network namespace this test makes; the gate (`stepgate run`,
in the host's namespace) has no URL for the tool and cannot connect to it. The
worker reaches the broker through a Unix-socket relay (netns_relay.py), so no
address but loopback is ever dialled. Needs root and `ip` (iproute2); skipped,
saying why, where a namespace cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from harness import Stack, brokers, wait_for

HERE = Path(__file__).resolve().parent


def _netns_or_skip(name: str) -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2's `ip`")
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, env=None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = p.stdout.readline().strip()
    assert line == "READY", f"{cmd}: {line}{p.stdout.read() if p.poll() is not None else ''}"
    return p


def test_a_tool_only_the_worker_can_reach_is_served_once_per_step(wf):
    ns = f"sgw-{uuid.uuid4().hex[:8]}"
    _netns_or_skip(ns)
    procs = []
    tmp = tempfile.TemporaryDirectory(prefix="stepgate-netns-")
    stack = None
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        host, port = brokers().split(",")[0].rsplit(":", 1)
        assert host in ("127.0.0.1", "localhost"), "the relay carries a loopback broker only"
        sock = str(Path(tmp.name) / "broker.sock")
        netns = ["ip", "netns", "exec", ns]
        procs.append(_start([sys.executable, str(HERE / "netns_relay.py"), "from-unix", sock,
                             f"127.0.0.1:{port}"]))
        procs.append(_start(netns + [sys.executable, str(HERE / "netns_relay.py"), "to-unix",
                                     f"127.0.0.1:{port}", sock]))

        stack = Stack(tools=[("render_invoice", "unkeyed", "20s", 'pool = "edge"\n')]).start()
        tool_port = _free_port()
        log = Path(tmp.name) / "tool.jsonl"
        log.touch()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE), os.environ.get("PYTHONPATH", "")])}
        procs.append(_start(netns + [sys.executable, str(HERE / "netns_worker.py"),
                                     f"127.0.0.1:{port}", "edge", stack.prefix, str(tool_port),
                                     str(log), stack.pool_key], env=env))

        # The gate's side cannot reach the tool: nothing listens on its port here.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", tool_port), timeout=5).close()

        client = stack.client()
        try:
            run = client.workflow(wf)
            first = run.call("render_invoice", {"order": "7781"}, timeout=90)
            assert first.ok, first
            assert first.output["rendered"] == "7781" and not first.deduplicated
            again = run.again(0, "render_invoice", {"order": "#7781"}, timeout=90)
            assert again.deduplicated and again.output == first.output
            second = run.call("render_invoice", {"order": "7781"}, timeout=90)
            assert second.ok and second.output["effect"] == 2
        finally:
            client.close()
        calls = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
        # Two steps, each served once (raw requests), each with its own key.
        assert len(calls) == 2, calls
        assert len({c["key"] for c in calls}) == 2
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()
        if stack is not None:
            stack.stop()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        tmp.cleanup()
