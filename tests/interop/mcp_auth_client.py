"""Drives `stepgate mcp --listen` as an OAuth 2.1 resource server, against the
test issuer of mcp_issuer.py: the official MCP Python SDK's client obtains its
token the way the MCP authorization spec has a client do it (401 → Protected
Resource Metadata → authorization server metadata → client_credentials token
for this resource), then lists and calls tools; raw HTTP requests probe what a
well-behaved client never sends (no token, a token for another audience, an
expired one, one signed with another key, a scope without the tool, a foreign
Origin or Host, a 10 MiB body, another principal's session or workflow).
Prints one JSON object with what it saw; tests/broker/mcp.rs checks it.

usage: mcp_auth_client.py MCP_URL ISSUER_URL STATIC_TOKEN FLOOD_TOKEN
"""
import asyncio
import json
import sys
import time

import httpx2
from mcp import ClientSession
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.streamable_http import streamable_http_client

url, issuer, static_token, flood_token = sys.argv[1:5]
base = url.rsplit("/mcp", 1)[0]
SECRETS = {"agent-a": "secret-a", "agent-b": "secret-b", "agent-c": "secret-c"}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def init_body(pad=None):
    params = {"protocolVersion": "2025-11-25", "capabilities": {},
              "clientInfo": {"name": "probe", "version": "0"}}
    if pad is not None:
        params["padding"] = pad
    return {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}


