/**
 * The AI SDK adapter through the SDK's own loops — generateText, streamText and
 * ToolLoopAgent — with its mock language model, against a real stepgate.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { generateText, isStepCount, jsonSchema, streamText, ToolLoopAgent, type ModelMessage, type ToolSet } from "ai";

import { ChatSteps, MemoryChatStepStore, stepgateAgentCall, stepgateApproval, stepgateContext, stepgateTool } from "../src/ai.js";
import { StepgatePositionLost } from "../src/errors.js";
import { NOT_ANSWERED } from "../src/run.js";
import type { Transport } from "../src/transport.js";
import { Stack, eventually, freshWorkflow } from "./harness.js";
import { aiModel } from "./scripted.js";

const TITLE = jsonSchema<{ title: string }>({ type: "object", properties: { title: { type: "string" } }, required: ["title"] });
const echo = (out: unknown) => (out as { echo: unknown }).echo;

/** The SDK's three ways to run a tool loop: the adapter serves them alike. */
type Runner = "generateText" | "streamText" | "ToolLoopAgent";

interface Ran {
  text: string;
  content: Array<{ type: string; [k: string]: unknown }>;
  steps: Array<{ content: Array<{ type: string; [k: string]: unknown }> }>;
  /** The response's messages, to append to the chat. */
  messages: ModelMessage[];
}

/** One turn loop of a chat, as an app runs it with `runner`. */
async function runLoop(
  runner: Runner,
  s: { model: unknown; tools: ToolSet; chatId: string; messages: ModelMessage[]; toolApproval?: unknown; abortSignal?: AbortSignal },
): Promise<Ran> {
  const common = {
    model: s.model,
    tools: s.tools,
    stopWhen: isStepCount(10),
    ...(s.toolApproval ? { toolApproval: s.toolApproval } : {}),
  };
  const abort = s.abortSignal ? { abortSignal: s.abortSignal } : {};
  if (runner === "generateText") {
    const r = await generateText({ ...common, ...abort, toolsContext: stepgateContext(s.tools, s.chatId), messages: s.messages } as never);
    return { text: r.text, content: r.content as never, steps: r.steps as never, messages: r.response.messages };
  }
  if (runner === "streamText") {
    const r = streamText({ ...common, ...abort, toolsContext: stepgateContext(s.tools, s.chatId), messages: s.messages } as never);
    const text = await r.text;
    s.abortSignal?.throwIfAborted();
    return { text, content: (await r.content) as never, steps: (await r.steps) as never, messages: (await r.response).messages };
  }
  // One agent for every chat: each call names its chat.
  const agent = new ToolLoopAgent({ ...common, ...stepgateAgentCall(s.tools) } as never);
  const r = await agent.generate({ messages: s.messages, options: { chatId: s.chatId }, ...abort } as never);
  return { text: r.text, content: r.content as never, steps: r.steps as never, messages: r.response.messages };
}

let stack: Stack;
before(async () => {
  stack = await Stack.start();
});
after(async () => {
  await stack?.stop();
});

