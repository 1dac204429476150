/** The Mastra adapter through Mastra's own Agent, with Mastra's test model and memory, against a real stepgate. */
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { Agent } from "@mastra/core/agent";
import { Mastra } from "@mastra/core/mastra";
import { InMemoryStore } from "@mastra/core/storage";
import { Memory } from "@mastra/memory";

import type { KafkaClient } from "../src/kafka.js";
import { stepgateTool, ThreadSteps, type StepgateHeld } from "../src/mastra.js";
import { NOT_ANSWERED, type StepRunState } from "../src/run.js";
import { Stack, eventually } from "./harness.js";
import { mastraModel, type Turn } from "./scripted.js";

const TITLE = { type: "object", properties: { title: { type: "string" } }, required: ["title"] };
const echo = (out: unknown) => (out as { echo: unknown }).echo;

let stack: Stack;
let client: KafkaClient;
before(async () => {
  stack = await Stack.start();
  client = await stack.client();
});
after(async () => {
  await client?.close();
  await stack?.stop();
});

/** A fresh memory thread: (resource, thread). */
const freshThread = () => ({ resource: `user-${randomUUID().slice(0, 8)}`, thread: `thread-${randomUUID().slice(0, 12)}` });

/**
 * An app's Mastra: one agent with stepgate tools and a memory, on `storage`
 * (the app's database; a second `app()` on the same storage is another
 * process of the same app).
 */
function app(storage: InMemoryStore, turns: Turn[], tools: string[], options: { lastMessages?: number; timeoutMs?: number } = {}) {
  const steps = new ThreadSteps();
  const m = mastraModel(turns);
  const agent = new Agent({
    id: "support",
    name: "support",
    instructions: "Help the user.",
    model: m.model as never,
    tools: Object.fromEntries(
      tools.map((name) => [name, stepgateTool(client, steps, { name, inputSchema: TITLE, ...(options.timeoutMs ? { timeoutMs: options.timeoutMs } : {}) })]),
    ),
    memory: new Memory(options.lastMessages ? { options: { lastMessages: options.lastMessages } } : {}),
  });
  const mastra = new Mastra({ agents: { support: agent }, storage, logger: false });
  return { agent: mastra.getAgent("support"), steps, m };
}

/** The thread's numbering as Mastra's storage holds it. */
async function saved(storage: InMemoryStore, thread: string): Promise<StepRunState | undefined> {
  const memory = await storage.getStore("memory");
  const row = await memory!.getThreadById({ threadId: thread });
  return row?.metadata?.stepgate as StepRunState | undefined;
}

