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

/** Who settles an in-doubt step (`InDoubt.settling`): a person (an operator, `stepgate resolve` or the console), or stepgate's reconciler (it asks the tool's `reconcile` lookup until `InDoubt.until`, then leaves the step to a person). */
export type Settler = "person" | "reconciler";

/** Result v1 `in_doubt` as it is on the wire (schemas/result.v1.json). */
export interface InDoubtV1 {
  version: number;
  idempotency_key: string;
  since: string;
  settling: Settler | (string & {});
  until?: string;
  learn: "repeat_step" | (string & {});
}

/**
 * Why and how an `in_doubt` answer will be settled (Result v1 `in_doubt`), for
 * a program: `error.message` says the same to a model.
 */
export interface InDoubt {
  /** The shape's version (1). A newer stepgate may add fields: they are in `Answer.raw`. */
  readonly version: number;
  /** The key the call carried (its `Idempotency-Key`): what to look the call up by at the provider. */
  readonly idempotencyKey: string;
  /** When the step was declared in doubt (RFC 3339). */
  readonly since: string;
  /** Who settles it: `person` or `reconciler`. */
  readonly settling: Settler | (string & {});
  /** With `reconciler`: when stepgate stops asking the tool and leaves the step to a person (RFC 3339). */
  readonly until?: string;
  /**
   * How to learn the resolution. `repeat_step`: call the same step again (same
   * workflow, step index, tool, attempt): it returns this answer until the step
   * is settled, then the settled one (a step found not executed is run once by
   * that repeat, with the same key).
   */
  readonly learn: "repeat_step" | (string & {});
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
  in_doubt?: InDoubtV1;
}

/**
 * The one answer of a step (Result v1). `output` is the tool's answer when
 * `status` is `ok`; `error` is set for every other status. `deduplicated` is
 * false only for the call that ran the tool. `in_doubt` is an answer like the
 * others: the call may have taken effect, and it is settled by a person or,
 * for a tool with a `reconcile` lookup, by stepgate asking the tool
 * (`inDoubt` says which, and how to learn the resolution).
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
  /** With `status === "in_doubt"`: who settles the step and how to learn the resolution. */
  readonly inDoubt?: InDoubt;
  /** `status === "ok"`. */
  readonly ok: boolean;
  /**
   * In doubt, and stepgate is asking the tool what happened: a repeat of the
   * step soon returns the resolution.
   */
  readonly reconciling: boolean;
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

/**
 * Result v1 `in_doubt`, read leniently: it is additive, and the answer stands
 * without it (its `status` and `error.message` say what happened), so a field
 * missing or of another type takes its default rather than refusing the answer.
 */
function inDoubtFromRecord(v: unknown): InDoubt | undefined {
  if (!isObject(v)) return undefined;
  const str = (x: unknown, dflt: string): string => (typeof x === "string" ? x : dflt);
  return Object.freeze({
    version: typeof v.version === "number" ? v.version : 1,
    idempotencyKey: str(v.idempotency_key, ""),
    since: str(v.since, ""),
    settling: str(v.settling, "person"),
    ...(typeof v.until === "string" ? { until: v.until } : {}),
    learn: str(v.learn, "repeat_step"),
  });
}

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
  const inDoubt = inDoubtFromRecord(r.in_doubt);
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
    ...(inDoubt ? { inDoubt } : {}),
    ok: r.status === "ok",
    reconciling: r.status === "in_doubt" && inDoubt?.settling === "reconciler",
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
