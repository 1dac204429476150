/** `npm pack` of the package installs into an empty directory and type-checks under `tsc --strict`. */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { test } from "node:test";

import { REPO } from "./harness.js";

const PKG = resolve(REPO, "clients/typescript");

test("the packed package installs into an empty project and type-checks strictly", () => {
  const dir = mkdtempSync(join(tmpdir(), "stepgate-ts-pack-"));
  try {
    const out = execFileSync("npm", ["pack", "--pack-destination", dir, "--silent"], { cwd: PKG, encoding: "utf8" }).trim().split("\n").pop()!;
    const tarball = join(dir, out);
    const files = execFileSync("tar", ["tzf", tarball], { encoding: "utf8" });
    assert.match(files, /package\/dist\/index\.d\.ts/);
    assert.match(files, /package\/README\.md/);
    assert.doesNotMatch(files, /package\/(src|test|node_modules)\//);
    const app = join(dir, "app");
    execFileSync("mkdir", ["-p", app]);
    writeFileSync(join(app, "package.json"), JSON.stringify({ name: "app", private: true, type: "module" }));
    // The registry's copies the lockfile already fetched: no other network.
    const typescript = JSON.parse(execFileSync("npm", ["ls", "typescript", "--json"], { cwd: PKG, encoding: "utf8" })).dependencies.typescript.version;
    const types = JSON.parse(execFileSync("npm", ["ls", "@types/node", "--json"], { cwd: PKG, encoding: "utf8" })).dependencies["@types/node"].version;
    execFileSync("npm", ["install", "--prefer-offline", "--no-audit", "--no-fund", tarball, `typescript@${typescript}`, `@types/node@${types}`], { cwd: app, stdio: "pipe" });
    // What an edge or serverless app writes: the core and the MCP transport, no native module.
    writeFileSync(
      join(app, "index.ts"),
      `import { McpClient } from "stepgate/mcp";
import { StepRun, invokeStep, type Outcome, type Answer } from "stepgate";
import type { KafkaClient } from "stepgate/kafka";

const client = new McpClient({ url: "http://127.0.0.1:9480/mcp", token: "t" });
export async function once(): Promise<string> {
  const outcome: Outcome = await client.workflow("ts/w").call("create_ticket", { title: "x" });
  if (outcome.kind === "answer") {
    const a: Answer = outcome;
    return a.ok ? JSON.stringify(a.output) : a.status;
  }
  const run = new StepRun("ts/w2");
  const r = await invokeStep(client, run, "create_ticket", {});
  return r.text;
}
export type K = KafkaClient;
`,
    );
    writeFileSync(
      join(app, "tsconfig.json"),
      JSON.stringify({ compilerOptions: { strict: true, module: "NodeNext", moduleResolution: "NodeNext", target: "ES2022", noEmit: true, types: ["node"], lib: ["ES2023", "DOM"] }, files: ["index.ts"] }),
    );
    const tsc = join(app, "node_modules", ".bin", "tsc");
    try {
      execFileSync(tsc, ["-p", "tsconfig.json"], { cwd: app, encoding: "utf8" });
    } catch (e) {
      assert.fail(`tsc --strict: ${(e as { stdout?: string }).stdout}`);
    }
    assert.ok(readdirSync(join(app, "node_modules", "stepgate", "dist")).includes("mcp.d.ts"));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
