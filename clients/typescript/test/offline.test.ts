/** What needs no broker: the partitioner against Kafka's Java vectors, answers' validation, waitSettled over a scripted transport. */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";

import { answerFromRecord, MalformedAnswer, murmur2, partitionFor, waitSettled, type Outcome, type StepCall, type Transport } from "../src/index.js";
import { REPO } from "./harness.js";

describe("murmur2", () => {
  test("matches Kafka's Java clients on the Rust client's vectors", () => {
    // The vectors of crates/stepgate-client/src/contract/partition.rs, read
    // from that file so the two cannot drift.
    const src = readFileSync(join(REPO, "crates/stepgate-client/src/contract/partition.rs"), "utf8");
    const table = src.slice(src.indexOf("const JAVA"), src.indexOf("const NS"));
    const rows = [...table.matchAll(/\(\s*"((?:[^"\\]|\\.)*)",\s*(-?\d+),\s*\[([^\]]*)\],?\s*\)/g)];
    assert.ok(rows.length >= 10, `parsed ${rows.length} vectors`);
    const ns = [1, 3, 4, 7, 12, 100];
    for (const [, rawKey, hash, parts] of rows) {
      const key = rawKey!.replace(/\\u\{([0-9a-f]+)\}/gi, (_, h: string) => String.fromCodePoint(parseInt(h, 16)));
      assert.equal(murmur2(new TextEncoder().encode(key)) | 0, Number(hash), `murmur2(${JSON.stringify(key)})`);
      const want = parts!.split(",").map((p) => Number(p.trim()));
      assert.deepEqual(ns.map((n) => partitionFor(key, n)), want, `${JSON.stringify(key)} over ${ns}`);
    }
    const all = Uint8Array.from({ length: 255 }, (_, i) => i);
    assert.equal(murmur2(all) | 0, 1542706800);
    assert.equal(partitionFor("w", 0), 0);
  });
});

describe("answers", () => {
  test("a record that is not a Result v1 is refused, with what is wrong", () => {
    assert.throws(() => answerFromRecord([1]), MalformedAnswer);
    assert.throws(() => answerFromRecord({ workflow_id: "w", step_index: -1 }), /step_index/);
    assert.throws(
      () => answerFromRecord({ workflow_id: "w", step_index: 0, tool: "t", attempt: 0, call_id: null, status: "error", deduplicated: false }),
      /must have an error/,
    );
    const a = answerFromRecord({
      workflow_id: "w", step_index: 4, tool: "wire", attempt: 0, call_id: null, status: "in_doubt",
      error: { kind: "executor_lost", message: "m" }, deduplicated: false, completed_at: "2026-01-01T00:00:00.000Z",
    });
    assert.equal(a.status, "in_doubt");
    assert.equal(a.ok, false);
    assert.equal(a.error?.kind, "executor_lost");
  });
});

describe("in doubt", () => {
  test("the structured in_doubt of the schema's examples is exposed, and a record without it still reads", () => {
    // The examples of schemas/result.v1.json, read from that file so the two cannot drift.
    const schema = JSON.parse(readFileSync(join(REPO, "schemas/result.v1.json"), "utf8")) as { examples: Record<string, any>[] };
    const doubtful = schema.examples.filter((e) => e.status === "in_doubt");
    assert.ok(doubtful.some((e) => e.in_doubt?.settling === "person"), "an example settled by a person");
    assert.ok(doubtful.some((e) => e.in_doubt?.settling === "reconciler"), "an example settled by the reconciler");
    for (const e of doubtful) {
      const a = answerFromRecord(e);
      assert.equal(a.inDoubt?.idempotencyKey, e.in_doubt.idempotency_key);
      assert.equal(a.inDoubt?.since, e.in_doubt.since);
      assert.equal(a.inDoubt?.settling, e.in_doubt.settling);
      assert.equal(a.inDoubt?.until, e.in_doubt.until);
      assert.equal(a.inDoubt?.learn, "repeat_step");
      assert.equal(a.reconciling, e.in_doubt.settling === "reconciler");
    }
    const bare = answerFromRecord({ ...doubtful[0], in_doubt: undefined });
    assert.equal(bare.inDoubt, undefined);
    assert.equal(bare.reconciling, false);
    const odd = answerFromRecord({ ...doubtful[0], in_doubt: { version: 2, settling: 7 } });
    assert.equal(odd.inDoubt?.settling, "person");
    assert.equal(odd.inDoubt?.version, 2);
  });
});

