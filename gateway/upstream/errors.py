"""The one place where HTTP-client exceptions become `gateway.errors` exceptions."""

from __future__ import annotations

import asyncio
import os

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


def reason(exc: BaseException) -> str:
    """What went wrong, without the address (library messages name the engine's URL or
    host and port, which a client-facing error must not show)."""
    # Not `strerror`: asyncio puts the address there ("Connect call failed ('10.0.0.5', 80)").
    os_error = getattr(exc, "os_error", exc)  # aiohttp's connector errors wrap one
    if isinstance(os_error, OSError) and os_error.errno:
        return os.strerror(os_error.errno)
    return type(exc).__name__


def map_transport_error(exc: BaseException, url: str = "") -> GatewayError:
    """Translate a transport failure (never called for CancelledError).

    Messages never name the engine's address: whoever knows the replica says which one
    (gateway.forward). `url` is unused, kept for callers.
    """
    if isinstance(exc, GatewayError):
        return exc
    # Connect-phase timeouts first: they are subclasses of the generic timeout types.
    if isinstance(exc, (httpx.ConnectTimeout, aiohttp.ConnectionTimeoutError)):
        return UpstreamConnectError("connecting timed out")
    if isinstance(exc, (httpx.TimeoutException, aiohttp.ServerTimeoutError, TimeoutError)):
        return UpstreamTimeout("the engine timed out")
    if isinstance(exc, (httpx.ConnectError, aiohttp.ClientConnectorError)):
        return UpstreamConnectError(f"cannot connect: {reason(exc)}")
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
        return UpstreamConnectError(f"the engine dropped the connection ({reason(exc)})")
    if isinstance(
        exc, (httpx.HTTPError, aiohttp.ClientError, OSError, asyncio.IncompleteReadError)
    ):
        return UpstreamError(f"the engine request failed ({reason(exc)})")
    return UpstreamError(f"the engine request failed unexpectedly ({reason(exc)})")
