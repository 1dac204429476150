/**
 * AI SDK adapter (`ai`): tools whose calls go through stepgate, for
 * `generateText`, `streamText` and `ToolLoopAgent`.
 *
 * The AI SDK persists nothing itself: the app keeps its chat (messages) in its
 * own store, keyed by chat id. The step numbering lives in that store too,
 * beside the messages and never among them — `ChatSteps` loads and saves a
 * `StepRun` per chat id through the app's `ChatStepStore` — so trimming or
 * pruning the messages never renumbers a step, and a chat resumed in another
 * process continues its numbering. Each tool reaches its chat through its tool
 * context: `toolsContext: { create_ticket: { chatId } }` (or `stepgateContext`);
 * a `ToolLoopAgent` built with `stepgateAgentCall(tools)` takes the chat id per
 * call (`agent.generate({ messages, options: { chatId } })`) and puts it there.
 *
 * A held call (a tool whose stepgate policy is `approval`) becomes the AI SDK's
 * own tool approval: `toolApproval: stepgateApproval(client, steps, tools)` publishes
 * the call when the SDK asks, and answers `user-approval` when stepgate holds
 * it. Once a person has approved it in stepgate, the app answers the approval
 * request (a `tool-approval-response` with `approved: true`) and runs the chat
 * again: the call keeps its step and gets its answer.
 */
import { jsonSchema, tool, type FlexibleSchema, type Tool, type ToolApprovalStatus, type ToolExecutionOptions, type ToolSet } from "ai";

import { askStep, invokeStep, StepRun, type InDoubtOptions, type StepResult, type StepRunState } from "./run.js";
import type { Transport } from "./transport.js";

/** Where the app keeps each chat's step numbering: its own chat store, keyed by chat id. */
export interface ChatStepStore {
  load(chatId: string): StepRunState | undefined | Promise<StepRunState | undefined>;
  /** Called with the newest state (before each call is published); keep it as durably as the chat's messages. */
  save(chatId: string, state: StepRunState): void | Promise<void>;
}

/** A `ChatStepStore` in memory (tests, or a chat that lives as long as the process). */
export class MemoryChatStepStore implements ChatStepStore {
  readonly rows = new Map<string, StepRunState>();
  load(chatId: string): StepRunState | undefined {
    const row = this.rows.get(chatId);
    return row ? (JSON.parse(JSON.stringify(row)) as StepRunState) : undefined;
  }
  save(chatId: string, state: StepRunState): void {
    this.rows.set(chatId, JSON.parse(JSON.stringify(state)) as StepRunState);
  }
}

/**
 * The step numbering of the app's chats: a `StepRun` per chat id (workflow
 * `<workflowPrefix><chatId>`), loaded from the store on first use and saved
 * there whenever it changes. A chat whose numbering was lost (another store, a
 * deleted row) starts again at 0 and cannot prove its position: its first call
 * that another life of the chat already made refuses (`StepgatePositionLost`).
 */
export class ChatSteps {
  readonly store: ChatStepStore;
  readonly workflowPrefix: string;
  readonly #runs = new Map<string, Promise<StepRun>>();
  readonly #saving = new Map<string, Promise<void>>();

  constructor(store: ChatStepStore, options: { workflowPrefix?: string } = {}) {
    this.store = store;
    this.workflowPrefix = options.workflowPrefix ?? "";
  }

  workflowId(chatId: string): string {
    return `${this.workflowPrefix}${chatId}`;
  }

