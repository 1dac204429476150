"""The quick starts of README.md's Python section, docs/agents.md's Python
client and clients/python/README.md run as written, against a running stepgate: only the broker's topics (the
stack's own) and the workflow id (this test's own) are swapped in."""

from __future__ import annotations

import re

import pytest

from harness import REPO


def first_python_block(path, after: str) -> str:
    text = path.read_text()
    start = text.index(after)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {after!r} in {path}"
    return m.group(1)


@pytest.mark.parametrize("readme,after", [
    ("clients/python/README.md", "# stepgate-client"),
    ("README.md", "**Python** — the client in"),
    ("docs/agents.md", "pip install ./clients/python"),
])
def test_the_quick_start_runs_as_written(stack, wf, readme, after, capsys):
    code = first_python_block(REPO / readme, after)
    assert 'Client("127.0.0.1:9092")' in code and '"support-thread-42"' in code
    code = code.replace(
        'Client("127.0.0.1:9092")',
        f'Client({stack.brokers!r}, intents={stack.intents!r}, results={stack.results!r})',
    ).replace('"support-thread-42"', repr(wf))
    scope: dict = {}
    exec(compile(code, f"{readme} quick start", "exec"), scope)
    scope["client"].close()
    assert scope["answer"].ok
    assert stack.tools.count("create_ticket", wf) == 1
    assert capsys.readouterr().out.startswith("ok ")
