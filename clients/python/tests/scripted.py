"""Scripted models for the frameworks' real runners, offline.

Agents SDK: a `Model` whose turns are given in advance (tool calls, then a
final text). LangGraph: a chat model whose turns are given in advance.

A tool call is `(name, args)`, with a random id, or `(name, args, id)` with the
id a model gives it — local and scripted models number their calls (`call_0`,
`call_1`, ...), so the same id comes from many conversations.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, List, Sequence, Tuple, Union

Turn = Union[str, Sequence[Union[Tuple[str, dict], Tuple[str, dict, str]]]]


def _call_id(call: tuple) -> str:
    return call[2] if len(call) > 2 else f"call-{uuid.uuid4().hex[:12]}"


def agents_model(turns: List[Turn]):
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    class Scripted(Model):
        def __init__(self) -> None:
            self.turns = list(turns)
            self.inputs: List[Any] = []

        async def get_response(self, system_instructions, input, model_settings, tools,
                               output_schema, handoffs, tracing, **kw):
            self.inputs.append(input)
            turn = self.turns.pop(0) if self.turns else "done"
            if isinstance(turn, str):
                output = [ResponseOutputMessage(
                    id=f"msg-{uuid.uuid4().hex[:8]}", type="message", role="assistant",
                    status="completed",
                    content=[ResponseOutputText(type="output_text", text=turn, annotations=[])])]
            else:
                output = []
                for call in turn:
                    name, args, cid = call[0], call[1], _call_id(call)
                    output.append(ResponseFunctionToolCall(
                        type="function_call", id=f"fc-{cid}", call_id=cid, name=name,
                        arguments=json.dumps(args), status="completed"))
            return ModelResponse(output=output, usage=Usage(), response_id=None)

        def stream_response(self, *a, **kw):  # pragma: no cover - not used
            raise NotImplementedError

        def tool_outputs(self) -> List[str]:
            """The tool outputs the model was shown (in its last input)."""
            last = self.inputs[-1] if self.inputs else []
            return [i["output"] for i in last
                    if isinstance(i, dict) and i.get("type") == "function_call_output"]

    return Scripted()


def langgraph_model(turns: List[Turn]):
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    def message(turn: Turn) -> AIMessage:
        if isinstance(turn, str):
            return AIMessage(content=turn)
        return AIMessage(content="", tool_calls=[
            {"id": _call_id(c), "name": c[0], "args": c[1], "type": "tool_call"} for c in turn])

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools, **kw):
            return self

    return Scripted(messages=iter([message(t) for t in turns]))
