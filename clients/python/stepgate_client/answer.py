"""stepgate's answers, typed: the Result v1 record (schemas/result.v1.json)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

if sys.version_info >= (3, 11):
    from typing import Literal, NotRequired, TypedDict
else:  # pragma: no cover - older interpreters
    from typing_extensions import Literal, NotRequired, TypedDict

#: The statuses of Result v1. A newer stepgate may add one: `Answer.status` is
#: then that string as sent.
Status = Literal["ok", "error", "in_doubt", "rejected"]

#: `error.kind` of a `rejected` answer to a call whose identity arguments
#: differ from the call recorded at its step.
IDENTITY_CONFLICT = "identity_conflict"

#: How many steps a workflow's call moves on past identity conflicts before it
#: returns the conflict itself (as the Rust client does).
MAX_CONFLICT_HOPS = 16


class ErrorV1(TypedDict):
    kind: str
    message: str


class InDoubtV1(TypedDict):
    """Result v1 `in_doubt` as it is on the wire (schemas/result.v1.json)."""

    version: int
    idempotency_key: str
    since: str
    settling: str
    learn: str
    until: NotRequired[str]


class ResultV1(TypedDict):
    """A Result v1 record as it is on the wire (JSON)."""

    workflow_id: str
    step_index: int
    tool: str
    attempt: int
    call_id: Optional[str]
    status: str
    deduplicated: bool
    completed_at: str
    output: NotRequired[Any]
    error: NotRequired[ErrorV1]
    in_doubt: NotRequired[InDoubtV1]


@dataclass(frozen=True)
class AnswerError:
    """Why a call did not succeed. `message` is written for a model to act on."""

    kind: str
    message: str


#: Who settles an in-doubt step (`InDoubt.settling`): a person (an operator,
#: `stepgate resolve` or the console), or stepgate's reconciler (it asks the
#: tool's lookup, until `InDoubt.until`; then a person).
PERSON = "person"
RECONCILER = "reconciler"


@dataclass(frozen=True)
class InDoubt:
    """Why and how an `in_doubt` answer will be settled (Result v1 `in_doubt`).

    `idempotency_key` is the key the call carried (look the call up by it at
    the provider); `since` when the step was declared in doubt; `settling`
    who settles it (`"person"` or `"reconciler"`); `until`, with the
    reconciler, when it stops asking the tool and leaves the step to a person.
    `learn` is how to learn the resolution: `"repeat_step"` — a repeat of the
    same step returns this answer until it is settled, then the settled one
    (`Client.wait_settled` does that, bounded). A newer stepgate may add
    fields: they are in `Answer.raw`.
    """

    version: int
    idempotency_key: str
    since: str
    settling: str
    learn: str = "repeat_step"
    until: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "InDoubt":
        until = d.get("until")
        return cls(
            version=int(d.get("version", 1) or 1),
            idempotency_key=str(d.get("idempotency_key", "")),
            since=str(d.get("since", "")),
            settling=str(d.get("settling", PERSON)),
            learn=str(d.get("learn", "repeat_step")),
            until=str(until) if until is not None else None,
        )


@dataclass(frozen=True)
class Answer:
    """The one answer of a step (Result v1).

    `output` is the tool's answer when `status == "ok"`; `error` is set for every
    other status. `deduplicated` is False only for the call that ran the tool.
    `in_doubt` (with `status == "in_doubt"`) says who settles the step and how
    to learn the resolution, for a program (`error.message` says the same to a
    model). `to_dict()` gives the record exactly as stepgate wrote it.
    """

    workflow_id: str
    step_index: int
    tool: str
    attempt: int
    call_id: Optional[str]
    status: str
    deduplicated: bool
    completed_at: str
    output: Any = None
    error: Optional[AnswerError] = None
    in_doubt: Optional[InDoubt] = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def identity_conflict(self) -> bool:
        """The call named another call than the one recorded at its step (the
        tool's identity arguments differ): not run, not given that answer."""
        return self.status == "rejected" and self.error is not None and \
            self.error.kind == IDENTITY_CONFLICT

    @property
    def settled(self) -> bool:
        """Not in doubt: the step's answer is final (or it was refused)."""
        return self.status != "in_doubt"

    @property
    def reconciling(self) -> bool:
        """In doubt, and stepgate is asking the tool what happened: a repeat of
        the step soon returns the resolution (`Client.wait_settled`)."""
        return self.status == "in_doubt" and self.in_doubt is not None and \
            self.in_doubt.settling == RECONCILER

    def to_dict(self) -> Dict[str, Any]:
        """The Result v1 record as received (a copy)."""
        return dict(self.raw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Answer":
        err = d.get("error")
        error = None
        if isinstance(err, Mapping):
            error = AnswerError(kind=str(err.get("kind", "")), message=str(err.get("message", "")))
        doubt = d.get("in_doubt")
        in_doubt = InDoubt.from_dict(doubt) if isinstance(doubt, Mapping) else None
        return cls(
            workflow_id=str(d.get("workflow_id", "")),
            step_index=int(d.get("step_index", 0) or 0),
            tool=str(d.get("tool", "")),
            attempt=int(d.get("attempt", 0) or 0),
            call_id=d.get("call_id"),
            status=str(d.get("status", "")),
            deduplicated=bool(d.get("deduplicated", False)),
            completed_at=str(d.get("completed_at", "")),
            output=d.get("output"),
            error=error,
            in_doubt=in_doubt,
            raw=dict(d),
        )


def answer_text(answer: "Answer | Mapping[str, Any]") -> str:
    """stepgate's answer as a tool's output for a model: the output's JSON when
    ok, else the status and stepgate's model-readable message."""
    if not isinstance(answer, Answer):
        answer = Answer.from_dict(answer)
    if answer.ok:
        return json.dumps(answer.output)
    message = answer.error.message if answer.error else ""
    return f"{answer.status}: {message}"
