"""`UpstreamClient` on aiohttp (faster than httpx in loadtests/bench_overhead.py; the h1
client hands https URLs to it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
from yarl import URL

from gateway.upstream.base import DEFAULT_MAX_RESPONSE_BYTES, RawHeaders, RequestBody, Timeouts
from gateway.upstream.errors import map_transport_error, too_large

_TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError)


class AiohttpResponse:
    __slots__ = ("_closed", "_done", "_limit", "_resp", "_url", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, url: str, limit: int) -> None:
        self._limit = limit
        self.status = resp.status
        self.headers: RawHeaders = resp.raw_headers
        self._resp = resp
        self._url = url
        self._done = False
        self._closed = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise map_transport_error(exc, self._url) from exc
        self._done = True

    def body_done(self) -> None:
        return None  # cannot tell before the iterator ends (gateway.upstream.base)

    async def read(self) -> bytes:
        limit = self._limit
        declared = self._resp.content_length
        if declared is not None and declared > limit:
            raise too_large(limit)
        chunks = []
        size = 0
        content = self._resp.content
        try:
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
        except _TRANSPORT_ERRORS as exc:
            raise map_transport_error(exc, self._url) from exc
        self._done = True
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done:
            self._resp.release()
        else:
            # Not drained: drop the connection so the engine sees the disconnect and aborts.
            self._resp.close()


class AiohttpClient:
    name = "aiohttp"

    def __init__(
        self,
        timeouts: Timeouts,
        max_connections: int = 1024,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._timeouts = timeouts
        self._max_response_bytes = max_response_bytes
        self._client_timeout = self._to_client_timeout(timeouts)
        self._session: aiohttp.ClientSession | None = None
        self._max_connections = max_connections

    @staticmethod
    def _to_client_timeout(t: Timeouts) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.read_s)

    def _get_session(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession must be made inside the running loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, ttl_dns_cache=60
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
                timeout=self._client_timeout,
            )
        return self._session

    async def send(
        self,
        method: str,
        url: str,
        headers: RawHeaders,
        body: RequestBody | None = None,
        *,
        timeouts: Timeouts | None = None,
    ) -> AiohttpResponse:
        session = self._get_session()
        t = timeouts or self._timeouts
        client_timeout = self._client_timeout if timeouts is None else self._to_client_timeout(t)
        str_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        if body is not None and not isinstance(body, bytes) and body.length is not None:
            # Without it aiohttp sends an iterable body chunked.
            str_headers.append(("content-length", str(body.length)))
        try:
            async with asyncio.timeout(t.response_headers_s):
                resp = await session.request(
                    method,
                    # encoded=True: the client's query string goes out byte for byte, not
                    # re-quoted (yarl would turn %2F back into /).
                    URL(url, encoded=True),
                    headers=str_headers,
                    data=body,
                    timeout=client_timeout,
                    allow_redirects=False,
                )
        except _TRANSPORT_ERRORS as exc:
            raise map_transport_error(exc, url) from exc
        return AiohttpResponse(resp, url, self._max_response_bytes)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
