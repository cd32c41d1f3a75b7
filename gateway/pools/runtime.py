"""`PoolsRuntime`: what the pools feature hangs on an app, built once by `build_app`.

It owns the weight controller (a lifespan task), the cost ledger (fed by the proxy's
outcome seam), the Prometheus collector and the read-only admin payload, and wraps the
configured router in a `PoolSelector`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.registry import CollectorRegistry

from gateway.errors import ConfigError
from gateway.hooks import RequestOutcome
from gateway.policy import Policy
from gateway.pools import metrics
from gateway.pools.config import PoolsSettings
from gateway.pools.controller import WeightController
from gateway.pools.cost import BASES, CostLedger, Usage
from gateway.pools.latency import TtftWindow
from gateway.pools.placement import Placement
from gateway.pools.selector import PoolSelector
from gateway.pools.warm import PrefixWarmer
from gateway.types import ClusterView, ReplicaId, ReplicaState


def check_replica_pools(settings: PoolsSettings, replicas: Sequence[ReplicaState]) -> None:
    """A replica naming a pool the `pools:` section lacks is a typo, not a new pool."""
    known = {p.name for p in settings.pools}
    unknown = sorted({r.pool for r in replicas if r.pool is not None and r.pool not in known})
    if unknown:
        raise ConfigError(
            f"replicas name pools missing from pools.pools: {', '.join(unknown)}",
            param="replicas.pool",
        )


class PoolsRuntime:
    def __init__(
        self,
        settings: PoolsSettings,
        replicas: Sequence[ReplicaState],
        view_source: Callable[[], ClusterView],
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        ledger_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_replica_pools(settings, replicas)
        self.settings = settings
        self.placement = Placement(settings)
        cfg = settings.controller
        self.ttft = TtftWindow((p.name for p in settings.pools), cfg.ttft_window_s)
        self._ttft_clock = ledger_clock
        self.controller = WeightController(
            settings,
            view_source,
            clock=clock,
            latency_source=lambda: self.ttft.quantiles(ledger_clock(), cfg.ttft_quantile),
        )
        self._replica_counts = Counter(r.pool for r in replicas if r.pool is not None)
        self._replica_pool = {r.id: r.pool for r in replicas}
        self.ledger = CostLedger(settings, self._replica_counts, clock=ledger_clock)
        self.selector: PoolSelector | None = None
        self.warmer: PrefixWarmer | None = None  # set by install when warm_moves is on
        if registry is not None:
            metrics.register(
                registry,
                lambda: self.controller.snapshot,
                self.ledger,
                lambda: self.warmer.counts if self.warmer is not None else {},
            )

    def wrap(
        self,
        inner_factory: Callable[[tuple[ReplicaState, ...]], Policy],
        replicas: Sequence[ReplicaState],
    ) -> PoolSelector:
        self.selector = PoolSelector(
            inner_factory, self.settings, lambda: self.controller.snapshot, replicas
        )
        return self.selector

    def served_model(self, model: str) -> str:
        """The name to send upstream for a public model name (aliases resolved)."""
        return self.placement.served_name(model)

    def record(
        self,
        replica: ReplicaId,
        usage: Usage,
        started_at: float,
        duration_s: float,
        *,
        served: bool = True,
    ) -> None:
        """Account one finished request; replicas outside any configured pool are skipped."""
        self.ledger.record(
            self._replica_pool.get(replica),
            replica,
            usage,
            started_at,
            duration_s,
            served=served,
        )

    def charge_warmup(self, replica: ReplicaId, started_at: float, duration_s: float) -> None:
        """A prefix warm-up kept `replica` busy; it served no tokens to anyone."""
        self.record(replica, Usage(0, 0, 0), started_at, duration_s, served=False)

    def observe(self, outcome: RequestOutcome) -> None:
        """Outcome observer. A failed request that reached a replica still kept it busy, so
        it is charged with whatever usage it reported (often none)."""
        if outcome.replica is None:
            return
        pool = self._replica_pool.get(outcome.replica)
        if (
            outcome.ok
            and outcome.ttfb_s is not None
            and pool is not None
            and self._measures_queueing(outcome)
        ):
            self.ttft.add(pool, self._ttft_clock(), outcome.ttfb_s)
        usage = Usage(
            outcome.prompt_tokens or 0, outcome.cached_tokens or 0, outcome.completion_tokens or 0
        )
        self.record(outcome.replica, usage, outcome.started_at, outcome.latency_s)
        if self.warmer is not None:
            self.warmer.consider(outcome)

    def _measures_queueing(self, outcome: RequestOutcome) -> bool:
        limit = self.settings.controller.ttft_max_uncached_tokens
        if limit is None:
            return True
        if outcome.prompt_tokens is None:
            return False  # size unknown: it could be a cold prompt timing its own prefill
        return outcome.prompt_tokens - (outcome.cached_tokens or 0) <= limit

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        self._replica_pool = {r.id: r.pool for r in replicas}
        self._replica_counts = Counter(r.pool for r in replicas if r.pool is not None)
        self.ledger.set_replica_counts(self._replica_counts)
        if self.selector is not None:
            self.selector.membership_changed(replicas)

    async def start(self) -> None:
        self.controller.start()

    async def stop(self) -> None:
        await self.controller.stop()
        if self.warmer is not None:
            await self.warmer.stop()

    def admin_payload(self) -> dict[str, Any]:
        snap = self.controller.snapshot
        summary = self.ledger.summary()
        cost = {
            name: {
                "requests": pc.requests,
                "tokens": {
                    "prompt": pc.prompt_tokens,
                    "cached_prompt": pc.cached_tokens,
                    "generated": pc.completion_tokens,
                    "total": pc.total_tokens,
                },
                "throughput_tokens_per_s": pc.throughput_tps,
                "cost": dict(pc.cost),
                "cost_per_1k_tokens": {b: pc.per_1k_total(b) for b in BASES},
                "cost_per_1k_output_tokens": {b: pc.per_1k_output(b) for b in BASES},
            }
            for name, pc in summary.items()
        }
        return {
            "weights": dict(snap.weights),
            "last_change": {
                "code": snap.code,
                "reason": snap.reason,
                "at": snap.changed_at,
                "version": snap.version,
            },
            "status": snap.status,
            "controller_steps": snap.steps,
            "controller": self.settings.controller.model_dump(),
            "utilisation": dict(snap.utilisation),
            "pools": [
                {
                    **p.model_dump(mode="json"),
                    "capabilities": sorted(p.capabilities),
                    "replicas": self._replica_counts.get(p.name, 0),
                }
                for p in self.settings.pools
            ],
            "models": {
                public: {"served": t.served, "pools": sorted(t.pools or ())}
                for public in self.placement.public_models()
                if (t := self.placement.resolve(public)) is not None
            },
            "cost": cost,
            "warm_moves": self._warm_payload(),
        }

    def _warm_payload(self) -> dict[str, Any]:
        warmer = self.warmer
        if warmer is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "in_flight": warmer.in_flight,
            "waiting": warmer.waiting,
            "skipped": dict(sorted(warmer.skipped.items())),
            "done": [
                {"from": src, "to": dst, "result": result, "count": n}
                for (src, dst, result), n in sorted(warmer.counts.items())
            ],
        }
