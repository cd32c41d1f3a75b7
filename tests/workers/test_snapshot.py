"""Snapshots of scrape-time series and their merge across workers (gateway.workers.snapshot)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.app import build_app
from gateway.metrics import GatewayRegistry
from gateway.settings import load_settings
from gateway.state import GatewayState
from gateway.workers.snapshot import (
    MergedCollector,
    MergeMode,
    MergesAcrossWorkers,
    Snapshot,
    decode,
    encode,
    merge,
    take,
)


class Live(Collector):
    merge_modes: ClassVar[dict[str, MergeMode]] = {
        "t_in_flight": "sum",
        "t_healthy": "max",
        "t_age": "min",
        "t_kv": "latest",
    }

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self) -> Iterator[Metric]:
        for name in ("t_in_flight", "t_healthy", "t_age", "t_kv", "t_undeclared"):
            g = GaugeMetricFamily(name, name, labels=["replica"])
            g.add_metric(["r0"], self.values[name])
            yield g
        c = CounterMetricFamily("t_moves", "moves")
        c.add_metric([], self.values["t_moves"])
        yield c

    def describe(self) -> Iterator[Metric]:
        return iter(())


def values(**kw: float) -> dict[str, float]:
    base = {
        "t_in_flight": 0,
        "t_healthy": 0,
        "t_age": 0,
        "t_kv": 0,
        "t_undeclared": 0,
        "t_moves": 0,
    }
    return {**base, **kw}


def samples(metrics: list[Metric]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in metrics for s in m.samples}


def test_each_family_merges_by_its_mode() -> None:
    a = take([Live(values(t_in_flight=3, t_healthy=0, t_age=4, t_kv=0.2, t_moves=5))], 11, 100)
    b = take([Live(values(t_in_flight=2, t_healthy=1, t_age=1, t_kv=0.7, t_moves=1))], 22, 101)
    got = samples(merge([b, a]))  # order of the files does not matter; time does
    r0 = (("replica", "r0"),)
    assert got[("t_in_flight", r0)] == 5
    assert got[("t_healthy", r0)] == 1
    assert got[("t_age", r0)] == 1
    assert got[("t_kv", r0)] == 0.7  # the newer snapshot's
    assert got[("t_moves_total", ())] == 6  # counters add up
    # Nobody said how it merges: one series per worker.
    assert got[("t_undeclared", (("replica", "r0"), ("worker", "11")))] == 0
    assert got[("t_undeclared", (("replica", "r0"), ("worker", "22")))] == 0


def test_a_label_set_only_one_worker_has_is_kept_and_a_vanished_one_is_gone() -> None:
    class Replicas(Collector):
        merge_modes: ClassVar[dict[str, MergeMode]] = {"t_in_flight": "sum"}

        def __init__(self, ids: list[str]) -> None:
            self.ids = ids

        def collect(self) -> Iterator[Metric]:
            g = GaugeMetricFamily("t_in_flight", "x", labels=["replica"])
            for rid in self.ids:
                g.add_metric([rid], 1)
            yield g

    collector = Replicas(["r0", "r1"])
    before = take([collector], 1, 10)
    collector.ids = ["r0"]  # r1 left the cluster
    after = take([collector], 1, 11)
    other = take([Replicas(["r2"])], 2, 11)
    got = samples(merge([after, other]))
    assert set(got) == {
        ("t_in_flight", (("replica", "r0"),)),
        ("t_in_flight", (("replica", "r2"),)),
    }
    assert ("t_in_flight", (("replica", "r1"),)) in samples(merge([before]))


def test_snapshots_round_trip_and_torn_files_are_refused() -> None:
    snap = take([Live(values(t_in_flight=2, t_moves=3))], 7, 5.5)
    assert decode(encode(snap)) == snap
    assert decode(encode(snap)[:-5]) is None
    assert decode(b'{"pid": 1}') is None
    assert decode(b"[]") is None


def test_the_merged_answer_is_valid_prometheus_text_with_the_worker_count() -> None:
    registry = CollectorRegistry()
    snaps = [take([Live(values(t_in_flight=1))], pid, 1) for pid in (1, 2, 3)]
    registry.register(MergedCollector(snaps))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kvgate_workers"].samples[0].value == 3
    assert families["t_in_flight"].samples[0].value == 3
    assert families["t_moves"].type == "counter"


def test_every_scrape_time_gauge_of_a_full_gateway_says_how_it_merges() -> None:
    """A new collector must declare its gauges' merge (else they'd stay per worker)."""
    settings = load_settings(
        replicas=[{"id": "e0", "url": "http://127.0.0.1:9", "models": ["m"], "pool": "a"}],
        pools={"pools": [{"name": "a", "price_per_card_hour": 1.0}]},
        kv_events={"enabled": True},
        scrape={"enabled": True},
    )
    state: GatewayState = build_app(settings).state.gateway
    registry = state.metrics.registry
    assert isinstance(registry, GatewayRegistry)
    live = registry.live_collectors()
    assert len(live) >= 4  # cluster, lineage, scrape, kv events index, pools
    undeclared = []
    for collector in live:
        assert isinstance(collector, MergesAcrossWorkers), type(collector).__name__
        for family in collector.collect():
            if family.type == "gauge" and family.name not in collector.merge_modes:
                undeclared.append(family.name)
    assert not undeclared
    snap = take(live, 1, 0.0)
    assert isinstance(snap, Snapshot) and snap.families
