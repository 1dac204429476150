/**
 * stepgate over its MCP front (`stepgate mcp --listen`): the same interface as
 * the Kafka client, with nothing but `fetch` — for serverless functions, Bun,
 * Deno and edge bundles, where a native Kafka client does not fit.
 *
 * Each call is an MCP `tools/call` over Streamable HTTP with the step key in
 * `_meta` (`workflow_id`, `step_index`, `attempt`), so a repeat of the step
 * from any session, any process, gets the step's first answer. The answer's
 * fields come back in the result's `_meta` (`stepgate/status`, …).
 */
import { answerFromRecord, type Answer, type Outcome } from "./answer.js";
import { StepgateClosed, StepgateMcpError } from "./errors.js";
import { checkCall, freshCallId, type CallOptions, type StepCall, type Transport } from "./transport.js";
import { Workflow } from "./workflow.js";

/** The MCP revision this client speaks (with the initialize handshake and a session). */
export const MCP_PROTOCOL_VERSION = "2025-11-25";

/** How to reach `stepgate mcp --listen`. */
export interface McpClientOptions {
  /** The front's URL, e.g. `http://127.0.0.1:9480/mcp`. */
  url: string | URL;
  /** A bearer token the front accepts (a static token or a JWT of its issuer); a function is asked per request. */
  token?: string | (() => string | Promise<string>);
  /** More HTTP headers. */
  headers?: Record<string, string>;
  /** Default `CallOptions.timeoutMs`: how long a call waits for its answer. Default 60 s. */
  timeoutMs?: number;
  /** The `fetch` to use (default: the global one). */
  fetch?: typeof fetch;
}

interface JsonRpcResponse {
  jsonrpc: "2.0";
  id?: number | string | null;
  result?: Record<string, unknown>;
  error?: { code: number; message: string; data?: unknown };
}

/** A request the front refused before it reached MCP (it says nothing was performed). */
class SessionGone extends Error {}

/** stepgate over its MCP front. `new McpClient({ url, token })`; no connection is made before the first call. */
export class McpClient implements Transport {
  readonly url: URL;
  readonly #options: McpClientOptions;
  readonly #fetch: typeof fetch;
  #session: Promise<string | undefined> | undefined;
  #nextId = 1;
  #closed = false;
  readonly #inflight = new Set<AbortController>();

  constructor(options: McpClientOptions) {
    this.url = new URL(options.url);
    this.#options = options;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** A workflow numbering its calls from `nextStep` (persist `nextStep` with the run). */
  workflow(workflowId: string, nextStep = 0): Workflow {
    return new Workflow(this, workflowId, nextStep);
  }

  async #headers(session: string | undefined): Promise<Record<string, string>> {
    const h: Record<string, string> = {
      "content-type": "application/json",
      accept: "application/json, text/event-stream",
      ...this.#options.headers,
    };
    const token = typeof this.#options.token === "function" ? await this.#options.token() : this.#options.token;
    if (token) h.authorization = `Bearer ${token}`;
    if (session !== undefined) {
      h["mcp-session-id"] = session;
      h["mcp-protocol-version"] = MCP_PROTOCOL_VERSION;
    }
    return h;
  }