  /** The chat's numbering. */
  run(chatId: string): Promise<StepRun> {
    if (typeof chatId !== "string" || chatId.length === 0) {
      return Promise.reject(
        new TypeError(
          "stepgate's AI SDK tools need the chat id in their tool context: give generateText/streamText " +
            "`toolsContext: stepgateContext(tools, chatId)`, or build the ToolLoopAgent with `...stepgateAgentCall(tools)` " +
            "and call it with `options: { chatId }`",
        ),
      );
    }
    let run = this.#runs.get(chatId);
    if (run === undefined) {
      run = (async () => {
        const saved = await this.store.load(chatId);
        const save = (state: StepRunState) => {
          // Saves of one chat are chained, so the store gets them in order.
          const next = (this.#saving.get(chatId) ?? Promise.resolve()).then(() => this.store.save(chatId, state));
          this.#saving.set(chatId, next.catch(() => undefined));
          return next;
        };
        if (saved === undefined) return new StepRun(this.workflowId(chatId), { save });
        if (saved.workflow_id !== this.workflowId(chatId)) {
          throw new TypeError(
            `the stored numbering of chat ${JSON.stringify(chatId)} is for workflow ${JSON.stringify(saved.workflow_id)}, not ` +
              `${JSON.stringify(this.workflowId(chatId))} (another workflowPrefix?)`,
          );
        }
        return StepRun.resume(saved, save);
      })();
      this.#runs.set(chatId, run);
      run.catch(() => this.#runs.delete(chatId));
    }
    return run;
  }

  /** Forget the loaded numbering of a chat (it is loaded again from the store on next use). */
  evict(chatId: string): void {
    this.#runs.delete(chatId);
  }
}

/** The tool context stepgate's AI SDK tools take. */
export type StepgateToolContext = {
  chatId: string;
  [key: string]: unknown;
};

/** What a stepgate tool's `execute` returns: the tool's output when ok, else stepgate's text for the model. */
export type StepgateToolOutput = unknown;

export interface StepgateToolOptions<INPUT> extends InDoubtOptions {
  /** The stepgate tool's name (as configured in stepgate). */
  name: string;
  description?: string;
  /** The input's schema (a JSON Schema via `jsonSchema()`, a zod schema, …); default: any JSON object. */
  inputSchema?: FlexibleSchema<INPUT>;
  /** How long a call waits for its answer before the model reads "not answered yet". */
  timeoutMs?: number;
}

/** The output for the model: the tool's output when ok, else stepgate's model-readable text. */
function modelOutput(result: StepResult): unknown {
  return result.kind === "answer" && result.answer.ok ? result.answer.output : result.text;
}

/** A stepgate tool, as `ChatSteps`' tools know it. */
export type StepgateTool<INPUT = Record<string, unknown>> = Tool<INPUT, StepgateToolOutput, StepgateToolContext> & {
  readonly stepgateName: string;
};

/**
 * An AI SDK tool whose calls go through stepgate: the step from the chat's
 * numbering (its chat id in the tool context), the call published to stepgate,
 * stepgate's answer to the model. Its own code never runs here: stepgate's
 * tool of that name does.
 */
export function stepgateTool<INPUT extends Record<string, unknown> = Record<string, unknown>>(
  transport: Transport,
  steps: ChatSteps,
  options: StepgateToolOptions<INPUT>,
): StepgateTool<INPUT> {
  const schema = options.inputSchema ?? (jsonSchema({ type: "object", additionalProperties: true }) as unknown as FlexibleSchema<INPUT>);
  const t = tool<INPUT, StepgateToolOutput, StepgateToolContext>({
    ...(options.description !== undefined ? { description: options.description } : {}),
    inputSchema: schema,
    execute: async (input: INPUT, { toolCallId, context, abortSignal }: ToolExecutionOptions<StepgateToolContext>) => {
      const run = await steps.run(context?.chatId);
      const result = await invokeStep(transport, run, options.name, input as Record<string, unknown>, {
        callId: toolCallId,
        ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
        ...(options.inDoubtWaitMs ? { inDoubtWaitMs: options.inDoubtWaitMs } : {}),
        ...(abortSignal ? { signal: abortSignal } : {}),
      });
      return modelOutput(result);
    },
  } as never) as Tool<INPUT, StepgateToolOutput, StepgateToolContext>;
  return Object.assign(t, { stepgateName: options.name });
}

/**
 * The AI SDK's `toolApproval` for stepgate tools whose policy is `approval`:
 * each call is published when the SDK asks, and answered `user-approval` (with
 * what to approve in stepgate as its reason) when stepgate holds it for a
 * person. A call stepgate does not hold needs no approval here, and its
 * `execute` gets the answer already in hand.
 *
 *     toolApproval: stepgateApproval(client, steps, { wire: wireTool })
 */
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export function stepgateApproval<TOOLS extends Record<string, StepgateTool<any>>>(
  transport: Transport,
  steps: ChatSteps,
  tools: TOOLS,
  options: { timeoutMs?: number } = {},
): { [K in keyof TOOLS]: (input: unknown, o: { toolCallId: string; toolContext: StepgateToolContext }) => Promise<ToolApprovalStatus> } {
  const out: Record<string, unknown> = {};
  for (const [key, t] of Object.entries(tools)) {
    out[key] = async (input: unknown, o: { toolCallId: string; toolContext: StepgateToolContext }): Promise<ToolApprovalStatus> => {
      const run = await steps.run(o.toolContext?.chatId);
      const result = await askStep(transport, run, t.stepgateName, input as Record<string, unknown>, o.toolCallId, options);
      if (result?.kind === "held") return { type: "user-approval", reason: result.text };
      return "not-applicable";
    };
  }
  return out as never;
}

/** `toolsContext` for a set of stepgate tools of one chat: `{ <tool>: { chatId } }`. */
export function stepgateContext<TOOLS extends ToolSet>(tools: TOOLS, chatId: string): { [K in keyof TOOLS]: StepgateToolContext } {
  return Object.fromEntries(Object.keys(tools).map((k) => [k, { chatId }])) as never;
}

/**
 * The `callOptionsSchema` and `prepareCall` of a `ToolLoopAgent` whose tools
 * are stepgate's: each call of the agent names its chat
 * (`agent.generate({ prompt, options: { chatId } })`), and the agent hands the
 * chat id to each stepgate tool in its tool context. One agent serves every chat.
 *
 *     const agent = new ToolLoopAgent({ model, tools, toolApproval, ...stepgateAgentCall(tools) });
 */
export function stepgateAgentCall<TOOLS extends ToolSet>(tools: TOOLS) {
  const stepgate = Object.entries(tools)
    .filter(([, t]) => typeof (t as Partial<StepgateTool>).stepgateName === "string")
    .map(([key]) => key);
  return {
    callOptionsSchema: jsonSchema<{ chatId: string }>({
      type: "object",
      properties: { chatId: { type: "string", minLength: 1 } },
      required: ["chatId"],
    }),
    prepareCall: <P extends { options: { chatId: string }; toolsContext?: unknown }>({ options, ...rest }: P) => {
      const given = (rest.toolsContext ?? {}) as Record<string, Record<string, unknown> | undefined>;
      const toolsContext = { ...given };
      for (const key of stepgate) toolsContext[key] = { ...given[key], chatId: options.chatId };
      return { ...rest, toolsContext } as unknown as Omit<P, "options">;
    },
  };
}
