/**
 * Mastra adapter (`@mastra/core`): tools made with Mastra's `createTool` whose
 * calls go through stepgate.
 *
 * The step numbering lives in Mastra's own storage, per memory thread: a
 * `StepRun` in the thread's metadata (`metadata.stepgate`), found by the run's
 * `(resourceId, threadId)` — the ids the app gives with `memory: { resource,
 * thread }`, never the model's or a run id — as workflow
 * `<workflowPrefix><resourceId>/<threadId>`. It is never derived from the
 * messages: a memory window (`lastMessages`), recall or a pruned history never
 * renumbers a step, a new thread starts a new numbering, and a thread served by
 * another process (the same storage) continues where the last one left off.
 *
 * A call that stepgate holds for a person (a tool whose stepgate policy is
 * `approval`) suspends the tool with Mastra's `suspend()`: the run ends
 * `suspended` (a `tool-call-suspended` chunk when streaming), its payload a
 * `StepgateHeld` naming the step and the `stepgate approvals approve` command.
 * Once the person has approved it in stepgate, resume the run
 * (`agent.resumeGenerate({}, { runId })` or `resumeStream`): the call keeps its
 * step and gets its answer. The decision is stepgate's; the resume data is not read.
 */
import type { PublicSchema } from "@mastra/core/schema";
import { createTool } from "@mastra/core/tools";

import { StepgateConfigError } from "./errors.js";
import { approveCommand, invokeStep, StepRun, type InDoubtOptions, type StepResult, type StepRunState } from "./run.js";
import type { Transport } from "./transport.js";

/** The part of Mastra's memory storage (`MemoryStorage`) the numbering uses. */
interface ThreadStore {
  getThreadById(args: { threadId: string; resourceId?: string }): Promise<{ id: string; metadata?: Record<string, unknown> } | null>;
  updateThreadMetadata(args: {
    id: string;
    resourceId?: string;
    update: (thread: { metadata?: Record<string, unknown> }) => Record<string, unknown> | undefined;
  }): Promise<unknown>;
}

/** Mastra's storage (`MastraCompositeStore`, e.g. `LibSQLStore`, `PostgresStore`), or its memory domain. */
export type MastraStorage = { getStore(name: "memory"): Promise<unknown> } | ThreadStore;

/** Where a tool call runs: the run's memory thread, and what the tool context offers to find the storage. */
export interface ThreadOf {
  resourceId: string | undefined;
  threadId: string | undefined;
  /** The tool's execution context (its `mastra` instance and the agent's `memory`). */
  context?: unknown;
}

interface Live {
  run: Promise<StepRun>;
  users: number;
  saving: Promise<void>;
}

async function threadStore(storage: unknown): Promise<ThreadStore | undefined> {
  if (typeof storage !== "object" || storage === null) return undefined;
  const s = storage as { getStore?: unknown; getThreadById?: unknown };
  if (typeof s.getStore === "function") return threadStore(await (storage as { getStore(n: string): Promise<unknown> }).getStore("memory"));
  if (typeof s.getThreadById === "function") return storage as ThreadStore;
  return undefined;
}

/** The storage of a tool's context: the agent's memory's, else the Mastra instance's. */
function storageOf(context: unknown): unknown {
  const ctx = (context ?? {}) as { memory?: { storage?: unknown }; mastra?: { getStorage?: () => unknown } };
  try {
    const fromMemory = ctx.memory?.storage; // a getter that throws when the memory has none
    if (fromMemory) return fromMemory;
  } catch {
    // none: the Mastra instance's
  }
  return ctx.mastra?.getStorage?.();
}

/**
 * The step numbering of Mastra memory threads: a `StepRun` per `(resourceId,
 * threadId)`, kept in the thread's metadata in Mastra's storage (the agent's
 * memory's storage, else the Mastra instance's, unless `storage` is given). It
 * is loaded for the calls in flight and saved there before each call is
 * published, so a thread served by several processes in turn always continues
 * from storage, and a process that dies mid-call leaves the call to the
 * model's retry. A thread whose numbering was lost (another storage, a wiped
 * row) starts again at 0 and cannot prove its position: its first call that
 * another life of the thread already made refuses (`StepgatePositionLost`).
 */
