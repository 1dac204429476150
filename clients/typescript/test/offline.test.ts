/** What needs no broker: the partitioner against Kafka's Java vectors, answers' validation. */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";

import { answerFromRecord, MalformedAnswer, murmur2, partitionFor } from "../src/index.js";
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

