/**
 * LangGraph.js adapter (`@langchain/langgraph`): tools for `ToolNode` whose
 * calls go through stepgate, with their step numbering in a checkpointed state
 * channel of their own; and a LangChain v1 middleware that routes every tool of
 * `createAgent` through stepgate the same way.
 *
 * The step key comes from the thread's durable state, never from the model or
 * the message list:
 *
 * - `workflowId` is the thread's `thread_id`, then `/` and the stable part of
 *   the node's `checkpoint_ns` (node names without task ids), then `@` and the
 *   lineage: 12 hex digits fixed when the state's numbering starts (derived
 *   from LangGraph's task id, so a re-run of that task after a crash finds the
 *   same one) and changed at a fork. A state that starts without its numbering
 *   is a new lineage: its calls are new steps, never an earlier state's answers.
 * - `stepIndex` is a counter in the `stepgate` channel (per namespace). Only
 *   tools advance it, so trimming (`RemoveMessage`), summarising or rewriting
 *   the messages never renumbers a step.
 * - A fork — a run from an older checkpoint (time travel, or after
 *   `updateState` on one) — starts a new lineage, so the fork's new calls are
 *   new steps and never receive the old branch's answers.
 *
 * The calls of one model turn are numbered in the order of the turn's
 * `tool_calls`, from the state the turn's tools all see, so parallel calls get
 * distinct steps and a re-run of the turn gets the same ones. A call whose
 * answer did not come in time is answered "not answered yet"; its step goes to
 * the thread's next call of the same tool — the model's retry, however
 * rephrased — which gets the first call's answer. A call held for a person's
 * approval is an `interrupt()`; resumed (`new Command({ resume: … })`) once the
 * person has decided in stepgate, the call gets its answer.
 */
import { ToolMessage, type BaseMessage } from "@langchain/core/messages";
import { tool, type StructuredToolInterface } from "@langchain/core/tools";
import {
  Annotation,
  Command,
  getConfig,
  getCurrentTaskInput,
  interrupt,
  MessagesAnnotation,
  ReducedValue,
  StateSchema,
} from "@langchain/langgraph";

import { answerText, type Answer } from "./answer.js";
import { StepgateMcpError, StepgatePublishError } from "./errors.js";
import { approveCommand, NOT_ANSWERED, settled, type InDoubtOptions } from "./run.js";
import type { Transport } from "./transport.js";

/** One namespace's numbering in the channel. */
export interface StepgateNamespace {
  lineage?: string;
  forked_at?: string | null;
  /** The next new step. */
  next?: number;
  /** Steps whose answer the model never got, by tool: [workflow id, step]. */
  unanswered?: Record<string, Array<[string, number]>>;
}

/** The `stepgate` channel: numbering per stable checkpoint namespace. */
export type StepgateChannel = Record<string, StepgateNamespace>;

/** A tool's update of the channel: what it takes, leaves, and the next step it saw. */
interface Delta {
  lineage: string;
  forked_at: string | null;
  next: number;
  take?: Record<string, Array<[string, number]>>;
  leave?: Record<string, Array<[string, number]>>;
}

const same = (a: [string, number], b: [string, number]) => a[0] === b[0] && a[1] === b[1];

/**
 * The reducer of the `stepgate` channel. Updates of one turn's parallel calls
 * commute: `next` is a maximum, `take` and `leave` name each call's own step.
 */
