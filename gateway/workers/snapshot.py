"""A worker's scrape-time series as a file the other workers read, and their merge.

prometheus-client's multiprocess mode shares the values of Counter, Gauge and Histogram
objects between processes; collectors that compute their series from a worker's live state
when collected (in-flight per replica, health, scraped engine load, index sizes) have no
such file. Each worker therefore writes what those collectors return as a snapshot, and the
worker answering `/metrics` merges the snapshots family by family:

* counters add up;
* a gauge merges as its collector's `merge_modes` says: `sum`, `max`, `min`, `latest`
  (the newest snapshot's value), or `worker` (one series per worker, labelled
  `worker="<pid>"`); a gauge nobody declared, and any other type, stays per worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import orjson
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gateway.metric_merge import MERGE_MODES, MergeMode

WORKER_LABEL = "worker"

Sample = tuple[str, dict[str, str], float]


@runtime_checkable
class MergesAcrossWorkers(Protocol):
    """A scrape-time collector that says how its gauges merge across workers."""

    merge_modes: ClassVar[Mapping[str, MergeMode]]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    type: str
    documentation: str
    mode: MergeMode
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    pid: int
    time: float  # wall clock when taken
    families: tuple[Family, ...]


def mode_of(family: Metric, modes: Mapping[str, MergeMode]) -> MergeMode:
    if family.type == "counter":
        return "sum"
    if family.type == "gauge":
        return modes.get(family.name, "worker")
    return "worker"


def take(collectors: Iterable[Collector], pid: int, now: float) -> Snapshot:
    """Collect `collectors` now (call it on the thread that owns their state)."""
    families: list[Family] = []
    for collector in collectors:
        modes: Mapping[str, MergeMode] = (
            collector.merge_modes if isinstance(collector, MergesAcrossWorkers) else {}
        )
        for family in collector.collect():
            samples = tuple((s.name, dict(s.labels), float(s.value)) for s in family.samples)
            families.append(
                Family(
                    family.name, family.type, family.documentation, mode_of(family, modes), samples
                )
            )
    return Snapshot(pid, now, tuple(families))


def encode(snapshot: Snapshot) -> bytes:
    return orjson.dumps(
        {
            "pid": snapshot.pid,
            "time": snapshot.time,
            "families": [
                [f.name, f.type, f.documentation, f.mode, [list(s) for s in f.samples]]
                for f in snapshot.families
            ],
        }
    )


def decode(data: bytes) -> Snapshot | None:
    """The snapshot in `data`, or None when it is not one (a torn or foreign file)."""
    try:
        doc = orjson.loads(data)
        families = tuple(
            Family(
                str(name),
                str(typ),
                str(doc_),
                mode if mode in MERGE_MODES else "worker",
                tuple(
                    (str(n), {str(k): str(v) for k, v in labels.items()}, float(value))
                    for n, labels, value in samples
                ),
            )
            for name, typ, doc_, mode, samples in doc["families"]
        )
        return Snapshot(int(doc["pid"]), float(doc["time"]), families)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


def merge(snapshots: Sequence[Snapshot]) -> list[Metric]:
    """One family per name over all `snapshots` (see the module's docstring)."""
    metrics: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    # Oldest first: `latest` keeps the value written last.
    for snap in sorted(snapshots, key=lambda s: s.time):
        for family in snap.families:
            if family.name not in metrics:
                metrics[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            acc = values[family.name]
            mode = family.mode
            for name, labels, value in family.samples:
                if mode == "worker":
                    labels = {**labels, WORKER_LABEL: str(snap.pid)}
                key = (name, tuple(sorted(labels.items())))
                previous = acc.get(key)
                if previous is None or mode in ("latest", "worker"):
                    acc[key] = value
                elif mode == "sum":
                    acc[key] = previous + value
                elif mode == "max":
                    acc[key] = max(previous, value)
                else:
                    acc[key] = min(previous, value)
    for name, metric in metrics.items():
        for (sample, label_pairs), value in values[name].items():
            metric.add_sample(sample, dict(label_pairs), value)
    return list(metrics.values())


class MergedCollector(Collector):
    """The merge of `snapshots`, and how many workers they came from (`kvgate_workers`)."""

    def __init__(self, snapshots: Sequence[Snapshot]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        yield from merge(self._snapshots)
        workers = Metric(
            "kvgate_workers", "Worker processes whose series this answer merges", "gauge"
        )
        workers.add_sample("kvgate_workers", {}, float(len({s.pid for s in self._snapshots})))
        yield workers

    def describe(self) -> Iterator[Metric]:
        return iter(())
