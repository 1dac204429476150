/** The OpenAI Agents JS adapter through the SDK's own Runner, with a scripted model, against a real stepgate. */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Agent, MCPServerStreamableHttp, Runner, RunState, setTracingDisabled } from "@openai/agents";

import { StepgatePositionLost } from "../src/errors.js";
import { McpStepHooks, stepgateTool } from "../src/openai-agents.js";
import { NOT_ANSWERED, StepRun, type StepRunState } from "../src/run.js";
import type { Transport } from "../src/transport.js";
import { MCP_TOKEN, Stack, eventually, freshWorkflow } from "./harness.js";
import { agentsModel, type Turn } from "./scripted.js";

setTracingDisabled(true);

const TITLE = { type: "object" as const, properties: { title: { type: "string" } }, required: ["title"], additionalProperties: false };
const echo = (text: string | undefined) => (JSON.parse(text ?? "null") as { echo: unknown }).echo;

/** The run failed with StepgatePositionLost (the SDK wraps a tool's error: `cause` or `error`). */
function causedByPositionLost(e: unknown): true {
  let c: unknown = e;
  for (let i = 0; c && i < 10 && !(c instanceof StepgatePositionLost); i++) c = (c as { cause?: unknown; error?: unknown }).cause ?? (c as { error?: unknown }).error;
  assert.ok(c instanceof StepgatePositionLost, String(e));
  return true;
}

/** An app's own run context, with stepgate's numbering as one property. */
interface AppContext {
  user: string;
  stepgate: StepRun;
}

let stack: Stack;
before(async () => {
  stack = await Stack.start();
});
after(async () => {
  await stack?.stop();
});

function agentsTests(name: string, connect: () => Promise<Transport>) {
  describe(`OpenAI Agents JS over ${name}`, () => {
    let client: Transport;
    const runner = new Runner();
    before(async () => {
      client = await connect();
    });
    after(async () => {
      await client?.close();
    });

    const agent = (tool: string, turns: Turn[], timeoutMs?: number) => {
      const m = agentsModel(turns);
      const a = new Agent({ name: "support", model: m.model as never, tools: [stepgateTool(client, { name: tool, description: `The ${tool} tool.`, parameters: TITLE, ...(timeoutMs ? { timeoutMs } : {}) })] });
      return { a, m };
    };

    test("the steps are numbered in the app's own run context", async () => {
      const wf = freshWorkflow();
      const ctx: AppContext = { user: "u-1", stepgate: new StepRun(wf) };
      const { a, m } = agent("create_ticket", [[["create_ticket", { title: "one" }]], [["create_ticket", { title: "two" }]], "done"]);
      const result = await runner.run(a, "open two tickets", { context: ctx });
      assert.equal(result.finalOutput, "done");
      assert.equal(ctx.stepgate.nextStep, 2);
      assert.deepEqual(stack.tools.invocations("create_ticket", wf).map((c) => c.stepIndex).sort(), [0, 1]);
      assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "two" });
    });

    test("a rephrased retry after a lost answer runs nothing and gets the first answer", async () => {
      const wf = freshWorkflow();
      stack.tools.hold("slow");
      try {
        const { a, m } = agent(
          "slow",
          [
            [["slow", { title: "Refund issued" }]],
            (outputs) => {
              assert.equal(outputs.at(-1), NOT_ANSWERED);
              stack.tools.release("slow");
              return [["slow", { title: "Your refund was issued" }]];
            },
            "done",
          ],
          1500,
        );
        await runner.run(a, "go", { context: new StepRun(wf) });
        assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "Refund issued" });
        assert.equal(stack.tools.count("slow", wf), 1);
      } finally {
        stack.tools.release("slow");
      }
    });

    test("compacted history: the next run's new call runs", async () => {
      const wf = freshWorkflow();
      const steps = new StepRun(wf);
      await runner.run(agent("create_ticket", [[["create_ticket", { title: "same" }]], "done"]).a, "open one", { context: steps });
      // The conversation was compacted to a summary; the numbering is in the context.
      await runner.run(agent("create_ticket", [[["create_ticket", { title: "same" }]], "done"]).a, "summary: one ticket open. open another", { context: steps });
      assert.equal(stack.tools.count("create_ticket", wf), 2);
    });

    test("a run that died mid-call resumes from its saved numbering and the retry gets the answer", async () => {
      const wf = freshWorkflow();
      let saved: StepRunState | undefined;
      stack.tools.hold("slow");
      try {
        const ac = new AbortController();
        const dying = runner.run(agent("slow", [[["slow", { title: "Refund issued" }]], "done"]).a, "go", {
          context: new StepRun(wf, { save: (s) => void (saved = JSON.parse(JSON.stringify(s))) }),
          signal: ac.signal,
        });
        await eventually(() => stack.tools.count("slow", wf) === 1, 30_000, "the call reached the tool");
        ac.abort(); // the process dies
        await assert.rejects(dying);
        assert.deepEqual(saved?.unanswered, { slow: [0] });
        stack.tools.release("slow");
        const { a, m } = agent("slow", [[["slow", { title: "Your refund was issued" }]], "done"]);
        await runner.run(a, "go on", { context: StepRun.resume(saved!) });
        assert.deepEqual(echo(m.toolOutputs().at(-1)), { title: "Refund issued" });
        assert.equal(stack.tools.count("slow", wf), 1);
      } finally {
        stack.tools.release("slow");
      }
    });

    test("a run restarted without its numbering refuses and never gets an old answer", async () => {
      const wf = freshWorkflow();
      await runner.run(agent("create_ticket", [[["create_ticket", { title: "the first ticket" }]], "done"]).a, "go", { context: new StepRun(wf) });
      const { a, m } = agent("create_ticket", [[["create_ticket", { title: "a brand new ticket" }]], "done"]);
      await assert.rejects(runner.run(a, "go", { context: new StepRun(wf) }), (e: unknown) => causedByPositionLost(e));
      assert.equal(m.inputs.length, 1, "the model was never shown the old answer");
      assert.deepEqual(stack.tools.invocations("create_ticket", wf).map((c) => c.body), [{ title: "the first ticket" }]);
    });

    test("8 tool calls of one turn are inside the tool together", async () => {
      stack.tools.meet("meet", 8);
      const wf = freshWorkflow();
      const calls: Array<[string, Record<string, unknown>]> = Array.from({ length: 8 }, (_, i) => ["meet", { title: String(i) }]);
      const { a, m } = agent("meet", [calls, "done"]);
      await runner.run(a, "go", { context: new StepRun(wf) });
      const outs = m.toolOutputs();
      assert.equal(outs.length, 8);
      for (const o of outs) assert.equal((JSON.parse(o) as { together: number }).together, 8);
    });
  });
}

