"""The package's own tests run against a real broker and a real `stepgate run`
(see harness.py for the environment they need)."""

from __future__ import annotations

import uuid

import pytest

from harness import REPO, Stack, brokers, wait_for  # noqa: F401  (re-exported to tests)


@pytest.fixture(scope="session")
def stack():
    """One stepgate for the session (4 intents and 4 results partitions)."""
    s = Stack().start()
    yield s
    s.stop()


@pytest.fixture
def wf(request) -> str:
    """A workflow id of this test's own."""
    return f"{request.node.name[:60]}-{uuid.uuid4().hex[:8]}"
