/** The client over Kafka (and the same interface over the MCP front) against a real stepgate. */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { waitSettled, type Answer, type Outcome } from "../src/index.js";
import type { KafkaClient } from "../src/kafka.js";
import type { McpClient } from "../src/mcp.js";
import { Stack, eventually, freshWorkflow } from "./harness.js";

function answered(o: Outcome): Answer {
  assert.equal(o.kind, "answer", `expected an answer, got ${JSON.stringify(o)}`);
  return o as Answer;
}

let stack: Stack;
before(async () => {
  stack = await Stack.start();
});
after(async () => {
  await stack?.stop();
});

/** The tests every transport passes. */
function transportTests(name: string, connect: () => Promise<KafkaClient | McpClient>) {
  describe(`${name}: calls`, () => {
    let client: KafkaClient | McpClient;
    before(async () => {
      client = await connect();
    });
    after(async () => {
      await client?.close();
    });

    test("a rephrased repeat of a step gets its first answer and the tool runs once", async () => {
      const wf = freshWorkflow();
      const run = client.workflow(wf);
      const first = answered(await run.call("create_ticket", { title: "Printer on fire" }));
      assert.equal(first.status, "ok");
      assert.equal(first.deduplicated, false);
      assert.deepEqual((first.output as { echo: unknown }).echo, { title: "Printer on fire" });
      const again = answered(await run.again(0, "create_ticket", { title: "The printer is on fire" }));
      assert.equal(again.deduplicated, true);
      assert.deepEqual(again.output, first.output);
      assert.equal(run.nextStep, 1);
      assert.equal(stack.tools.count("create_ticket", wf), 1);
    });

    test("two calls with identical arguments at two steps both run", async () => {
      const wf = freshWorkflow();
      const run = client.workflow(wf);
      answered(await run.call("create_ticket", { title: "same" }));
      answered(await run.call("create_ticket", { title: "same" }));
      assert.equal(stack.tools.count("create_ticket", wf), 2);
    });

    test("8 calls at once through one client are inside the tool together, about as long as one", async () => {
      stack.tools.meet("meet", 8);
      const wf = freshWorkflow();
      const run = client.workflow(wf);
      const outs = await Promise.all(Array.from({ length: 8 }, (_, i) => run.call("meet", { i })));
      for (const o of outs) assert.equal((answered(o).output as { together: number }).together, 8);
      // Timing, as a relative check: one call of a 400 ms tool, then 8 at once.
      stack.tools.delays.set("slow", 400);
      const t0 = performance.now();
      answered(await run.call("slow", { n: "one" }));
      const one = performance.now() - t0;
      const t1 = performance.now();
      await Promise.all(Array.from({ length: 8 }, (_, i) => run.call("slow", { i })).map(async (p) => answered(await p)));
      const eight = performance.now() - t1;
      stack.tools.delays.delete("slow");
      assert.ok(eight < one * 3, `8 at once took ${eight.toFixed(0)} ms, one took ${one.toFixed(0)} ms`);
    });

    test("two concurrent calls sharing a call_id in two workflows each get their own answer", async () => {
      const [a, b] = [freshWorkflow("a"), freshWorkflow("b")];
      const [x, y] = await Promise.all([
        client.call({ workflowId: a, stepIndex: 0, tool: "create_ticket", arguments: { title: "for a" }, callId: "shared" }),
        client.call({ workflowId: b, stepIndex: 0, tool: "create_ticket", arguments: { title: "for b" }, callId: "shared" }),
      ]);
      assert.deepEqual((answered(x).output as { echo: unknown }).echo, { title: "for a" });
      assert.deepEqual((answered(y).output as { echo: unknown }).echo, { title: "for b" });
      assert.equal(answered(x).workflowId, a);
      assert.equal(answered(y).workflowId, b);
    });

    test("a call not answered in time is unanswered; the same step again gets its one answer", async () => {
      stack.tools.hold("slow");
      const wf = freshWorkflow();
      const run = client.workflow(wf);
      try {
        const lost = await run.call("slow", { n: 1 }, { timeoutMs: 1500 });
        assert.equal(lost.kind, "unanswered");
        await eventually(() => stack.tools.count("slow", wf) === 1, 30_000, "the call reached the tool");
      } finally {
        stack.tools.release("slow");
      }
      const again = answered(await run.again(0, "slow", { n: "one, rephrased" }));
      assert.deepEqual((again.output as { echo: unknown }).echo, { n: 1 });
      assert.equal(stack.tools.count("slow", wf), 1);
    });

    test("an identity conflict moves the call to the next step; the recorded call keeps its own", async () => {
      const wf = freshWorkflow();
      answered(await client.workflow(wf).call("mail", { to: "a@example.com" }));
      // Another life of the run numbers from 0 again with another recipient.
      const other = client.workflow(wf, 0);
      const moved = answered(await other.call("mail", { to: "b@example.com" }));
      assert.equal(moved.stepIndex, 1);
      assert.equal(moved.deduplicated, false);
      assert.equal(other.nextStep, 2);
      assert.equal(stack.tools.count("mail", wf), 2);
    });

    test("an aborted call rejects with the signal's reason", async () => {
      stack.tools.hold("slow");
      try {
        const ac = new AbortController();
        const p = client.call({ workflowId: freshWorkflow(), stepIndex: 0, tool: "slow", arguments: {} }, { signal: ac.signal });
        setTimeout(() => ac.abort(new Error("the user left")), 200);
        await assert.rejects(p, /the user left/);
      } finally {
        stack.tools.release("slow");
      }
    });

    test("a call in doubt while stepgate asks the tool is settled by waitSettled, and the tool ran once", async () => {
      // The tool answers 503 (it may have acted): the unkeyed call is in doubt,
      // and stepgate asks its lookup, which reports the effect.
      stack.tools.statuses.set("doubtful", 503);
      stack.tools.bodies.set("doubtful_lookup", { status: "executed", output: { fax_id: "F-1" } });
      const wf = freshWorkflow();
      const first = answered(await client.workflow(wf).call("doubtful", { to: "+331" }));
      assert.equal(first.status, "in_doubt", JSON.stringify(first));
      assert.ok(first.reconciling, JSON.stringify(first));
      assert.equal(first.inDoubt?.learn, "repeat_step");
      assert.ok(first.inDoubt?.until);
      const got = await waitSettled(client, first, { to: "+331" }, { everyMs: 200, withinMs: 60_000 });
      assert.equal(got.status, "ok", JSON.stringify(got));
      assert.deepEqual(got.output, { fax_id: "F-1" });
      assert.equal(got.deduplicated, true);
      assert.equal(stack.tools.count("doubtful", wf), 1, "the tool ran once");
    });

    test("bad input is refused before anything is sent", async () => {
      await assert.rejects(client.call({ workflowId: "", stepIndex: 0, tool: "x", arguments: {} }), TypeError);
      await assert.rejects(client.call({ workflowId: "w", stepIndex: -1, tool: "x", arguments: {} }), /stepIndex/);
      await assert.rejects(client.call({ workflowId: "w", stepIndex: 0, tool: "bad tool", arguments: {} }), /tool must match/);
      await assert.rejects(client.call({ workflowId: "w", stepIndex: 0, tool: "x", arguments: [] as never }), /JSON object/);
    });
  });
}

transportTests("kafka", () => stack.client());
transportTests("mcp", async () => {
  await stack.startMcp();
  return stack.mcpClient();
});

describe("kafka: held calls", () => {
  test("a held call comes to `held` at once; approved by a person, the same step gets its answer and runs once", async () => {
    const client = await stack.client();
    try {
      const wf = freshWorkflow();
      const held = await client.call({ workflowId: wf, stepIndex: 0, tool: "wire_approved", arguments: { amount: 900 } }, { onHeld: "return" });
      assert.equal(held.kind, "held");
      assert.equal(stack.tools.count("wire_approved", wf), 0);
      stack.approve(wf, 0, "wire_approved");
      const answer = answered(await client.call({ workflowId: wf, stepIndex: 0, tool: "wire_approved", arguments: { amount: 900 } }));
      assert.equal(answer.status, "ok");
      assert.equal(stack.tools.count("wire_approved", wf), 1);
    } finally {
      await client.close();
    }
  });
});