describe("Mastra over Kafka", () => {
  test("the thread's calls are numbered in its metadata in Mastra's storage", async () => {
    const storage = new InMemoryStore();
    const { resource, thread } = freshThread();
    const { agent, steps, m } = app(storage, [[["create_ticket", { title: "one" }]], [["create_ticket", { title: "two" }]], "done"], ["create_ticket"]);
    const out = await agent.generate("go", { memory: { resource, thread } });
    assert.equal(out.text, "done");
    const wf = steps.workflowId(resource, thread);
    assert.deepEqual(await saved(storage, thread), { workflow_id: wf, next_step: 2, unanswered: {} });
    assert.deepEqual(stack.tools.invocations("create_ticket", wf).map((c) => c.stepIndex).sort(), [0, 1]);
    assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "two" });
  });

  test("a rephrased retry after a lost answer runs nothing and gets the first answer", async () => {
    const storage = new InMemoryStore();
    const { resource, thread } = freshThread();
    stack.tools.hold("slow");
    try {
      const { agent, steps, m } = app(
        storage,
        [
          [["slow", { title: "Refund issued" }]],
          (outputs) => {
            // The model read "not answered yet" and retries, rephrased.
            assert.equal(outputs.at(-1), NOT_ANSWERED);
            stack.tools.release("slow");
            return [["slow", { title: "Your refund was issued" }]];
          },
          "done",
        ],
        ["slow"],
        { timeoutMs: 1500 },
      );
      await agent.generate("refund me", { memory: { resource, thread } });
      assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "Refund issued" });
      assert.equal(stack.tools.count("slow", steps.workflowId(resource, thread)), 1);
    } finally {
      stack.tools.release("slow");
    }
  });

  test("a memory window that drops the earlier calls, and a new thread: each new call runs", async () => {
    const storage = new InMemoryStore();
    const { resource, thread } = freshThread();
    const same = (): Turn[] => [[["create_ticket", { title: "same" }]], "done"];
    // The model sees only the last message of the thread's history.
    const first = app(storage, same(), ["create_ticket"], { lastMessages: 1 });
    await first.agent.generate("a ticket please", { memory: { resource, thread } });
    const second = app(storage, same(), ["create_ticket"], { lastMessages: 1 });
    await second.agent.generate("and another one", { memory: { resource, thread } });
    assert.ok(!JSON.stringify(second.m.prompts[0]).includes("a ticket please"), "the window dropped the first turn");
    const wf = first.steps.workflowId(resource, thread);
    assert.equal(stack.tools.count("create_ticket", wf), 2);
    // The same user opens a new thread: a numbering of its own.
    const other = `thread-${randomUUID().slice(0, 12)}`;
    const third = app(storage, same(), ["create_ticket"]);
    await third.agent.generate("a ticket please", { memory: { resource, thread: other } });
    assert.deepEqual(echo(third.m.toolOutputs().at(-1)), { title: "same" });
    assert.equal(stack.tools.count("create_ticket", third.steps.workflowId(resource, other)), 1);
  });

  test("a restart that resumes the thread's numbering: the retry of the lost call gets its answer", async () => {
    const storage = new InMemoryStore(); // the app's database: it outlives the process
    const { resource, thread } = freshThread();
    stack.tools.hold("slow");
    try {
      const dying = app(storage, [[["slow", { title: "Refund issued" }]], "done"], ["slow"]);
      const wf = dying.steps.workflowId(resource, thread);
      const ac = new AbortController();
      const run = dying.agent.generate("refund me", { memory: { resource, thread }, abortSignal: ac.signal });
      await eventually(() => stack.tools.count("slow", wf) === 1, 30_000, "the call reached the tool");
      ac.abort(new Error("the process died")); // the process dies mid-call
      await run.catch(() => undefined);
      assert.deepEqual((await saved(storage, thread))?.unanswered, { slow: [0] });
      stack.tools.release("slow");
      // A new process of the same app: the thread's numbering from storage.
      const resumed = app(storage, [[["slow", { title: "Your refund was issued" }]], "done"], ["slow"]);
      await resumed.agent.generate("did it work?", { memory: { resource, thread } });
      assert.deepEqual(echo(resumed.m.toolOutputs().at(-1)), { title: "Refund issued" });
      assert.equal(stack.tools.count("slow", wf), 1);
    } finally {
      stack.tools.release("slow");
    }
  });

  test("a restart without the thread's numbering refuses, and never shows an old answer", async () => {
    const { resource, thread } = freshThread();
    const first = app(new InMemoryStore(), [[["create_ticket", { title: "the first ticket" }]], "done"], ["create_ticket"]);
    await first.agent.generate("a ticket", { memory: { resource, thread } });
    // The process restarts on a storage that lost the thread (a wiped database).
    const lost = app(new InMemoryStore(), [[["create_ticket", { title: "a brand new ticket" }]], [["create_ticket", { title: "and again" }]], "done"], [
      "create_ticket",
    ]);
    const out = await lost.agent.generate("another ticket", { memory: { resource, thread } });
    assert.ok(!JSON.stringify(lost.m.prompts).includes("the first ticket"), "the model never saw the old answer");
    const refused = lost.m.toolOutputs().filter((o) => typeof o === "string" && o.includes("was already used by another run"));
    assert.equal(refused.length, 2, `both calls refused: ${JSON.stringify(lost.m.toolOutputs())}`);
    assert.deepEqual(stack.tools.invocations("create_ticket", first.steps.workflowId(resource, thread)).map((c) => c.body), [{ title: "the first ticket" }]);
    assert.equal(out.text, "done");
  });

  test("a held call suspends the run; approved in stepgate, the resumed call runs once", async () => {
    const storage = new InMemoryStore();
    const { resource, thread } = freshThread();
    const { agent, steps, m } = app(storage, [[["wire_approved", { title: "wire 900" }]], "sent"], ["wire_approved"]);
    const wf = steps.workflowId(resource, thread);
    const first = await agent.generate("wire 900", { memory: { resource, thread } });
    assert.equal(first.finishReason, "suspended", JSON.stringify(first.suspendPayload));
    const held = (first.suspendPayload as { suspendPayload: StepgateHeld }).suspendPayload;
    assert.equal(held.stepgate, "awaiting_approval");
    assert.deepEqual([held.workflow_id, held.step_index, held.tool], [wf, 0, "wire_approved"]);
    assert.match(held.approve, /^stepgate approvals approve \S+ 0 wire_approved/);
    assert.equal(stack.tools.count("wire_approved", wf), 0);
    // A person approves in stepgate; the app resumes the run.
    stack.approve(wf, 0, "wire_approved");
    const second = await agent.resumeGenerate({}, { runId: first.runId!, memory: { resource, thread } });
    assert.equal(second.text, "sent");
    assert.equal((m.toolOutputs().at(-1) as { tool: string }).tool, "wire_approved");
    assert.equal(stack.tools.count("wire_approved", wf), 1);
  });

  test("8 tool calls of one turn are inside the tool together", async () => {
    stack.tools.meet("meet", 8);
    const { resource, thread } = freshThread();
    const calls: Array<[string, Record<string, unknown>]> = Array.from({ length: 8 }, (_, i) => ["meet", { title: String(i) }]);
    const { agent, m } = app(new InMemoryStore(), [calls, "done"], ["meet"]);
    await agent.generate("go", { memory: { resource, thread } });
    const outs = m.toolOutputs();
    assert.equal(outs.length, 8);
    for (const o of outs) assert.equal((o as { together: number }).together, 8);
  });
});
