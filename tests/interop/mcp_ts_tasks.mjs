// Drives `stepgate mcp --listen` with the official MCP TypeScript SDK's client
// (protocol 2025-11-25, its default request timeout of 60 s) against a tool
// that takes 90 s, authorized like mcp_ts_client.mjs. At once:
// - step 0 as a task (`callToolStream`, which asks for one because the tool
//   lists `execution.taskSupport`): created at once, polled with tasks/get,
//   read with tasks/result past the 60 s;
// - step 1 as a plain call: the SDK gives up at 60 s; then the same step is
//   re-issued as a task and attaches to the step still running.
// Prints one JSON object with what it saw; tests/broker/mcp.rs checks it.
//
// usage: node mcp_ts_tasks.mjs MCP_URL ISSUER_URL CLIENT_ID CLIENT_SECRET TOOL
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ClientCredentialsProvider } from "@modelcontextprotocol/sdk/client/auth-extensions.js";

const [url, issuer, clientId, clientSecret, tool] = process.argv.slice(2);
const provider = new ClientCredentialsProvider({ clientId, clientSecret, expectedIssuer: issuer });
const transport = new StreamableHTTPClientTransport(new URL(url), { authProvider: provider });
const client = new Client({ name: "stepgate-ts-tasks", version: "0.0.0" });
const t0 = Date.now();
const since = () => Date.now() - t0;

const seen = (r) =>
  r && {
    text: (r.content ?? []).filter((c) => c.type === "text").map((c) => c.text),
    structured: r.structuredContent ?? null,
    is_error: Boolean(r.isError),
    meta: r._meta ?? {},
  };

// One call as a task: what the stream yields, in order.
async function asTask(step, month) {
  const out = { statuses: [], task_id: null, created_ms: null, result: null, error: null };
  const stream = client.experimental.tasks.callToolStream({
    name: tool,
    arguments: { month },
    _meta: step,
  });
  for await (const m of stream) {
    if (m.type === "taskCreated") {
      out.task_id = m.task.taskId;
      out.created_ms = since();
      out.poll_interval = m.task.pollInterval ?? null;
    } else if (m.type === "taskStatus") {
      if (out.statuses.at(-1) !== m.task.status) out.statuses.push(m.task.status);
    } else if (m.type === "result") {
      out.result = seen(m.result);
      out.done_ms = since();
    } else if (m.type === "error") {
      out.error = String(m.error);
    }
  }
  return out;
}

await client.connect(transport);
const out = { protocol: transport.protocolVersion ?? null };
out.tasks_capability = client.getServerCapabilities()?.tasks ?? null;
const listed = (await client.listTools()).tools.find((t) => t.name === tool);
out.task_support = listed?.execution?.taskSupport ?? null;

const step0 = { workflow_id: `jwt:${clientId}/ts-tasks`, step_index: 0 };
const step1 = { workflow_id: `jwt:${clientId}/ts-tasks`, step_index: 1 };
const plain = (async () => {
  try {
    const r = await client.callTool({ name: tool, arguments: { month: "2026-10" }, _meta: step1 });
    return { result: seen(r), ms: since() };
  } catch (e) {
    return { error: String(e), ms: since() };
  }
})();
const [task, plainOut] = await Promise.all([asTask(step0, "2026-11"), plain]);
out.task = task;
out.plain = plainOut;
// The plain call's step, re-issued (rephrased) after its request gave up.
out.reissued = await asTask(step1, "October 2026");
// And step 0 once more, as a plain call: its answer at once.
out.again = seen(await client.callTool({ name: tool, arguments: { month: "Nov 2026" }, _meta: step0 }));
await client.close();
console.log(JSON.stringify(out));
