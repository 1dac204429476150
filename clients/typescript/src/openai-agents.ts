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
import { tool, type FunctionTool, type MCPToolCustomDataContext, type MCPToolMetaContext, type RunContext } from "@openai/agents";

import { StepgateError, StepgateMcpError, StepgatePositionLost } from "./errors.js";
import { askStep, invokeStep, NOT_ANSWERED, StepRun, type InDoubtOptions } from "./run.js";
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

export interface StepgateToolOptions extends InDoubtOptions {
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
        ...(options.inDoubtWaitMs ? { inDoubtWaitMs: options.inDoubtWaitMs } : {}),
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

// ---------------------------------------------------------------------------
// `stepgate mcp` through the SDK's own MCP client (`MCPServerStreamableHttp`).

interface Inflight {
  run: StepRun;
  step: number;
  fresh: boolean;
  tool: string;
  args: string;
}

/** Arguments as a canonical string (sorted keys): how a call is recognised between the hooks. */
function fingerprint(value: unknown): string {
  const sort = (v: unknown): unknown =>
    Array.isArray(v) ? v.map(sort) : v && typeof v === "object" ? Object.fromEntries(Object.entries(v).sort(([a], [b]) => (a < b ? -1 : 1)).map(([k, x]) => [k, sort(x)])) : v;
  return JSON.stringify(sort(value ?? {}));
}

/**
 * The step of each call to `stepgate mcp` through an Agents SDK MCP server
 * (`MCPServerStreamableHttp`), from the run's `StepRun` in its context, with
 * no Kafka client in the agent's process:
 *
 *     const hooks = new McpStepHooks();
 *     const stepgate = new MCPServerStreamableHttp({ url, requestInit: { headers: { authorization: `Bearer ${token}` } }, ...hooks.options() });
 *
 * - `toolMetaResolver` takes the call's step as `stepgateTool` does (the
 *   tool's first unanswered step, else the next), saves the numbering with
 *   the step pending, and sends it in `_meta`.
 * - `customDataExtractor` reads the result's `stepgate/…` fields. An answer
 *   settles the step; a result without one (not answered in time, refused)
 *   leaves the step to the model's retry. A fresh step answered as a repeat
 *   throws `StepgatePositionLost`.
 * - `errorFunction`: a call that failed in the client leaves its step to the
 *   model's retry when it is the run's only call in flight (with others in
 *   flight the failed one cannot be told apart: its step is not reused, so the
 *   retry runs as a new step rather than risk another call's answer).
 *
 * Give the server a `timeout` above `stepgate mcp --timeout` (120 s by
 * default), so a slow call comes back as the front's "not answered yet".
 */
export class McpStepHooks {
  readonly contextAttribute: string;
  readonly #inflight = new Map<string, Inflight[]>();
  /** Steps a call conflicted with: "<workflow>\u0000<step>" → argument fingerprints. */
  readonly #conflicts = new Map<string, Set<string>>();

  constructor(options: { contextAttribute?: string } = {}) {
    this.contextAttribute = options.contextAttribute ?? "stepgate";
  }

  /** The three hooks, to spread into the MCP server's options. */
  options() {
    return { toolMetaResolver: this.toolMetaResolver, customDataExtractor: this.customDataExtractor, errorFunction: this.errorFunction };
  }

  #key(run: StepRun, tool: string, args: string): string {
    return `${run.workflowId}\u0000${tool}\u0000${args}`;
  }

  toolMetaResolver = async (ctx: MCPToolMetaContext): Promise<Record<string, unknown>> => {
    const run = runOf(ctx.runContext as RunContext<unknown>, this.contextAttribute);
    if (run.positionLost) throw new StepgatePositionLost(run.workflowId, run.nextStep, ctx.toolName);
    const args = fingerprint(ctx.arguments);
    const skip = new Set<number>();
    for (const [k, seen] of this.#conflicts) {
      const [wf, step] = k.split("\u0000");
      if (wf === run.workflowId && seen.has(args)) skip.add(Number(step));
    }
    const { step, fresh } = run.takeStep(ctx.toolName, skip);
    run.pending.set(step, ctx.toolName);
    const key = this.#key(run, ctx.toolName, args);
    this.#inflight.set(key, [...(this.#inflight.get(key) ?? []), { run, step, fresh, tool: ctx.toolName, args }]);
    await run.saved(); // before the call is sent
    return { workflow_id: run.workflowId, step_index: step, attempt: 0 };
  };

