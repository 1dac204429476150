"""One life of an Agents SDK conversation in a process of its own (the tests
kill it, or let it finish), resumed through its SQLiteSession:

    python3 agents_life.py '<json>'

with `brokers`, `intents`, `results`, `db` (the session's SQLite file),
`session_id`, `agent` and `turns` (the scripted model's turns). Prints one JSON
line: the final output and the tool outputs the model was shown.
"""

from __future__ import annotations

import asyncio
import json
import sys

from agents import Agent, Runner, SQLiteSession, set_tracing_disabled

from scripted import agents_model
from stepgate_client import AsyncClient
from stepgate_client.openai_agents import SessionSteps, stepgate_tool

TITLE = {"type": "object", "properties": {"title": {"type": "string"}},
         "required": ["title"], "additionalProperties": False}


async def main(cfg: dict) -> None:
    set_tracing_disabled(True)
    session = SQLiteSession(cfg["session_id"], cfg["db"])
    async with await AsyncClient.connect(cfg["brokers"], intents=cfg["intents"],
                                         results=cfg["results"]) as client:
        tools = [stepgate_tool(client, t, f"The {t} tool.", TITLE)
                 for t in sorted({name for turn in cfg["turns"] if not isinstance(turn, str)
                                  for name, _ in turn})]
        model = agents_model([t if isinstance(t, str) else [tuple(c) for c in t]
                              for t in cfg["turns"]])
        result = await Runner.run(Agent(name=cfg["agent"], model=model, tools=tools), "go on",
                                  session=session, context=SessionSteps(session))
    print(json.dumps({"final": result.final_output, "outputs": model.tool_outputs()}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
