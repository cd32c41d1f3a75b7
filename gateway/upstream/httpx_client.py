"""`UpstreamClient` on httpx (the alternative; see loadtests/bench_overhead.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from gateway.upstream.base import DEFAULT_MAX_RESPONSE_BYTES, RawHeaders, RequestBody, Timeouts
from gateway.upstream.errors import map_transport_error, too_large

_TRANSPORT_ERRORS = (httpx.HTTPError, httpx.StreamError, OSError, TimeoutError)


class HttpxResponse:
    __slots__ = ("_closed", "_limit", "_resp", "_url", "headers", "status")

    def __init__(self, resp: httpx.Response, url: str, limit: int) -> None:
        self._limit = limit
        self.status = resp.status_code
        self.headers: RawHeaders = resp.headers.raw
        self._resp = resp
        self._url = url
        self._closed = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise map_transport_error(exc, self._url) from exc

    def body_done(self) -> None:
        return None  # cannot tell before the iterator ends (gateway.upstream.base)

    async def read(self) -> bytes:
        limit = self._limit
        declared = self._resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        chunks = []
        size = 0
        async for chunk in self.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # httpcore closes (rather than pools) a connection whose response was not drained.
        await self._resp.aclose()


class HttpxClient:
    name = "httpx"

    def __init__(
        self,
        timeouts: Timeouts,
        max_connections: int = 1024,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._timeouts = timeouts
        self._max_response_bytes = max_response_bytes
        self._client = httpx.AsyncClient(
            timeout=self._to_httpx_timeout(timeouts),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            follow_redirects=False,
        )

    @staticmethod
    def _to_httpx_timeout(t: Timeouts) -> httpx.Timeout:
        return httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=t.connect_s)

    async def send(
        self,
        method: str,
        url: str,
        headers: RawHeaders,
        body: RequestBody | None = None,
        *,
        timeouts: Timeouts | None = None,
    ) -> HttpxResponse:
        t = timeouts or self._timeouts
        out = list(headers)
        if body is not None and not isinstance(body, bytes) and body.length is not None:
            # Without it httpx sends an iterable body chunked.
            out.append((b"content-length", b"%d" % body.length))
        request = self._client.build_request(
            method,
            url,
            headers=out,
            content=body,
            timeout=httpx.USE_CLIENT_DEFAULT if timeouts is None else self._to_httpx_timeout(t),
        )
        try:
            async with asyncio.timeout(t.response_headers_s):
                resp = await self._client.send(request, stream=True)
        except _TRANSPORT_ERRORS as exc:
            raise map_transport_error(exc, url) from exc
        return HttpxResponse(resp, url, self._max_response_bytes)

    async def aclose(self) -> None:
        await self._client.aclose()
