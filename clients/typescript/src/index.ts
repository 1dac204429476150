/**
 * stepgate for TypeScript agents.
 *
 * - `answer`: Result v1 typed (`Answer`), and the other outcomes of a call (`Held`, `Unanswered`).
 * - `transport`: a call (`StepCall`) and the `Transport` both clients serve.
 * - `stepgate/kafka`: `KafkaClient` over `@confluentinc/kafka-javascript` (Node).
 * - `stepgate/mcp`: `McpClient` over stepgate's MCP front, with `fetch` only (serverless, Bun, edge).
 * - `workflow`: `Workflow`, a run's steps numbered in order, `again(step)` for a lost answer.
 * - `settle`: `waitSettled`, an in-doubt step repeated until it is settled.
 * - `run`: `StepRun`, the durable numbering the adapters keep in their framework's state, and `invokeStep`.
 * - Adapters: `stepgate/ai`, `stepgate/openai-agents`, `stepgate/langgraph`, `stepgate/mastra`.
 */
export * from "./answer.js";
export * from "./errors.js";
export { murmur2, partitionFor } from "./murmur2.js";
export * from "./run.js";
export { waitSettled, type WaitSettledOptions } from "./settle.js";
export type { CallOptions, StepCall, Transport } from "./transport.js";
export { Workflow, type WorkflowCallOptions } from "./workflow.js";
