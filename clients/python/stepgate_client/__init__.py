"""The Python client of stepgate: publish a tool call as an intent, get its one answer.

A call is identified by where it came from — its step key (workflow_id,
step_index, tool, attempt) — never by its arguments: a retry the model
rephrased is the same step and gets the first answer back.

Distributed on PyPI as `stepgate-client`; imported as `stepgate_client` (the
PyPI name `stepgate` belongs to an unrelated project, and a distinct import name
keeps the two from overwriting each other's files if both get installed).
"""

__version__ = "0.2.0"

from .answer import (
    PERSON,
    RECONCILER,
    Answer,
    AnswerError,
    InDoubt,
    InDoubtV1,
    ResultV1,
    Status,
    answer_text,
)
from .client import (
    AsyncClient,
    AsyncWorkflow,
    Client,
    StepgateAwaitingApproval,
    StepgateClosed,
    StepgateError,
    StepgatePublishError,
    StepgateTimeout,
    StepgateTopicError,
    Workflow,
    await_settled,
    hop_call_id,
    murmur2,
    new_call_id,
    partition_for,
    topic_names,
    wait_settled,
)

__all__ = [
    "PERSON",
    "RECONCILER",
    "Answer",
    "AnswerError",
    "AsyncClient",
    "AsyncWorkflow",
    "Client",
    "InDoubt",
    "InDoubtV1",
    "ResultV1",
    "Status",
    "StepgateAwaitingApproval",
    "StepgateClosed",
    "StepgateError",
    "StepgatePublishError",
    "StepgateTimeout",
    "StepgateTopicError",
    "Workflow",
    "__version__",
    "answer_text",
    "await_settled",
    "hop_call_id",
    "murmur2",
    "new_call_id",
    "partition_for",
    "topic_names",
    "wait_settled",
]
