/**
 * The durable step numbering of an agent run, and one tool call of a run
 * through stepgate: what every adapter shares.
 *
 * The step key comes from the run, never from the model: `workflowId` is the
 * run's id, the step its tool calls counted in order. A call whose answer did
 * not come in time leaves its step to the run's next call of the same tool —
 * the model's retry, however rephrased — which gets the first call's answer,
 * and the tool runs once. A call that was published when the process died is
 * such a call too, once the run is resumed from its saved state.
 *
 * A run that cannot prove its position refuses: a *new* step (one this run's
 * state never published) answered as a repeat was used by another life of the
 * workflow — a run restarted without its state, or two runs sharing one id —
 * and `invokeStep` throws `StepgatePositionLost`; the model never sees the
 * other call's answer.
 */
import { answerText, MAX_CONFLICT_HOPS, type Answer, type Held } from "./answer.js";
import { StepgateMcpError, StepgatePositionLost, StepgatePublishError } from "./errors.js";
import { waitSettled } from "./settle.js";
import type { Transport } from "./transport.js";

/** What the model reads for a call whose answer did not come in time. */
export const NOT_ANSWERED =
  "not answered yet: this call may still be running. Call the tool again to get its result; it will not be " +
  "performed twice. Your next call of this tool is taken as this call's retry, even if you rephrase it; only a " +
  "call that names a different target (for a tool that declares identity arguments, e.g. another recipient) is " +
  "run as a new call instead.";

/** A run's numbering as it is persisted (JSON). */
export interface StepRunState {
  workflow_id: string;
  /** The step the run's next new call takes. */
  next_step: number;
  /** Steps whose answer the model never got, by tool: the next call of that tool takes the first. */
  unanswered: Record<string, number[]>;
  /** Steps already given to a model's call id (a held call, asked again after its approval). */
  calls?: Record<string, number>;
  /** Set once a new step of this run was found used by another life of the workflow: every call refuses. */
  position_lost?: boolean;
}

/** Called with the run's state whenever it changes, before a call is published. */
export type SaveHook = (state: StepRunState) => void | Promise<void>;

/**
 * The step numbering of one agent run, kept where the framework keeps the
 * run's state. `state()` is what to persist; `StepRun.resume(state)`
 * continues it. `save`, when given, is called (and awaited) with `state()`
 * whenever it changes — before a call is published — so a run that dies
 * mid-call resumes knowing that call.
 */
export class StepRun {
  readonly workflowId: string;
  nextStep: number;
  readonly unanswered: Map<string, number[]>;
  /** Steps published and not yet answered to the model: step → tool. Saved as unanswered. */
  readonly pending = new Map<number, string>();
  readonly calls: Map<string, number>;
  /** Answers `askStep` got for a call id before the framework ran the call (in memory only: a lost one is asked again). */
  readonly answered = new Map<string, Answer>();
  /** A new step was found used by another life of the workflow: the numbering cannot be trusted, every call refuses. */
  positionLost: boolean;
  save: SaveHook | undefined;

  constructor(
    workflowId: string,
    options: { nextStep?: number; unanswered?: Record<string, number[]>; calls?: Record<string, number>; positionLost?: boolean; save?: SaveHook } = {},
  ) {
    if (typeof workflowId !== "string" || workflowId.length === 0) throw new TypeError("a StepRun needs a workflow id");
    this.workflowId = workflowId;
    this.nextStep = options.nextStep ?? 0;
    this.unanswered = new Map(Object.entries(options.unanswered ?? {}).map(([k, v]) => [k, [...v]]));
    this.calls = new Map(Object.entries(options.calls ?? {}));
    this.positionLost = options.positionLost ?? false;
    this.save = options.save;
  }

  /** True for a saved `state()` (what `resume` takes). */
  static isState(value: unknown): value is StepRunState {
    const v = value as StepRunState | null;
    return typeof v === "object" && v !== null && typeof v.workflow_id === "string" && Number.isSafeInteger(v.next_step) && typeof v.unanswered === "object";
  }

