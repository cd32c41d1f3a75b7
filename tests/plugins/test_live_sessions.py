"""The live-session table's counts and token mass through place, move, expiry and forget."""

from __future__ import annotations

from gateway.types import ReplicaId, SessionKey
from plugins.live_sessions import LiveSessions

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_session_counts_once_with_its_latest_prompt() -> None:
    t = LiveSessions(idle_s=10.0, max_sessions=100)
    t.place(SessionKey("s"), A, 0.0, 1000)
    t.place(SessionKey("s"), A, 1.0, 5000)  # the next turn: the context grew
    assert t.counts[A] == 1 and t.tokens[A] == 5000


def test_a_move_carries_the_session_and_its_tokens() -> None:
    t = LiveSessions(idle_s=10.0, max_sessions=100)
    t.place(SessionKey("s"), A, 0.0, 1000)
    t.place(SessionKey("t"), A, 0.0, 300)
    t.place(SessionKey("s"), B, 1.0, 1200)
    assert (t.counts[A], t.tokens[A]) == (1, 300)
    assert (t.counts[B], t.tokens[B]) == (1, 1200)


def test_idle_and_overflowing_sessions_leave_both_totals() -> None:
    t = LiveSessions(idle_s=10.0, max_sessions=2)
    t.place(SessionKey("old"), A, 0.0, 700)
    t.place(SessionKey("x"), B, 5.0, 100)
    t.place(SessionKey("y"), B, 12.0, 100)  # "old" is idle past 10 s
    assert (t.counts[A], t.tokens[A]) == (0, 0)
    t.place(SessionKey("z"), A, 13.0, 50)  # over max_sessions: "x" goes
    assert (t.counts[B], t.tokens[B]) == (1, 100)
    assert t.replica_of(SessionKey("x"), 13.0) is None


def test_a_replica_that_leaves_takes_its_sessions() -> None:
    t = LiveSessions(idle_s=10.0, max_sessions=100)
    t.place(SessionKey("s"), A, 0.0, 1000)
    t.place(SessionKey("t"), B, 0.0, 10)
    t.forget(A)
    assert A not in t.tokens and t.replica_of(SessionKey("s"), 1.0) is None
    assert t.tokens[B] == 10


def test_seen_gives_the_replica_and_last_time_of_a_live_session_only() -> None:
    t = LiveSessions(idle_s=10.0, max_sessions=100)
    t.place(SessionKey("s"), A, 2.0, 100)
    assert t.seen(SessionKey("s"), 5.0) == (A, 2.0)
    assert t.seen(SessionKey("s"), 12.5) is None  # idle past idle_s
    assert t.seen(SessionKey("never"), 5.0) is None
