"""docs/kvevents.md lists exactly the metrics gateway.kvevents registers."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.metrics import KVEventMetrics
from gateway.types import ReplicaId

DOC = Path(__file__).resolve().parents[2] / "docs" / "kvevents.md"


def test_metric_table_matches_the_code() -> None:
    registry = CollectorRegistry()
    metrics = KVEventMetrics(registry)
    index = EventIndex()
    index.clear(ReplicaId("a"))
    metrics.watch(index, lambda: {ReplicaId("a"): SyncState.SYNCED})
    metrics.batch(ReplicaId("a"), 1, 1, 1, 0.0)
    metrics.resync(ReplicaId("a"), "start")
    metrics.gap(ReplicaId("a"), 1)
    metrics.malformed(ReplicaId("a"))
    metrics.connection(ReplicaId("a"), False)
    metrics.evidence.labels("precise").inc()
    metrics.tokenize.labels("done").inc()
    names = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in registry.collect()
    }
    documented = set(re.findall(r"^\| `(kvgate_kv\w*)` \|", DOC.read_text(), re.MULTILINE))
    assert names == documented
