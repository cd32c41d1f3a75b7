"""The `Store` protocol: state that several gateway instances share.

Methods are domain verbs, not get/set on strings. Reads that sit on a request's path
(`lookup_session`, `ejections`) are answered from local state whenever
possible; an implementation backed by a network service may spend at most one pipelined
round trip on them, bounded by a short timeout, and must answer from local state (never
raise) when the service is unavailable. Writes never block a request: they
are queued and flushed by background tasks.

What is shared, and how stale it may be, is documented on each method and in
`gateway.store.redis` for the Redis implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gateway.types import ReplicaId, SessionKey


@dataclass(frozen=True, slots=True)
class Ejection:
    """A replica taken out of rotation until `until` (wall-clock epoch seconds)."""

    replica: ReplicaId
    until: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PrefixPlacement:
    """A request's prompt prefix was served by `replica`.

    Shared placements carry only the leading block hashes of the prompt (a bounded,
    prefix-closed slice), so the index other instances rebuild is approximate.
    """

    model: str
    replica: ReplicaId
    prefix_hashes: tuple[int, ...]
    block_tokens: int = 16
    origin: str = ""
    at: float = 0.0


PrefixSink = Callable[[PrefixPlacement], None]


@dataclass(frozen=True, slots=True)
class StoreStatus:
    backend: str
    degraded: bool
    sessions_cached: int
    reason: str = ""


@runtime_checkable
class Store(Protocol):
    """Shared routing state. One instance per app, created in `build_app`, never global."""

    instance_id: str

    async def start(self) -> None:
        """Start background tasks (sync, reconnect). Called in the app lifespan."""

    async def close(self) -> None:
        """Flush what can be flushed quickly and stop background tasks."""

    # -- sessions -------------------------------------------------------------------------
    async def lookup_session(self, session: SessionKey) -> ReplicaId | None:
        """Where the session lives, or None. Refreshes the session's idle TTL.

        Local answer when known; otherwise at most one round trip with a short timeout.
        """

    async def assign_session(self, session: SessionKey, replica: ReplicaId) -> None:
        """Place (or move) the session on `replica`; the TTL starts again. Never blocks."""

    async def forget_replica(self, replica: ReplicaId) -> None:
        """The replica left the cluster: drop every session placed on it, everywhere."""

    # -- Responses chains -----------------------------------------------------------------
    async def link_response(self, response: str, root: str) -> None:
        """The answer `response` continues the chain the answer `root` opened (opaque ids:
        the proxy passes digests). Expires like a session placement. Never blocks."""

    async def response_root(self, response: str) -> str | None:
        """The root of the chain the answer `response` belongs to, or None (it opened one,
        or its link aged out). Local answer when known; otherwise at most one round trip
        with a short timeout."""

    # -- health and ejections -------------------------------------------------------------
    async def eject_replica(self, replica: ReplicaId, cooldown_s: float, reason: str = "") -> None:
        """Take `replica` out of rotation on every instance for `cooldown_s` seconds."""

    async def readmit_replica(self, replica: ReplicaId) -> None:
        """End an ejection early (e.g. the replica passed its health checks again)."""

    def ejections(self) -> Mapping[ReplicaId, Ejection]:
        """Ejections still in force, as last synchronised. Synchronous, no I/O."""

    # -- prefix placements ----------------------------------------------------------------
    def publish_prefix(self, placement: PrefixPlacement) -> None:
        """Tell other instances where a prefix was placed. Never blocks."""

    def subscribe_prefixes(self, sink: PrefixSink) -> None:
        """Call `sink` (on the event loop, synchronously) for placements of other instances."""

    # -- housekeeping ---------------------------------------------------------------------
    async def sync(self) -> None:
        """Flush pending writes and pull shared state now (tests, shutdown)."""

    async def flushed(self) -> None:
        """Return once the writes queued so far have reached the shared store (at once when
        there is none). Bounded by the store's operation timeout; never raises."""

    def status(self) -> StoreStatus: ...
