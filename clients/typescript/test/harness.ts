/**
 * A real `stepgate run` (and `stepgate mcp --listen`) for the package's tests.
 *
 * Environment:
 * - `KAFKA_BROKERS` (default 127.0.0.1:9092): a broker with transactions.
 * - `STEPGATE_BIN`: the stepgate binary; by default `$CARGO_TARGET_DIR/debug/stepgate`
 *   or the clone's `target/debug/stepgate`.
 *
 * Each stack has its own random topics, state directory and tool server (an
 * HTTP server here that counts raw invocations), so runs never see each
 * other's records. Tests share a stack and tell their calls apart by workflow id.
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { randomUUID } from "node:crypto";
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type IncomingHttpHeaders, type Server } from "node:http";
import { createRequire } from "node:module";
import { createServer as netServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { KafkaClient } from "../src/kafka.js";
import { McpClient } from "../src/mcp.js";

const require = createRequire(import.meta.url);

/** The repository's root (clients/typescript/build/test → four levels up). */
export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

export const brokers = (): string => process.env.KAFKA_BROKERS ?? "127.0.0.1:9092";

export function stepgateBin(): string {
  if (process.env.STEPGATE_BIN) return process.env.STEPGATE_BIN;
  const candidates = [
    ...(process.env.CARGO_TARGET_DIR ? [join(process.env.CARGO_TARGET_DIR, "debug", "stepgate")] : []),
    join(REPO, "target", "debug", "stepgate"),
  ];
  const found = candidates.find((c) => existsSync(c));
  if (!found) throw new Error(`no stepgate binary: run \`cargo build\` (or set STEPGATE_BIN); looked at ${candidates.join(", ")}`);
  return found;
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Wait for `cond()` to be truthy (polled), or fail after `limitMs`. */
export async function eventually<T>(cond: () => T | Promise<T>, limitMs: number, what: string, everyMs = 50): Promise<T> {
  const deadline = Date.now() + limitMs;
  for (;;) {
    const v = await cond();
    if (v) return v;
    if (Date.now() >= deadline) throw new Error(`timed out after ${limitMs} ms waiting for: ${what}`);
    await sleep(everyMs);
  }
}

export interface Invocation {
  tool: string;
  headers: IncomingHttpHeaders;
  body: unknown;
  workflowId: string;
  stepIndex: number;
}

/**
 * An HTTP tool for stepgate: `POST /t/<tool>` answers `{tool, echo: body, together}`.
 * Per tool: a delay, a hold (until released), a rendezvous (each call waits
 * until `n` are inside at once), or a fixed HTTP status.
 */
export class ToolServer {
  readonly calls: Invocation[] = [];
  readonly delays = new Map<string, number>();
  readonly statuses = new Map<string, number>();
  /** A body a path answers with 200 (e.g. a `reconcile` lookup's verdict). */
  readonly bodies = new Map<string, unknown>();
  readonly #held = new Map<string, Array<() => void>>();
  readonly #holding = new Set<string>();
  readonly #meets = new Map<string, { n: number; waiting: Array<() => void>; most: number }>();
  readonly #inside = new Map<string, number>();
  readonly server: Server;
  base = "";

  constructor() {
    this.server = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (c: Buffer) => chunks.push(c));
      req.on("end", () => {
        void this.#handle(req.url ?? "", req.headers, Buffer.concat(chunks)).then(([status, out]) => {
          const data = JSON.stringify(out);
          res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(data) });
          res.end(data);
        });
      });
    });
  }

  async start(): Promise<void> {
    await new Promise<void>((r) => this.server.listen(0, "127.0.0.1", r));
    const addr = this.server.address();
    if (typeof addr !== "object" || addr === null) throw new Error("no address");
    this.base = `http://127.0.0.1:${addr.port}/t`;
  }

  async #handle(url: string, headers: IncomingHttpHeaders, raw: Buffer): Promise<[number, unknown]> {
    const tool = url.split("/").pop() ?? "";
    let body: unknown = null;
    try {
      body = JSON.parse(raw.toString("utf8") || "null");
    } catch {
      body = null;
    }
    this.calls.push({
      tool,
      headers,
      body,
      workflowId: String(headers["stepgate-workflow-id"] ?? ""),
      stepIndex: Number(headers["stepgate-step-index"] ?? -1),
    });
    const inside = (this.#inside.get(tool) ?? 0) + 1;
    this.#inside.set(tool, inside);
    let together = inside;
    try {
      if (this.#holding.has(tool)) await new Promise<void>((r) => this.#held.get(tool)!.push(r));
      const meet = this.#meets.get(tool);
      if (meet) {
        meet.most = Math.max(meet.most, inside);
        if (meet.most >= meet.n) meet.waiting.splice(0).forEach((w) => w());
        else await Promise.race([new Promise<void>((r) => meet.waiting.push(r)), sleep(25_000)]);
        together = meet.most;
      }
      const delay = this.delays.get(tool);
      if (delay) await sleep(delay);
      const status = this.statuses.get(tool);
      if (status) return [status, { error: `status ${status}` }];
      if (this.bodies.has(tool)) return [200, this.bodies.get(tool)];
      return [200, { tool, echo: body, together }];
    } finally {
      this.#inside.set(tool, (this.#inside.get(tool) ?? 1) - 1);
    }
  }

  /** Calls of `tool` wait inside until `release(tool)`. */
  hold(tool: string): void {
    this.#holding.add(tool);
    if (!this.#held.has(tool)) this.#held.set(tool, []);
  }

  release(tool: string): void {
    this.#holding.delete(tool);
    for (const r of this.#held.get(tool)?.splice(0) ?? []) r();
  }

  /** Calls of `tool` wait until `n` are inside at once (or 25 s pass). */
  meet(tool: string, n: number): void {
    this.#meets.set(tool, { n, waiting: [], most: 0 });
  }

  invocations(tool?: string, workflowId?: string): Invocation[] {
    return this.calls.filter((c) => (tool === undefined || c.tool === tool) && (workflowId === undefined || c.workflowId === workflowId));
  }

  count(tool?: string, workflowId?: string): number {
    return this.invocations(tool, workflowId).length;
  }

  close(): Promise<void> {
    for (const t of [...this.#holding]) this.release(t);
    this.server.closeAllConnections();
    return new Promise((r) => this.server.close(() => r()));
  }
}

/** [name, category, timeout, extra lines]. */
export type ToolSpec = [string, string, string, string?];

export const DEFAULT_TOOLS: ToolSpec[] = [
  ["create_ticket", "unkeyed", "10s"],
  ["send_email", "keyed", "10s"],
  ["slow", "unkeyed", "30s"],
  ["search", "read_only", "10s"],
  ["meet", "unkeyed", "30s"],
  // A tool whose calls are named by their recipient: a repeat to another
  // recipient is another call (identity_conflict), not a retry.
  ["mail", "keyed", "10s", 'identity = ["to"]\n'],
  // Every call waits for a person's approval (`stepgate approvals approve`).
  ["wire_approved", "unkeyed", "10s", 'policy = "approval"\n'],
  // An unkeyed tool stepgate can ask what happened: its lookup is the tool
  // server's `doubtful_lookup`, answering `ToolServer.bodies` ({tools} is the server).
  ["doubtful", "unkeyed", "10s", 'reconcile = { url = "{tools}/doubtful_lookup", every = "200ms", until = "60s" }\n'],
];

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = netServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const a = s.address();
      s.close(() => resolve(typeof a === "object" && a ? a.port : 0));
    });
  });
}

