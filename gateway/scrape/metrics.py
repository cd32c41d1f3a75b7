"""Gateway-side metrics that show what the scraper saw and when."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.metric_merge import MergeMode
from gateway.types import EngineLoad, ReplicaId


class _SnapshotCollector(Collector):
    """Renders the current snapshots at collection time, so the age is always current."""

    # Workers: each scrapes every engine; the freshest reading wins.
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {
        "kvgate_scrape_waiting": "latest",
        "kvgate_scrape_running": "latest",
        "kvgate_scrape_kv_usage": "latest",
        "kvgate_scrape_prefix_hit_rate": "latest",
        "kvgate_scrape_age_seconds": "min",
        "kvgate_scrape_fresh_for_seconds": "max",
        "kvgate_replica_engine_load_missing": "max",
    }

    def __init__(
        self,
        loads: Callable[[], Mapping[ReplicaId, EngineLoad]],
        clock: Callable[[], float],
        missing: Callable[[], Collection[ReplicaId]] = frozenset,
        stale_after_s: float = 2.0,
    ) -> None:
        self._loads = loads
        self._clock = clock
        self._missing = missing
        self._stale_after_s = stale_after_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self._clock()
        fams = {
            "waiting": GaugeMetricFamily(
                "kvgate_scrape_waiting", "Waiting requests in the last scrape", labels=["replica"]
            ),
            "running": GaugeMetricFamily(
                "kvgate_scrape_running", "Running requests in the last scrape", labels=["replica"]
            ),
            "kv_usage": GaugeMetricFamily(
                "kvgate_scrape_kv_usage",
                "KV-cache usage fraction in the last scrape",
                labels=["replica"],
            ),
            "prefix_hit_rate": GaugeMetricFamily(
                "kvgate_scrape_prefix_hit_rate",
                "Recent prefix-cache hit rate in the last scrape",
                labels=["replica"],
            ),
            "age": GaugeMetricFamily(
                "kvgate_scrape_age_seconds",
                "Seconds since the last successful scrape",
                labels=["replica"],
            ),
            # A quiet replica is read less often and its load stays fresh longer: compare
            # the age with this, not with scrape.stale_after_s alone (kvgate doctor does).
            "fresh_for": GaugeMetricFamily(
                "kvgate_scrape_fresh_for_seconds",
                "Age up to which the last scrape counts as the replica's load (older: unknown, "
                "treated as saturated)",
                labels=["replica"],
            ),
        }
        loads = self._loads()
        missing = GaugeMetricFamily(
            "kvgate_replica_engine_load_missing",
            "1 while the replica's engine serves no load (/metrics 404) and the gateway's "
            "own in-flight and token counts stand in",
            labels=["replica"],
        )
        absent = self._missing()
        for replica in sorted(loads):
            missing.add_metric([replica], 1.0 if replica in absent else 0.0)
        for replica, load in sorted(loads.items()):
            if not load.engine:
                continue  # no engine reading to show
            fams["waiting"].add_metric([replica], load.waiting)
            fams["running"].add_metric([replica], load.running)
            if load.kv_usage is not None:
                fams["kv_usage"].add_metric([replica], load.kv_usage)
            if load.prefix_hit_rate is not None:
                fams["prefix_hit_rate"].add_metric([replica], load.prefix_hit_rate)
            fams["age"].add_metric([replica], max(0.0, now - load.scraped_at))
            fams["fresh_for"].add_metric([replica], self._stale_after_s + load.grace_s)
        yield from fams.values()
        yield missing

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Empty describe: the registry must not call collect() at registration time.
        return iter(())


class ScrapeMetrics:
    """Registered on the app's registry; never on the global default one."""

    def __init__(
        self,
        registry: CollectorRegistry,
        loads: Callable[[], Mapping[ReplicaId, EngineLoad]],
        clock: Callable[[], float],
        missing: Callable[[], Collection[ReplicaId]] = frozenset,
        stale_after_s: float = 2.0,
    ) -> None:
        self.errors = Counter(
            "kvgate_scrape_errors", "Failed scrapes", ["replica", "reason"], registry=registry
        )
        self.scrapes = Counter(
            "kvgate_scrapes", "Successful scrapes", ["replica"], registry=registry
        )
        self.duration = Histogram(
            "kvgate_scrape_duration_seconds",
            "Time to fetch and parse one replica's /metrics",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self._collector = _SnapshotCollector(loads, clock, missing, stale_after_s)
        registry.register(self._collector)
        self._registry = registry

    def forget(self, replica: ReplicaId) -> None:
        try:
            self.scrapes.remove(replica)
        except KeyError:
            pass
        for labels in list(self.errors._metrics):
            if labels[0] == replica:
                self.errors.remove(*labels)

    def unregister(self) -> None:
        for collector in (self.errors, self.scrapes, self.duration, self._collector):
            self._registry.unregister(collector)
