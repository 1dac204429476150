/**
 * OpenAI Agents JS adapter (`@openai/agents`): function tools whose calls go
 * through stepgate, and hooks for the SDK's own MCP client to `stepgate mcp`.
 *
 * The run's step numbering is a `StepRun` in the run's context — the context
 * itself, or its `stepgate` property — so it is serialized with the SDK's
 * `RunState` (`state.toString()`: a `StepRun` serializes as its state) and
 * comes back with `RunState.fromString`, revived on first use. Every agent of
 * a run (after a handoff, or as another agent's tool) reaches the same
 * numbering through the context, so their calls never share a step.
 *
 * A call of a tool made with `approval: true` is published when the SDK asks
 * whether it needs approval (`needsApproval`); if stepgate holds it for a
 * person, the run stops with the call among its `interruptions`. Once the
 * person has approved it in stepgate (`stepgate approvals approve`), approve
 * the interruption (`state.approve(item)`) and run the state again: the call
 * keeps its step and gets its answer.
 *
 * A run that cannot prove its position stops: `StepgatePositionLost` is
 * thrown out of `run()`, never shown to the model as a tool's output.
 */
import { tool, type FunctionTool, type RunContext } from "@openai/agents";

import { StepgateError, StepgatePositionLost } from "./errors.js";
import { askStep, invokeStep, StepRun } from "./run.js";
import type { Transport } from "./transport.js";

/**
 * The `StepRun` of a run context: the context itself or its `attribute`
 * property. A numbering that came back from a serialized `RunState` (its
 * state, as JSON) is revived in place.
 */
export function runOf(runContext: RunContext<unknown> | undefined, attribute = "stepgate"): StepRun {
  const ctx = runContext?.context as unknown;
  if (ctx instanceof StepRun) return ctx;
  if (StepRun.isState(ctx)) {
    const run = StepRun.resume(ctx);
    (runContext as { context: unknown }).context = run;
    return run;
  }
  if (typeof ctx === "object" && ctx !== null) {
    const holder = ctx as Record<string, unknown>;
    const found = holder[attribute];
    if (found instanceof StepRun) return found;
    if (StepRun.isState(found)) {
      const run = StepRun.resume(found);
      holder[attribute] = run;
      return run;
    }
  }
  throw new TypeError(
    `stepgate tools need a StepRun in the run's context: pass context: new StepRun("<workflow id>"), or a context ` +
      `with a \`${attribute}\` property holding one (or its saved state); got ${ctx === null ? "null" : typeof ctx}`,
  );
}

/** JSON Schema for a tool's parameters (an object schema). */
export type ParametersSchema = {
  type: "object";
  properties: Record<string, unknown>;
  required: string[];
  additionalProperties: boolean;
  description?: string;
};

export interface StepgateToolOptions {
  /** The stepgate tool's name (as configured in stepgate). */
  name: string;
  description: string;
  /** The parameters' JSON Schema. */
  parameters: ParametersSchema;
  /** The schema is strict (all properties required, no others). Default: true when `additionalProperties` is false. */
  strict?: boolean;
  /** How long a call waits for its answer before the model reads "not answered yet". Default 60 s. */
  timeoutMs?: number;
  /** A tool whose stepgate policy is `approval`: held calls become the run's interruptions. */
  approval?: boolean;
  /** The property of the app's context that holds the StepRun. Default `stepgate`. */
  contextAttribute?: string;
}

/** The text for a tool call that failed in the client: the run stops on a lost position, else the model reads it. */
function errorText(_ctx: RunContext<unknown>, error: unknown): string {
  if (error instanceof StepgatePositionLost) throw error;
  if (error instanceof StepgateError) return `stepgate could not take this call: ${error.message}`;
  throw error;
}

/** A function tool for `new Agent({ tools: [...] })` whose calls go through stepgate. */
export function stepgateTool(transport: Transport, options: StepgateToolOptions): FunctionTool {
  const attribute = options.contextAttribute ?? "stepgate";
  const strict = options.strict ?? options.parameters.additionalProperties === false;
  return tool({
    name: options.name,
    description: options.description,
    parameters: options.parameters as never,
    strict: strict as never,
    execute: async (input: unknown, runContext?: RunContext<unknown>, details?: { toolCall?: { callId?: string }; signal?: AbortSignal }) => {
      const run = runOf(runContext, attribute);
      const callId = details?.toolCall?.callId;
      const result = await invokeStep(transport, run, options.name, (input ?? {}) as Record<string, unknown>, {
        ...(callId !== undefined ? { callId } : {}),
        ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
        ...(details?.signal ? { signal: details.signal } : {}),
      });
      return result.text;
    },
    errorFunction: errorText,
    ...(options.approval
      ? {
          needsApproval: async (runContext: RunContext<unknown>, input: unknown, callId?: string) => {
            if (callId === undefined) return false; // invoke waits for the decision
            const run = runOf(runContext, attribute);
            const result = await askStep(transport, run, options.name, (input ?? {}) as Record<string, unknown>, callId, {
              ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
            });
            return result?.kind === "held";
          },
        }
      : {}),
  } as never) as FunctionTool;
}