  /** Continue a run from its saved `state()`. */
  static resume(state: StepRunState, save?: SaveHook): StepRun {
    if (typeof state !== "object" || state === null || typeof state.workflow_id !== "string" || !Number.isSafeInteger(state.next_step)) {
      throw new TypeError("StepRun.resume: not a saved StepRun state ({workflow_id, next_step, unanswered})");
    }
    return new StepRun(state.workflow_id, {
      nextStep: state.next_step,
      unanswered: state.unanswered ?? {},
      ...(state.calls ? { calls: state.calls } : {}),
      ...(state.position_lost ? { positionLost: true } : {}),
      ...(save ? { save } : {}),
    });
  }

  /**
   * The step of a new call of `tool`: an unanswered one first (none in
   * `skip`), else the next. `fresh` when the step was never published by this run.
   */
  takeStep(tool: string, skip: ReadonlySet<number> = new Set()): { step: number; fresh: boolean } {
    const waiting = this.unanswered.get(tool);
    if (waiting) {
      const i = waiting.findIndex((s) => !skip.has(s));
      if (i >= 0) return { step: waiting.splice(i, 1)[0]!, fresh: false };
    }
    return { step: this.nextStep++, fresh: true };
  }

  /** Leave `step` to the next call of `tool` (its answer never reached the model). */
  leaveUnanswered(tool: string, step: number, front = false): void {
    const waiting = this.unanswered.get(tool) ?? [];
    if (!waiting.includes(step)) front ? waiting.unshift(step) : waiting.push(step);
    this.unanswered.set(tool, waiting);
  }

  /** What to persist with the run to resume it (JSON-serialisable). */
  state(): StepRunState {
    const unanswered: Record<string, number[]> = {};
    for (const [tool, steps] of this.unanswered) unanswered[tool] = [...steps];
    // A published call whose answer was never handed over is unanswered.
    for (const [step, tool] of [...this.pending].sort((a, b) => a[0] - b[0])) {
      const list = (unanswered[tool] ??= []);
      if (!list.includes(step)) list.push(step);
    }
    for (const k of Object.keys(unanswered)) unanswered[k]!.sort((a, b) => a - b);
    return {
      workflow_id: this.workflowId,
      next_step: this.nextStep,
      unanswered,
      ...(this.calls.size ? { calls: Object.fromEntries(this.calls) } : {}),
      ...(this.positionLost ? { position_lost: true } : {}),
    };
  }

  /** The state, so that a framework that serializes its context with JSON.stringify keeps the numbering. */
  toJSON(): StepRunState {
    return this.state();
  }

  /** Hand the state to `save` (awaited). */
  async saved(): Promise<void> {
    if (this.save) await this.save(this.state());
  }
}

/** What one call of a run comes to, for an adapter to hand to its framework. */
export type StepResult =
  | { kind: "answer"; answer: Answer; /** The text for the model. */ text: string }
  | { kind: "unanswered"; stepIndex: number; text: string }
  | { kind: "held"; held: Held; text: string };

/** What every adapter's tool takes for a call in doubt. */
export interface InDoubtOptions {
  /**
   * How long a call in doubt waits while stepgate asks the tool what happened
   * (`Answer.reconciling`): its step is repeated until settled (`waitSettled`),
   * and the model gets the settled answer. 0 (the default): the model gets the
   * in-doubt answer, which tells it that a repeat returns the outcome once known.
   */
  inDoubtWaitMs?: number;
}

/** How `invokeStep` calls. */
export interface InvokeOptions extends InDoubtOptions {
  /** The model's id for this call (e.g. its tool call id): echoed in the answer, and the key of a held call's step. */
  callId?: string;
  timeoutMs?: number;
  signal?: AbortSignal;
  /** `"return"`: a call held for a person comes to `held` at once (Kafka only). */
  onHeld?: "wait" | "return";
}

