"""`lineage`'s sticky bound: seconds of prefill queued on the session's replica (at its
prefill speed measured by the gateway's meter), not a count of requests."""

from __future__ import annotations

import dataclasses

import pytest
from policy_views import load, replicas, request, rid, view
from pydantic import ValidationError

from gateway.policy import PolicyContext
from gateway.prefill_meter import PrefillMeter
from gateway.types import ClusterView, EngineLoad, ReplicaId, RouteRequest
from plugins.lineage import REMOVED_FIELDS, Lineage, LineageConfig

BLOCK = 512


def measured_meter(speeds: dict[int, float]) -> PrefillMeter:
    """A meter that has timed three first tokens per replica at `speeds` (tokens/s)."""
    meter = PrefillMeter()
    t = 0.0
    for i, speed in speeds.items():
        for k in range(3):
            meter.dispatched(f"warm-{i}-{k}", rid(i), speed, t)
            t += 1.0
            meter.first_token(f"warm-{i}-{k}", t)
    return meter


def turn(session: str, hashes: tuple[int, ...], n: int) -> RouteRequest:
    return dataclasses.replace(
        request(session, hashes, block_tokens=BLOCK), request_id=f"{session}-{n}"
    )


def setup(
    speeds: dict[int, float] | None = None,
    loads: dict[int, EngineLoad | None] | None = None,
    inflight: dict[int, int] | None = None,
    history: int = 3,
    **config: object,
) -> tuple[Lineage, ClusterView, ReplicaId]:
    """Four replicas prefilling at 10,000 tokens/s unless `speeds` says otherwise, and one
    conversation of `history` blocks served once; returns the policy, the view and the
    conversation's replica."""
    states = replicas(4)
    rates = {i: 10_000.0 for i in range(4)} | (speeds or {})
    v = dataclasses.replace(
        view(states, loads=loads, inflight=inflight), prefill=measured_meter(rates)
    )
    p = Lineage(LineageConfig(**config), PolicyContext(states))  # type: ignore[arg-type]
    first = turn("s", tuple(range(1, history + 1)), 0)
    home = p.choose(first, v).first
    assert home is not None
    p.dispatched(first, home)
    p.placed(first, home)
    p.finished(first, home, True, 0.1)
    return p, v, home


def queue(p: Lineage, replica: ReplicaId, requests: int, blocks: int) -> None:
    """`requests` prompts of `blocks` uncached blocks sent to `replica`, no first token yet."""
    for _ in range(requests):
        start = 100_000 + 1_000 * len(p._open)  # fresh blocks: none cached anywhere
        p.dispatched(turn(f"q{start}", tuple(range(start, start + blocks)), 0), replica)


def next_turn(p: Lineage, v: ClusterView, history: int = 3) -> str:
    """The reason for the conversation's next turn: its history and one block more."""
    return p.choose(turn("s", tuple(range(1, history + 2)), 1), v).reason


def test_many_short_requests_queued_keep_the_session() -> None:
    # 120 requests in flight there, one block each: 6 s of prefill, under the mean (1.5 s)
    # + 8 s. A bound in requests (the old one: 1.5 x the mean load + 24 mean
    # requests, 256 tokens per request in flight) moves it.
    p, v, home = setup()
    busy = dataclasses.replace(v, in_flight={home: 120})
    queue(p, home, requests=120, blocks=1)
    assert next_turn(p, busy) == "sticky"


def test_one_long_prefill_queued_moves_the_session() -> None:
    # One request of 200K uncached tokens: 20 s at 10,000 tokens/s, past the mean (5 s)
    # + 8 s.
    p, v, home = setup()
    queue(p, home, requests=1, blocks=400)
    choice = p.choose(turn("s", (1, 2, 3, 4), 1), v)
    assert choice.reason == "bounded_load" and choice.first != home


def test_the_bound_is_in_seconds_at_the_replica_s_own_speed() -> None:
    # The same 200K tokens on a replica measured at 40,000 tokens/s are 5 s: it stays.
    p, v, home = setup(speeds={i: 40_000.0 for i in range(4)})
    queue(p, home, requests=1, blocks=400)
    assert next_turn(p, v) == "sticky"


def test_a_cluster_busy_everywhere_raises_the_bound() -> None:
    # 20 s queued on the session's replica and 15 s on each other: the mean is 16.25 s, the
    # bound 24.25 s: moving would queue as long elsewhere. Alone, the 20 s move it.
    p, v, home = setup()
    queue(p, home, requests=1, blocks=400)
    for i in range(4):
        if rid(i) != home:
            queue(p, rid(i), requests=1, blocks=300)
    assert next_turn(p, v) == "sticky"
    lone, lone_view, lone_home = setup()
    queue(lone, lone_home, requests=1, blocks=400)
    assert next_turn(lone, lone_view) == "bounded_load"


def test_waiting_the_engine_reports_beyond_this_gateway_s_counts() -> None:
    # Other gateways' or clients' work: the engine reports 80 waiting requests this gateway
    # did not send, each the mean request's uncached prefill (about 4,600 tokens here): 37 s.
    p, v, home = setup()
    idx = int(home[1:])
    busy = dataclasses.replace(
        v, replicas=view(replicas(4), loads={idx: load(waiting=80)}).replicas
    )
    assert next_turn(p, busy) == "bounded_load"
    assert next_turn(p, v) == "sticky"  # the control: the engine reports nothing waiting


def test_before_any_speed_is_measured_the_session_stays() -> None:
    p, v, home = setup()
    queue(p, home, requests=1, blocks=400)
    assert next_turn(p, dataclasses.replace(v, prefill=PrefillMeter())) == "sticky"
    assert next_turn(p, dataclasses.replace(v, prefill=None)) == "sticky"


@pytest.mark.parametrize("field", sorted(REMOVED_FIELDS))
def test_a_removed_setting_is_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError, match=f"removed setting.*{field}"):
        LineageConfig(**{field: 1.0})  # type: ignore[arg-type]


def test_an_unknown_setting_is_still_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        LineageConfig(no_such_knob=1.0)  # type: ignore[call-arg]


def test_past_the_bound_a_session_stays_while_moving_costs_more_than_it_saves() -> None:
    # 400 blocks queued there: 20.5 s, the mean 5.1 s, 15.4 s over it (past the 8 s bound).
    # A 350-block history (179K tokens) would take 17.9 s to recompute elsewhere: it stays.
    p, v, home = setup(history=350)
    queue(p, home, requests=1, blocks=400)
    assert next_turn(p, v, history=350) == "sticky"
    # A 100-block history (5.1 s to recompute) moves with the same queue.
    short, short_view, short_home = setup(history=100)
    queue(short, short_home, requests=1, blocks=400)
    assert next_turn(short, short_view, history=100) == "bounded_load"
    # Twice the queue (41 s, 30.7 s over the mean) moves the long one too.
    queue(p, home, requests=1, blocks=400)
    assert next_turn(p, v, history=350) == "bounded_load"