export class ThreadSteps {
  readonly workflowPrefix: string;
  readonly metadataKey: string;
  readonly storage: MastraStorage | undefined;
  readonly #live = new WeakMap<object, Map<string, Live>>();

  constructor(options: { workflowPrefix?: string; metadataKey?: string; storage?: MastraStorage } = {}) {
    this.workflowPrefix = options.workflowPrefix ?? "";
    this.metadataKey = options.metadataKey ?? "stepgate";
    this.storage = options.storage;
  }

  workflowId(resourceId: string, threadId: string): string {
    return `${this.workflowPrefix}${resourceId}/${threadId}`;
  }

  /** Run `fn` with the thread's numbering (shared by the thread's calls in flight in this process). */
  async with<T>(where: ThreadOf, fn: (run: StepRun) => Promise<T>): Promise<T> {
    const { resourceId, threadId } = where;
    if (typeof resourceId !== "string" || !resourceId || typeof threadId !== "string" || !threadId) {
      throw new TypeError(
        "stepgate's Mastra tools number their calls per memory thread: give the agent a memory and run it with " +
          "`memory: { resource, thread }` (agent.generate(…, { memory: { resource: userId, thread: threadId } }))",
      );
    }
    const store = await threadStore(this.storage ?? storageOf(where.context));
    if (!store) {
      throw new StepgateConfigError(
        "stepgate's Mastra tools keep their numbering in Mastra's storage: give the Mastra instance (or the agent's memory) a storage, or pass `storage` to ThreadSteps",
      );
    }
    let threads = this.#live.get(store);
    if (!threads) this.#live.set(store, (threads = new Map()));
    const key = JSON.stringify([resourceId, threadId]);
    let live = threads.get(key);
    if (!live) {
      const entry: Live = { users: 0, saving: Promise.resolve(), run: Promise.resolve(undefined as never) };
      entry.run = this.#load(store, entry, resourceId, threadId);
      entry.run.catch(() => {
        if (threads!.get(key) === entry) threads!.delete(key);
      });
      threads.set(key, (live = entry));
    }
    live.users++;
    try {
      return await fn(await live.run);
    } finally {
      if (--live.users === 0) {
        // Loaded again from storage by the thread's next call: another process may serve it in between.
        await live.saving.catch(() => undefined);
        if (live.users === 0 && threads.get(key) === live) threads.delete(key);
      }
    }
  }

  async #load(store: ThreadStore, live: Live, resourceId: string, threadId: string): Promise<StepRun> {
    const thread = await store.getThreadById({ threadId, resourceId });
    if (!thread) {
      throw new StepgateConfigError(
        `no memory thread ${JSON.stringify(threadId)} of resource ${JSON.stringify(resourceId)} in Mastra's storage: ` +
          "stepgate keeps the thread's step numbering in its metadata (run the agent with memory)",
      );
    }
    const workflowId = this.workflowId(resourceId, threadId);
    const saved = thread.metadata?.[this.metadataKey];
    if (saved !== undefined && saved !== null) {
      if (!StepRun.isState(saved)) {
        throw new StepgateConfigError(`the metadata.${this.metadataKey} of thread ${JSON.stringify(threadId)} is not a stepgate numbering`);
      }
      if (saved.workflow_id !== workflowId) {
        throw new StepgateConfigError(
          `thread ${JSON.stringify(threadId)} holds the numbering of workflow ${JSON.stringify(saved.workflow_id)}, not ` +
            `${JSON.stringify(workflowId)} (another workflowPrefix?)`,
        );
      }
    }
    const write = async (state: StepRunState): Promise<void> => {
      const updated = await store.updateThreadMetadata({
        id: threadId,
        resourceId,
        update: (t) => ({ ...(t.metadata ?? {}), [this.metadataKey]: state }),
      });
      if (!updated) throw new StepgateConfigError(`memory thread ${JSON.stringify(threadId)} is gone: its step numbering cannot be saved`);
    };
    // Saves of one thread are chained, so storage gets them in order.
    const save = (state: StepRunState): Promise<void> => {
      const next = live.saving.then(() => write(state));
      live.saving = next.catch(() => undefined);
      return next;
    };
    return saved ? StepRun.resume(saved as StepRunState, save) : new StepRun(workflowId, { save });
  }
}

