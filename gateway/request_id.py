"""Propagate the client's X-Request-Id or mint one, and return it on the response."""

from __future__ import annotations

import itertools
import os

from gateway.asgi import ASGIApp, Message, Receive, Scope, Send
from gateway.scope import REQUEST_ID_KEY

HEADER = b"x-request-id"
MAX_LENGTH = 128  # longer client ids are replaced: they would bloat logs and engine ids


def accepted_request_id(value: bytes | None) -> str | None:
    """The client's id when it is usable (1 to MAX_LENGTH ASCII bytes), else None."""
    if value is not None and 0 < len(value) <= MAX_LENGTH and value.isascii():
        return value.decode("ascii")
    return None


class RequestIds:
    """Ids unique across processes without a syscall per request: a random prefix (8 bytes
    from the OS, once) and a counter; 24 hex characters."""

    __slots__ = ("_next", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._next = itertools.count(1).__next__

    def __call__(self) -> str:
        return f"{self._prefix}{self._next():08x}"


class RequestIdMiddleware:
    """Stores the id in ``scope["kvgate.request_id"]`` for the handlers that forward it.

    A minted id replaces the client's header in the scope, so handlers forwarding the
    request headers pass it on to the engine; every response carries the id once.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._new_id = RequestIds()

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
            request_id = self._new_id()
            scope["headers"] = [(n, v) for n, v in scope["headers"] if n != HEADER] + [
                (HEADER, request_id.encode())
            ]
        scope[REQUEST_ID_KEY] = request_id
        encoded = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", ()) if n.lower() != HEADER]
                headers.append((HEADER, encoded))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
