/** A workflow's steps numbered in the order the run makes its calls. */
import { MAX_CONFLICT_HOPS, type Outcome } from "./answer.js";
import type { CallOptions, StepCall, Transport } from "./transport.js";

/** Options of one call of a workflow. */
export interface WorkflowCallOptions extends CallOptions {
  /** Deliberate re-execution of the step: attempt n+1 runs again, with its own Idempotency-Key. */
  attempt?: number;
  /** The caller's id for this call (default: a fresh unique id). */
  callId?: string;
  /** Stored with the step, never interpreted. */
  metadata?: Record<string, unknown>;
}

function stepCall(workflowId: string, stepIndex: number, tool: string, args: Record<string, unknown>, o: WorkflowCallOptions, hop = 0): StepCall {
  return {
    workflowId,
    stepIndex,
    tool,
    arguments: args,
    ...(o.attempt !== undefined ? { attempt: o.attempt } : {}),
    // A call moved to the next step gets an id of its own there, so that no
    // late answer to the earlier step's intent can answer it.
    ...(o.callId !== undefined ? { callId: hop ? `${o.callId}~${hop}` : o.callId } : {}),
    ...(o.metadata !== undefined ? { metadata: o.metadata } : {}),
  };
}

/**
 * One agent run: its tool calls numbered in the order the run makes them.
 *
 * Persist `nextStep` with the run and resume it with
 * `client.workflow(id, nextStep)`: a resumed run must number its calls as
 * before, so that a call made again is recognised as the same step. Calls of
 * one workflow may run concurrently: each takes its step when it is made.
 */
export class Workflow {
  constructor(
    readonly transport: Transport,
    readonly workflowId: string,
    /** The step the next call takes. */
    public nextStep = 0,
  ) {}

  /** Take the next step (and move the counter on). */
  takeStep(): number {
    return this.nextStep++;
  }

  /**
   * The run's next tool call. A call the gate finds to be another call than
   * the one recorded at its step (`identity_conflict`: the tool's identity
   * arguments differ) is sent again as the step after, and so on: the
   * recorded call's step stays its own.
   */
  async call(tool: string, args: Record<string, unknown>, options: WorkflowCallOptions = {}): Promise<Outcome> {
    let outcome: Outcome | undefined;
    for (let hop = 0; hop < MAX_CONFLICT_HOPS; hop++) {
      outcome = await this.transport.call(stepCall(this.workflowId, this.takeStep(), tool, args, options, hop), options);
      if (outcome.kind !== "answer" || !outcome.identityConflict) break;
    }
    return outcome!;
  }

  /** An earlier step's call again (after a lost answer): its first answer, the tool not run again. */
  again(stepIndex: number, tool: string, args: Record<string, unknown>, options: WorkflowCallOptions = {}): Promise<Outcome> {
    return this.transport.call(stepCall(this.workflowId, stepIndex, tool, args, options), options);
  }
}
