/** The client's own errors. An answer with a non-ok status is not one: it is an `Answer`. */

/** Base of the client's errors. */
export class StepgateError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/**
 * The intent could not be published (Kafka refused it or timed out). It may or
 * may not have reached stepgate: call again with the same step key.
 */
export class StepgatePublishError extends StepgateError {}

/** The client was closed while the call waited. Call again with the same step key on another client. */
export class StepgateClosed extends StepgateError {}

/** The client cannot be used as configured (a missing topic, a layout stepgate refuses, bad options). */
export class StepgateConfigError extends StepgateError {}

/**
 * The MCP front refused the request or answered something that is not a
 * stepgate answer (an HTTP error, a JSON-RPC error, a result without
 * `stepgate/status`). `status` is the HTTP status, when there was one.
 */
export class StepgateMcpError extends StepgateError {
  readonly status: number | undefined;
  constructor(message: string, status?: number, options?: { cause?: unknown }) {
    super(message, options);
    this.status = status;
  }
}

/**
 * A new step of a run was answered as a repeat: the run's numbering is not
 * its workflow's (a run restarted without its saved state, or two runs sharing
 * one id). The call was not performed and the other call's answer is withheld.
 * Resume the run from its saved state, or start it under a new workflow id.
 */
export class StepgatePositionLost extends StepgateError {
  readonly workflowId: string;
  readonly stepIndex: number;
  readonly tool: string;
  constructor(workflowId: string, stepIndex: number, tool: string) {
    super(
      `step ${stepIndex} of workflow ${JSON.stringify(workflowId)} was already used by another run of ` +
        `this workflow (a run restarted without its saved state, or two runs with one id): its ` +
        `${JSON.stringify(tool)} call was not performed, and the other call's answer is withheld. ` +
        `Resume the run from its saved numbering (StepRun.resume(savedState)), or start it under a new workflow id.`,
    );
    this.workflowId = workflowId;
    this.stepIndex = stepIndex;
    this.tool = tool;
  }
}