function aiTests(name: string, runner: Runner, connect: () => Promise<Transport>) {
  describe(`AI SDK ${runner} over ${name}`, () => {
    let client: Transport;
    before(async () => {
      client = await connect();
    });
    after(async () => {
      await client?.close();
    });

    /** One turn loop of a chat, as an app runs it. */
    async function chat(steps: ChatSteps, chatId: string, turns: Parameters<typeof aiModel>[0], tool = "create_ticket", messages?: ModelMessage[], timeoutMs?: number) {
      const tools = { [tool]: stepgateTool(client, steps, { name: tool, inputSchema: TITLE, ...(timeoutMs ? { timeoutMs } : {}) }) };
      const m = aiModel(turns);
      const result = await runLoop(runner, { model: m.model, tools, chatId, messages: messages ?? [{ role: "user", content: "go" }] });
      return { result, m };
    }

    test("the chat's calls are numbered in the app's chat store", async () => {
      const store = new MemoryChatStepStore();
      const steps = new ChatSteps(store, { workflowPrefix: "ts/" });
      const chatId = freshWorkflow("chat").slice(3);
      const { result, m } = await chat(steps, chatId, [[["create_ticket", { title: "one" }]], [["create_ticket", { title: "two" }]], "done"]);
      assert.equal(result.text, "done");
      assert.equal(store.rows.get(chatId)?.next_step, 2);
      const wf = steps.workflowId(chatId);
      assert.deepEqual(stack.tools.invocations("create_ticket", wf).map((c) => c.stepIndex).sort(), [0, 1]);
      assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "two" });
    });

    test("a rephrased retry after a lost answer runs nothing and gets the first answer", async () => {
      const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      const chatId = freshWorkflow("chat").slice(3);
      const wf = steps.workflowId(chatId);
      stack.tools.hold("slow");
      try {
        const { m } = await chat(
          steps,
          chatId,
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
          "slow",
          undefined,
          1500,
        );
        assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "Refund issued" });
        assert.equal(stack.tools.count("slow", wf), 1);
      } finally {
        stack.tools.release("slow");
      }
    });

    test("with inDoubtWaitMs, a call in doubt while stepgate asks the tool reaches the model settled", async () => {
      stack.tools.statuses.set("doubtful", 503);
      stack.tools.bodies.set("doubtful_lookup", { status: "executed", output: { fax_id: "F-7" } });
      const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      const chatId = freshWorkflow("chat").slice(3);
      const tools = { doubtful: stepgateTool(client, steps, { name: "doubtful", inDoubtWaitMs: 60_000 }) };
      const m = aiModel([[["doubtful", { to: "+331" }]], "done"]);
      const result = await runLoop(runner, { model: m.model, tools, chatId, messages: [{ role: "user", content: "fax it" }] });
      assert.equal(result.text, "done");
      assert.deepEqual(m.toolOutputs().at(-1), { fax_id: "F-7" });
      assert.equal(stack.tools.count("doubtful", steps.workflowId(chatId)), 1, "the tool ran once");
    });

    test("trimmed history: each new call runs", async () => {
      const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      const chatId = freshWorkflow("chat").slice(3);
      const first = await chat(steps, chatId, [[["create_ticket", { title: "same" }]], "done"]);
      // The app prunes the history to the new user message only.
      const trimmed: ModelMessage[] = [{ role: "user", content: "and another one" }];
      const second = await chat(steps, chatId, [[["create_ticket", { title: "same" }]], "done"], "create_ticket", trimmed);
      assert.equal(stack.tools.count("create_ticket", steps.workflowId(chatId)), 2);
      assert.notDeepEqual(second.m.toolOutputs(), []);
      assert.ok(first.result.text === "done" && second.result.text === "done");
    });

    test("a restart that resumes the chat's numbering: the retry of the lost call gets its answer", async () => {
      const store = new MemoryChatStepStore();
      const chatId = freshWorkflow("chat").slice(3);
      const dying = new ChatSteps(store, { workflowPrefix: "ts/" });
      const wf = dying.workflowId(chatId);
      stack.tools.hold("slow");
      try {
        const ac = new AbortController();
        const tools = { slow: stepgateTool(client, dying, { name: "slow", inputSchema: TITLE }) };
        const model = aiModel([[["slow", { title: "Refund issued" }]], "done"]).model;
        const run = runLoop(runner, { model, tools, chatId, messages: [{ role: "user", content: "go" }], abortSignal: ac.signal });
        await eventually(() => stack.tools.count("slow", wf) === 1, 30_000, "the call reached the tool");
        ac.abort(new Error("the process died")); // the process dies mid-call
        await assert.rejects(run, /the process died/);
        assert.deepEqual(store.rows.get(chatId)?.unanswered, { slow: [0] });
        stack.tools.release("slow");
        // A new process: the chat's numbering from the app's store.
        const resumed = new ChatSteps(store, { workflowPrefix: "ts/" });
        const { m } = await chat(resumed, chatId, [[["slow", { title: "Your refund was issued" }]], "done"], "slow");
        assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "Refund issued" });
        assert.equal(stack.tools.count("slow", wf), 1);
      } finally {
        stack.tools.release("slow");
      }
    });

    test("a restart without the chat's numbering refuses, and never shows an old answer", async () => {
      const chatId = freshWorkflow("chat").slice(3);
      const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      await chat(steps, chatId, [[["create_ticket", { title: "the first ticket" }]], "done"]);
      // The process restarts and the app lost the numbering (another store).
      const lost = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      const { m, result } = await chat(lost, chatId, [[["create_ticket", { title: "a brand new ticket" }]], [["create_ticket", { title: "and again" }]], "done"]);
      const errors = result.steps.flatMap((st) => st.content).filter((p) => p.type === "tool-error");
      assert.equal(errors.length, 2, "both calls refused");
      assert.ok(errors.every((e) => e.error instanceof StepgatePositionLost));
      assert.ok(!JSON.stringify(m.prompts).includes("the first ticket"), "the model never saw the old answer");
      assert.deepEqual(stack.tools.invocations("create_ticket", steps.workflowId(chatId)).map((c) => c.body), [{ title: "the first ticket" }]);
    });

    test("8 tool calls of one turn are inside the tool together", async () => {
      stack.tools.meet("meet", 8);
      const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
      const chatId = freshWorkflow("chat").slice(3);
      const calls: Array<[string, Record<string, unknown>]> = Array.from({ length: 8 }, (_, i) => ["meet", { title: String(i) }]);
      const { m } = await chat(steps, chatId, [calls, "done"], "meet");
      const outs = m.toolOutputs();
      assert.equal(outs.length, 8);
      for (const o of outs) assert.equal((o as { together: number }).together, 8);
    });
  });
}