const TOPICS = ["intents", "results", "dlq", "progress", "changelog", "commands", "approvals"];

/** The MCP front's static token in the tests, and its principal's namespace. */
export const MCP_TOKEN = "stepgate-ts-test-token";
export const MCP_NAMESPACE = "ts/";

/** Topics, a tool server, a running `stepgate run`, and (on demand) `stepgate mcp --listen`. */
export class Stack {
  readonly prefix = `sgts-${randomUUID().slice(0, 10)}`;
  readonly dir = mkdtempSync(join(tmpdir(), "stepgate-ts-"));
  readonly tools = new ToolServer();
  readonly intents = `${this.prefix}.intents`;
  readonly results = `${this.prefix}.results`;
  readonly approvals = `${this.prefix}.approvals`;
  readonly brokers = brokers();
  readonly configPath = join(this.dir, "stepgate.toml");
  http = "";
  mcpUrl = "";
  proc: ChildProcess | undefined;
  readonly fronts = new Map<string, { url: string; proc: ChildProcess }>();

  static async start(tools: ToolSpec[] = DEFAULT_TOOLS): Promise<Stack> {
    const s = new Stack();
    await s.tools.start();
    s.http = `127.0.0.1:${await freePort()}`;
    const topics = TOPICS.map((k) => `${k} = "${s.prefix}.${k}"`).join("\n");
    const tables = tools
      .map(([n, c, t, more]) => `\n[tools.${n}]\ncategory = "${c}"\nurl = "${s.tools.base}/${n}"\ntimeout = "${t}"\nretries = 1\nbackoff = "50ms"\ndescription = "The ${n} tool."\ninput_schema = { type = "object" }\n${(more ?? "").replaceAll("{tools}", s.tools.base)}`)
      .join("");
    writeFileSync(
      s.configPath,
      `[kafka]
brokers = "${s.brokers}"
gate_group = "${s.prefix}-gate"
instance_id = "${s.prefix}-0"
partitions = 4
session_timeout = "10s"
transaction_timeout = "10s"

[kafka.topics]
${topics}

[state]
path = "${join(s.dir, "state")}"

[gate]
in_doubt_grace = "1s"

[http]
listen = "${s.http}"

[log]
level = "info,rdkafka=warn"

[mcp.auth.scopes]
all = ["*"]

[[mcp.auth.tokens]]
name = "ts"
token = "env:STEPGATE_TS_TEST_MCP_TOKEN"
scopes = ["all"]
${tables}`,
    );
    try {
      const out = s.cli("topics", "create");
      if (out.status !== 0) throw new Error(`stepgate topics create: ${out.stdout}\n${out.stderr}`);
      await s.#startRun();
    } catch (e) {
      await s.stop();
      throw e;
    }
    return s;
  }

