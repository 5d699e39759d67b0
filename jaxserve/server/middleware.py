"""The request guard: pure ASGI middleware in front of every route, before any routing or parsing.

    request head --> more than max_header_bytes or MAX_HEADER_COUNT headers: 431
                 --> API key (when configured): only PUBLIC (exact raw path and method: /health, /ping,
                     /version, /metrics) is open; anything else, /v1/* and /tokenize included, needs
                     `Authorization: Bearer <key>` (hmac.compare_digest): 401
                 --> tenant: with API keys, "key-<sha256 prefix>" of the request's key (the tenant header is
                     ignored); without, the tenant header when configured and sent (400 unless well
                     formed); else None                                      -> scope["jaxserve.tenant"]
                 --> body: read (chunked included) and counted; past max_body_bytes: 413 (at once when
                     Content-Length is far past it); else replayed to the app

NOTE: authentication looks at the raw request target (scope["raw_path"]) and lists the public routes,
not the protected ones, so `//v1/...`, `%2F`-encoded or absolute-form paths cannot reach a resource
without a key (vLLM GHSA-94f4-hr76-p5j6: a path rebuilt by the framework bypassed the key check).
uvicorn's own h11 limit (set slightly above max_header_bytes by the CLI) bounds what is buffered at all.

NOTE: with API keys the tenant comes from the key alone: a header a client may set freely would let it
mint a fresh tenant per request (or claim another key's "key-..." tenant) and defeat fair scheduling.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from jaxserve.config import ServerConfig
from jaxserve.server.errors import error_body

MAX_HEADER_COUNT = 256
_DRAIN_FACTOR = 4  # an over-limit body is read (and dropped) up to this many times the limit
# Raw path -> the methods that need no key (probes and monitoring; they reveal no model output).
PUBLIC = {b"/health": ("GET", "HEAD"), b"/ping": ("GET", "POST"), b"/version": ("GET",), b"/metrics": ("GET",)}
_TENANT = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


def tenant_of_key(key: bytes) -> str:
    """The fair-share tenant of an API key: a prefix of its SHA-256, so the key itself never shows."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


class Guard:
    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config
        keys = config.api_key if isinstance(config.api_key, tuple) else (config.api_key,) if config.api_key else ()
        self.keys = [key.encode() for key in keys]
        # The tenant header counts only when no key is configured (the key is the tenant otherwise).
        self.tenant_header = config.tenant_header.encode() if config.tenant_header and not self.keys else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > MAX_HEADER_COUNT or sum(len(k) + len(v) for k, v in headers) > self.config.max_header_bytes:
            await _reply(send, 431, f"request headers exceed {self.config.max_header_bytes} bytes or "
                                    f"{MAX_HEADER_COUNT} fields; send fewer or smaller headers")
            return
        authorization = tenant = content_length = None
        for name, value in headers:
            if name == b"authorization" and authorization is None:
                authorization = value
            elif name == self.tenant_header and tenant is None:
                tenant = value
            elif name == b"content-length":
                content_length = value
        if self.keys and not self._is_public(scope):
            key = _bearer(authorization)
            if key is None or not self._key_matches(key):
                await _reply(send, 401, "missing or invalid API key; send the header 'Authorization: Bearer <key>'",
                             extra_headers=[(b"www-authenticate", b"Bearer")])
                return
            tenant = tenant_of_key(key)
        elif tenant is not None:
            tenant = tenant.decode("latin-1")
            if not _TENANT.match(tenant):
                await _reply(send, 400, f"the {self.config.tenant_header} header must be 1 to 128 characters of "
                                        f"A-Z a-z 0-9 . _ : @ -", param=self.config.tenant_header)
                return
        scope["jaxserve.tenant"] = tenant
        await self._with_body(scope, receive, send, content_length)

    def _is_public(self, scope) -> bool:
        return scope["method"] in PUBLIC.get(scope.get("raw_path"), ())

    def _key_matches(self, key: bytes) -> bool:
        matches = [hmac.compare_digest(key, known) for known in self.keys]  # no early exit
        return any(matches)

    async def _with_body(self, scope, receive, send, content_length: bytes | None) -> None:
        limit = self.config.max_body_bytes
        too_large = f"request body exceeds max_body_bytes={limit}; send a smaller request"
        if content_length is not None and not content_length.isdigit():
            await _reply(send, 400, "invalid Content-Length header")
            return
        if content_length is not None and int(content_length) > _DRAIN_FACTOR * limit:
            await _reply(send, 413, too_large)
            return
        # NOTE: a body a little past the limit is read to its end (and dropped) before the 413, so the
        # client gets the answer rather than a connection reset by unread data.
        chunks = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received <= limit:
                chunks.append(chunk)
            if not message.get("more_body", False) or received > _DRAIN_FACTOR * limit:
                break
        if received > limit:
            await _reply(send, 413, too_large)
            return
        body = b"".join(chunks)  # one copy (none for a body that came in one piece)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: http.disconnect when the client goes away
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _bearer(authorization: bytes | None) -> bytes | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


async def _reply(send, status: int, message: str, param: str | None = None,
                 extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(status, message, param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra_headers]})
    await send({"type": "http.response.body", "body": body})
