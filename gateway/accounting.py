"""Tokens, end-to-end latency and cost per replica: an outcome observer for every request.

Installed unless `metrics.tokens` is off (listed in `gateway.app.FEATURE_INSTALLERS`). As an
observer it makes the proxy ask streams for usage (gateway.stream_usage), so streamed output
tokens are counted whether or not the client asked for usage.

Cost: a replica is charged its price per hour for the time it had at least one request of
this gateway in flight (the union of those requests' intervals, `gateway.pools.cost`), the
same "busy" basis as the pools' ledger. The price is the replica's `price_per_hour`, else
its pool's price per replica-hour. Cost per 1,000 tokens is a ratio of two rates in
PromQL, per replica, per pool (`sum by (pool)`) or overall.
"""

from __future__ import annotations

from gateway.hooks import RequestOutcome
from gateway.pools.cost import BusyTime
from gateway.settings import KvgateSettings
from gateway.state import GatewayState
from gateway.types import ReplicaId, ReplicaState


class Accounting:
    def __init__(self, state: GatewayState) -> None:
        self._metrics = state.metrics
        self._cluster = state.cluster
        self._pool_prices = _pool_prices(state.settings)
        self._busy: dict[ReplicaId, BusyTime] = {}
        state.cluster.on_membership_change(self._forget_removed)

    def __call__(self, outcome: RequestOutcome) -> None:
        replica, request = outcome.replica, outcome.request
        if replica is None or request is None:
            return
        m = self._metrics
        member = self._cluster.members.get(replica)
        pool = (member.pool if member is not None else None) or ""
        m.served(
            m.model_label(request.model),
            replica,
            pool,
            outcome.latency_s,
            outcome.prompt_tokens,
            outcome.cached_tokens,
            outcome.completion_tokens,
        )
        forecast = outcome.forecast
        if forecast is not None and outcome.cached_tokens is not None:
            m.cache_forecast(
                replica,
                forecast.policy,
                forecast.predicted,
                forecast.best,
                outcome.cached_tokens,
            )
        price = (member.price_per_hour if member is not None else 0.0) or self._pool_prices.get(
            pool, 0.0
        )
        if price:
            busy = self._busy.get(replica)
            if busy is None:
                busy = self._busy[replica] = BusyTime()
            added = busy.add(outcome.started_at, outcome.started_at + outcome.latency_s)
            m.charge(replica, pool, price * added / 3600.0)

    def _forget_removed(self, replicas: tuple[ReplicaState, ...]) -> None:
        kept = {r.id for r in replicas}
        for rid in [r for r in self._busy if r not in kept]:
            del self._busy[rid]


def _pool_prices(settings: KvgateSettings) -> dict[str, float]:
    if settings.pools is None:
        return {}
    return {p.name: p.price_per_replica_hour for p in settings.pools.pools}


def install(state: GatewayState) -> None:
    if state.settings.metrics.tokens:
        state.observers.append(Accounting(state))
