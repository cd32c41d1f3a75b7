"""Upstream HTTP seam: see `gateway.upstream.base` for the contract."""

from __future__ import annotations

from gateway.upstream.base import (
    DEFAULT_MAX_RESPONSE_BYTES,
    RawHeaders,
    RequestBody,
    StreamedBody,
    Timeouts,
    UpstreamClient,
    UpstreamResponse,
)
from gateway.upstream.headers import request_headers, response_headers

__all__ = [
    "RawHeaders",
    "RequestBody",
    "StreamedBody",
    "Timeouts",
    "UpstreamClient",
    "UpstreamResponse",
    "make_client",
    "request_headers",
    "response_headers",
]


def make_client(
    kind: str,
    timeouts: Timeouts,
    max_connections: int = 1024,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> UpstreamClient:
    """Construct the configured client implementation (`h1`, `aiohttp` or `httpx`)."""
    if kind == "h1":
        from gateway.upstream.h1_client import H1Client

        return H1Client(timeouts, max_connections, max_response_bytes)
    if kind == "httpx":
        from gateway.upstream.httpx_client import HttpxClient

        return HttpxClient(timeouts, max_connections, max_response_bytes)
    if kind == "aiohttp":
        from gateway.upstream.aiohttp_client import AiohttpClient

        return AiohttpClient(timeouts, max_connections, max_response_bytes)
    raise ValueError(f"unknown upstream client {kind!r}")