  /** POST one JSON-RPC message; the response to `id` (JSON or an SSE stream), or undefined for a notification. */
  async #post(
    session: string | undefined,
    body: Record<string, unknown>,
    signal: AbortSignal | undefined,
  ): Promise<{ response: JsonRpcResponse | undefined; session: string | undefined }> {
    const res = await this.#fetch(this.url, {
      method: "POST",
      headers: await this.#headers(session),
      body: JSON.stringify(body),
      ...(signal ? { signal } : {}),
    });
    if (res.status === 404 && session !== undefined) {
      await res.body?.cancel();
      throw new SessionGone(await res.text().catch(() => ""));
    }
    if (!res.ok) {
      const text = await res.text().catch(() => "");
      throw new StepgateMcpError(`the MCP front answered ${res.status}: ${text.slice(0, 500)}`, res.status);
    }
    const newSession = res.headers.get("mcp-session-id") ?? session;
    if (!("id" in body)) {
      await res.body?.cancel();
      return { response: undefined, session: newSession };
    }
    const type = res.headers.get("content-type") ?? "";
    if (type.includes("text/event-stream")) {
      return { response: await readSse(res, body.id as number), session: newSession };
    }
    return { response: (await res.json()) as JsonRpcResponse, session: newSession };
  }

  /** The MCP session: opened once (initialize, then initialized), opened again after a 404. */
  #openSession(signal: AbortSignal | undefined): Promise<string | undefined> {
    this.#session ??= (async () => {
      const { response, session } = await this.#post(
        undefined,
        {
          jsonrpc: "2.0",
          id: this.#nextId++,
          method: "initialize",
          params: {
            protocolVersion: MCP_PROTOCOL_VERSION,
            capabilities: {},
            clientInfo: { name: "stepgate-ts", version: "0.1.0" },
          },
        },
        signal,
      );
      if (response?.error) throw new StepgateMcpError(`initialize: ${response.error.message}`);
      await this.#post(session, { jsonrpc: "2.0", method: "notifications/initialized" }, signal);
      return session;
    })();
    this.#session.catch(() => (this.#session = undefined));
    return this.#session;
  }

  /**
   * One `tools/call` with the step in `_meta`, waiting for what it comes to:
   * its `Answer`, or `unanswered` when no answer came within `timeoutMs` or
   * the front answered without stepgate's answer (its text says why). A call
   * of an `approval` tool waits for the decision (the front does not tell a
   * held call from a slow one: `onHeld` is not used here). The front names
   * each call itself: an answer's `callId` is the front's id for the call,
   * not `call.callId` (which stays in the `held`/`unanswered` outcomes).
   */
  async call(call: StepCall, options: CallOptions = {}): Promise<Outcome> {
    checkCall(call);
    if (this.#closed) throw new StepgateClosed("the client is closed");
    options.signal?.throwIfAborted();
    const attempt = call.attempt ?? 0;
    const callId = call.callId ?? freshCallId();
    const base = { workflowId: call.workflowId, stepIndex: call.stepIndex, tool: call.tool, attempt, callId };
    const timeoutMs = options.timeoutMs ?? this.#options.timeoutMs ?? 60_000;
    const controller = new AbortController();
    this.#inflight.add(controller);
    const timer = setTimeout(() => controller.abort(new TimedOut()), timeoutMs);
    const onAbort = () => controller.abort(options.signal?.reason);
    options.signal?.addEventListener("abort", onAbort, { once: true });
    const meta: Record<string, unknown> = { workflow_id: call.workflowId, step_index: call.stepIndex, attempt };
    try {
      // A 404 (the session is gone) performed nothing: the call is sent again
      // in a new session, once.
      for (let tries = 0; ; tries++) {
        const session = await this.#openSession(controller.signal);
        try {
          const { response } = await this.#post(
            session,
            {
              jsonrpc: "2.0",
              id: this.#nextId++,
              method: "tools/call",
              params: { name: call.tool, arguments: call.arguments, _meta: meta },
            },
            controller.signal,
          );
          if (response === undefined) throw new StepgateMcpError("tools/call: no response");
          if (response.error) {
            throw new StepgateMcpError(`tools/call ${call.tool}: ${response.error.message} (JSON-RPC ${response.error.code})`);
          }
          const answer = toAnswer(call, response.result ?? {});
          if (answer === undefined) {
            return { kind: "unanswered", ...base, reason: resultText(response.result ?? {}) || "the MCP front answered without stepgate's answer" };
          }
          return answer;
        } catch (e) {
          if (e instanceof SessionGone && tries === 0) {
            this.#session = undefined;
            continue;
          }
          if (e instanceof SessionGone) throw new StepgateMcpError(`the MCP session was closed twice: ${e.message}`, 404);
          throw e;
        }
      }
    } catch (e) {
      if (controller.signal.aborted && controller.signal.reason instanceof TimedOut) {
        return { kind: "unanswered", ...base, reason: `no answer for step ${call.stepIndex} of ${call.workflowId} (${call.tool}) in ${timeoutMs} ms` };
      }
      if (options.signal?.aborted) throw options.signal.reason;
      if (this.#closed) throw new StepgateClosed("the client was closed while the call waited");
      if (e instanceof StepgateMcpError) throw e;
      throw new StepgateMcpError(`the call to the MCP front failed: ${(e as Error).message}`, undefined, { cause: e });
    } finally {
      clearTimeout(timer);
      options.signal?.removeEventListener("abort", onAbort);
      this.#inflight.delete(controller);
    }
  }

  /** Close the MCP session; calls still waiting reject with `StepgateClosed`. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const c of this.#inflight) c.abort(new StepgateClosed("the client was closed while the call waited"));
    const session = await this.#session?.catch(() => undefined);
    if (session !== undefined) {
      await this.#fetch(this.url, { method: "DELETE", headers: await this.#headers(session) })
        .then((r) => r.body?.cancel())
        .catch(() => undefined);
    }
  }
}

class TimedOut extends Error {}

function resultText(result: Record<string, unknown>): string {
  const content = Array.isArray(result.content) ? result.content : [];
  return content
    .filter((c): c is { type: "text"; text: string } => typeof c === "object" && c !== null && (c as { type?: unknown }).type === "text")
    .map((c) => c.text)
    .join("\n");
}

/** The front's result as stepgate's answer; undefined when it carries none (not answered in time, refused). */
function toAnswer(call: StepCall, result: Record<string, unknown>): Answer | undefined {
  const meta = (result._meta ?? {}) as Record<string, unknown>;
  const status = meta["stepgate/status"];
  if (typeof status !== "string") return undefined;
  const text = resultText(result);
  let output: unknown;
  if (status === "ok") {
    if (result.structuredContent !== undefined) output = result.structuredContent;
    else {
      try {
        output = JSON.parse(text);
      } catch {
        output = text; // a string output is sent as its text
      }
    }
  }
  const kind = meta["stepgate/error_kind"];
  const record = {
    workflow_id: meta["stepgate/workflow_id"] ?? call.workflowId,
    step_index: meta["stepgate/step_index"] ?? call.stepIndex,
    tool: call.tool,
    attempt: meta["stepgate/attempt"] ?? call.attempt ?? 0,
    call_id: (meta["stepgate/call_id"] as string | null | undefined) ?? null,
    status,
    deduplicated: meta["stepgate/deduplicated"] === true,
    completed_at: typeof meta["stepgate/completed_at"] === "string" ? meta["stepgate/completed_at"] : "",
    ...(status === "ok" ? { output } : { error: { kind: typeof kind === "string" ? kind : status, message: text } }),
    ...(meta["stepgate/in_doubt"] !== undefined ? { in_doubt: meta["stepgate/in_doubt"] } : {}),
  };
  const answer = answerFromRecord(record);
  if (answer.workflowId !== call.workflowId || answer.stepIndex !== call.stepIndex) {
    throw new StepgateMcpError(
      `the MCP front answered ${call.tool} as step ${answer.stepIndex} of ${JSON.stringify(answer.workflowId)}, not the step ` +
        `sent in _meta (step ${call.stepIndex} of ${JSON.stringify(call.workflowId)}): is it \`stepgate mcp\`, and does it read _meta?`,
    );
  }
  return answer;
}

/** The JSON-RPC response with `id` from a Streamable HTTP SSE stream. */
async function readSse(res: Response, id: number): Promise<JsonRpcResponse | undefined> {
  if (!res.body) return undefined;
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data: string[] = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return undefined;
      buffer += value;
      let nl: number;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (line === "") {
          // An event ends; the stream opens with an empty one (a resumption id only).
          const text = data.join("\n").trim();
          data = [];
          if (text) {
            const message = JSON.parse(text) as JsonRpcResponse;
            if (message.id === id && ("result" in message || "error" in message)) return message;
          }
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
  } finally {
    await reader.cancel().catch(() => undefined);
  }
}
