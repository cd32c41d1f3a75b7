"""Per-request figures the gateway's own series lack: tokens and time to first byte per
replica, and the sessions table. An outcome observer, attached only while it is wanted
(gateway.console.watch), because with any observer present the proxy also asks streaming
engines for usage."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.cluster import Cluster
from gateway.console.sessions import BOUNDED_LOAD, FAILOVER, POOL_WEIGHTS, Move, SessionTable
from gateway.hooks import RequestOutcome
from gateway.types import ReplicaId

TTFT_WINDOW_S = 60.0
# Bounds the memory per replica: at a higher rate the minute is sampled, not exhaustive.
TTFT_KEEP = 4096


@dataclass(slots=True)
class Tally:
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TTFT_KEEP))


def quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class Measurements:
    def __init__(
        self,
        cluster: Cluster,
        sessions: SessionTable,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._cluster = cluster
        self.sessions = sessions
        self._clock = clock
        self._wall = wall
        self.tallies: dict[ReplicaId, Tally] = {}

    def observe(self, outcome: RequestOutcome) -> None:
        replica = outcome.replica
        if replica is None:
            return
        tally = self.tallies.get(replica)
        if tally is None:
            tally = self.tallies[replica] = Tally()
        prompt = outcome.prompt_tokens or 0
        completion = outcome.completion_tokens or 0
        tally.requests += 1
        tally.prompt += prompt
        tally.cached += outcome.cached_tokens or 0
        tally.completion += completion
        now = self._clock()
        if outcome.ok and outcome.ttfb_s is not None:
            tally.ttft.append((now, outcome.ttfb_s))
        request = outcome.request
        if request is None or not outcome.ok:
            return
        came_from = self.sessions.seen(
            request.session_key, request.key_source, replica, now, prompt + completion
        )
        if came_from is not None:
            reason = self._why(came_from, replica, outcome.retries)
            self.sessions.moved(Move(self._wall(), request.session_key, came_from, replica, reason))

    def _why(self, source: ReplicaId, target: ReplicaId, retries: int) -> str:
        cluster = self._cluster
        if retries or source not in cluster.members or not cluster.is_healthy(source):
            return FAILOVER
        members = cluster.members
        if members[source].pool != (members[target].pool if target in members else None):
            return POOL_WEIGHTS
        return BOUNDED_LOAD

    def ttft(self, replica: ReplicaId, q: Sequence[float] = (0.5, 0.99)) -> list[float] | None:
        """Quantiles of the last minute's time to first byte on `replica` (None: no data)."""
        tally = self.tallies.get(replica)
        if tally is None:
            return None
        cutoff = self._clock() - TTFT_WINDOW_S
        samples = tally.ttft
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if not samples:
            return None
        ordered = sorted(s for _, s in samples)
        return [quantile(ordered, x) for x in q]

    def reset(self) -> None:
        self.tallies.clear()
        self.sessions.clear()

    def live_sessions(self, window_s: float) -> int:
        return sum(1 for _ in self.sessions.live(self._clock(), window_s))

    def now(self) -> float:
        return self._clock()

    def totals(self) -> dict[str, float]:
        out = {"requests": 0.0, "prompt": 0.0, "cached": 0.0, "completion": 0.0}
        for t in self.tallies.values():
            out["requests"] += t.requests
            out["prompt"] += t.prompt
            out["cached"] += t.cached
            out["completion"] += t.completion
        return out

    def forget(self, keep: Sequence[ReplicaId]) -> None:
        """Drop tallies of replicas no longer in the cluster (none in flight any more)."""
        for replica in [r for r in self.tallies if r not in keep]:
            del self.tallies[replica]