export function mergeSteps(current: StepgateChannel | undefined, update: Record<string, Delta | StepgateNamespace> | undefined): StepgateChannel {
  const out: StepgateChannel = { ...(current ?? {}) };
  for (const [ns, d] of Object.entries(update ?? {})) {
    const delta = d as Delta & StepgateNamespace;
    const c: StepgateNamespace = { ...(out[ns] ?? {}) };
    const unanswered: Record<string, Array<[string, number]>> = {};
    for (const [t, v] of Object.entries(c.unanswered ?? {})) unanswered[t] = v.map((k) => [k[0], k[1]]);
    for (const [t, v] of Object.entries(delta.unanswered ?? {})) unanswered[t] = v.map((k) => [k[0], k[1]]);
    for (const [t, keys] of Object.entries(delta.take ?? {})) {
      unanswered[t] = (unanswered[t] ?? []).filter((k) => !keys.some((x) => same(x, k)));
    }
    for (const [t, keys] of Object.entries(delta.leave ?? {})) {
      const list = (unanswered[t] ??= []);
      for (const k of keys) if (!list.some((x) => same(x, k))) list.push([k[0], k[1]]);
    }
    if (delta.lineage !== undefined) {
      c.lineage = delta.lineage;
      c.forked_at = delta.forked_at ?? null;
    }
    c.next = Math.max(c.next ?? 0, delta.next ?? 0);
    c.unanswered = Object.fromEntries(Object.entries(unanswered).filter(([, v]) => v.length));
    out[ns] = c;
  }
  return out;
}

/** The channel's annotation, to add to a graph's own state: `stepgate: stepgateChannel()`. */
export const stepgateChannel = () =>
  Annotation<StepgateChannel, Record<string, Delta | StepgateNamespace>>({ reducer: mergeSteps, default: () => ({}) });

/** `MessagesAnnotation` with the `stepgate` channel. */
export const StepgateAnnotation = Annotation.Root({
  ...MessagesAnnotation.spec,
  stepgate: stepgateChannel(),
});

function stableNs(checkpointNs: string): string {
  return checkpointNs
    .split("|")
    .filter(Boolean)
    .map((p) => p.split(":")[0])
    .join("|");
}

async function hash12(text: string): Promise<string> {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("").slice(0, 12);
}

type ToolCallLike = { id?: string; name: string };

function turnOf(messages: BaseMessage[], toolCallId: string): ToolCallLike[] {
  for (let i = messages.length - 1; i >= 0; i--) {
    const calls = (messages[i] as { tool_calls?: ToolCallLike[] }).tool_calls;
    if (calls?.some((c) => c.id === toolCallId)) return calls;
  }
  throw new Error(`tool call ${toolCallId} is not in the state's messages`);
}

/** Where one call of a turn stands: its step key and the channel update. */
class Place {
  key: [string, number] = ["", 0];
  taken = false;
  ns = "";
  workflowId = "";
  delta!: Delta;
  constructor(
    readonly name: string,
    readonly toolCallId: string,
    readonly channel: string,
  ) {}

  static async of(state: Record<string, unknown>, config: Record<string, unknown>, toolCallId: string, name: string, channel: string): Promise<Place> {
    const conf = (config.configurable ?? {}) as Record<string, unknown>;
    const thread = conf.thread_id;
    if (!thread) throw new Error("run the graph with { configurable: { thread_id } } and a checkpointer");
    if (!(channel in state)) {
      throw new Error(`the graph's state has no \`${channel}\` channel: build it on StepgateAnnotation, or add \`${channel}: stepgateChannel()\` to its state`);
    }
    const p = new Place(name, toolCallId, channel);
    p.ns = stableNs(String(conf.checkpoint_ns ?? ""));
    const ch = ((state[channel] as StepgateChannel | undefined) ?? {})[p.ns];
    let lineage = ch?.lineage ?? "";
    let forkedAt = ch?.forked_at ?? null;
    const replayedFrom = (conf.__pregel_replay_state as { checkpointId?: string } | undefined)?.checkpointId;
    const task = String(conf.__pregel_task_id ?? "");
    if (!ch || !ch.lineage) {
      // No numbering yet in this state: a new lineage, so a state started
      // over never reuses an earlier one's steps. The task id is LangGraph's,
      // derived from the checkpoint: a re-run of this task finds it again.
      lineage = await hash12(`new|${task}`);
      forkedAt = replayedFrom ?? null;
    } else if (replayedFrom && replayedFrom !== forkedAt) {
      // Time travel: this branch's steps must not be the old branch's.
      lineage = await hash12(`${lineage}|${replayedFrom}|${task}`);
      forkedAt = replayedFrom;
    }
    p.workflowId = `${String(thread)}${p.ns ? `/${p.ns}` : ""}@${lineage}`;
    const pool: Record<string, Array<[string, number]>> = {};
    for (const [t, v] of Object.entries(ch?.unanswered ?? {})) pool[t] = v.map((k) => [k[0], k[1]]);
    let next = ch?.next ?? 0;
    let mine: { key: [string, number]; taken: boolean } | undefined;
    for (const call of turnOf((state.messages ?? []) as BaseMessage[], toolCallId)) {
      const waiting = pool[call.name];
      let key: [string, number];
      let taken: boolean;
      if (waiting?.length) {
        key = waiting.shift()!;
        taken = true;
      } else {
        key = [p.workflowId, next++];
        taken = false;
      }
      if (call.id === toolCallId) mine = { key, taken };
    }
    if (!mine) throw new Error(`tool call ${toolCallId} not found in its turn`);
    p.key = mine.key;
    p.taken = mine.taken;
    p.delta = { lineage, forked_at: forkedAt, next };
    if (p.taken) p.delta.take = { [name]: [p.key] };
    return p;
  }