agentsTests("Kafka", () => stack.client());
agentsTests("MCP", async () => {
  await stack.startMcp();
  return stack.mcpClient();
});

describe("OpenAI Agents JS approvals", () => {
  test("a held call is an interruption; the numbering travels in RunState; approved in stepgate, the call runs once", async () => {
    const client = await stack.client();
    try {
      const wf = freshWorkflow();
      const wire = stepgateTool(client, { name: "wire_approved", description: "Wire money.", parameters: { type: "object", properties: { amount: { type: "number" } }, required: ["amount"], additionalProperties: false }, approval: true });
      const m = agentsModel([[["wire_approved", { amount: 900 }]], "sent"]);
      const agent = new Agent({ name: "payments", model: m.model as never, tools: [wire] });
      const first = await new Runner().run(agent, "wire 900", { context: { user: "u-1", stepgate: new StepRun(wf) } });
      assert.equal(first.interruptions.length, 1);
      assert.equal(stack.tools.count("wire_approved", wf), 0);
      const serialized = first.state.toString();
      assert.match(serialized, /"next_step":1/);
      // Another process: the run comes back from its serialized RunState.
      stack.approve(wf, 0, "wire_approved");
      const state = await RunState.fromString(agent, serialized);
      for (const item of state.getInterruptions()) state.approve(item);
      const second = await new Runner().run(agent, state);
      assert.equal(second.finalOutput, "sent");
      assert.equal((JSON.parse(m.toolOutputs().at(-1) ?? "{}") as { tool: string }).tool, "wire_approved");
      assert.equal(stack.tools.count("wire_approved", wf), 1);
    } finally {
      await client.close();
    }
  });
});

describe("OpenAI Agents JS through its own MCP client (MCPServerStreamableHttp) to stepgate mcp", () => {
  /** An agent whose tools are stepgate mcp's, with the step hooks; the front answers "not answered yet" after 3 s. */
  async function mcpAgent(turns: Turn[]) {
    const url = await stack.startMcp("3s");
    const hooks = new McpStepHooks();
    const server = new MCPServerStreamableHttp({
      url,
      name: "stepgate",
      requestInit: { headers: { authorization: `Bearer ${MCP_TOKEN}` } },
      timeout: 60_000,
      ...hooks.options(),
    });
    await server.connect();
    const m = agentsModel(turns);
    return { a: new Agent({ name: "support", model: m.model as never, mcpServers: [server] }), m, server };
  }

  test("the step goes in _meta: numbered calls, and a rephrased retry after a lost answer gets the first answer", async () => {
    const wf = freshWorkflow();
    stack.tools.hold("slow");
    const { a, m, server } = await mcpAgent([
      [["create_ticket", { title: "one" }]],
      [["slow", { title: "Refund issued" }]],
      (outputs) => {
        assert.doesNotMatch(String(outputs.at(-1) ?? ""), /Refund issued/);
        stack.tools.release("slow");
        return [["slow", { title: "Your refund was issued" }]];
      },
      "done",
    ]);
    try {
      const steps = new StepRun(wf);
      await new Runner().run(a, "go", { context: steps });
      assert.deepEqual(stack.tools.invocations("create_ticket", wf).map((c) => c.stepIndex), [0]);
      assert.deepEqual(stack.tools.invocations("slow", wf).map((c) => c.stepIndex), [1]);
      assert.match(m.toolOutputs().at(-1) ?? "", /Refund issued/);
      assert.doesNotMatch(m.toolOutputs().at(-1) ?? "", /Your refund/);
      assert.equal(steps.nextStep, 2);
    } finally {
      stack.tools.release("slow");
      await server.close();
    }
  });

  test("a run restarted without its numbering refuses and never gets an old answer", async () => {
    const wf = freshWorkflow();
    const first = await mcpAgent([[["create_ticket", { title: "the first ticket" }]], "done"]);
    await new Runner().run(first.a, "go", { context: new StepRun(wf) });
    await first.server.close();
    const again = await mcpAgent([[["create_ticket", { title: "a brand new ticket" }]], "done"]);
    try {
      await assert.rejects(new Runner().run(again.a, "go", { context: new StepRun(wf) }), (e: unknown) => causedByPositionLost(e));
      assert.ok(!JSON.stringify(again.m.inputs.slice(1)).includes("the first ticket"), "the model never saw the old answer");
      assert.equal(stack.tools.count("create_ticket", wf), 1);
    } finally {
      await again.server.close();
    }
  });
});