/** A held call's suspend payload: what a person approves in stepgate before the run is resumed. */
export interface StepgateHeld {
  stepgate: "awaiting_approval";
  workflow_id: string;
  step_index: number;
  tool: string;
  arguments: unknown;
  /** The command that lets the call run. */
  approve: string;
  /** The same, in a sentence. */
  reason: string;
}

export interface StepgateToolOptions extends InDoubtOptions {
  /** The stepgate tool's name (as configured in stepgate); also the Mastra tool's id. */
  name: string;
  description?: string;
  /** The input's schema: a zod schema, a JSON Schema object, …; default: any JSON object. */
  inputSchema?: unknown;
  /** How long a call waits for its answer before the model reads "not answered yet". Default 60 s. */
  timeoutMs?: number;
}

/** The output for the model: the tool's output when ok, else stepgate's model-readable text. */
function modelOutput(result: StepResult): unknown {
  return result.kind === "answer" && result.answer.ok ? result.answer.output : result.text;
}

interface ToolContext {
  abortSignal?: AbortSignal;
  suspend?: (payload: unknown) => Promise<unknown>;
  agent?: { toolCallId?: string; threadId?: string; resourceId?: string; suspend?: (payload: unknown) => Promise<unknown> };
}

/**
 * A Mastra tool (`createTool`) whose calls go through stepgate: the step from
 * the thread's numbering, the call published to stepgate, stepgate's answer
 * to the model. Its own code never runs here: stepgate's tool of that name does.
 *
 *     const steps = new ThreadSteps();
 *     const agent = new Agent({ …, tools: { create_ticket: stepgateTool(client, steps, { name: "create_ticket" }) }, memory });
 *     await agent.generate("…", { memory: { resource: "user-1", thread: "thread-42" } });
 */
export function stepgateTool(transport: Transport, steps: ThreadSteps, options: StepgateToolOptions) {
  return createTool({
    id: options.name,
    description: options.description ?? `The ${options.name} tool.`,
    inputSchema: (options.inputSchema ?? { type: "object", additionalProperties: true }) as PublicSchema<Record<string, unknown>>,
    execute: async (input: unknown, context: unknown) => {
      const ctx = (context ?? {}) as ToolContext;
      const agent = ctx.agent ?? {};
      return steps.with({ resourceId: agent.resourceId, threadId: agent.threadId, context }, async (run) => {
        const result = await invokeStep(transport, run, options.name, (input ?? {}) as Record<string, unknown>, {
          ...(agent.toolCallId !== undefined ? { callId: agent.toolCallId } : {}),
          onHeld: "return",
          ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
          ...(options.inDoubtWaitMs ? { inDoubtWaitMs: options.inDoubtWaitMs } : {}),
          ...(ctx.abortSignal ? { signal: ctx.abortSignal } : {}),
        });
        const suspend = agent.suspend ?? ctx.suspend;
        if (result.kind === "held" && suspend) {
          const h = result.held;
          const payload: StepgateHeld = {
            stepgate: "awaiting_approval",
            workflow_id: h.workflowId,
            step_index: h.stepIndex,
            tool: h.tool,
            arguments: h.event?.arguments ?? input,
            approve: approveCommand(h),
            reason: result.text,
          };
          // The run stops here; resumed, the tool runs again: the same step, its answer.
          return await suspend(payload);
        }
        return modelOutput(result);
      });
    },
  });
}
