"""The simulated engine's ASGI middlewares: request ids echoed, and vLLM's `--api-key`."""

from __future__ import annotations

import hmac
from collections import deque

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class EchoRequestId:
    """Pure ASGI middleware: copy the caller's X-Request-Id onto every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", rid))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RecordHeaders:
    """Pure ASGI middleware: note each request's method, path and headers (last value of a
    name wins) in `log`, before any check: what reached the engine."""

    def __init__(self, app: ASGIApp, log: deque[tuple[str, str, dict[str, str]]]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            self.log.append((scope["method"], scope["path"], headers))
        await self.app(scope, receive, send)


_KEYED_PATHS = ("/v1", "/admin/", "/reset_prefix_cache")


class RequireApiKey:
    """Pure ASGI middleware: like vLLM's `--api-key`, every `/v1` path needs
    `Authorization: Bearer <key>` (401 otherwise), and so do the fault and reset endpoints
    (anyone could break the engine through them); health and metrics stay open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_KEYED_PATHS):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if given is None or not hmac.compare_digest(given, self.expected):
                await Response(
                    b'{"error":"Unauthorized"}', status_code=401, media_type="application/json"
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)
