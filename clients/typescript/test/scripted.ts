/** Scripted models for the frameworks' real runners, offline. */
import { randomUUID } from "node:crypto";

import { Usage } from "@openai/agents";
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

/** The AI SDK's own mock language model, answering the turns in order (then "done"). */
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
  const model = new MockLanguageModelV4({
    doGenerate: async (options) => {
      prompts.push(options.prompt);
      let turn = queue.shift() ?? "done";
      if (typeof turn === "function") turn = turn(outputsOf(options.prompt));
      if (typeof turn === "string") {
        return { content: [{ type: "text", text: turn }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
      }
      return {
        content: turn.map(([name, args]) => ({
          type: "tool-call" as const,
          toolCallId: `call-${randomUUID().slice(0, 12)}`,
          toolName: name,
          input: JSON.stringify(args),
        })),
        finishReason: { unified: "tool-calls", raw: "tool_calls" },
        usage,
        warnings: [],
      };
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
