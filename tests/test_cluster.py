from __future__ import annotations

import pytest

from gateway.cluster import VIEW_MAX_AGE_S, Cluster
from gateway.testing.clock import FakeClock
from gateway.types import EngineLoad, ReplicaId, ReplicaState

A, B = ReplicaId("a"), ReplicaId("b")


def cluster(clock: FakeClock | None = None) -> Cluster:
    return Cluster(
        [ReplicaState(A, "http://a"), ReplicaState(B, "http://b")], clock=clock or FakeClock()
    )


def test_view_is_cached_until_something_changes() -> None:
    clock = FakeClock()
    c = cluster(clock)
    v1 = c.view()
    assert c.view() is v1
    assert c.set_healthy(A, False) is True and c.set_healthy(A, False) is False
    v2 = c.view()
    assert v2 is not v1 and not v2.by_id[A].healthy and [r.id for r in v2.healthy()] == [B]
    c.publish_load(B, EngineLoad(waiting=3, running=1, scraped_at=clock()))
    v3 = c.view()
    assert v3.load_of(v3.by_id[B]) is not None
    # Time alone refreshes `now` (for staleness) but keeps the replicas tuple.
    clock.advance(VIEW_MAX_AGE_S + 0.01)
    v4 = c.view()
    assert v4 is not v3 and v4.replicas is v3.replicas and v4.now == clock()
    clock.advance(5)
    v5 = c.view()
    assert v5.load_of(v5.by_id[B]) is None  # stale load reads as unknown


def test_in_flight_is_a_live_read_only_mapping() -> None:
    c = cluster()
    view = c.view()
    c.acquire(A)
    c.acquire(A)
    assert view.inflight(A) == 2 and c.view() is view
    c.release(A)
    c.release(A)
    assert view.inflight(A) == 0
    with pytest.raises(TypeError):
        view.in_flight[A] = 5  # type: ignore[index]


def test_membership_changes_notify_and_keep_counters_of_removed_replicas() -> None:
    c = cluster()
    seen: list[tuple[str, ...]] = []
    c.on_membership_change(lambda replicas: seen.append(tuple(r.id for r in replicas)))
    c.acquire(B)
    c.set_members([ReplicaState(A, "http://a")])
    assert seen == [("a",)] and B not in c.members
    assert c.in_flight[B] == 1  # its request is still running
    c.release(B)
    assert B not in c.in_flight
    c.publish_load(B, EngineLoad(0, 0))  # unknown replicas are ignored
    assert c.set_healthy(B, False) is False


def test_known_models() -> None:
    c = cluster()
    assert c.known_models() is None
    c.set_models(A, ["m1"])
    assert c.known_models() is None
    c.set_models(B, ["m2"])
    assert c.known_models() == {"m1", "m2"}
    assert c.view().by_id[A].models == {"m1"}
    configured = Cluster([ReplicaState(A, "http://a", models=frozenset({"x"}))])
    assert configured.known_models() == {"x"}