/** A word for a POSIX shell: as it is when it is plain, else single-quoted. */
function shellWord(word: string): string {
  return /^[A-Za-z0-9_./:@#~+=,-]+$/.test(word) ? word : `'${word.replace(/'/g, `'\\''`)}'`;
}

/** The command a person runs to let a held call run (`stepgate approvals approve <workflow> <step> <tool>`). */
export function approveCommand(h: Pick<Held, "workflowId" | "stepIndex" | "tool" | "attempt">): string {
  const attempt = h.attempt ? ` --attempt ${h.attempt}` : "";
  return `stepgate approvals approve ${shellWord(h.workflowId)} ${h.stepIndex} ${h.tool}${attempt} --by <you>`;
}

function heldText(h: Held): string {
  return (
    `held for a person's approval: step ${h.stepIndex} of workflow ${h.workflowId} (${h.tool}) waits for a decision ` +
    `(${approveCommand(h)}). It has not run yet; it runs once when approved.`
  );
}

/**
 * One tool call of a run through stepgate. Takes the call's step (an
 * unanswered one of the same tool first), saves the run, publishes, and
 * settles the step from what the call came to. Throws `StepgatePositionLost`
 * for a fresh step answered as a repeat; an abort rejects and leaves the step
 * pending (saved as unanswered).
 */
export async function invokeStep(
  transport: Transport,
  run: StepRun,
  tool: string,
  args: Record<string, unknown>,
  options: InvokeOptions = {},
): Promise<StepResult> {
  const { callId } = options;
  if (run.positionLost) throw new StepgatePositionLost(run.workflowId, run.nextStep, tool);
  const early = callId !== undefined ? run.answered.get(callId) : undefined;
  if (early !== undefined) {
    // Answered when the framework asked whether it needs approval.
    run.answered.delete(callId!);
    run.calls.delete(callId!);
    await run.saved();
    const answer = await settled(transport, early, args, options);
    return { kind: "answer", answer, text: answerText(answer) };
  }
  let step: number;
  let fresh: boolean;
  const given = callId !== undefined ? run.calls.get(callId) : undefined;
  if (given !== undefined) {
    // A call whose step was taken before it was held for approval.
    run.calls.delete(callId!);
    ({ step, fresh } = { step: given, fresh: false });
  } else {
    ({ step, fresh } = run.takeStep(tool));
  }
  let answer: Answer | undefined;
  for (let hop = 0; hop < MAX_CONFLICT_HOPS; hop++) {
    run.pending.set(step, tool);
    await run.saved(); // before the call is published
    let outcome;
    try {
      outcome = await transport.call(
        {
          workflowId: run.workflowId,
          stepIndex: step,
          tool,
          arguments: args,
          ...(callId !== undefined ? { callId: hop ? `${callId}~${hop}` : callId } : {}),
        },
        {
          ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
          ...(options.signal ? { signal: options.signal } : {}),
          ...(options.onHeld ? { onHeld: options.onHeld } : {}),
        },
      );
    } catch (e) {
      // Published or not, nothing came back: the step goes to the model's retry.
      if (e instanceof StepgatePublishError || e instanceof StepgateMcpError) {
        run.pending.delete(step);
        run.leaveUnanswered(tool, step);
        await run.saved();
        return { kind: "unanswered", stepIndex: step, text: NOT_ANSWERED };
      }
      throw e; // aborted or closed: the step stays pending, as saved
    }
    if (outcome.kind === "unanswered") {
      run.pending.delete(step);
      run.leaveUnanswered(tool, step);
      await run.saved();
      return { kind: "unanswered", stepIndex: step, text: NOT_ANSWERED };
    }
    if (outcome.kind === "held") {
      run.pending.delete(step);
      if (callId !== undefined) run.calls.set(callId, step);
      else run.leaveUnanswered(tool, step);
      await run.saved();
      return { kind: "held", held: outcome, text: heldText(outcome) };
    }
    answer = outcome;
    if (!answer.identityConflict || fresh) break;
    // The unanswered step this call took belongs to another call (its
    // identity arguments differ): it stays open for that call's real retry,
    // and this call runs as a new step.
    run.pending.delete(step);
    run.leaveUnanswered(tool, step, true);
    step = run.nextStep++;
    fresh = true;
  }
  run.pending.delete(step);
  if (fresh && (answer!.deduplicated || answer!.identityConflict)) {
    // Never published by this run, yet answered as a repeat: another life of
    // this workflow used the step. Its answer is not this call's, and no
    // later step of this numbering can be trusted.
    run.positionLost = true;
    await run.saved();
    throw new StepgatePositionLost(run.workflowId, step, tool);
  }
  await run.saved();
  answer = await settled(transport, answer!, args, options);
  return { kind: "answer", answer, text: answerText(answer) };
}

/**
 * The answer an adapter gives its model: with `inDoubtWaitMs`, a call in doubt
 * while stepgate asks the tool is waited on until settled (`waitSettled`); a
 * transport error leaves the in-doubt answer, which says how to learn more.
 */
export async function settled(
  transport: Transport,
  answer: Answer,
  args: Record<string, unknown>,
  options: InDoubtOptions & { timeoutMs?: number; signal?: AbortSignal },
): Promise<Answer> {
  if (!options.inDoubtWaitMs || !answer.reconciling) return answer;
  try {
    return await waitSettled(transport, answer, args, {
      withinMs: options.inDoubtWaitMs,
      ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
      ...(options.signal ? { signal: options.signal } : {}),
    });
  } catch (e) {
    if (e instanceof StepgatePublishError || e instanceof StepgateMcpError) return answer;
    throw e;
  }
}

/**
 * A call of an `approval` tool asked before the framework runs it (its
 * approval hook): the call takes its step now, keyed by `callId` in the run,
 * and is published with `onHeld: "return"`. `held` means the framework should
 * ask for approval; anything else means it need not — its later
 * `invokeStep(…, { callId })` repeats the same step and gets the answer.
 * Undefined when this call id was asked already (asked again after an
 * interruption: no approval needed now).
 */
export async function askStep(
  transport: Transport,
  run: StepRun,
  tool: string,
  args: Record<string, unknown>,
  callId: string,
  options: Omit<InvokeOptions, "callId" | "onHeld"> = {},
): Promise<StepResult | undefined> {
  if (run.positionLost) throw new StepgatePositionLost(run.workflowId, run.nextStep, tool);
  if (run.calls.has(callId)) return undefined;
  const { step, fresh } = run.takeStep(tool);
  run.calls.set(callId, step);
  await run.saved(); // before the call is published
  let outcome;
  try {
    outcome = await transport.call(
      { workflowId: run.workflowId, stepIndex: step, tool, arguments: args, callId },
      {
        onHeld: "return",
        ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
        ...(options.signal ? { signal: options.signal } : {}),
      },
    );
  } catch (e) {
    if (e instanceof StepgatePublishError || e instanceof StepgateMcpError) {
      return { kind: "unanswered", stepIndex: step, text: NOT_ANSWERED }; // invokeStep asks again at the same step
    }
    throw e;
  }
  if (outcome.kind === "held") return { kind: "held", held: outcome, text: heldText(outcome) };
  if (outcome.kind === "unanswered") return { kind: "unanswered", stepIndex: step, text: NOT_ANSWERED };
  if (fresh && (outcome.deduplicated || outcome.identityConflict)) {
    run.calls.delete(callId);
    run.positionLost = true;
    await run.saved();
    throw new StepgatePositionLost(run.workflowId, step, tool);
  }
  if (outcome.identityConflict) {
    // The unanswered step belongs to another call: invokeStep runs this one as a new step.
    run.calls.delete(callId);
    run.leaveUnanswered(tool, step, true);
    await run.saved();
    return undefined;
  }
  run.answered.set(callId, outcome);
  return { kind: "answer", answer: outcome, text: answerText(outcome) };
}
