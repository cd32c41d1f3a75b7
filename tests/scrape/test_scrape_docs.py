"""docs/routing.md lists exactly the metrics the scraper registers."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.scrape.metrics import ScrapeMetrics
from gateway.types import EngineLoad, ReplicaId

DOC = Path(__file__).resolve().parents[2] / "docs" / "routing.md"


def test_metric_table_matches_the_code() -> None:
    registry = CollectorRegistry()
    load = EngineLoad(1, 2, 0.5, 0.25, 100, scraped_at=0.0)
    metrics = ScrapeMetrics(registry, lambda: {ReplicaId("a"): load}, lambda: 1.0)
    metrics.errors.labels("a", "parse").inc()
    metrics.scrapes.labels("a").inc()
    names = set()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        names.add(name)
    documented = set(
        re.findall(
            r"^\| `(kvgate_scrape\w*|kvgate_replica_engine_load_missing)` \|",
            DOC.read_text(),
            re.MULTILINE,
        )
    )
    assert names == documented