  #take(run: StepRun, tool: string, args: string): Inflight | undefined {
    const key = this.#key(run, tool, args);
    const list = this.#inflight.get(key);
    const entry = list?.shift();
    if (list && list.length === 0) this.#inflight.delete(key);
    return entry;
  }

  async #unanswered(entry: Inflight, front = false): Promise<void> {
    entry.run.pending.delete(entry.step);
    entry.run.leaveUnanswered(entry.tool, entry.step, front);
    await entry.run.saved();
  }

  customDataExtractor = async (ctx: MCPToolCustomDataContext): Promise<undefined> => {
    const run = runOf(ctx.runContext as RunContext<unknown>, this.contextAttribute);
    const entry = this.#take(run, ctx.toolName, fingerprint(ctx.arguments));
    if (entry === undefined) return undefined;
    const meta = ctx.resultMeta ?? {};
    if (typeof meta["stepgate/status"] !== "string") {
      // No answer of stepgate's: not answered in time, or refused before it
      // was asked. The step goes to the model's retry.
      await this.#unanswered(entry);
      return undefined;
    }
    if (meta["stepgate/workflow_id"] !== run.workflowId || meta["stepgate/step_index"] !== entry.step) {
      await this.#unanswered(entry);
      throw new StepgateMcpError(
        `the MCP server answered ${ctx.toolName} as step ${String(meta["stepgate/step_index"])} of ${String(meta["stepgate/workflow_id"])}, ` +
          `not the step sent in _meta (step ${entry.step} of ${run.workflowId}): is it \`stepgate mcp\`, and does it read _meta?`,
      );
    }
    const conflict = meta["stepgate/error_kind"] === "identity_conflict";
    if (conflict && !entry.fresh) {
      // The unanswered step belongs to another call (its identity arguments
      // differ): it stays open for that call's real retry.
      const k = `${run.workflowId}\u0000${entry.step}`;
      this.#conflicts.set(k, new Set([...(this.#conflicts.get(k) ?? []), entry.args]));
      await this.#unanswered(entry, true);
      return undefined;
    }
    run.pending.delete(entry.step);
    if (entry.fresh && (meta["stepgate/deduplicated"] === true || conflict)) {
      run.positionLost = true;
      await run.saved();
      throw new StepgatePositionLost(run.workflowId, entry.step, entry.tool);
    }
    this.#conflicts.delete(`${run.workflowId}\u0000${entry.step}`);
    await run.saved();
    return undefined;
  };

  errorFunction = async ({ context, error }: { context: RunContext; error: unknown }): Promise<string> => {
    let e: unknown = error;
    while (e) {
      if (e instanceof StepgatePositionLost || e instanceof StepgateMcpError) throw e; // the run stops
      e = (e as { cause?: unknown }).cause;
    }
    let run: StepRun | undefined;
    try {
      run = runOf(context as RunContext<unknown>, this.contextAttribute);
    } catch {
      run = undefined;
    }
    if (run) {
      const mine = [...this.#inflight.entries()].filter(([, list]) => list.some((x) => x.run === run));
      const only = mine.length === 1 && mine[0]![1].length === 1 ? mine[0]! : undefined;
      if (only) {
        this.#inflight.delete(only[0]);
        await this.#unanswered(only[1][0]!);
        return NOT_ANSWERED;
      }
    }
    return (
      `not answered: the call to stepgate failed (${error instanceof Error ? error.message : String(error)}), and it may or ` +
      "may not have been performed. Another call of this tool now runs as a new call: tell the user the outcome is " +
      "unconfirmed instead of calling it again."
    );
  };
}
