/** The LangGraph.js adapter through LangGraph's own runner (StateGraph, ToolNode, a checkpointer), with a scripted model node. */
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { AIMessage, RemoveMessage, type BaseMessage } from "@langchain/core/messages";
import { Command, END, MemorySaver, START, StateGraph } from "@langchain/langgraph";
import { ToolNode, toolsCondition } from "@langchain/langgraph/prebuilt";

import { StepgateAnnotation, stepgateMiddleware, stepgateTool } from "../src/langgraph.js";
import { NOT_ANSWERED } from "../src/run.js";
import type { Transport } from "../src/transport.js";
import { Stack } from "./harness.js";

type Turn = string | Array<[string, Record<string, unknown>]> | ((messages: BaseMessage[]) => string | Array<[string, Record<string, unknown>]>);

const TITLE = { type: "object", properties: { title: { type: "string" } }, required: ["title"] };

let stack: Stack;
before(async () => {
  stack = await Stack.start();
});
after(async () => {
  await stack?.stop();
});

/** A graph: a scripted model node, a ToolNode with stepgate's tools, a checkpointer. */
function graph(client: Transport, names: string[], turns: Turn[], checkpointer = new MemorySaver(), timeoutMs?: number) {
  const queue = [...turns];
  const seen: BaseMessage[][] = [];
  const tools = new ToolNode(names.map((name) => stepgateTool(client, { name, description: `The ${name} tool.`, schema: TITLE, ...(timeoutMs ? { timeoutMs } : {}) })));
  const g = new StateGraph(StepgateAnnotation)
    .addNode("agent", (state) => {
      seen.push(state.messages);
      let turn = queue.shift() ?? "done";
      if (typeof turn === "function") turn = turn(state.messages);
      if (typeof turn === "string") return { messages: [new AIMessage(turn)] };
      return { messages: [new AIMessage({ content: "", tool_calls: turn.map(([name, args]) => ({ id: `call-${randomUUID().slice(0, 12)}`, name, args, type: "tool_call" as const })) })] };
    })
    .addNode("tools", tools)
    .addEdge(START, "agent")
    .addConditionalEdges("agent", toolsCondition, ["tools", END])
    .addEdge("tools", "agent")
    .compile({ checkpointer });
  return { g, seen, checkpointer, queue };
}

const lastToolText = (messages: BaseMessage[]) => {
  const tool = [...messages].reverse().find((m) => m.getType() === "tool");
  return String(tool?.content ?? "");
};
const echo = (text: string) => (JSON.parse(text) as { echo: unknown }).echo;

function workflowsOf(thread: string) {
  return [...new Set(stack.tools.calls.filter((c) => (c.workflowId.startsWith(`${thread}/`) || c.workflowId.startsWith(`${thread}@`))).map((c) => c.workflowId))];
}

