"""The `cost` policy on hand-built views: one currency (seconds to the first token), forks
that follow a deep prefix, preambles held everywhere that pull no one, a queue in seconds
that moves a session, and bursts that co-locate."""

from __future__ import annotations

import dataclasses

from policy_views import replicas, request, rid, view

from gateway.policy import PolicyContext
from gateway.prefill_meter import PrefillMeter
from gateway.types import ClusterView, ReplicaId, RouteRequest
from plugins.cost import Cost, CostConfig

PREAMBLE = tuple(range(1000, 1030))  # 30 blocks of 512 tokens: an agent kind's preamble
SPEED = 10_000.0  # tokens/s, as measured below


def rig(n: int = 4, **config: object) -> tuple[Cost, ClusterView, PrefillMeter]:
    states = replicas(n)
    meter = PrefillMeter(memory=1.0, min_samples=1)
    for i in range(n):  # each replica measured at SPEED
        meter.dispatched(f"warm{i}", rid(i), SPEED, 0.0)
        meter.first_token(f"warm{i}", 1.0)
    v = dataclasses.replace(view(states), prefill=meter)
    return Cost(CostConfig(**config), PolicyContext(states)), v, meter  # type: ignore[arg-type]


def turn(session: str, hashes: tuple[int, ...], n: int) -> RouteRequest:
    return dataclasses.replace(
        request(session, hashes, block_tokens=512), request_id=f"{session}-{n}"
    )


def send(p: Cost, meter: PrefillMeter, req: RouteRequest, v: ClusterView) -> ReplicaId:
    """Choose and dispatch as the proxy does; the prefill stays queued (no first token)."""
    chosen = p.choose(req, v).first
    assert chosen is not None
    meter.dispatched(req.request_id, chosen, req.prompt_tokens - p.cached_tokens(req, chosen), 2.0)
    p.placed(req, chosen)
    return chosen


def done(meter: PrefillMeter, req: RouteRequest) -> None:
    meter.first_token(req.request_id, 3.0)


def test_a_fork_follows_a_deep_prefix_held_on_one_replica() -> None:
    p, v, meter = rig()
    history = (*PREAMBLE, *range(2000, 2120))  # 150 blocks: a 77K-token conversation
    home = send(p, meter, turn("parent", history, 0), v)
    done(meter, turn("parent", history, 0))
    # Some load on the home replica, none elsewhere: recomputing 77K tokens costs more.
    meter.dispatched("busy", home, 20_000, 2.0)
    child = turn("child", (*history, 9001, 9002), 0)
    choice = p.choose(child, v)
    assert choice.first == home and choice.reason == "prefix"


def test_a_preamble_held_everywhere_does_not_pull_new_sessions_together() -> None:
    p, v, meter = rig()
    for i in range(4):  # every replica holds the preamble
        req = turn(f"seed{i}", (*PREAMBLE, 3000 + i), 0)
        p.index.record(rid(i), req.prefix_hashes, 512)
    homes = []
    for s in range(8):
        req = turn(f"new{s}", (*PREAMBLE, 4000 + s), 0)
        homes.append(send(p, meter, req, v))
    # Each one queues its own prefill where it went: the next goes elsewhere.
    assert len(set(homes)) == 4
    assert all(homes.count(r) == 2 for r in set(homes))


def test_a_queue_in_seconds_moves_a_session() -> None:
    p, v, meter = rig(stay_queue_s=2.0)
    conv = (*PREAMBLE, *range(5000, 5010))
    home = send(p, meter, turn("s", conv, 0), v)
    done(meter, turn("s", conv, 0))
    nxt = turn("s", (*conv, 5010), 1)
    assert p.choose(nxt, v).reason == "sticky"
    # 1.5 s queued there: under the bound, it stays.
    meter.dispatched("q1", home, 1.5 * SPEED, 2.0)
    assert p.choose(nxt, v).first == home
    # 6 s queued: over the bound; recomputing 20K tokens elsewhere (2 s) is sooner.
    meter.dispatched("q2", home, 4.5 * SPEED, 2.0)
    choice = p.choose(nxt, v)
    assert choice.reason == "queued" and choice.first != home


def test_a_burst_extending_one_prefix_co_locates() -> None:
    p, v, meter = rig()
    prompt = (*PREAMBLE, *range(6000, 6080))  # cached nowhere
    # Four samples of one prompt sent at once: the first is "about to be cached" on its
    # replica as soon as it is dispatched, so the others follow it there.
    homes = {send(p, meter, turn(f"sample{i}", prompt, 0), v) for i in range(4)}
    assert len(homes) == 1
    # Four forks of that conversation at once, each with its own task, go there too.
    home = homes.pop()
    forks = {send(p, meter, turn(f"fork{i}", (*prompt, 7000 + i), 0), v) for i in range(4)}
    assert forks == {home}


def test_a_burst_spreads_when_the_queue_says_otherwise() -> None:
    p, v, meter = rig()
    prompt = tuple(range(8000, 8008))  # 4K tokens: cheap to recompute
    first = send(p, meter, turn("a", prompt, 0), v)
    meter.dispatched("backlog", first, 30 * SPEED, 2.0)  # 30 s queued there
    assert send(p, meter, turn("b", prompt, 0), v) != first


def test_without_a_meter_every_replica_counts_alike_and_sessions_stay() -> None:
    states = replicas(3)
    p = Cost(CostConfig(), PolicyContext(states))
    v = view(states)
    req = turn("s", tuple(range(10)), 0)
    home = p.choose(req, v).first
    assert home is not None
    p.placed(req, home)
    assert p.choose(turn("s", tuple(range(11)), 1), v).first == home


def test_one_shot_sessions_owe_nothing_and_forks_follow_their_history() -> None:
    # Six one-shot jobs from the preamble sit with the conversation on its replica (the
    # preamble pulled them there). They owe no turns: the four forks of the conversation,
    # sent at once, go where its history is, not wherever fewer sessions sit.
    p, v, meter = rig()
    for s in range(6):
        req = turn(f"job{s}", (*PREAMBLE, 9000 + s), 0)
        send(p, meter, req, v)
        done(meter, req)
    history: tuple[int, ...] = (*PREAMBLE, 1)
    home = send(p, meter, turn("parent", history, 0), v)
    for n in range(1, 4):
        done(meter, turn("parent", history, n - 1))
        history = (*history, *range(100 * n, 100 * n + 3))
        assert send(p, meter, turn("parent", history, n), v) == home
    done(meter, turn("parent", history, 3))
    forks = [send(p, meter, turn(f"fork{k}", (*history, 7000 + k), 0), v) for k in range(4)]
    assert forks == [home] * 4