/** A transport answering scripted statuses in turn (the last one again once they run out). */
function scripted(statuses: Array<[string, "person" | "reconciler" | undefined]>): Transport & { calls: StepCall[] } {
  const calls: StepCall[] = [];
  return {
    calls,
    async call(call: StepCall): Promise<Outcome> {
      calls.push(call);
      const [status, settling] = statuses[Math.min(calls.length - 1, statuses.length - 1)]!;
      return doubtAnswer(status, settling, call.callId ?? null, true);
    },
    async close() {},
  } as Transport & { calls: StepCall[] };
}

function doubtAnswer(status: string, settling: "person" | "reconciler" | undefined, callId: string | null, deduplicated = false) {
  return answerFromRecord({
    workflow_id: "w", step_index: 3, tool: "fax", attempt: 1, call_id: callId, status, deduplicated,
    completed_at: "2026-12-01T00:00:00.000Z",
    ...(status === "ok" ? { output: { fax_id: "F" } } : { error: { kind: status, message: "m" } }),
    ...(settling ? { in_doubt: { version: 1, idempotency_key: "k", since: "2026-12-01T00:00:00.000Z", settling, learn: "repeat_step" } } : {}),
  });
}

describe("waitSettled", () => {
  test("repeats the same step, each time as a call of its own, until it is settled", async () => {
    const t = scripted([["in_doubt", "reconciler"], ["in_doubt", "reconciler"], ["ok", undefined]]);
    const got = await waitSettled(t, doubtAnswer("in_doubt", "reconciler", "c0"), { to: "+331" }, { everyMs: 1, withinMs: 5_000 });
    assert.equal(got.status, "ok");
    assert.deepEqual(got.output, { fax_id: "F" });
    assert.equal(t.calls.length, 3);
    for (const c of t.calls) {
      assert.deepEqual([c.workflowId, c.stepIndex, c.tool, c.attempt], ["w", 3, "fax", 1]);
      assert.deepEqual(c.arguments, { to: "+331" });
    }
    assert.equal(new Set(t.calls.map((c) => c.callId)).size, 3, "each repeat has its own call id");
    assert.ok(!t.calls.some((c) => c.callId === "c0"));
  });

  test("is bounded, and waits on a person only when asked to", async () => {
    const forever = scripted([["in_doubt", "reconciler"]]);
    const started = Date.now();
    const last = await waitSettled(forever, doubtAnswer("in_doubt", "reconciler", "c0"), {}, { everyMs: 5, withinMs: 100 });
    assert.equal(last.status, "in_doubt");
    assert.ok(Date.now() - started < 5_000, "returned after its bound");
    assert.ok(forever.calls.length >= 1);
    const person = scripted([["ok", undefined]]);
    const held = await waitSettled(person, doubtAnswer("in_doubt", "person", "c0"), {}, { everyMs: 1 });
    assert.equal(held.status, "in_doubt", "a person's step is returned at once");
    assert.equal(person.calls.length, 0);
    const waited = await waitSettled(person, doubtAnswer("in_doubt", "person", "c0"), {}, { everyMs: 1, waitForPerson: true });
    assert.equal(waited.status, "ok");
    const settled = scripted([["in_doubt", "reconciler"]]);
    assert.equal((await waitSettled(settled, doubtAnswer("ok", undefined, "c0"), {})).status, "ok");
    assert.equal(settled.calls.length, 0, "an answer not in doubt is returned as it is");
  });

  test("an abort stops the wait", async () => {
    const t = scripted([["in_doubt", "reconciler"]]);
    const ac = new AbortController();
    const waiting = waitSettled(t, doubtAnswer("in_doubt", "reconciler", "c0"), {}, { everyMs: 60_000, signal: ac.signal });
    ac.abort(new Error("stopped"));
    await assert.rejects(waiting, /stopped/);
  });
});
