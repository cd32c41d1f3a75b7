"""The fleet panel's timeline when the membership changes under a running gateway (as
discovery changes it), the engine kind it shows, the ring shares it recomputes, and the
event log's bounds; the console's own URLs from the bound host."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from gateway.console.api import console_asset_paths
from gateway.console.config import console_url
from gateway.console.events import MAX_EVENTS, EventLog
from gateway.testing.clock import FakeClock
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId


async def test_replicas_added_and_removed_are_on_the_timeline_and_the_ring_follows() -> None:
    async with (
        sim_engines(3, "instant") as engines,
        gateway(
            engines,
            replicas=[{"id": f"e{e.index}", "url": e.url} for e in engines[:2]],
            scrape={"engine": "sglang"},
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        cluster = gw.state.cluster
        e0, e1 = cluster.members[ReplicaId("e0")], cluster.members[ReplicaId("e1")]
        e2 = dataclasses.replace(e0, id=ReplicaId("e2"), url=engines[2].url, weight=2.0)
        cluster.set_members([e0, e2])  # e1 leaves, e2 joins with twice the weight
        fleet = (await http.get("/admin/fleet")).json()
        assert [(e["kind"], e["subject"]) for e in fleet["events"]] == [
            ("added", "e2"),
            ("removed", "e1"),
        ]
        rows = {r["id"]: r for r in fleet["replicas"]}
        assert sorted(rows) == ["e0", "e2"]
        assert rows["e2"]["ring_share"] > rows["e0"]["ring_share"] > 0.2
        assert rows["e0"]["ring_share"] + rows["e2"]["ring_share"] == pytest.approx(1.0, abs=1e-3)
        # The engine kind configured for the scraper is shown as configured.
        assert {r["engine"] for r in rows.values()} == {"sglang"}
        cluster.set_members([e0, e1, e2])
        fleet = (await http.get("/admin/fleet")).json()
        assert [e["kind"] for e in fleet["events"]] == ["added", "removed", "added"]


def test_the_event_log_forgets_by_age_and_by_count() -> None:
    clock = FakeClock(100.0)
    log = EventLog(60.0, clock=clock)
    log.add("ejected", "e1", "3 failures")
    clock.advance(30)
    log.add("healthy", "e1")
    assert [e["kind"] for e in log.recent()] == ["ejected", "healthy"]
    first = {"at": 100.0, "kind": "ejected", "subject": "e1", "detail": "3 failures"}
    assert log.recent()[0] == first
    clock.advance(31)  # the first is past the horizon now
    assert [e["kind"] for e in log.recent()] == ["healthy"]
    for i in range(MAX_EVENTS + 5):
        log.add("weights", f"pool-{i}")
    recent = log.recent()
    assert len(recent) == MAX_EVENTS and recent[-1]["subject"] == f"pool-{MAX_EVENTS + 4}"


def test_the_console_url_a_browser_on_this_machine_can_open() -> None:
    assert console_url("0.0.0.0", 8080, "/console") == "http://127.0.0.1:8080/console"
    assert console_url("", 8080, "/c") == "http://127.0.0.1:8080/c"
    assert console_url("::", 80, "/console") == "http://[::1]:80/console"
    assert console_url("fd00::7", 80, "/console") == "http://[fd00::7]:80/console"
    assert console_url("gw.internal", 80, "/ops") == "http://gw.internal:80/ops"
    assert console_asset_paths("/ops/") == console_asset_paths("/ops")
    assert "/ops" in console_asset_paths("/ops") and "/ops/index.html" not in (
        console_asset_paths("/ops")
    )
    assert "/console" in console_asset_paths("")
