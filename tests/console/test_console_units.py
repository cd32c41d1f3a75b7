"""The console's pure parts: the sessions table, why sessions moved, rates, quantiles,
the watch and the event log."""

from __future__ import annotations

import pytest

from gateway.cluster import Cluster
from gateway.console.counters import Rates, by_label
from gateway.console.events import EventLog
from gateway.console.measure import Measurements, quantile
from gateway.console.sessions import SessionTable
from gateway.console.watch import Watch
from gateway.hooks import OutcomeObserver, RequestOutcome
from gateway.testing.clock import FakeClock
from gateway.types import ReplicaId, ReplicaState, RouteRequest, SessionKey


def outcome(
    session: str,
    replica: str,
    *,
    retries: int = 0,
    ok: bool = True,
    prompt: int = 10,
    completion: int = 5,
    ttfb: float = 0.1,
) -> RequestOutcome:
    request = RouteRequest(
        request_id="r", model="m", session_key=SessionKey(session), key_source="header"
    )
    return RequestOutcome(
        request=request,
        request_id="r",
        endpoint="chat",
        replica=ReplicaId(replica),
        status=200 if ok else 502,
        ok=ok,
        stream=False,
        prompt_tokens=prompt,
        cached_tokens=4,
        completion_tokens=completion,
        ttfb_s=ttfb,
        retries=retries,
    )


def cluster() -> Cluster:
    return Cluster(
        [
            ReplicaState(ReplicaId("a"), "http://a", pool="fast"),
            ReplicaState(ReplicaId("b"), "http://b", pool="fast"),
            ReplicaState(ReplicaId("c"), "http://c", pool="cheap"),
        ]
    )


def test_moves_are_told_apart_by_why() -> None:
    c = cluster()
    m = Measurements(c, SessionTable(100), clock=FakeClock(), wall=lambda: 1.0)
    m.observe(outcome("s1", "a"))
    m.observe(outcome("s1", "b"))  # same pool, source healthy: the load bound moved it
    m.observe(outcome("s1", "c"))  # another pool: the pool weights moved it
    c.set_healthy(ReplicaId("c"), False)
    m.observe(outcome("s1", "a"))  # the source is down: failover
    m.observe(outcome("s2", "a"))
    m.observe(outcome("s2", "b", retries=1))  # a retry landed elsewhere: failover
    m.observe(outcome("s2", "a", ok=False))  # failed: not a placement of the session
    assert dict(m.sessions.moves) == {"bounded_load": 1, "pool_weights": 1, "failover": 2}
    assert [(mv.source, mv.target, mv.reason) for mv in m.sessions.recent_moves] == [
        ("a", "b", "bounded_load"),
        ("b", "c", "pool_weights"),
        ("c", "a", "failover"),
        ("a", "b", "failover"),
    ]
    assert m.totals() == {"requests": 7, "prompt": 70, "cached": 28, "completion": 35}
    assert m.tallies[ReplicaId("a")].requests == 4


def test_the_sessions_table_is_bounded_and_live_is_most_recent_first() -> None:
    table = SessionTable(3)
    for i, t in enumerate([1.0, 2.0, 3.0, 4.0]):
        table.seen(SessionKey(f"s{i}"), "header", ReplicaId("a"), t, 10)
    assert len(table) == 3  # s0 (least recent) dropped
    table.seen(SessionKey("s1"), "header", ReplicaId("a"), 5.0, 10)
    assert [k for k, _ in table.live(5.0, 1.5)] == ["s1", "s3"]
    assert next(iter(table.live(5.0, 10.0)))[1].requests == 2
    table.clear()
    assert len(table) == 0 and not table.moves


def test_ttft_quantiles_cover_the_last_minute_only() -> None:
    clock = FakeClock()
    m = Measurements(cluster(), SessionTable(10), clock=clock)
    for i in range(100):
        m.observe(outcome(f"s{i}", "a", ttfb=(i + 1) / 100))
    assert m.ttft(ReplicaId("a")) == [0.5, 0.99]
    assert m.ttft(ReplicaId("b")) is None
    clock.advance(61)
    assert m.ttft(ReplicaId("a")) is None


def test_quantile_is_nearest_rank() -> None:
    assert quantile([1.0], 0.99) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_rates_skip_new_totals_and_survive_resets() -> None:
    rates = Rates()
    assert rates.update(0.0, {"a": 10.0}) == {}
    assert rates.update(2.0, {"a": 30.0, "b": 5.0}) == {"a": 10.0}
    assert rates.update(4.0, {"a": 4.0, "b": 9.0}) == {"a": 2.0, "b": 2.0}  # a was reset
    assert rates.update(4.0, {"a": 8.0}) == {}  # no time passed


def test_by_label_sums_over_the_other_labels() -> None:
    series = {
        (("endpoint", "chat"), ("replica", "a"), ("status", "200")): 3.0,
        (("endpoint", "completions"), ("replica", "a"), ("status", "200")): 2.0,
        (("endpoint", "chat"), ("replica", "b"), ("status", "503")): 1.0,
    }
    assert by_label(series, "replica") == {"a": 5.0, "b": 1.0}
    assert by_label(series, "replica", "status") == {"a/200": 5.0, "b/503": 1.0}


def test_watch_attaches_on_a_read_and_detaches_when_unread() -> None:
    clock = FakeClock()
    observers: list[OutcomeObserver] = []
    resets: list[int] = []

    def observer(outcome: RequestOutcome) -> None:
        return None

    watch = Watch(
        observers, observer, "watched", 10.0, clock=clock, on_attach=lambda: resets.append(1)
    )
    assert observers == [] and not watch.measuring
    watch.touch()
    assert observers == [observer] and len(resets) == 1
    clock.advance(9)
    watch.touch()
    clock.advance(9)
    watch.tick()
    assert watch.measuring
    clock.advance(1)
    watch.tick()
    assert observers == [] and watch.since is None
    watch.touch()
    assert observers == [observer] and len(resets) == 2  # figures restart with the watch


@pytest.mark.parametrize(("mode", "attached"), [("always", True), ("off", False)])
def test_watch_modes(mode: str, attached: bool) -> None:
    observers: list[OutcomeObserver] = []
    watch = Watch(observers, lambda o: None, mode, 1.0)  # type: ignore[arg-type]
    watch.touch()
    watch.tick()
    assert watch.measuring is attached
    watch.close()
    assert observers == []


def test_events_expire_with_the_history() -> None:
    clock = FakeClock()
    log = EventLog(60.0, clock=clock)
    log.add("ejected", "a", "probe failed")
    clock.advance(30)
    log.add("healthy", "a")
    assert [e["kind"] for e in log.recent()] == ["ejected", "healthy"]
    clock.advance(40)
    assert [e["kind"] for e in log.recent()] == ["healthy"]
