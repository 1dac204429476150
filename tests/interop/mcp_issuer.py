"""A test OAuth 2.1 authorization server for `stepgate mcp`, on loopback: an
RSA key generated at start, its JWK Set, RFC 8414 metadata, and a token
endpoint for the client_credentials grant that issues RS256 JWTs for the
`resource` asked for (RFC 8707), with the scopes asked for that the client is
allowed. Clients and their secrets and scopes come from CLIENTS_JSON:
{"agent-a": {"secret": "...", "scopes": ["tickets", "search"]}, ...}.

For the tests only, POST /mint takes claims as JSON and returns a token signed
with the published key (or, with "foreign_key": true, with a key that is not
published, under the same kid); POST /rotate makes a new key (a new kid),
published beside the old one and signing from then on; POST /withdraw with
{"kid": ...} removes that key from the JWK Set (its tokens must then be
refused); GET /stats counts the JWK Set's fetches.

usage: mcp_issuer.py PORT CLIENTS_JSON
"""
import base64
import json
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

port, clients = int(sys.argv[1]), json.loads(sys.argv[2])
issuer = f"http://127.0.0.1:{port}"
foreign = rsa.generate_private_key(public_exponent=65537, key_size=2048)
stats = {"jwks_fetches": 0, "tokens": 0}
lock = threading.Lock()
keys = []  # (kid, private key), the last one signing
jwks = []


def rotate():
    kid = f"test-key-{len(keys) + 1}"
    k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(k.public_key()))
    public.update({"kid": kid, "use": "sig", "alg": "RS256"})
    with lock:
        keys.append((kid, k))
        jwks.append(public)
    return kid


rotate()


def sign(claims, signing_key=None):
    kid, k = keys[-1]
    return jwt.encode(claims, signing_key or k, algorithm="RS256", headers={"kid": kid})


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = urllib.parse.urlparse(self.path).path
        if path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
            self.reply(200, {
                "issuer": issuer,
                "authorization_endpoint": f"{issuer}/authorize",
                "token_endpoint": f"{issuer}/token",
                "jwks_uri": f"{issuer}/jwks",
                "grant_types_supported": ["client_credentials"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
                "response_types_supported": ["code"],
            })
        elif path == "/jwks":
            with lock:
                stats["jwks_fetches"] += 1
            with lock:
                self.reply(200, {"keys": list(jwks)})
        elif path == "/stats":
            with lock:
                self.reply(200, dict(stats))
        else:
            self.reply(404, {"error": "not_found"})

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n).decode()

    def do_POST(self):
        path = urllib.parse.urlparse(self.path).path
        if path == "/token":
            self.token()
        elif path == "/mint":
            c = json.loads(self.body())
            foreign_key = c.pop("foreign_key", False)
            now = int(time.time())
            claims = {"iss": issuer, "iat": now, "exp": now + 300}
            claims.update(c)
            self.reply(200, {"access_token": sign(claims, foreign if foreign_key else None)})
        elif path == "/rotate":
            self.reply(200, {"kid": rotate()})
        elif path == "/withdraw":
            kid = json.loads(self.body())["kid"]
            with lock:
                jwks[:] = [k for k in jwks if k["kid"] != kid]
            self.reply(200, {"withdrawn": kid})
        else:
            self.reply(404, {"error": "not_found"})

    def token(self):
        form = dict(urllib.parse.parse_qsl(self.body()))
        client_id, secret = form.get("client_id"), form.get("client_secret")
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            raw = base64.b64decode(auth[6:]).decode()
            client_id, secret = (urllib.parse.unquote(p) for p in raw.split(":", 1))
        client = clients.get(client_id or "")
        if client is None or client["secret"] != secret:
            return self.reply(401, {"error": "invalid_client"})
        if form.get("grant_type") != "client_credentials":
            return self.reply(400, {"error": "unsupported_grant_type"})
        resource = form.get("resource")
        if not resource:
            return self.reply(400, {"error": "invalid_target", "error_description": "resource is required"})
        asked = form.get("scope", "").split()
        granted = [s for s in client["scopes"] if not asked or s in asked]
        now = int(time.time())
        claims = {"iss": issuer, "sub": client_id, "aud": resource, "iat": now, "exp": now + 300,
                  "scope": " ".join(granted), "client_id": client_id}
        with lock:
            stats["tokens"] += 1
        self.reply(200, {"access_token": sign(claims), "token_type": "Bearer", "expires_in": 300,
                         "scope": " ".join(granted)})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
