"""Propagate the client's X-Request-Id or mint one, and return it on the response."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SCOPE_KEY = "kvgate.request_id"
HEADER = b"x-request-id"
MAX_LENGTH = 128  # longer client ids are replaced: they would bloat logs and engine ids


def accepted_request_id(value: bytes | None) -> str | None:
    """The client's id when it is usable (1 to MAX_LENGTH ASCII bytes), else None."""
    if value is not None and 0 < len(value) <= MAX_LENGTH and value.isascii():
        return value.decode("ascii")
    return None


class RequestIdMiddleware:
    """Stores the id in ``scope["kvgate.request_id"]`` for the handlers that forward it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id: str | None = None
        for name, value in scope["headers"]:
            if name == HEADER:
                request_id = accepted_request_id(value)
                break
        if request_id is None:
            request_id = os.urandom(12).hex()
            scope["headers"] = [(n, v) for n, v in scope["headers"] if n != HEADER] + [
                (HEADER, request_id.encode())
            ]
        scope[SCOPE_KEY] = request_id
        encoded = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", ()) if n.lower() != HEADER]
                headers.append((HEADER, encoded))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