for (const runner of ["generateText", "streamText", "ToolLoopAgent"] as const) aiTests("Kafka", runner, () => stack.client());
aiTests("MCP", "generateText", async () => {
  await stack.startMcp();
  return stack.mcpClient();
});

for (const runner of ["generateText", "streamText", "ToolLoopAgent"] as const) {
  describe(`AI SDK ${runner} tool approval`, () => {
    test("a held call is the SDK's approval request; approved in stepgate, the call runs once", async () => {
      const client = await stack.client();
      try {
        const steps = new ChatSteps(new MemoryChatStepStore(), { workflowPrefix: "ts/" });
        const chatId = freshWorkflow("chat").slice(3);
        const wf = steps.workflowId(chatId);
        const wire = stepgateTool(client, steps, { name: "wire_approved", inputSchema: jsonSchema<Record<string, unknown>>({ type: "object" }) });
        const tools = { wire };
        const m = aiModel([[["wire", { amount: 900 }]], "sent"]);
        const settings = { model: m.model, tools, chatId, toolApproval: stepgateApproval(client, steps, tools) };
        const messages: ModelMessage[] = [{ role: "user", content: "wire 900" }];
        const first = await runLoop(runner, { ...settings, messages });
        const request = first.content.find((p) => p.type === "tool-approval-request") as { approvalId: string; reason?: string } | undefined;
        assert.ok(request, `an approval request: ${JSON.stringify(first.content)}`);
        assert.match(request.reason ?? "", /stepgate approvals approve \S+ 0 wire_approved/);
        assert.equal(stack.tools.count("wire_approved", wf), 0);
        // A person approves in stepgate; the app answers the SDK's request.
        stack.approve(wf, 0, "wire_approved");
        messages.push(...first.messages, { role: "tool", content: [{ type: "tool-approval-response", approvalId: request.approvalId, approved: true }] });
        const second = await runLoop(runner, { ...settings, messages });
        assert.equal(second.text, "sent");
        assert.equal((m.toolOutputs().at(-1) as { tool: string }).tool, "wire_approved");
        assert.equal(stack.tools.count("wire_approved", wf), 1);
      } finally {
        await client.close();
      }
    });
  });
}