def call_body(tool, args, meta):
    return {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": tool, "arguments": args, "_meta": meta}}


class Memory:
    """Token storage for the SDK's OAuth provider (it keeps what it was given)."""

    def __init__(self):
        self.tokens = None
        self.client_info = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client_info

    async def set_client_info(self, client_info):
        self.client_info = client_info


def seen(result):
    return {
        "text": [c.text for c in result.content if getattr(c, "type", "") == "text"],
        "structured": result.structured_content,
        "is_error": bool(result.is_error),
        "meta": result.meta or {},
    }


async def as_agent(name, work):
    """Run `work(session)` as the SDK client of `name`, authorized by the issuer."""
    storage = Memory()
    provider = ClientCredentialsOAuthProvider(
        server_url=url, storage=storage, client_id=name, client_secret=SECRETS[name], issuer=issuer)
    async with httpx2.AsyncClient(auth=provider, timeout=60) as http:
        async with streamable_http_client(url, http_client=http) as (read, write, *_):
            async with ClientSession(read, write) as s:
                await s.initialize()
                out = await work(s)
    out["token"] = storage.tokens.access_token if storage.tokens else None
    out["granted_scope"] = storage.tokens.scope if storage.tokens else None
    return out


async def agent_a(s):
    out = {"tools": sorted(t.name for t in (await s.list_tools()).tools)}
    step = {"workflow_id": "jwt:agent-a/wf-1", "step_index": 0}
    out["first"] = seen(await s.call_tool("create_ticket", {"title": "Printer jammed"}, meta=step))
    out["again"] = seen(await s.call_tool("create_ticket", {"title": "The printer is jammed"}, meta=step))
    # Its own namespace only: another's workflow is refused.
    out["foreign_wf"] = seen(await s.call_tool(
        "create_ticket", {"title": "x"}, meta={"workflow_id": "jwt:agent-b/wf-1", "step_index": 0}))
    # A JWT principal's namespace is under `jwt:`: the workflow a static
    # token of the same name would have is not its.
    out["static_root"] = seen(await s.call_tool(
        "create_ticket", {"title": "x"}, meta={"workflow_id": "agent-a/wf-1", "step_index": 0}))
    return out


async def agent_b(s):
    out = {"tools": sorted(t.name for t in (await s.list_tools()).tools)}
    out["search"] = seen(await s.call_tool(
        "search", {"q": "printers"}, meta={"workflow_id": "jwt:agent-b/wf-1", "step_index": 0}))
    return out


async def agent_c(s):
    # agent-c may call create_ticket, but only in its own namespace: naming
    # agent-a's answered step, and a workflow that never existed, must read the same.
    return {
        "others_step": seen(await s.call_tool(
            "create_ticket", {"title": "give me yours"},
            meta={"workflow_id": "jwt:agent-a/wf-1", "step_index": 0})),
        "no_such_wf": seen(await s.call_tool(
            "create_ticket", {"title": "give me yours"},
            meta={"workflow_id": "jwt:agent-a/never-used", "step_index": 0})),
        "own": seen(await s.call_tool(
            "create_ticket", {"title": "mine"}, meta={"workflow_id": "jwt:agent-c/wf-1", "step_index": 0})),
    }


def shown(r):
    return {"status": r.status_code, "www_authenticate": r.headers.get("www-authenticate"),
            "session": r.headers.get("mcp-session-id"), "retry_after": r.headers.get("retry-after"),
            "body": r.text[:1000]}


async def probes(out, tokens):
    async with httpx2.AsyncClient(timeout=60) as http:
        async def post(token=None, body=None, extra=None, content=None):
            h = dict(HEADERS)
            if token:
                h["Authorization"] = f"Bearer {token}"
            h.update(extra or {})
            data = content if content is not None else json.dumps(body or init_body())
            return shown(await http.post(url, headers=h, content=data))

        async def mint(**claims):
            r = await http.post(f"{issuer}/mint", json=claims)
            return r.json()["access_token"]

        out["unauthenticated"] = await post()
        challenge = out["unauthenticated"]["www_authenticate"] or ""
        meta_url = challenge.split('resource_metadata="', 1)[-1].split('"', 1)[0]
        out["metadata_url"] = meta_url
        r = await http.get(meta_url)
        out["metadata"] = {"status": r.status_code, "json": r.json() if r.status_code == 200 else None}
        r = await http.get(f"{base}/.well-known/oauth-protected-resource")
        out["metadata_root"] = {"status": r.status_code, "json": r.json() if r.status_code == 200 else None}

        now = int(time.time())
        good = dict(sub="agent-a", aud=url, scope="tickets search")
        valid = await mint(**good)
        tokens.append(valid)
        out["valid"] = await post(valid)
        bad = {
            "wrong_audience": await mint(**{**good, "aud": "http://127.0.0.1:1/other-mcp"}),
            "expired": await mint(**good, exp=now - 3600, iat=now - 7200),
            "foreign_key": await mint(**good, foreign_key=True),
            "no_audience": await mint(sub="agent-a", scope="tickets"),
        }
        tokens.extend(bad.values())
        for k, t in bad.items():
            out[k] = await post(t)
        out["not_a_jwt"] = await post("not-a-token-at-all")
        # A namespace claim with `/` in it would make a namespace that holds others.
        slash = await mint(sub="agent-a/eu", aud=url, scope="tickets")
        tokens.append(slash)
        out["slash_sub"] = await post(slash)

        # A scope without the tool: 403 insufficient_scope naming the scope that grants it.
        search_only = await mint(sub="agent-b", aud=url, scope="search")
        tokens.append(search_only)
        out["search_only_init"] = await post(search_only)
        out["scope_without_tool"] = await post(
            search_only, call_body("create_ticket", {"title": "x"}, {"workflow_id": "jwt:agent-b/x", "step_index": 0}))

        # Transport: Origin and Host.
        out["foreign_origin"] = await post(valid, extra={"Origin": "https://evil.example"})
        out["allowed_origin"] = await post(valid, extra={"Origin": "http://app.test"})
        out["foreign_host"] = await post(valid, extra={"Host": "evil.example"})
        # A body of 10 MiB.
        out["huge_body"] = await post(valid, content=json.dumps(init_body("x" * (10 * 1024 * 1024))))

        # Static tokens: the simple mode.
        out["static"] = await post(static_token)
        out["static_wrong"] = await post(static_token[:-1] + ("x" if static_token[-1] != "x" else "y"))

        # Another principal's session is unknown to it.
        a_session = out["valid"]["session"]
        agent_c = await mint(sub="agent-c", aud=url, scope="tickets")
        tokens.append(agent_c)
        out["hijack"] = await post(agent_c, {"jsonrpc": "2.0", "id": 3, "method": "tools/list"},
                                   extra={"Mcp-Session-Id": a_session or "none",
                                          "Mcp-Protocol-Version": "2025-11-25"})

        # Sessions per principal are capped (the config says 3): the oldest of
        # the static principal's four is closed.
        opened = [await post(static_token) for _ in range(3)]
        first = out["static"]["session"]
        out["capped_oldest"] = await post(static_token, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                                          extra={"Mcp-Session-Id": first or "none",
                                                 "Mcp-Protocol-Version": "2025-11-25"})
        out["capped_newest"] = await post(static_token, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                                          extra={"Mcp-Session-Id": opened[-1]["session"] or "none",
                                                 "Mcp-Protocol-Version": "2025-11-25"})

        # Rate limit per principal: the flood principal is stopped (429), a
        # bounded number of requests; agent-a is not.
        flood = {"sent": 0, "limited": None}
        for _ in range(50):
            batch = await asyncio.gather(*[
                http.get(url, headers={"Authorization": f"Bearer {flood_token}"}) for _ in range(20)])
            flood["sent"] += len(batch)
            limited = [r for r in batch if r.status_code == 429]
            if limited:
                flood["limited"] = shown(limited[0])
                break
        out["flood"] = flood
        out["after_flood_other"] = await post(valid)

        # The issuer rotates its key: a token under the new kid is accepted
        # once the front fetches the JWK Set again (at most every 10 s).
        rotated = (await http.post(f"{issuer}/rotate")).json()["kid"]
        new_key_token = await mint(**good)
        tokens.append(new_key_token)
        attempts, deadline = 0, time.monotonic() + 60
        while True:
            attempts += 1
            r = await post(new_key_token)
            if r["status"] == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        out["rotated"] = {"kid": rotated, "status": r["status"], "attempts": attempts}
        out["old_key_after_rotation"] = await post(valid)

        # Guessing tokens: an address that presents too many refused tokens
        # gets 429 for them; a valid token from it is still accepted. Last: it
        # is this script's address.
        guessing = {"sent": 0, "limited": None}
        for n in range(10):
            batch = await asyncio.gather(*[post(f"guess-{n}-{i}-0123456789abcdef") for i in range(20)])
            guessing["sent"] += len(batch)
            limited = [r for r in batch if r["status"] == 429]
            if limited:
                guessing["limited"] = limited[0]
                break
        out["guessing"] = guessing
        out["valid_while_locked"] = await post(valid)
        out["static_while_locked"] = await post(static_token)


async def main():
    out, tokens = {}, []
    out["agent_a"] = await as_agent("agent-a", agent_a)
    out["agent_b"] = await as_agent("agent-b", agent_b)
    out["agent_c"] = await as_agent("agent-c", agent_c)
    await probes(out, tokens)
    tokens += [out[a]["token"] for a in ("agent_a", "agent_b", "agent_c") if out[a]["token"]]
    out["tokens"] = tokens + [static_token]
    r = httpx2.get(f"{issuer}/stats")
    out["issuer_stats"] = r.json()
    print(json.dumps(out))


asyncio.run(main())
