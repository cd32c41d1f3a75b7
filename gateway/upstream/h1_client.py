"""`UpstreamClient` on asyncio protocols and httptools: HTTP/1.1 keep-alive, nothing else.

Why a third client: a proxy hop to an engine on a private network needs none of what makes a
general client costly per request (cookies, redirects, proxies, auth, URL objects, payload
registries, per-read timeout rescheduling). `loadtests/bench_overhead.py` measures all three
side by side. Parsing is httptools' (llhttp), the same parser uvicorn serves us with.

Scope, on purpose: plain `http://` (engines sit on the cluster network; `https://` URLs are
handed to an aiohttp client made on first use), HTTP/1.1 with keep-alive, request bodies
sent whole (they are bounded by the gateway's body limit and already in memory), except a
`StreamedBody` (an upload), written chunk by chunk as it arrives with the transport's flow
control, on a new connection (so no stale pooled one can fail it once bytes are gone).

Timeouts use one timer per request instead of one per read: a watchdog fires at the
deadline and, when data arrived since it was armed, re-arms for the remaining time.

A response belongs to the request it answers, nothing else: 1xx interim responses are
skipped, and a connection that receives anything once its response is complete (an idle
engine's `408`, a stray extra response) is dropped, never reused. At `max_connections`,
a released connection goes straight to the request that waits longest.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.upstream.base import (
    DEFAULT_MAX_RESPONSE_BYTES,
    RawHeaders,
    RequestBody,
    StreamedBody,
    Timeouts,
    UpstreamClient,
    UpstreamPoolTimeout,
    UpstreamResponse,
)
from gateway.upstream.errors import reason, too_large

# Flow control: stop reading from the engine while this much body waits for the client.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
_MAX_IDLE_PER_HOST = 64


class _Unsolicited(Exception):
    """A message began after this exchange's response was complete."""