describe("LangGraph.js over Kafka", () => {
  let client: Transport;
  before(async () => {
    client = await stack.client();
  });
  after(async () => {
    await client?.close();
  });

  test("trimmed history: the counter is in the channel, each new call runs", async () => {
    const thread = `lg-${randomUUID().slice(0, 8)}`;
    const { g } = graph(client, ["create_ticket"], [[["create_ticket", { title: "same" }]], "done", [["create_ticket", { title: "same" }]], "done"]);
    const config = { configurable: { thread_id: thread } };
    const first = await g.invoke({ messages: [{ role: "user", content: "open one" }] }, config);
    // Trim the whole history, then ask again.
    await g.updateState(config, { messages: first.messages.map((m: BaseMessage) => new RemoveMessage({ id: m.id! })) });
    await g.invoke({ messages: [{ role: "user", content: "open another" }] }, config);
    const wfs = workflowsOf(thread);
    assert.equal(wfs.length, 1);
    assert.deepEqual(stack.tools.invocations("create_ticket", wfs[0]).map((c) => c.stepIndex), [0, 1]);
  });

  test("a rephrased retry after a lost answer runs nothing and gets the first answer", async () => {
    const thread = `lg-${randomUUID().slice(0, 8)}`;
    stack.tools.hold("slow");
    try {
      const { g } = graph(
        client,
        ["slow"],
        [
          [["slow", { title: "Refund issued" }]],
          (messages) => {
            assert.equal(lastToolText(messages), NOT_ANSWERED);
            stack.tools.release("slow");
            return [["slow", { title: "Your refund was issued" }]];
          },
          "done",
        ],
        new MemorySaver(),
        1500,
      );
      const out = await g.invoke({ messages: [{ role: "user", content: "go" }] }, { configurable: { thread_id: thread } });
      assert.deepEqual(echo(lastToolText(out.messages)), { title: "Refund issued" });
      assert.equal(stack.tools.count("slow", workflowsOf(thread)[0]), 1);
    } finally {
      stack.tools.release("slow");
    }
  });

  test("a fork from an older checkpoint is a new lineage: its new call runs, never the old branch's answer", async () => {
    const thread = `lg-${randomUUID().slice(0, 8)}`;
    const { g } = graph(client, ["create_ticket"], [
      [["create_ticket", { title: "old branch, first" }]],
      [["create_ticket", { title: "old branch, second" }]],
      "done",
      [["create_ticket", { title: "new branch" }]],
      "done",
    ]);
    const config = { configurable: { thread_id: thread } };
    await g.invoke({ messages: [{ role: "user", content: "go" }] }, config);
    // Time travel: back to the checkpoint after the first call's answer, on from there.
    const history = [];
    for await (const s of g.getStateHistory(config)) history.push(s);
    const afterFirst = history.find((s) => s.next.includes("agent") && s.values.messages?.length === 3)!;
    assert.ok(afterFirst, "the checkpoint after the first call's answer");
    const out = await g.invoke(null, afterFirst.config);
    // The fork's call is its own: run, with its own answer (not the old branch's second call's).
    assert.deepEqual(echo(lastToolText(out.messages)), { title: "new branch" });
    const wfs = workflowsOf(thread);
    assert.equal(wfs.length, 2, `two lineages: ${wfs}`);
    assert.deepEqual(
      stack.tools.calls.filter((c) => wfs.includes(c.workflowId)).map((c) => (c.body as { title: string }).title),
      ["old branch, first", "old branch, second", "new branch"],
    );
  });

  test("a thread restarted without its checkpoints never gets an old answer: a new lineage", async () => {
    const thread = `lg-${randomUUID().slice(0, 8)}`;
    const config = { configurable: { thread_id: thread } };
    await graph(client, ["create_ticket"], [[["create_ticket", { title: "the first ticket" }]], "done"]).g.invoke({ messages: [{ role: "user", content: "go" }] }, config);
    // The checkpointer was lost: a fresh one, the same thread id.
    const out = await graph(client, ["create_ticket"], [[["create_ticket", { title: "a brand new ticket" }]], "done"]).g.invoke({ messages: [{ role: "user", content: "go" }] }, config);
    assert.deepEqual(echo(lastToolText(out.messages)), { title: "a brand new ticket" });
    assert.equal(workflowsOf(thread).length, 2);
  });

  test("a held call is an interrupt(); approved in stepgate and resumed, it runs once", async () => {
    const thread = `lg-${randomUUID().slice(0, 8)}`;
    const config = { configurable: { thread_id: thread } };
    const { g } = graph(client, ["wire_approved"], [[["wire_approved", { title: "900" }]], "sent"]);
    const first = await g.invoke({ messages: [{ role: "user", content: "wire" }] }, config);
    const interrupts = (first as { __interrupt__?: Array<{ value: { workflow_id: string; step_index: number; approve: string } }> }).__interrupt__;
    assert.equal(interrupts?.length, 1, JSON.stringify(first));
    const held = interrupts![0]!.value;
    assert.match(held.approve, /stepgate approvals approve/);
    assert.equal(stack.tools.count("wire_approved", held.workflow_id), 0);
    stack.approve(held.workflow_id, held.step_index, "wire_approved");
    const second = await g.invoke(new Command({ resume: "approved" }), config);
    assert.equal((JSON.parse(lastToolText(second.messages)) as { tool: string }).tool, "wire_approved");
    assert.equal(stack.tools.count("wire_approved", held.workflow_id), 1);
  });
});

describe("LangChain v1 createAgent with stepgate's middleware", () => {
  test("every tool call goes through stepgate, numbered in the agent's stepgate channel; the local tool body never runs", async () => {
    const client = await stack.client();
    try {
      const { createAgent } = await import("langchain");
      const { tool } = await import("@langchain/core/tools");
      const { BaseChatModel } = await import("@langchain/core/language_models/chat_models");
      const { z } = await import("zod");
      let localRuns = 0;
      const createTicket = tool(
        async () => {
          localRuns++;
          return "the local body ran";
        },
        { name: "create_ticket", description: "Open a support ticket.", schema: z.object({ title: z.string() }) },
      );
      const call = (title: string) => new AIMessage({ content: "", tool_calls: [{ id: `call-${randomUUID().slice(0, 12)}`, name: "create_ticket", args: { title }, type: "tool_call" }] });
      // A scripted chat model: its turns in order, whatever tools it is bound to.
      const turns = [call("one"), call("two"), new AIMessage("done")];
      class Scripted extends BaseChatModel {
        _llmType() {
          return "scripted";
        }
        override bindTools() {
          return this as never;
        }
        async _generate() {
          const message = turns.shift() ?? new AIMessage("done");
          return { generations: [{ message, text: String(message.content) }] };
        }
      }
      const model = new Scripted({});
      const agent = createAgent({ model, tools: [createTicket], middleware: [await stepgateMiddleware(client)], checkpointer: new MemorySaver() });
      const thread = `lg-${randomUUID().slice(0, 8)}`;
      const out = await agent.invoke({ messages: [{ role: "user", content: "open two tickets" }] }, { configurable: { thread_id: thread } });
      assert.equal(localRuns, 0);
      const wfs = workflowsOf(thread);
      assert.equal(wfs.length, 1, `one workflow: ${wfs}`);
      assert.deepEqual(stack.tools.invocations("create_ticket", wfs[0]).map((c) => [c.stepIndex, (c.body as { title: string }).title]), [[0, "one"], [1, "two"]]);
      assert.deepEqual(echo(lastToolText(out.messages as BaseMessage[])), { title: "two" });
    } finally {
      await client.close();
    }
  });
});
