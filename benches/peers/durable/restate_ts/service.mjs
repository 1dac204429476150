// The Restate peer with Restate's TypeScript SDK: the same service as
// restate_service.py (service `Tools`, handler `call`), whose handler journals
// the tool call with `ctx.run` — what a Restate user writes for "a tool call
// runs once". Callers invoke it through Restate's ingress with the step key as
// the invocation's `idempotency-key`, so a repeated step gets the first
// invocation's result.
//
// Served over HTTP/2 cleartext (the SDK's endpoint handler, bidirectional, as
// `restate.serve` does), on 127.0.0.1 only:
//   TOOL_URL=… node service.mjs PORT      (or PORT=… in the environment)
// setup.sh copies this file beside its node_modules in the peers directory.

// The SDK calls Promise.withResolvers, which Node gained in 22; the SDK is
// imported below, after this, so that it is there before any of its code runs.
if (typeof Promise.withResolvers !== "function") {
  Promise.withResolvers = function withResolvers() {
    let resolve, reject;
    const promise = new this((res, rej) => {
      resolve = res;
      reject = rej;
    });
    return { promise, resolve, reject };
  };
}

const http2 = await import("node:http2");
const restate = await import("@restatedev/restate-sdk");

const TOOL_URL = process.env.TOOL_URL;
if (!TOOL_URL) throw new Error("service.mjs: TOOL_URL is not set");
const port = parseInt(process.argv[2] ?? process.env.PORT ?? "9080", 10);

// One POST of the arguments with the step's key as `Idempotency-Key`, as
// tool_client.py does: an HTTP error or a timeout (60 s) throws, and `ctx.run`
// retries it.
async function post(args, key) {
  const res = await fetch(TOOL_URL, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Idempotency-Key": key },
    body: JSON.stringify(args),
    signal: AbortSignal.timeout(60_000),
  });
  if (!res.ok) throw new Error(`tool: HTTP ${res.status}`);
  return await res.json();
}

const tools = restate.service({
  name: "Tools",
  handlers: {
    call: async (ctx, args) => {
      // The invocation's own idempotency key (the step key), stable across the
      // retries of this invocation; its id when it was submitted without one.
      const request = ctx.request();
      const key = request.idempotencyKey || request.id;
      return await ctx.run("tool", () => post(args, key));
    },
  },
});

const server = http2.createServer(restate.endpoint().bind(tools).http2Handler());
server.listen(port, "127.0.0.1", () => {
  console.error(`service.mjs: listening on 127.0.0.1:${server.address().port}`);
});
