"""DnsDiscovery on a real Cluster fed by a real DNS server on loopback."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from gateway.cluster import Cluster
from gateway.discovery.config import DiscoverySettings, DnsTarget
from gateway.discovery.resolve import DnsResolver
from gateway.discovery.service import DiscoveryMetrics, DnsDiscovery
from gateway.policy import PolicyContext
from gateway.routing import RoutingSettings, build_router
from gateway.testing.views import make_request
from gateway.types import ReplicaId, ReplicaState
from tests.discovery.dns_server import Zone, dns_server

NAME = "_http._tcp.engines.test"


def engines_zone(count: int) -> Zone:
    z = Zone()
    set_engines(z, range(count))
    return z


def set_engines(z: Zone, indices: range | list[int]) -> None:
    with z.lock:
        z.srv[NAME] = [(f"e{i}.engines.test", 9000 + i) for i in indices]
        for i in indices:
            z.a[f"e{i}.engines.test"] = [f"10.1.0.{i + 1}"]


def discovery(
    cluster: Cluster, ns: str, registry: CollectorRegistry | None = None, **settings: object
) -> DnsDiscovery:
    cfg = DiscoverySettings(
        dns=(DnsTarget(name=NAME, models=("m",)),), nameservers=(ns,), **settings
    )  # type: ignore[arg-type]
    metrics = DiscoveryMetrics(registry) if registry is not None else None
    return DnsDiscovery(cluster, cfg, DnsResolver(cfg.nameservers, 1.0), metrics)


def ids(cluster: Cluster) -> list[str]:
    return sorted(cluster.members)


async def test_engines_join_at_once_and_leave_after_remove_after_rounds() -> None:
    z = engines_zone(2)
    cluster = Cluster()
    with dns_server(z) as ns:
        d = discovery(cluster, ns, remove_after=2)
        assert await d.resolve_once() is True
        assert ids(cluster) == ["e0.engines.test:9000", "e1.engines.test:9001"]
        assert cluster.url_of(ReplicaId("e1.engines.test:9001")) == "http://10.1.0.2:9001"
        assert await d.resolve_once() is False  # same answer, no membership change
        set_engines(z, [0, 1, 2])
        assert await d.resolve_once() is True
        assert len(cluster.members) == 3
        set_engines(z, [0, 2])
        assert await d.resolve_once() is False  # missing once: kept
        assert "e1.engines.test:9001" in cluster.members
        set_engines(z, [0, 1, 2])
        await d.resolve_once()  # back: its miss count starts over
        set_engines(z, [0, 2])
        assert await d.resolve_once() is False
        assert await d.resolve_once() is True  # missing twice in a row: gone
        assert ids(cluster) == ["e0.engines.test:9000", "e2.engines.test:9002"]


async def test_a_dns_failure_keeps_the_members_and_an_empty_answer_removes_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    z = engines_zone(3)
    cluster = Cluster()
    registry = CollectorRegistry()
    with dns_server(z) as ns:
        d = discovery(cluster, ns, registry, remove_after=1)
        await d.resolve_once()
        z.servfail = True
        with caplog.at_level(logging.WARNING, "kvgate.discovery"):
            assert await d.resolve_once() is False
        assert len(cluster.members) == 3
        assert "keeping its 3 replica(s)" in caplog.text
        z.servfail = False
        with z.lock:
            del z.srv[NAME]  # NXDOMAIN: the service has no endpoints now
        assert await d.resolve_once() is True and not cluster.members

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvgate_discovery_lookups_total", target=NAME, result="ok") == 1
    assert value("kvgate_discovery_lookups_total", target=NAME, result="error") == 1
    assert value("kvgate_discovery_lookups_total", target=NAME, result="empty") == 1
    assert value("kvgate_discovery_replicas", target=NAME) == 0
    assert value("kvgate_discovery_membership_changes_total") == 2


async def test_configured_replicas_stay_and_win_over_a_dns_replica_of_the_same_id() -> None:
    static = ReplicaState(ReplicaId("e0.engines.test:9000"), "http://static:1")
    other = ReplicaState(ReplicaId("fixed"), "http://fixed:1")
    cluster = Cluster([static, other])
    with dns_server(engines_zone(2)) as ns:
        d = discovery(cluster, ns, remove_after=1)
        await d.resolve_once()
        assert ids(cluster) == ["e0.engines.test:9000", "e1.engines.test:9001", "fixed"]
        assert cluster.url_of(static.id) == "http://static:1"
        assert [r.id for r in d.discovered] == ["e1.engines.test:9001"]


async def test_health_of_a_replica_survives_rounds() -> None:
    cluster = Cluster()
    z = engines_zone(2)
    with dns_server(z) as ns:
        d = discovery(cluster, ns, remove_after=1)
        await d.resolve_once()
        cluster.set_healthy(ReplicaId("e0.engines.test:9000"), False)
        set_engines(z, [0, 1, 2])
        await d.resolve_once()
        assert not cluster.is_healthy(ReplicaId("e0.engines.test:9000"))
        assert cluster.is_healthy(ReplicaId("e2.engines.test:9002"))


@pytest.mark.parametrize("start", [4, 8])
async def test_scaling_through_dns_remaps_about_one_in_n_sessions(start: int) -> None:
    """The consistent-hash ring, rebuilt by the membership change: adding the (N+1)th
    replica moves ~1/(N+1) of the sessions, all of them onto the new replica; removing it
    again moves exactly those back."""
    z = engines_zone(start)
    cluster = Cluster()
    router = build_router(RoutingSettings(policy="consistent_hash"), PolicyContext())
    cluster.on_membership_change(router.membership_changed)  # type: ignore[attr-defined]
    sessions = [make_request(f"s{i}") for i in range(4000)]

    def placement() -> list[ReplicaId | None]:
        view = cluster.view()
        return [router.choose(r, view).first for r in sessions]

    with dns_server(z) as ns:
        d = discovery(cluster, ns, remove_after=1)
        await d.resolve_once()
        before = placement()
        set_engines(z, list(range(start + 1)))
        await d.resolve_once()
        after = placement()
        moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        new = ReplicaId(f"e{start}.engines.test:{9000 + start}")
        assert all(after[i] == new for i in moved)
        share = len(moved) / len(sessions)
        assert abs(share - 1 / (start + 1)) < 0.35 / (start + 1), share
        set_engines(z, list(range(start)))
        with z.lock:
            del z.a[f"e{start}.engines.test"]
        await d.resolve_once()
        assert placement() == before