  /**
   * The step taken for this call is another call's (an identity conflict):
   * that step stays open for its real retry, and this call moves to a step of
   * its own, `<workflowId>#<toolCallId>` step 0 — the same on a re-run of this
   * task, and no other call's.
   */
  conflicted(): boolean {
    if (this.key[0].endsWith(`#${this.toolCallId}`)) return false;
    delete this.delta.take;
    this.taken = false;
    this.key = [`${this.workflowId}#${this.toolCallId}`, 0];
    return true;
  }

  result(text: string, unanswered = false): Command {
    if (unanswered) this.delta.leave = { [this.name]: [this.key] };
    return new Command({
      update: {
        messages: [new ToolMessage({ content: text, tool_call_id: this.toolCallId, name: this.name })],
        [this.channel]: { [this.ns]: this.delta },
      },
    });
  }
}

/** The interrupt's value for a call held for a person's approval. */
export interface StepgateHeld {
  stepgate: "awaiting_approval";
  workflow_id: string;
  step_index: number;
  tool: string;
  arguments: unknown;
  approve: string;
}

/** One call through stepgate from a graph's tool task: the `Command` with its ToolMessage and the channel's update. */
async function callThrough(
  transport: Transport,
  name: string,
  args: Record<string, unknown>,
  toolCallId: string,
  state: Record<string, unknown>,
  config: Record<string, unknown>,
  options: InDoubtOptions & { timeoutMs?: number; channel: string; signal?: AbortSignal },
): Promise<Command> {
  const place = await Place.of(state, config, toolCallId, name, options.channel);
  let answer: Answer | undefined;
  for (let hop = 0; hop < 2; hop++) {
    const [workflowId, stepIndex] = place.key;
    const callId = hop ? `${toolCallId}~${hop}` : toolCallId;
    const call = { workflowId, stepIndex, tool: name, arguments: args, callId };
    const wait = { ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}), ...(options.signal ? { signal: options.signal } : {}) };
    let outcome;
    try {
      outcome = await transport.call(call, { ...wait, onHeld: "return" });
      if (outcome.kind === "held") {
        // The graph pauses here until resumed; resumed, the tool runs again:
        // the same step, its answer.
        const held: StepgateHeld = {
          stepgate: "awaiting_approval",
          workflow_id: workflowId,
          step_index: stepIndex,
          tool: name,
          arguments: outcome.event?.arguments ?? args,
          approve: approveCommand({ workflowId, stepIndex, tool: name, attempt: 0 }),
        };
        interrupt(held);
        outcome = await transport.call(call, wait);
      }
    } catch (e) {
      if (e instanceof StepgatePublishError || e instanceof StepgateMcpError) return place.result(NOT_ANSWERED, true);
      throw e;
    }
    if (outcome.kind !== "answer") return place.result(NOT_ANSWERED, true);
    answer = outcome;
    if (!(answer.identityConflict && place.conflicted())) break;
  }
  return place.result(answerText(await settled(transport, answer!, args, options)));
}