  /** The config file is the whole config: no STEPGATE_* from the caller. */
  env(): NodeJS.ProcessEnv {
    const env: NodeJS.ProcessEnv = {};
    for (const [k, v] of Object.entries(process.env)) if (!k.startsWith("STEPGATE_")) env[k] = v;
    env.STEPGATE_TS_TEST_MCP_TOKEN = MCP_TOKEN;
    return env;
  }

  /** Another stepgate command against this stack's config. */
  cli(...args: string[]) {
    return spawnSync(stepgateBin(), [...args, "--config", this.configPath], { env: this.env(), encoding: "utf8", timeout: 180_000 });
  }

  async #startRun(): Promise<void> {
    const log = openSync(join(this.dir, "stepgate.log"), "a");
    const proc = spawn(stepgateBin(), ["run", "--config", this.configPath], { env: this.env(), stdio: ["ignore", "ignore", log] });
    this.proc = proc;
    await eventually(
      async () => {
        if (proc.exitCode !== null) throw new Error(`stepgate exited (${proc.exitCode}):\n${this.log()}`);
        try {
          const r = await fetch(`http://${this.http}/readyz`, { signal: AbortSignal.timeout(2000) });
          return r.status === 200;
        } catch {
          return false;
        }
      },
      120_000,
      "stepgate's /readyz",
      100,
    );
  }

  /**
   * `stepgate mcp --listen` on a free loopback port, with the static token
   * `MCP_TOKEN`; one front per `timeout` (how long a call waits for stepgate's
   * answer before the front answers "not answered yet").
   */
  async startMcp(timeout = "30s"): Promise<string> {
    const running = this.fronts.get(timeout);
    if (running) return running.url;
    const port = await freePort();
    const log = openSync(join(this.dir, "mcp.log"), "a");
    const proc = spawn(stepgateBin(), ["mcp", "--config", this.configPath, "--listen", `127.0.0.1:${port}`, "--timeout", timeout], {
      env: this.env(),
      stdio: ["ignore", "ignore", log],
    });
    const url = `http://127.0.0.1:${port}/mcp`;
    await eventually(
      async () => {
        if (proc.exitCode !== null) throw new Error(`stepgate mcp exited (${proc.exitCode}):\n${readFileSync(join(this.dir, "mcp.log"), "utf8")}`);
        try {
          await fetch(url, { method: "POST", signal: AbortSignal.timeout(2000) });
          return true;
        } catch {
          return false;
        }
      },
      60_000,
      "stepgate mcp listening",
      100,
    );
    this.fronts.set(timeout, { url, proc });
    if (!this.mcpUrl) this.mcpUrl = url;
    return url;
  }

  log(): string {
    const p = join(this.dir, "stepgate.log");
    return existsSync(p) ? readFileSync(p, "utf8").slice(-20_000) : "";
  }

  client(options: { timeoutMs?: number; republishAfterMs?: number } = {}): Promise<KafkaClient> {
    return KafkaClient.connect({ brokers: this.brokers, intents: this.intents, results: this.results, approvals: this.approvals, ...options });
  }

  mcpClient(options: { timeoutMs?: number } = {}): McpClient {
    if (!this.mcpUrl) throw new Error("startMcp() first");
    return new McpClient({ url: this.mcpUrl, token: MCP_TOKEN, ...options });
  }

  /** Approve a held call as a person would. */
  approve(workflowId: string, step: number, tool: string): void {
    const out = this.cli("approvals", "approve", workflowId, String(step), tool, "--by", "alice");
    if (out.status !== 0) throw new Error(`stepgate approvals approve: ${out.stdout}\n${out.stderr}`);
  }

  async stop(): Promise<void> {
    for (const p of [...[...this.fronts.values()].map((f) => f.proc), this.proc]) {
      if (p && p.exitCode === null) {
        const exited = new Promise((r) => p.once("exit", r));
        p.kill("SIGTERM");
        await Promise.race([exited, sleep(60_000)]);
        if (p.exitCode === null) p.kill("SIGKILL");
      }
    }
    await this.tools.close();
    rmSync(this.dir, { recursive: true, force: true });
    await this.#deleteTopics();
  }

  /** The stack's topics are its own (random names): gone with it. */
  async #deleteTopics(): Promise<void> {
    const Kafka = require("@confluentinc/kafka-javascript") as typeof import("@confluentinc/kafka-javascript");
    const admin = Kafka.AdminClient.create({ "bootstrap.servers": this.brokers });
    await Promise.all(TOPICS.map((k) => new Promise<void>((r) => admin.deleteTopic(`${this.prefix}.${k}`, 30_000, () => r()))));
    admin.disconnect();
  }
}

/** A fresh workflow id (in the MCP token's namespace, so it serves both transports). */
export const freshWorkflow = (label = "wf"): string => `${MCP_NAMESPACE}${label}-${randomUUID().slice(0, 12)}`;
