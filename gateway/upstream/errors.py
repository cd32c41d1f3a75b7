"""The one place where HTTP-client exceptions become `gateway.errors` exceptions."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from gateway.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)


def too_large(limit: int) -> UpstreamResponseTooLarge:
    """A non-streaming body past the client's `max_response_bytes`."""
    return UpstreamResponseTooLarge(f"the upstream response body exceeds the {limit}-byte limit")


def map_transport_error(exc: BaseException, url: str) -> GatewayError:
    """Translate a transport failure talking to `url` (never called for CancelledError)."""
    if isinstance(exc, GatewayError):
        return exc
    # Connect-phase timeouts first: they are subclasses of the generic timeout types.
    if isinstance(exc, (httpx.ConnectTimeout, aiohttp.ConnectionTimeoutError)):
        return UpstreamConnectError(f"connecting to {url} timed out")
    if isinstance(exc, (httpx.TimeoutException, aiohttp.ServerTimeoutError, TimeoutError)):
        return UpstreamTimeout(f"upstream {url} timed out")
    if isinstance(exc, (httpx.ConnectError, aiohttp.ClientConnectorError)):
        return UpstreamConnectError(f"cannot connect to {url}: {exc}")
    if isinstance(
        exc,
        (
            httpx.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            aiohttp.ClientPayloadError,
            ConnectionError,
        ),
    ):
        return UpstreamConnectError(f"upstream {url} dropped the connection: {exc!r}")
    if isinstance(exc, (httpx.HTTPError, aiohttp.ClientError, OSError, asyncio.IncompleteReadError)):
        return UpstreamError(f"upstream {url} failed: {exc!r}")
    return UpstreamError(f"upstream {url} failed unexpectedly: {exc!r}")