class _Conn(asyncio.Protocol):
    """One TCP connection, carrying one exchange at a time."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, url: str, on_lost: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._url = url
        self._on_lost: Callable[[], None] | None = on_lost
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # has carried an exchange before (set when first released)
        self._parser = httptools.HttpResponseParser(self)
        self.write_paused = False  # the transport's buffer is full (an upload waits)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.error: GatewayError | None = None
        self.keep_alive = True
        self.waiter: asyncio.Future[None] | None = None
        self.last_data = 0.0
        self.paused = False
        self.high_water = _HIGH_WATER
        self.whole = False  # read() buffers the body: high_water is its limit, not a pause

    # -- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.complete:
            # Nobody asked: idle in the pool (or not yet released), the connection is out of
            # step with its requests, and the next one would take these bytes as its answer.
            self.abort()
            return
        self.last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # Also `_Unsolicited` (as a callback error): this response stays intact.
            self.fail(UpstreamError(f"the engine sent malformed HTTP: {exc}"))
            return
        if self.buffered > self.high_water and not self.paused and self.transport is not None:
            if self.whole:
                self.fail(too_large(self.high_water))
                return
            self.paused = True
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._on_lost is not None:
            on_lost, self._on_lost = self._on_lost, None
            on_lost()
        if self.complete or self.error is not None:
            return
        if self.headers_done and exc is None and self._until_eof():
            # A body delimited by the connection closing (no length, not chunked).
            self.complete = True
            self._wake()
            return
        self.fail(
            UpstreamConnectError(
                f"the engine dropped the connection ({reason(exc) if exc else 'closed'})"
            )
        )

    # -- httptools callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Unsolicited  # stops the parser before it touches this response

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self._parser
        status = p.get_status_code()
        if status < 200 and status != 101:
            # 100 Continue, 103 Early Hints: interim, the final response follows (RFC 9110
            # 15.2). Its headers go; headers_done stays False, so its end is not ours.
            self.headers.clear()
            return
        self.status = status
        self.keep_alive = p.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self._wake()

    def _until_eof(self) -> bool:
        """The body is delimited by the connection closing (no length, not chunked).

        Only asked when the connection drops, so the response path does not pay for it.
        """
        return self.status not in (204, 304) and not any(
            n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.headers
        )

    # -- used by the client and the response ------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, error: GatewayError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.abort()
        self._wake()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def consumed(self, n: int) -> None:
        self.buffered -= n
        if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
            self._resume()

    def _resume(self) -> None:
        # The engine's idle clock starts again now: while paused, its silence was ours.
        self.paused = False
        self.last_data = self._loop.time()
        assert self.transport is not None
        self.transport.resume_reading()

    def read_whole(self, limit: int) -> None:
        """The caller wants the body in one piece, of at most `limit` bytes."""
        self.whole = True
        self.high_water = limit
        if self.paused and self.transport is not None:
            self._resume()

    async def wait(self) -> None:
        w = self.waiter = self._loop.create_future()
        try:
            await w
        finally:
            self.waiter = None

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def usable(self) -> bool:
        """Still open (the engine may have closed it while it sat idle)."""
        transport = self.transport
        return not self.closed and transport is not None and not transport.is_closing()


def _declared_length(headers: RawHeaders) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


async def _write_stream(conn: _Conn, body: StreamedBody) -> None:
    """Write `body` as it arrives, waiting while the transport's buffer is full.

    An engine that answers before the whole body went (an early error) gets no more of it,
    and its connection is not reused: the request it carried was cut short.
    """
    transport = conn.transport
    assert transport is not None
    chunked = body.length is None
    async for chunk in body:
        if conn.headers_done:
            conn.keep_alive = False
            return
        if conn.error is not None:
            raise conn.error
        if chunked:
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        else:
            transport.write(chunk)
        while conn.write_paused and conn.error is None and not conn.headers_done:
            await conn.wait()
    if conn.error is not None:
        raise conn.error
    if chunked:
        transport.write(b"0\r\n\r\n")


class _Watchdog:
    """A deadline for the response headers, then an idle limit between body reads."""

    __slots__ = ("_conn", "_handle", "_idle_s", "_loop", "_url")

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: _Conn, t: Timeouts, url: str) -> None:
        self._loop = loop
        self._conn = conn
        self._idle_s = t.read_s
        self._url = url
        self._handle: asyncio.TimerHandle | None = loop.call_later(t.response_headers_s, self._fire)

    def _fire(self) -> None:
        conn = self._conn
        if conn.complete or conn.error is not None or conn.closed:
            self._handle = None
            return
        if conn.headers_done:
            # Reading paused for a slow client is our doing, not the engine's silence.
            last = self._loop.time() if conn.paused else conn.last_data
            remaining = last + self._idle_s - self._loop.time()
            if remaining > 0:
                self._handle = self._loop.call_later(remaining, self._fire)
                return
        self._handle = None
        conn.fail(UpstreamTimeout("the engine timed out"))

    def headers_arrived(self) -> None:
        """From now on the limit is the idle time between reads.

        The pending timer is kept when it fires no later than the idle limit would (with
        equal limits, always): `_fire` then re-arms for the idle time left, so the usual
        request pays for one timer, not two.
        """
        handle = self._handle
        if handle is not None:
            if handle.when() <= self._loop.time() + self._idle_s:
                return
            handle.cancel()
        self._handle = self._loop.call_later(self._idle_s, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class H1Response:
    __slots__ = ("_client", "_closed", "_conn", "_dog", "_key", "headers", "status")

    def __init__(self, client: H1Client, key: tuple[str, int], conn: _Conn, dog: _Watchdog) -> None:
        self._client = client
        self._key = key
        self._conn = conn
        self._dog = dog
        self._closed = False
        self.status = conn.status
        self.headers: RawHeaders = conn.headers

    def iter_bytes(self) -> AsyncIterator[bytes]:
        # The response is its own iterator: no async generator to finalise when the proxy
        # stops at `body_done()` instead of draining the iterator to StopAsyncIteration.
        return self

    def __aiter__(self) -> H1Response:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        chunks = conn.chunks
        while True:
            if chunks:
                # What already arrived goes out in one piece: joining adds no wait, and one
                # ASGI send per SSE event would cost a write each.
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                conn.consumed(len(chunk))
                return chunk
            if conn.complete:
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    def body_done(self) -> bool:
        """Every body byte arrived and was handed out: the next read would end."""
        conn = self._conn
        return conn.complete and not conn.chunks

    async def read(self) -> bytes:
        conn = self._conn
        limit = self._client._max_response_bytes
        if conn.buffered > limit or _declared_length(conn.headers) > limit:
            conn.abort()
            raise too_large(limit)
        conn.read_whole(limit)
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        if conn.buffered > limit:
            raise too_large(limit)
        body = b"".join(conn.chunks)
        conn.chunks.clear()
        conn.consumed(conn.buffered)
        return body

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dog.cancel()
        conn = self._conn
        if conn.reusable() and not conn.chunks:
            self._client._release(self._key, conn)
        else:
            # Not drained: drop the connection so the engine sees the disconnect and aborts.
            conn.abort()


class H1Client:
    name = "h1"

    def __init__(
        self,
        timeouts: Timeouts,
        max_connections: int = 1024,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._timeouts = timeouts
        self._max_response_bytes = max_response_bytes
        self._max_idle = min(max_connections, _MAX_IDLE_PER_HOST)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}
        self._max_connections = max_connections
        # Open connections per engine (idle ones included), and who waits at the cap: for a
        # released connection, or for None when one closed (a new one may be opened).
        self._open: dict[tuple[str, int], int] = {}
        self._slot_waiters: dict[
            tuple[str, int], collections.deque[asyncio.Future[_Conn | None]]
        ] = {}
        self._tls: UpstreamClient | None = None

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes]:
        """(host, port), the request target and the Host header, parsed once per URL."""
        hit = self._targets.get(url)
        if hit is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"the h1 upstream client cannot send to {url}")
            port = parts.port or 80
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            host = parts.netloc.rpartition("@")[2]
            hit = ((parts.hostname, port), path.encode("latin-1"), host.encode("latin-1"))
            if len(self._targets) < 4096:
                self._targets[url] = hit
        return hit

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        """A finished exchange's connection: to the longest waiter, else to the pool.

        It is reset by whoever takes it, so until then it counts as complete and any byte
        it receives drops it (see `_Conn.data_received`).
        """
        conn.reused = True
        waiters = self._slot_waiters.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        idle = self._idle.get(key)
        if idle is None:
            idle = self._idle[key] = []
        if len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.abort()

    def _closed_one(self, key: tuple[str, int]) -> None:
        self._open[key] -= 1
        self._wake_one(key)

    def _wake_one(self, key: tuple[str, int]) -> None:
        """Tell the longest waiter a slot is free: it may open a connection."""
        waiters = self._slot_waiters.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def _wait_for_slot(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], url: str, wait_s: float
    ) -> _Conn | None:
        """Past `max_connections`: the next connection released to this engine, or None once
        one closed and a new one may be opened. Gives up after `wait_s` (the connect
        timeout) with `UpstreamPoolTimeout`: all connections busy is no fault of the engine.
        """
        waiters = self._slot_waiters.get(key)
        if waiters is None:
            waiters = self._slot_waiters[key] = collections.deque()
        try:
            async with asyncio.timeout(wait_s):
                while self._open.get(key, 0) >= self._max_connections:
                    waiter: asyncio.Future[_Conn | None] = loop.create_future()
                    waiters.append(waiter)
                    try:
                        conn = await waiter
                    except BaseException:
                        # Handed a connection or a slot just as the wait ended: pass it on.
                        if waiter.done() and not waiter.cancelled():
                            handed = waiter.result()
                            if handed is None:
                                self._wake_one(key)
                            else:
                                self._release(key, handed)
                        raise
                    if conn is not None and conn.usable():
                        return conn
                    # A slot, or a connection that closed on the way (which frees one).
        except TimeoutError as exc:
            raise UpstreamPoolTimeout(
                f"all {self._max_connections} connections to the engine stayed busy for {wait_s} s"
            ) from exc
        return None

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], url: str, t: Timeouts
    ) -> _Conn:
        """A new connection, or past `max_connections` to this engine the first one released."""
        if self._open.get(key, 0) >= self._max_connections:
            handed = await self._wait_for_slot(loop, key, url, t.connect_s)
            if handed is not None:
                handed._reset()
                return handed
        # No await between the check above and this count: the slot is ours.
        self._open[key] = self._open.get(key, 0) + 1
        counted = [True]

        def release() -> None:
            # Once per connection, whether it failed to open or closed later.
            if counted[0]:
                counted[0] = False
                self._closed_one(key)

        try:
            async with asyncio.timeout(t.connect_s):
                _, proto = await loop.create_connection(lambda: _Conn(loop, url, release), *key)
        except TimeoutError as exc:
            release()
            raise UpstreamConnectError("connecting timed out") from exc
        except OSError as exc:
            release()
            raise UpstreamConnectError(f"cannot connect: {reason(exc)}") from exc
        except BaseException:
            release()
            raise
        return proto

    async def send(
        self,
        method: str,
        url: str,
        headers: RawHeaders,
        body: RequestBody | None = None,
        *,
        timeouts: Timeouts | None = None,
    ) -> UpstreamResponse:
        if url.startswith("https:"):
            if self._tls is None:
                from gateway.upstream.aiohttp_client import AiohttpClient

                self._tls = AiohttpClient(self._timeouts, self._max_connections)
            return await self._tls.send(method, url, headers, body, timeouts=timeouts)
        t = timeouts or self._timeouts
        key, target, host = self._target(url)
        head = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        stream: StreamedBody | None = None
        if body is not None and not isinstance(body, bytes):
            stream, body = body, None
            if stream.length is None:
                head.append(b"transfer-encoding: chunked\r\n")
            else:
                head.append(b"content-length: %d\r\n" % stream.length)
        elif body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d\r\n" % len(body or b""))
        head.append(b"\r\n")
        message = b"".join(head)
        if body:
            message += body

        # A pooled connection the engine closed while idle shows up as closed here and is
        # skipped. One the engine closes just as the request goes out fails before any
        # response byte: that request is sent once more (the engine dropped an idle
        # connection, it never took the request). Anything else fails.
        idle = self._idle.get(key) if stream is None else None
        conn: _Conn | None = None
        while idle:
            candidate = idle.pop()
            if candidate.usable():
                conn = candidate
                conn._reset()
                break
        once_more = True
        # A pooled connection knows its loop: asking asyncio costs a getpid() syscall.
        loop = conn._loop if conn is not None else asyncio.get_running_loop()
        while True:
            if conn is None:
                conn = await self._connect(loop, key, url, t)
            assert conn.transport is not None
            dog = _Watchdog(loop, conn, t, url)
            try:
                conn.transport.write(message)
                if stream is not None:
                    await _write_stream(conn, stream)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except UpstreamConnectError:
                dog.cancel()
                conn.abort()
                if once_more and conn.reused and conn.last_data == 0.0:
                    once_more = False
                    conn = None
                    continue
                raise
            except BaseException:
                dog.cancel()
                conn.abort()
                raise
            dog.headers_arrived()
            break
        return H1Response(self, key, conn, dog)

    async def aclose(self) -> None:
        if self._tls is not None:
            await self._tls.aclose()
            self._tls = None
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
