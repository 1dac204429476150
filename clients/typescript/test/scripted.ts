/** Scripted models for the frameworks' real runners, offline. */
import { randomUUID } from "node:crypto";

import { Usage } from "@openai/agents";
import { MastraLanguageModelV2Mock, simulateReadableStream } from "@mastra/core/test-utils/llm-mock";
import { simulateReadableStream as aiStream } from "ai";
import { MockLanguageModelV4 } from "ai/test";

/**
 * A turn: a final text, tool calls `[name, args]`, or a function giving either
 * (run when the model is asked, with the tool outputs it is shown then).
 */
export type Turn = string | Array<[string, Record<string, unknown>]> | ((toolOutputs: unknown[]) => string | Array<[string, Record<string, unknown>]>);

const usage = {
  inputTokens: { total: 1, noCache: 1, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 1, text: 1, reasoning: undefined },
};

/** The AI SDK's own mock language model, answering the turns in order (then "done"), generating or streaming. */
export function aiModel(turns: Turn[]) {
  const queue = [...turns];
  const prompts: unknown[] = [];
  const outputsOf = (prompt: unknown): unknown[] => {
    const out: unknown[] = [];
    for (const m of (prompt ?? []) as Array<{ role: string; content: unknown }>) {
      if (m.role !== "tool" || !Array.isArray(m.content)) continue;
      for (const part of m.content as Array<{ type: string; output?: { type: string; value: unknown } }>) {
        if (part.type === "tool-result") out.push(part.output?.value);
      }
    }
    return out;
  };
  const next = (prompt: unknown) => {
    prompts.push(prompt);
    let turn = queue.shift() ?? "done";
    if (typeof turn === "function") turn = turn(outputsOf(prompt));
    return turn;
  };
  const calls = (turn: Array<[string, Record<string, unknown>]>) =>
    turn.map(([name, args]) => ({
      type: "tool-call" as const,
      toolCallId: `call-${randomUUID().slice(0, 12)}`,
      toolName: name,
      input: JSON.stringify(args),
    }));
  const stop = { unified: "stop" as const, raw: "stop" };
  const toolCalls = { unified: "tool-calls" as const, raw: "tool_calls" };
  const model = new MockLanguageModelV4({
    // generateText
    doGenerate: async (options) => {
      const turn = next(options.prompt);
      if (typeof turn === "string") return { content: [{ type: "text", text: turn }], finishReason: stop, usage, warnings: [] };
      return { content: calls(turn), finishReason: toolCalls, usage, warnings: [] };
    },
    // streamText (and ToolLoopAgent.stream)
    doStream: async (options) => {
      const turn = next(options.prompt);
      const parts: unknown[] = [{ type: "stream-start", warnings: [] }];
      if (typeof turn === "string") parts.push({ type: "text-start", id: "t" }, { type: "text-delta", id: "t", delta: turn }, { type: "text-end", id: "t" });
      else parts.push(...calls(turn));
      parts.push({ type: "finish", finishReason: typeof turn === "string" ? stop : toolCalls, usage });
      return { stream: aiStream({ chunks: parts }) as never };
    },
  });
  return {
    model,
    prompts,
    /** The tool results the model was shown in its last prompt, as the SDK sent them. */
    toolOutputs(): unknown[] {
      return outputsOf(prompts.at(-1));
    },
  };
}

/** A scripted model for OpenAI Agents JS's Runner: the turns in order (then "done"). */
export function agentsModel(turns: Turn[]) {
  const queue = [...turns];
  const inputs: unknown[] = [];
  const outputsOf = (input: unknown): string[] =>
    Array.isArray(input)
      ? input
          .filter((i: { type?: string }) => i.type === "function_call_result")
          .map((i: { output: unknown }) => {
            const o = i.output as { type?: string; text?: string } | string;
            return typeof o === "string" ? o : (o.text ?? JSON.stringify(o));
          })
      : [];
  const model = {
    async getResponse(request: { input: unknown }) {
      inputs.push(request.input);
      let turn = queue.shift() ?? "done";
      if (typeof turn === "function") turn = turn(outputsOf(request.input));
      const usage = new Usage();
      if (typeof turn === "string") {
        return {
          usage,
          output: [{ type: "message", id: `msg-${randomUUID().slice(0, 8)}`, role: "assistant", status: "completed", content: [{ type: "output_text", text: turn }] }],
        };
      }
      return {
        usage,
        output: turn.map(([name, args]) => {
          const callId = `call-${randomUUID().slice(0, 12)}`;
          return { type: "function_call", id: `fc-${callId}`, callId, name, arguments: JSON.stringify(args), status: "completed" };
        }),
      };
    },
    // eslint-disable-next-line require-yield
    async *getStreamedResponse(): AsyncIterable<never> {
      throw new Error("not used");
    },
  };
  return {
    model,
    inputs,
    /** The tool outputs the model was shown in its last input. */
    toolOutputs(): string[] {
      return outputsOf(inputs.at(-1));
    },
  };
}

/**
 * Mastra's own test model (`MastraLanguageModelV2Mock`) for its Agent: the
 * turns in order (then "done"), for `generate` and `stream` alike.
 */
export function mastraModel(turns: Turn[]) {
  const queue = [...turns];
  const prompts: unknown[] = [];
  const outputsOf = (prompt: unknown): unknown[] => {
    const out: unknown[] = [];
    for (const m of (prompt ?? []) as Array<{ role: string; content: unknown }>) {
      if (m.role !== "tool" || !Array.isArray(m.content)) continue;
      for (const part of m.content as Array<{ type: string; output?: { type: string; value: unknown } }>) {
        if (part.type === "tool-result") out.push(part.output?.value);
      }
    }
    return out;
  };
  const mastraUsage = { inputTokens: 1, outputTokens: 1, totalTokens: 2 };
  const next = (prompt: unknown) => {
    prompts.push(prompt);
    let turn = queue.shift() ?? "done";
    if (typeof turn === "function") turn = turn(outputsOf(prompt));
    return turn;
  };
  const calls = (turn: Array<[string, Record<string, unknown>]>) =>
    turn.map(([name, args]) => ({ type: "tool-call" as const, toolCallId: `call-${randomUUID().slice(0, 12)}`, toolName: name, input: JSON.stringify(args) }));
  const model = new MastraLanguageModelV2Mock({
    doGenerate: async (options) => {
      const turn = next(options.prompt);
      if (typeof turn === "string") return { content: [{ type: "text", text: turn }], finishReason: "stop", usage: mastraUsage, warnings: [] };
      return { content: calls(turn), finishReason: "tool-calls", usage: mastraUsage, warnings: [] };
    },
    doStream: async (options) => {
      const turn = next(options.prompt);
      const parts: unknown[] = [{ type: "stream-start", warnings: [] }];
      if (typeof turn === "string") parts.push({ type: "text-start", id: "t" }, { type: "text-delta", id: "t", delta: turn }, { type: "text-end", id: "t" });
      else parts.push(...calls(turn));
      parts.push({ type: "finish", finishReason: typeof turn === "string" ? "stop" : "tool-calls", usage: mastraUsage });
      return { stream: simulateReadableStream({ chunks: parts }) as never };
    },
  });
  return {
    model,
    prompts,
    /** The tool results the model was shown in its last prompt. */
    toolOutputs(): unknown[] {
      return outputsOf(prompts.at(-1));
    },
  };
}
