/**
 * stepgate's answers, typed: the Result v1 record (schemas/result.v1.json),
 * and what a call can come to besides an answer (held for a person, not
 * answered in time).
 */

/** The statuses of Result v1. A newer stepgate may add one: `status` is then that string as sent. */
export type Status = "ok" | "error" | "in_doubt" | "rejected";

/** `error.kind` of a `rejected` answer whose identity arguments differ from the call recorded at its step. */
export const IDENTITY_CONFLICT = "identity_conflict";

/** How many steps a workflow's call moves on past identity conflicts before it returns the conflict itself. */
export const MAX_CONFLICT_HOPS = 16;

/** Why a call did not succeed. `message` is written for a model to act on. */
export interface AnswerError {
  kind: string;
  message: string;
}

/** A Result v1 record as it is on the wire (JSON). */
export interface ResultV1 {
  workflow_id: string;
  step_index: number;
  tool: string;
  attempt: number;
  call_id: string | null;
  status: Status | (string & {});
  deduplicated: boolean;
  completed_at: string;
  output?: unknown;
  error?: AnswerError;
}

/**
 * The one answer of a step (Result v1). `output` is the tool's answer when
 * `status` is `ok`; `error` is set for every other status. `deduplicated` is
 * false only for the call that ran the tool. `in_doubt` is an answer like the
 * others: the call may have taken effect, and a person must check it.
 */
export interface Answer {
  readonly kind: "answer";
  readonly workflowId: string;
  readonly stepIndex: number;
  readonly tool: string;
  readonly attempt: number;
  readonly callId: string | null;
  readonly status: Status | (string & {});
  readonly deduplicated: boolean;
  readonly completedAt: string;
  readonly output?: unknown;
  readonly error?: AnswerError;
  /** `status === "ok"`. */
  readonly ok: boolean;
  /** The call named another call than the one recorded at its step (not run, not given that answer). */
  readonly identityConflict: boolean;
  /** The record exactly as stepgate wrote it. */
  readonly raw: ResultV1;
}

/**
 * A call of an `approval` tool that stepgate holds for a person (returned
 * instead of waiting when the call asked for it with `onHeld: "return"`). The
 * step is recorded: call it again with the same step key for its answer once
 * a person has decided (`stepgate approvals approve <workflow> <step> <tool>`).
 */
export interface Held {
  readonly kind: "held";
  readonly workflowId: string;
  readonly stepIndex: number;
  readonly tool: string;
  readonly attempt: number;
  readonly callId: string;
  /** The approval event (schemas/approval.v1.json); over MCP, absent. */
  readonly event?: Record<string, unknown>;
}

/**
 * No answer came within the call's timeout. The step may still be answered:
 * call it again with the same step key (a repeat never runs the tool twice).
 */
export interface Unanswered {
  readonly kind: "unanswered";
  readonly workflowId: string;
  readonly stepIndex: number;
  readonly tool: string;
  readonly attempt: number;
  readonly callId: string;
  /** What happened, for a log. */
  readonly reason: string;
}

/** What a call comes to. */
export type Outcome = Answer | Held | Unanswered;

/** Thrown for a record that is not a Result v1 (never for a non-ok status). */
export class MalformedAnswer extends Error {
  constructor(message: string) {
    super(message);
    this.name = "MalformedAnswer";
  }
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

const isStepNumber = (v: unknown): v is number => typeof v === "number" && Number.isInteger(v) && v >= 0;

/** A Result v1 record (parsed JSON) as an `Answer`; `MalformedAnswer` when it is not one. */
export function answerFromRecord(record: unknown): Answer {
  if (!isObject(record)) throw new MalformedAnswer("a result record must be a JSON object");
  const r = record;
  if (typeof r.workflow_id !== "string") throw new MalformedAnswer("result: workflow_id must be a string");
  if (!isStepNumber(r.step_index)) throw new MalformedAnswer("result: step_index must be an integer >= 0");
  if (typeof r.tool !== "string") throw new MalformedAnswer("result: tool must be a string");
  if (!isStepNumber(r.attempt)) throw new MalformedAnswer("result: attempt must be an integer >= 0");
  if (r.call_id !== null && typeof r.call_id !== "string") {
    throw new MalformedAnswer("result: call_id must be a string or null");
  }
  if (typeof r.status !== "string") throw new MalformedAnswer("result: status must be a string");
  if (typeof r.deduplicated !== "boolean") throw new MalformedAnswer("result: deduplicated must be a boolean");
  let error: AnswerError | undefined;
  if (r.error !== undefined) {
    const e = r.error;
    if (!isObject(e) || typeof e.kind !== "string" || typeof e.message !== "string") {
      throw new MalformedAnswer("result: error must be {kind, message} strings");
    }
    error = { kind: e.kind, message: e.message };
  }
  if (r.status !== "ok" && error === undefined) {
    throw new MalformedAnswer(`result: a ${r.status} answer must have an error`);
  }
  const raw = r as unknown as ResultV1;
  return Object.freeze({
    kind: "answer" as const,
    workflowId: r.workflow_id,
    stepIndex: r.step_index,
    tool: r.tool,
    attempt: r.attempt,
    callId: (r.call_id as string | null) ?? null,
    status: r.status,
    deduplicated: r.deduplicated,
    completedAt: typeof r.completed_at === "string" ? r.completed_at : "",
    ...(r.status === "ok" ? { output: r.output } : {}),
    ...(error ? { error } : {}),
    ok: r.status === "ok",
    identityConflict: r.status === "rejected" && error?.kind === IDENTITY_CONFLICT,
    raw,
  });
}

/**
 * stepgate's answer as a tool's output for a model: the output's JSON when ok,
 * else the status and stepgate's model-readable message.
 */
export function answerText(answer: Answer): string {
  if (answer.ok) return typeof answer.output === "string" ? answer.output : JSON.stringify(answer.output ?? null);
  return `${answer.status}: ${answer.error?.message ?? ""}`;
}
