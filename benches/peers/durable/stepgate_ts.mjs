// The sequential mode of run.py through stepgate's TypeScript client
// (clients/typescript, over Kafka): one Node caller, one call at a time, each
// timed here around the client's `call` — N new steps, then N repeats of them
// with rephrased arguments. Prints one JSON object: each call's milliseconds
// and the Result v1 it got (run.py computes the percentiles and checks that
// each repeat got its first answer).
//
//     node stepgate_ts.mjs '{"client": "<repo>/clients/typescript", "brokers": "…",
//                            "intents": "…", "results": "…", "tool": "keyed", "n": 200}'
import { join } from "node:path";
import { performance } from "node:perf_hooks";
import { pathToFileURL } from "node:url";

const a = JSON.parse(process.argv[2]);
// The package as built in its checkout (`npm run build`), with its node_modules.
const { KafkaClient } = await import(pathToFileURL(join(a.client, "dist", "kafka.js")).href);
const client = await KafkaClient.connect({
  brokers: a.brokers,
  intents: a.intents,
  results: a.results,
  approvals: null,
  timeoutMs: 120_000,
  republishAfterMs: 3_000, // as run.py's Python caller
});

const run = Math.random().toString(16).slice(2, 10);
const workflowId = `seq-${run}`;

async function one(stepIndex, title) {
  const t = performance.now();
  const outcome = await client.call({ workflowId, stepIndex, tool: a.tool, arguments: { title } });
  const ms = performance.now() - t;
  return { ms, result: outcome.kind === "answer" ? outcome.raw : { kind: outcome.kind, reason: outcome.reason ?? null } };
}

const out = { new_ms: [], repeat_ms: [], firsts: [], repeats: [] };
try {
  for (let i = 0; i < a.n; i++) {
    const { ms, result } = await one(i, `Order ${workflowId}/${i} confirmed`);
    out.new_ms.push(ms);
    out.firsts.push(result);
  }
  for (let i = 0; i < a.n; i++) {
    const { ms, result } = await one(i, `Your order ${workflowId}/${i} is confirmed`);
    out.repeat_ms.push(ms);
    out.repeats.push(result);
  }
} finally {
  await client.close();
}
process.stdout.write(JSON.stringify(out) + "\n");
