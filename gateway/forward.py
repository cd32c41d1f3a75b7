"""Opening one upstream leg: the helper both the proxy and dispatchers (PD) forward with.

A `Leg` owns one in-flight slot on its replica from `open_leg` until `aclose()`; the slot
is released exactly once whatever happens (error, cancellation, double close).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from gateway.cluster import Cluster
from gateway.errors import GatewayError, UpstreamStalled, UpstreamStatusError, UpstreamTimeout
from gateway.health import HealthMonitor
from gateway.types import ReplicaId
from gateway.upload import Upload
from gateway.upstream import RawHeaders, UpstreamClient, UpstreamResponse

RETRYABLE_STATUSES = frozenset({502, 503, 504})


class Leg:
    """One response from one replica. `first` and `chunks`: for a stream, its first body
    chunk (already read, so that an engine that sends headers and then nothing can still be
    failed over) and the iterator the rest comes from. A leg names its replica in the
    errors its body raises (`read`, `next_chunk`): the clients' messages never name the
    engine's address, and the stages that relay the body need not."""

    __slots__ = ("_cluster", "_released", "chunks", "first", "replica", "response")

    def __init__(self, cluster: Cluster, replica: ReplicaId, response: UpstreamResponse) -> None:
        self.replica = replica
        self.response = response
        self._cluster = cluster
        self._released = False
        self.first: bytes | None = None
        self.chunks: AsyncIterator[bytes] | None = None

    async def read(self) -> bytes:
        """The whole body (see `UpstreamResponse.read`)."""
        try:
            return await self.response.read()
        except GatewayError as err:
            name_replica(err, self.replica)
            raise

    async def next_chunk(self) -> bytes:
        """The next body chunk, `b""` at the end; the chunk `open_leg` peeked comes first."""
        first = self.first
        if first is not None:
            self.first = None
            return first
        chunks = self.chunks
        if chunks is None:
            chunks = self.chunks = self.response.iter_bytes()
        try:
            return await anext(chunks, b"")
        except GatewayError as err:
            name_replica(err, self.replica)
            raise

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._cluster.release(self.replica)
        await self.response.aclose()


def name_replica(err: GatewayError, replica: ReplicaId) -> None:
    """Say which replica failed: the clients' messages never name the engine's address."""
    prefix = f"replica {replica}: "
    if not err.message.startswith(prefix):
        err.message = prefix + err.message


async def open_leg(
    cluster: Cluster,
    client: UpstreamClient,
    health: HealthMonitor,
    replica: ReplicaId,
    path: str,
    headers: RawHeaders,
    body: bytes | Upload | None,
    *,
    peek: bool = True,
    on_headers: Callable[[], None] | None = None,
    method: str = "POST",
) -> Leg:
    """`method` (POST unless told) `body` to `replica` + `path`; return once the response
    headers arrived (and, with `peek`, a stream's first chunk).

    Raises a `GatewayError` on transport errors (retryable ones: connect errors) and a
    retryable one on 502/503/504 (the response is closed first); any other status is
    returned for the caller to relay. Transport errors reach passive health; a 5xx the engine
    answers goes to outlier detection, which holds it against the replica only across
    different requests (gateway.outlier). An upload whose client side
    failed (gone: `ClientGone`; past the body limit: `PayloadTooLarge`) raises that, however
    the upstream client wrapped it, and nothing is held against the replica.
    `on_headers` is called when the response headers arrived (a tracing span's end).
    """
    url = cluster.url_of(replica) + path
    cluster.acquire(replica)
    try:
        response = await client.send(method, url, headers, body)
    except Exception as exc:
        cluster.release(replica)
        failure = body.failure if isinstance(body, Upload) else None
        if failure is not None:
            if failure is exc:
                raise
            raise failure from exc
        if not isinstance(exc, GatewayError):
            raise
        health.passive_failure(replica, exc)
        name_replica(exc, replica)
        await _blame(health, replica, body if isinstance(body, bytes) else b"", exc)
        raise
    except BaseException:
        cluster.release(replica)
        raise
    if on_headers is not None:
        on_headers()
    status = response.status
    if status >= 500 and isinstance(body, bytes):
        health.answered_5xx(replica, path, body, status)
    # An upload's bytes are gone: nothing can resend it, so the engine's answer is relayed.
    if status in RETRYABLE_STATUSES and not (isinstance(body, Upload) and body.sent):
        cluster.release(replica)
        await response.aclose()
        raise UpstreamStatusError(f"replica {replica} answered {status}", upstream_status=status)
    if status < 500:
        health.passive_success(replica, path)
    leg = Leg(cluster, replica, response)
    if not peek or not _is_stream(response.headers):
        return leg
    # A stream's headers come before its prefill; read up to its first chunk here, still
    # inside the attempt, so a replica that stalled after its headers can be failed over.
    chunks = leg.chunks = response.iter_bytes()
    try:
        leg.first = await anext(chunks, b"")
    except GatewayError as err:
        await leg.aclose()
        name_replica(err, replica)
        await _blame(health, replica, body if isinstance(body, bytes) else b"", err)
        raise
    except BaseException:
        await leg.aclose()
        raise
    return leg


async def _blame(health: HealthMonitor, replica: ReplicaId, body: bytes, err: GatewayError) -> None:
    """A timed-out request whose canary timed out too was innocent: raise it retryable."""
    if isinstance(err, UpstreamTimeout) and await health.stalled(replica, body):
        raise UpstreamStalled(
            f"{err.message}, and a one-token canary timed out too: the replica stalled"
        ) from err


def _is_stream(headers: RawHeaders) -> bool:
    for name, value in headers:
        if len(name) == 12 and name.lower() == b"content-type":
            return value.startswith(b"text/event-stream")
    return False
