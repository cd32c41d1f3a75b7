"""What tokens cost per pool: a ledger fed by finished requests, read by the metrics.

Two bases, both in the currency of `price_per_card_hour`:
* `busy`: each replica is charged for the time it had at least one request in flight (the
  union of its requests' [arrival, end] intervals), at its replica-hour price. Concurrent
  requests share that time, so batching lowers the cost per token, as it does on real
  cards. It answers "what did the tokens routed here cost" (idle cards free to be lent or
  scaled down), so it moves when routing moves traffic between pools.
* `provisioned`: every configured replica of the pool, all the time since the ledger
  started. It answers "what does the fleet cost per token served", idle cards included.

Totals count prompt tokens (cached ones included) plus generated tokens; under
prefill-heavy agent traffic that is the throughput figure that matters, and per-output-token
cost is shown next to it only for comparison.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.pools.config import PoolsSettings

ALL_POOLS = "all"
THROUGHPUT_WINDOW_S = 60.0
BASES = ("busy", "provisioned")
# Intervals ending this long before the newest one are forgotten: a request longer than
# this that overlaps them is charged its full length again (bounded memory over exactness).
BUSY_HORIZON_S = 900.0


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one finished request, as the engine reported them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class PoolCost:
    pool: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    requests: int
    cost: Mapping[str, float]
    throughput_tps: float

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def per_1k_total(self, basis: str) -> float | None:
        return per_thousand(self.cost[basis], self.total_tokens)

    def per_1k_output(self, basis: str) -> float | None:
        return per_thousand(self.cost[basis], self.completion_tokens)


def per_thousand(cost: float, tokens: int) -> float | None:
    """Cost per 1,000 tokens; None (not zero) when nothing was served."""
    return cost * 1000.0 / tokens if tokens > 0 else None


class BusyTime:
    """Union length of [start, end] intervals that arrive in any order.

    Keeps the merged intervals (sorted, disjoint) seen within `horizon` of the newest end;
    `add` returns the seconds the new interval adds to the union.
    """

    def __init__(self, horizon: float = BUSY_HORIZON_S) -> None:
        self.horizon = horizon
        self._spans: list[tuple[float, float]] = []
        self.total = 0.0

    def add(self, start: float, end: float) -> float:
        if end <= start:
            return 0.0
        spans = self._spans
        i = bisect_left(spans, (start, start))
        if i > 0 and spans[i - 1][1] >= start:
            i -= 1
        covered, lo, hi, j = 0.0, start, end, i
        while j < len(spans) and spans[j][0] <= end:
            s, e = spans[j]
            covered += min(e, end) - max(s, start)
            lo, hi = min(lo, s), max(hi, e)
            j += 1
        spans[i:j] = [(lo, hi)]
        added = (end - start) - covered
        self.total += added
        newest = max(spans[-1][1], end)
        cut = 0
        while cut < len(spans) and spans[cut][1] < newest - self.horizon:
            cut += 1
        if cut:
            del spans[:cut]
        return added


class _Tally:
    __slots__ = ("busy", "cached", "completion", "prompt", "requests")

    def __init__(self) -> None:
        self.prompt = self.cached = self.completion = self.requests = 0
        self.busy = 0.0


class CostLedger:
    """Token and cost totals per pool. `record` is O(1) amortised; `summary` O(pools)."""

    def __init__(
        self,
        settings: PoolsSettings,
        replicas_per_pool: Mapping[str, int],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._specs = {p.name: p for p in settings.pools}
        self._replicas = dict(replicas_per_pool)
        self._clock = clock
        self._started = self._provisioned_at = clock()
        self._provisioned = {name: 0.0 for name in self._specs}
        self._tallies = {name: _Tally() for name in self._specs}
        self._busy: dict[str, BusyTime] = {}
        self._recent: deque[tuple[float, str, int]] = deque()

    def set_replica_counts(self, replicas_per_pool: Mapping[str, int]) -> None:
        """Provisioned cost from now on uses these counts (history is not re-priced)."""
        now = self._clock()
        hours = max(now - self._provisioned_at, 0.0) / 3600.0
        for name, spec in self._specs.items():
            self._provisioned[name] += (
                spec.price_per_replica_hour * self._replicas.get(name, 0) * hours
            )
        self._provisioned_at = now
        self._replicas = dict(replicas_per_pool)

    def record(
        self,
        pool: str | None,
        replica: str,
        usage: Usage,
        started_at: float,
        duration_s: float,
        *,
        served: bool = True,
    ) -> None:
        """Account one finished request that `replica` of `pool` served from `started_at`
        (any clock, the same for every call) for `duration_s`. Unknown pools are ignored.
        `served=False` (the gateway's own work, e.g. a prefix warm-up) charges the busy time
        without counting a request."""
        spec = self._specs.get(pool) if pool is not None else None
        if spec is None:
            return
        tally = self._tallies[spec.name]
        tally.prompt += usage.prompt_tokens
        tally.cached += usage.cached_tokens
        tally.completion += usage.completion_tokens
        tally.requests += served
        busy = self._busy.get(replica)
        if busy is None:
            busy = self._busy[replica] = BusyTime()
        added = busy.add(started_at, started_at + max(duration_s, 0.0))
        tally.busy += spec.price_per_replica_hour * added / 3600.0
        now = self._clock()
        self._recent.append((now, spec.name, usage.total))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def summary(self) -> dict[str, PoolCost]:
        """Per pool and overall (key `all`)."""
        now = self._clock()
        self._trim(now)
        hours = max(now - self._provisioned_at, 0.0) / 3600.0
        window = min(THROUGHPUT_WINDOW_S, max(now - self._started, 1e-9))
        recent: dict[str, int] = {}
        for _, pool, tokens in self._recent:
            recent[pool] = recent.get(pool, 0) + tokens
        out: dict[str, PoolCost] = {}
        for name, spec in self._specs.items():
            t = self._tallies[name]
            provisioned = self._provisioned[name] + (
                spec.price_per_replica_hour * self._replicas.get(name, 0) * hours
            )
            out[name] = PoolCost(
                name,
                t.prompt,
                t.cached,
                t.completion,
                t.requests,
                {"busy": t.busy, "provisioned": provisioned},
                recent.get(name, 0) / window,
            )
        parts = list(out.values())
        out[ALL_POOLS] = PoolCost(
            ALL_POOLS,
            sum(p.prompt_tokens for p in parts),
            sum(p.cached_tokens for p in parts),
            sum(p.completion_tokens for p in parts),
            sum(p.requests for p in parts),
            {b: sum(p.cost[b] for p in parts) for b in BASES},
            sum(p.throughput_tps for p in parts),
        )
        return out
