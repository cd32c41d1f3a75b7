from __future__ import annotations

import pytest

from gateway.cluster import VIEW_MAX_AGE_S, Cluster
from gateway.policy import PolicyContext
from gateway.routing import RoutingSettings, build_router
from gateway.testing.clock import FakeClock
from gateway.types import EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

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


def test_a_replica_removed_then_added_back_starts_afresh_but_keeps_its_requests() -> None:
    clock = FakeClock()
    c = cluster(clock)
    c.set_healthy(B, False)
    c.publish_load(B, EngineLoad(waiting=7, running=1, scraped_at=clock()))
    c.set_models(B, ["m"])
    c.acquire(B)
    c.set_members([ReplicaState(A, "http://a")])
    c.set_members([ReplicaState(A, "http://a"), ReplicaState(B, "http://b2")])
    back = c.view().by_id[B]
    # What was learnt of the old replica is not carried to the new one at the same id...
    assert back.healthy and back.load is None and back.models == frozenset()
    assert c.url_of(B) == "http://b2"
    # ...but the request it was running is still counted, and released exactly once.
    assert c.in_flight[B] == 1
    c.release(B)
    assert c.in_flight[B] == 0 and B in c.in_flight


def test_busy_is_told_on_the_first_request_only_and_after_a_removal() -> None:
    c = cluster()
    busy: list[ReplicaId] = []
    c.on_busy(busy.append)
    c.acquire(A)
    c.acquire(A)
    assert busy == [A]
    c.release(A)
    c.release(A)
    c.acquire(A)
    assert busy == [A, A]
    c.set_members([ReplicaState(B, "http://b")])
    c.release(A)  # A's last request finishes after A left
    assert A not in c.in_flight
    c.set_members([ReplicaState(A, "http://a"), ReplicaState(B, "http://b")])
    c.acquire(A)
    assert busy == [A, A, A]


def test_membership_listeners_see_the_new_view_with_current_health() -> None:
    c = cluster()
    c.set_healthy(A, False)
    seen: list[dict[str, bool]] = []
    c.on_membership_change(lambda replicas: seen.append({r.id: r.healthy for r in replicas}))
    before = c.view()
    c.set_members([*c.members.values(), ReplicaState(ReplicaId("c"), "http://c")])
    assert seen == [{"a": False, "b": True, "c": True}]
    after = c.view()
    assert after is not before and ReplicaId("c") in after.by_id
    assert [r.id for r in after.healthy()] == ["b", "c"]


def test_a_hash_router_wired_to_the_cluster_moves_only_what_membership_forces() -> None:
    settings = RoutingSettings.model_validate({"policy": "consistent_hash"})
    router = build_router(settings, PolicyContext())
    c = Cluster([ReplicaState(ReplicaId(f"r{i}"), f"http://r{i}") for i in range(3)])
    c.on_membership_change(router.membership_changed)  # type: ignore[attr-defined]
    sessions = [f"conversation-{i}" for i in range(300)]

    def placement() -> dict[str, ReplicaId | None]:
        view = c.view()
        return {s: router.choose(_request(s), view).first for s in sessions}

    three = placement()
    assert set(three.values()) == {"r0", "r1", "r2"}
    c.set_members([*c.members.values(), ReplicaState(ReplicaId("r3"), "http://r3")])
    four = placement()
    moved = {s for s in sessions if four[s] != three[s]}
    # Only sessions the new replica takes move; it takes some, but not most.
    assert moved and all(four[s] == "r3" for s in moved)
    assert len(moved) < len(sessions) / 2
    c.set_members([r for r in c.members.values() if r.id != "r1"])
    three_again = placement()
    assert "r1" not in three_again.values()
    assert all(three_again[s] == four[s] for s in sessions if four[s] != "r1")


def _request(session: str) -> RouteRequest:
    return RouteRequest(
        request_id=session,
        model="m",
        session_key=SessionKey(session),
        prefix_hashes=(),
        block_tokens=16,
        prompt_tokens=16,
    )
