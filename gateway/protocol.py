"""uvicorn's httptools protocol with what a public listener needs and uvicorn lacks.

* A request must arrive whole in time: its headers within `header_timeout_s` of its first
  byte (of the connection, for the first request), its body within `body_timeout_s` of the
  headers. Otherwise the connection is closed (a 408 first when nothing else is being
  written). uvicorn only times idle keep-alive connections, so a client trickling a byte
  at a time (slowloris) held a connection forever.
* At most `max_connections_per_ip` open connections per client address (0: no cap);
  past it a new connection gets a 429 and is closed. The count is per worker process.
* Chunked-body trailers never reach the app: httptools reports them through the same
  callback as headers, and uvicorn appended them to the request's `scope["headers"]`,
  where the proxy would forward them and admission would read `X-Priority` from them.

* A response's head may go out with its body in one write, when the app asks for it
  (gateway.coalesce).

No timer per request on the common path: a request whose bytes come in one read is
parsed whole before the guard looks, and only one that spans reads arms the deadline.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.coalesce import HeadHolder
from gateway.scope import HEAD_HOLDER_KEY

_IDLE, _HEADERS, _BODY = 0, 1, 2
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: 95\r\n\r\n"
    b'{"error":{"message":"request not received in time","type":"invalid_request_error","code":null}}'
)
_TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: 99\r\n\r\n"
    b'{"error":{"message":"too many connections from one address","type":"rate_limit_error","code":null}}'
)


class _Sealed:
    """A request's complete header list: still readable, appends (trailers) are dropped."""

    __slots__ = ("_headers",)

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._headers = headers

    def append(self, field: tuple[bytes, bytes]) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self._headers)


@dataclass(slots=True)
class ClientGuard:
    """The limits, and the open connections per client address they are checked against."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections_per_ip: int = 0
    per_ip: dict[str, int] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        # Handed to each worker process: the counts start afresh there.
        return {
            "header_timeout_s": self.header_timeout_s,
            "body_timeout_s": self.body_timeout_s,
            "max_connections_per_ip": self.max_connections_per_ip,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.header_timeout_s = state["header_timeout_s"]
        self.body_timeout_s = state["body_timeout_s"]
        self.max_connections_per_ip = state["max_connections_per_ip"]
        self.per_ip = {}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, guard: ClientGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard
        self._phase = _HEADERS  # waiting for the first request
        self._since = 0.0  # when the phase began; 0 = not yet looked at
        self._deadline: asyncio.TimerHandle | None = None
        self._counted: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self._guard
        if guard.max_connections_per_ip and self.client is not None:
            ip = self.client[0]
            open_now = guard.per_ip.get(ip, 0)
            if open_now >= guard.max_connections_per_ip:
                self._phase = _IDLE
                transport.write(_TOO_MANY)
                transport.close()
                return
            guard.per_ip[ip] = open_now + 1
            self._counted = ip
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        ip = self._counted
        if ip is not None:
            self._counted = None
            per_ip = self._guard.per_ip
            left = per_ip[ip] - 1
            if left:
                per_ip[ip] = left
            else:
                del per_ip[ip]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._phase == _IDLE:
            if self._deadline is not None:
                self._disarm()
        elif self._deadline is None:
            self._arm()
        elif not self._since:
            # The headers completed in this read: the body's own deadline from now on.
            self._disarm()
            self._arm()

    # -- parser callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEADERS
        self._since = 0.0

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._since = 0.0
        earlier = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        # No new cycle for an upgrade. A HEAD answer has no body to write, so a held head
        # would never go out: such a request gets no holder.
        if cycle is not None and cycle is not earlier and self.scope["method"] != "HEAD":
            holder = HeadHolder(self.transport)
            cycle.transport = holder  # type: ignore[assignment]
            self.scope[HEAD_HOLDER_KEY] = holder  # type: ignore[literal-required]
        # Trailers arrive through uvicorn's on_header, which appends to this list (the one
        # in scope["headers"]): from now on they go nowhere. Cheaper than checking per header.
        self.headers = _Sealed(self.headers)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        super().on_message_complete()

    # -- the deadline -----------------------------------------------------------------
    def _arm(self) -> None:
        now = self.loop.time()
        if not self._since:
            self._since = now
        limit = (
            self._guard.header_timeout_s if self._phase == _HEADERS else self._guard.body_timeout_s
        )
        self._deadline = self.loop.call_at(self._since + limit, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._phase == _IDLE or self.transport.is_closing():
            return
        phase = self._phase
        limit = self._guard.header_timeout_s if phase == _HEADERS else self._guard.body_timeout_s
        if not self._since or self.loop.time() < self._since + limit:
            self._arm()  # a new phase began since the timer was set
            return
        if phase == _HEADERS and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


def guarded_protocol(
    header_timeout_s: float = 10.0, body_timeout_s: float = 60.0, max_connections_per_ip: int = 0
) -> Callable[..., GuardedHttpToolsProtocol]:
    """The `http=` argument for uvicorn: a protocol factory sharing one `ClientGuard`."""
    guard = ClientGuard(header_timeout_s, body_timeout_s, max_connections_per_ip)
    return functools.partial(GuardedHttpToolsProtocol, guard=guard)