export interface StepgateToolOptions extends InDoubtOptions {
  /** The stepgate tool's name (as configured in stepgate). */
  name: string;
  description: string;
  /** The arguments' schema: a zod object or a JSON Schema object. */
  schema: unknown;
  /** How long a call waits for its answer before the model reads "not answered yet". */
  timeoutMs?: number;
  /** The state channel of the numbering. Default `stepgate`. */
  channel?: string;
}

/**
 * A tool for LangGraph's `ToolNode` whose calls go through stepgate. The
 * graph's state needs the `stepgate` channel (`StepgateAnnotation`, or
 * `stepgate: stepgateChannel()` in its own) and a checkpointer.
 */
export function stepgateTool(transport: Transport, options: StepgateToolOptions): StructuredToolInterface {
  const channel = options.channel ?? "stepgate";
  return tool(
    async (input: unknown, runConfig: { toolCall?: { id?: string }; signal?: AbortSignal }) => {
      const toolCallId = runConfig?.toolCall?.id;
      if (!toolCallId) throw new Error("stepgate tools run in a ToolNode, from a model's tool call (no tool call id)");
      const state = getCurrentTaskInput<Record<string, unknown>>();
      return callThrough(transport, options.name, (input ?? {}) as Record<string, unknown>, toolCallId, state, getConfig() as Record<string, unknown>, {
        channel,
        ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
        ...(options.inDoubtWaitMs ? { inDoubtWaitMs: options.inDoubtWaitMs } : {}),
        ...(runConfig.signal ? { signal: runConfig.signal } : {}),
      });
    },
    { name: options.name, description: options.description, schema: options.schema as never },
  ) as unknown as StructuredToolInterface;
}

/** What `stepgateMiddleware` needs to route a call. */
export interface StepgateMiddlewareOptions extends InDoubtOptions {
  /** The tools that go through stepgate (by name); default: every tool of the agent. */
  tools?: string[];
  timeoutMs?: number;
}

/**
 * A LangChain v1 middleware (`createAgent({ middleware: [...] })`) that routes
 * tool calls through stepgate: the agent's tools declare the schema the model
 * sees, stepgate's tool of the same name runs. Its state adds the `stepgate`
 * channel to the agent's.
 */
export async function stepgateMiddleware(transport: Transport, options: StepgateMiddlewareOptions = {}) {
  const { createMiddleware } = await import("langchain");
  const { z } = await import("zod");
  const only = options.tools ? new Set(options.tools) : undefined;
  // The agent's state gains the channel (a middleware's state is a StateSchema).
  const channel = z.record(z.string(), z.any());
  const stateSchema = new StateSchema({
    stepgate: new ReducedValue(channel.optional() as never, { inputSchema: channel.optional() as never, reducer: mergeSteps as never }),
  });
  return createMiddleware({
    name: "stepgate",
    stateSchema,
    wrapToolCall: async (request, handler) => {
      const call = request.toolCall;
      if (only && !only.has(call.name)) return handler(request);
      if (!call.id) throw new Error("stepgate's middleware needs the model's tool call id");
      return callThrough(
        transport,
        call.name,
        (call.args ?? {}) as Record<string, unknown>,
        call.id,
        { ...(request.state as unknown as Record<string, unknown>), stepgate: (request.state as { stepgate?: StepgateChannel }).stepgate ?? {} },
        getConfig() as Record<string, unknown>,
        {
          channel: "stepgate",
          ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
          ...(options.inDoubtWaitMs ? { inDoubtWaitMs: options.inDoubtWaitMs } : {}),
        },
      );
    },
  });
}
