// Drives `stepgate mcp --listen` with the official MCP TypeScript SDK's client,
// authorized by the test issuer (mcp_issuer.py) through the SDK's own OAuth
// flow for the client_credentials grant: 401 → Protected Resource Metadata →
// authorization server metadata → a token for this resource. Prints one JSON
// object with what it saw; tests/broker/mcp.rs checks it.
//
// usage: node mcp_ts_client.mjs MCP_URL ISSUER_URL CLIENT_ID CLIENT_SECRET
// (run from a directory whose node_modules has @modelcontextprotocol/sdk)
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ClientCredentialsProvider } from "@modelcontextprotocol/sdk/client/auth-extensions.js";

const [url, issuer, clientId, clientSecret] = process.argv.slice(2);
const provider = new ClientCredentialsProvider({ clientId, clientSecret, expectedIssuer: issuer });
const transport = new StreamableHTTPClientTransport(new URL(url), { authProvider: provider });
const client = new Client({ name: "stepgate-ts-test", version: "0.0.0" });

const seen = (r) => ({
  text: (r.content ?? []).filter((c) => c.type === "text").map((c) => c.text),
  structured: r.structuredContent ?? null,
  is_error: Boolean(r.isError),
  meta: r._meta ?? {},
});

await client.connect(transport);
const out = { protocol: transport.protocolVersion ?? null };
out.tools = (await client.listTools()).tools.map((t) => t.name).sort();
const step = { workflow_id: `jwt:${clientId}/ts-wf-1`, step_index: 0 };
out.first = seen(await client.callTool({ name: "create_ticket", arguments: { title: "From TypeScript" }, _meta: step }));
out.again = seen(await client.callTool({ name: "create_ticket", arguments: { title: "From TypeScript, again" }, _meta: step }));
out.foreign_wf = seen(await client.callTool({
  name: "create_ticket", arguments: { title: "x" }, _meta: { workflow_id: "jwt:agent-a/wf-1", step_index: 0 },
}));
out.token = provider.tokens()?.access_token ?? null;
out.granted_scope = provider.tokens()?.scope ?? null;
await client.close();
console.log(JSON.stringify(out));
