"""The narrow seam between the proxy and an HTTP client library.

`UpstreamClient.send()` returns an `UpstreamResponse` once the status line and headers have
arrived: status, raw headers, an async byte iterator and `aclose()`. Nothing else of the
client library leaks out, so a second implementation can be swapped in by config.

Contract:
* Transport failures surface as `gateway.errors` exceptions (mapped once, in
  `gateway.upstream.errors.map_transport_error`), from `send()` and from the iterator.
  A client that gives up waiting for one of its own pooled connections raises
  `UpstreamPoolTimeout`: the gateway's limit was reached, the engine did nothing wrong.
* `body_done() -> bool | None`: True once every body byte arrived and was handed out.
  The proxy then sends the last chunk with the end of the response (one write, not two)
  and stops iterating, so an implementation that can tell must count the body as read
  without a final StopAsyncIteration (h1 does). None: this client cannot tell (the others);
  the proxy then reads until the iterator ends.
* A request body is bytes, or a `StreamedBody` sent as it arrives (multipart uploads):
  framed by its `length` (Content-Length; None: chunked), iterated at most once. An
  exception the body's own iterator raises (the client left, the body is too large) comes
  out of `send()` as it is or wrapped; the body keeps it (gateway.upload), so the caller can
  tell it from the engine's failure.
* `aclose()` on a response whose body was not read to the end closes the TCP connection
  instead of returning it to the pool: that is how the engine learns the client left and
  aborts generation. `aclose()` is idempotent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import GatewayError

RawHeaders = Sequence[tuple[bytes, bytes]]

# `read()` refuses a body larger than this (the client's `max_response_bytes`).
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024


class UpstreamPoolTimeout(GatewayError):
    """Every connection the client may open to the engine stayed busy for the whole wait.

    Not the replica's failure, so passive health ignores it; retryable, because another
    replica's connections are counted apart.
    """

    status = 503
    error_type = "service_unavailable_error"
    code = "upstream_pool_timeout"
    retryable = True


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 3.0
    response_headers_s: float = 600.0
    read_s: float = 600.0


class StreamedBody(Protocol):
    """A request body forwarded chunk by chunk; `length`: its size, when declared."""

    length: int | None

    def __aiter__(self) -> AsyncIterator[bytes]: ...


RequestBody = bytes | StreamedBody


class UpstreamResponse(Protocol):
    status: int
    headers: RawHeaders  # as received (names may be any case)

    def iter_bytes(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (no decompression, no re-chunking)."""
        ...

    async def read(self) -> bytes:
        """The whole body; `UpstreamResponseTooLarge` past the client's `max_response_bytes`
        (the connection is then dropped)."""
        ...

    def body_done(self) -> bool | None:
        """Every body byte arrived and was handed out; None: this client cannot tell."""
        ...

    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    name: str

    async def send(
        self,
        method: str,
        url: str,
        headers: RawHeaders,
        body: RequestBody | None = None,
        *,
        timeouts: Timeouts | None = None,
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...
