"""The per-replica sum of what active sessions will send next (plugins.owed_prefill)."""

from __future__ import annotations

import pytest

from gateway.types import ReplicaId, SessionKey
from plugins.owed_prefill import ACTIVE_GAPS, OwedPrefill

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_continued_turn_owes_its_own_prefill_again() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=100)
    t.place(SessionKey("s"), A, 0.0, None)
    assert not t.measured
    t.place(SessionKey("s"), A, 10.0, 4000.0)
    t.place(SessionKey("s"), A, 20.0, 2000.0)
    assert t.measured
    assert t.owed[A] == pytest.approx(3000.0)  # the session's own mean, not the cluster's


def test_heavy_agents_owe_more_than_many_light_chats() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=100)
    for s in range(3):
        key = SessionKey(f"main{s}")
        t.place(key, A, 0.0, None)
        t.place(key, A, 5.0, 6000.0)
    for s in range(10):
        key = SessionKey(f"chat{s}")
        t.place(key, B, 0.0, None)
        t.place(key, B, 5.0, 200.0)
    assert t.owed[A] == pytest.approx(18_000.0)
    assert t.owed[B] == pytest.approx(2_000.0)


def test_a_session_stops_owing_a_few_of_its_own_gaps_after_its_last_turn() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=100)
    key = SessionKey("s")
    t.place(key, A, 0.0, None)
    t.place(key, A, 10.0, 1000.0)  # one gap of 10 s: active for ACTIVE_GAPS of them
    t.expire(10.0 + ACTIVE_GAPS * 10.0 - 0.1)
    assert t.owed[A] == pytest.approx(1000.0)
    t.expire(10.0 + ACTIVE_GAPS * 10.0 + 0.1)
    assert t.owed[A] == 0.0
    t.place(key, A, 50.0, 3000.0)  # it came back: it owes again, its mean of two turns
    assert t.owed[A] == pytest.approx(2000.0)


def test_a_new_session_owes_the_cluster_mean_turn_until_it_continues() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=100)
    t.place(SessionKey("old"), A, 0.0, None)
    t.place(SessionKey("old"), A, 4.0, 1000.0)
    t.place(SessionKey("new"), B, 5.0, None)
    assert t.owed[B] == pytest.approx(1000.0)
    # with the cluster's mean gap (4 s) as its window
    t.expire(5.0 + ACTIVE_GAPS * 4.0 + 0.1)
    assert t.owed[B] == 0.0


def test_a_moved_session_takes_what_it_owes_along() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=100)
    key = SessionKey("s")
    t.place(key, A, 0.0, None)
    t.place(key, A, 5.0, 1000.0)
    t.place(key, B, 6.0, None)  # moved: its prefill there is a recompute, not a turn
    assert t.owed[A] == 0.0
    assert t.owed[B] == pytest.approx(1000.0)


def test_the_table_is_bounded_and_forgets_a_replica() -> None:
    t = OwedPrefill(idle_s=900.0, max_sessions=2)
    for s in range(3):
        t.place(SessionKey(f"s{s}"), A, float(s), None)
        t.place(SessionKey(f"s{s}"), A, float(s) + 0.5, 100.0)
    assert len(t) == 2
    assert t.owed[A] == pytest.approx(200.0)
    t.forget(A)
    assert len(t) == 0 and A not in t.owed
