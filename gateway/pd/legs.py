"""Leg helpers shared by both hand-off protocols.

A decode leg is only committed to the client once its first body chunk arrived: until
then nothing was relayed, so a failure can still be retried or served colocated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from gateway.errors import GatewayError, UpstreamError
from gateway.forward import Leg
from gateway.upstream import RawHeaders, UpstreamResponse

OpenLeg = Callable[[Any, bytes, "list[tuple[bytes, bytes]] | None"], Awaitable[Leg]]
# (replica, whether the leg prefills) -> the body that replica must see.
LegBody = Callable[[Any, bool], Mapping[str, Any]]


class PeekedResponse:
    """An upstream response whose first chunk was read ahead; relays it, then the rest.

    `watch`, when given, is a task the stream depends on (the SGLang prefill leg): if it
    fails while the stream waits for data, the stream fails too instead of hanging. Closing
    the response cancels the task.
    """

    __slots__ = ("_first", "_inner", "_rest", "_watch", "headers", "status")

    def __init__(
        self,
        inner: UpstreamResponse,
        first: bytes,
        rest: AsyncIterator[bytes],
        watch: asyncio.Task[None] | None = None,
    ) -> None:
        self.status = inner.status
        self.headers: RawHeaders = inner.headers
        self._inner = inner
        self._first = first
        self._rest = rest
        self._watch = watch

    def body_done(self) -> None:
        return None  # read to the end of `rest` (gateway.upstream.base)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        while True:
            try:
                chunk = await self._next()
            except StopAsyncIteration:
                return
            yield chunk

    async def _next(self) -> bytes:
        watch = self._watch
        if watch is None or (watch.done() and _succeeded(watch)):
            return await anext(self._rest)
        if watch.done():
            raise UpstreamError("prefill leg failed during the hand-off")
        reader = asyncio.ensure_future(anext(self._rest))
        try:
            await asyncio.wait((reader, watch), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            reader.cancel()
            raise
        if reader.done():
            return reader.result()
        if _succeeded(watch):
            return await reader
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        raise UpstreamError("prefill leg failed during the hand-off")

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_bytes()]
        return b"".join(parts)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            await cancel_task(self._watch)


def _succeeded(task: asyncio.Task[None]) -> bool:
    return not task.cancelled() and task.exception() is None


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel and reap `task`; its own failure is already accounted for by its owner."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we are being cancelled ourselves: do not swallow that
    except (GatewayError, TimeoutError):
        pass


async def commit_first_chunk(
    leg: Leg, timeout_s: float | None, watch: asyncio.Task[None] | None = None
) -> Leg:
    """Read the leg's first body chunk (within `timeout_s`) and make the leg replay it.

    Raises `UpstreamError` (the leg is closed) when the body fails or ends before any byte,
    or when `watch` fails first; the caller may then try elsewhere.
    """
    rest = aiter(leg.response.iter_bytes())
    probe = PeekedResponse(leg.response, b"", rest, watch)
    try:
        async with asyncio.timeout(timeout_s):
            first = await probe._next()
    except StopAsyncIteration:
        await leg.aclose()
        raise UpstreamError(f"replica {leg.replica} ended the response before any byte") from None
    except TimeoutError:
        await leg.aclose()
        raise UpstreamError(f"replica {leg.replica} sent no byte within {timeout_s}s") from None
    except BaseException:
        await leg.aclose()
        raise
    leg.response = PeekedResponse(leg.response, first, rest, watch)
    return leg
