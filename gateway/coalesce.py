"""A response's head and its body in one write, when the app says the body follows at once.

uvicorn writes the status line and headers as soon as the app sends `http.response.start`,
and the body with the next message: two socket writes (two syscalls, and often two reads
for the client) for an answer the gateway holds whole. `HeadHolder` stands in for the
transport of one request/response cycle (gateway.protocol puts it there, and in the scope
under gateway.scope's `HEAD_HOLDER_KEY`). An app that is about to send a head and then, without waiting
for anything, its body (or a stream's first chunk) calls `hold()` first: the head's write
is kept back and goes out with the next one. Nothing is held otherwise, so a head whose
body may be slow to come is never delayed, and nothing needs a timer.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeadHolder:
    """The write side of one cycle's transport; `hold()` joins the next write to the one after."""

    __slots__ = ("_held", "_holding", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._holding = False
        self._held: bytes | None = None

    def hold(self) -> None:
        """Keep the next write back until the one after it (which must follow at once)."""
        self._holding = True

    def write(self, data: bytes) -> None:
        if self._holding:
            self._holding = False
            self._held = data
            return
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        self._transport.write(data)

    def flush(self) -> None:
        self._holding = False
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        # Anything else a cycle might ask of its transport.
        return getattr(self._transport, name)
