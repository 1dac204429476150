/** What a call is, and the interface both transports (Kafka, MCP) serve. */
import type { Outcome } from "./answer.js";

/** One tool call at one step of a workflow: the step key and the arguments. */
export interface StepCall {
  /** The workflow (conversation, run, thread): 1 to 255 bytes, no control characters. */
  workflowId: string;
  /** The step's position in the workflow, counted by the agent runtime (never by the model). */
  stepIndex: number;
  /** The configured tool to call. */
  tool: string;
  /** The tool's arguments (a JSON object). A repeat of a step may rephrase them: the first call's run. */
  arguments: Record<string, unknown>;
  /** Deliberate re-execution: attempt n+1 is a new step key and runs again. Default 0. */
  attempt?: number;
  /**
   * The caller's id for this call, echoed in its answer. Default: a fresh
   * unique id. Answers are matched on the whole step key and this id, so two
   * calls sharing an id in different workflows or steps never take each
   * other's answer.
   */
  callId?: string;
  /** Stored with the step, never interpreted. */
  metadata?: Record<string, unknown>;
}

/** How one call waits. */
export interface CallOptions {
  /** Stops waiting: the call rejects with the signal's reason. The step, once published, stays recorded. */
  signal?: AbortSignal;
  /** How long to wait for the answer before the call comes to `unanswered`. Default 60 s. */
  timeoutMs?: number;
  /**
   * A call of an `approval` tool held for a person: `"wait"` (default) waits
   * for the decision; `"return"` comes to a `held` outcome as soon as stepgate
   * holds it (Kafka only: the MCP front does not tell a held call from a slow one).
   */
  onHeld?: "wait" | "return";
}

/** A way to stepgate: `KafkaClient` (stepgate/kafka) or `McpClient` (stepgate/mcp). */
export interface Transport {
  /** Publish one call and wait for what it comes to. */
  call(call: StepCall, options?: CallOptions): Promise<Outcome>;
  /** Stop; calls still waiting reject with `StepgateClosed`. */
  close(): Promise<void>;
}

const TOOL = /^[A-Za-z0-9_.:-]{1,128}$/;
// eslint-disable-next-line no-control-regex
const CONTROL = /[\u0000-\u001f\u007f-\u009f]/;

/** Checks a call against the Intent v1 schema before anything is sent; a `TypeError` saying what is wrong. */
export function checkCall(call: StepCall): void {
  const wf = call.workflowId;
  if (typeof wf !== "string" || wf.length === 0 || new TextEncoder().encode(wf).length > 255 || CONTROL.test(wf)) {
    throw new TypeError(`workflowId must be 1 to 255 bytes without control characters, not ${JSON.stringify(wf)}`);
  }
  if (!Number.isSafeInteger(call.stepIndex) || call.stepIndex < 0) {
    throw new TypeError(`stepIndex must be an integer >= 0, not ${String(call.stepIndex)}`);
  }
  if (typeof call.tool !== "string" || !TOOL.test(call.tool)) {
    throw new TypeError(`tool must match ${TOOL.source}, not ${JSON.stringify(call.tool)}`);
  }
  const attempt = call.attempt ?? 0;
  if (!Number.isSafeInteger(attempt) || attempt < 0) {
    throw new TypeError(`attempt must be an integer >= 0, not ${String(call.attempt)}`);
  }
  const args = call.arguments;
  if (typeof args !== "object" || args === null || Array.isArray(args)) {
    throw new TypeError("arguments must be a JSON object");
  }
  if (call.metadata !== undefined && (typeof call.metadata !== "object" || call.metadata === null || Array.isArray(call.metadata))) {
    throw new TypeError("metadata must be a JSON object");
  }
}

/** The Intent v1 record of a call (schemas/intent.v1.json). */
export function intentRecord(call: StepCall, callId: string): Record<string, unknown> {
  return {
    workflow_id: call.workflowId,
    step_index: call.stepIndex,
    tool: call.tool,
    attempt: call.attempt ?? 0,
    arguments: call.arguments,
    call_id: callId,
    ...(call.metadata !== undefined ? { metadata: call.metadata } : {}),
  };
}

/** A fresh unique call id. */
export function freshCallId(): string {
  return globalThis.crypto.randomUUID();
}
