"""The async waiting room: release order, bounds, disconnects, no lost requests."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.queue import WaitingRoom
from gateway.errors import RateLimited
from gateway.types import ReplicaId

R = ReplicaId("r0")


class Engine:
    """A replica with `slots` places, counted the way the proxy counts in-flight requests."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.inflight = 0

    def has_room(
        self, replica: ReplicaId, reserved: int, reserved_weight: int, class_name: str, weight: int
    ) -> bool:
        # Class "b" is held back: it leaves the last place to class "a".
        keep = 1 if class_name == "b" else 0
        return self.inflight + reserved < self.slots - keep


def _room(engine: Engine, registry: CollectorRegistry | None = None, **kw: float) -> WaitingRoom:
    metrics = AdmissionMetrics(registry, ("a", "b")) if registry is not None else None
    opts: dict[str, float] = {
        "max_queue": 100,
        "max_wait_s": 5.0,
        "retry_after_s": 2.0,
        "recheck_interval_s": 0.01,
    }
    opts.update(kw)
    return WaitingRoom(
        engine.has_room,
        max_queue=int(opts["max_queue"]),
        max_wait_s=opts["max_wait_s"],
        retry_after_s=opts["retry_after_s"],
        recheck_interval_s=opts["recheck_interval_s"],
        metrics=metrics,
    )


async def _admit(room: WaitingRoom, engine: Engine, score: float, log: list[float]) -> None:
    await room.wait(R, score, "a")
    engine.inflight += 1  # what the proxy does before its next await
    log.append(score)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_room_free_means_no_suspension() -> None:
    engine = Engine(slots=1)
    room = _room(engine)
    waited = await room.wait(R, 1.0, "a")
    assert waited < 0.01
    assert len(room) == 0 and room.reserved(R) == 0 and not room.busy(R)


async def test_released_best_score_first_as_capacity_frees() -> None:
    engine = Engine(slots=1)
    engine.inflight = 1
    room = _room(engine, recheck_interval_s=60)
    log: list[float] = []
    scores = [5.0, 1.0, 4.0, 2.0, 3.0]
    tasks = [asyncio.create_task(_admit(room, engine, s, log)) for s in scores]
    await _settle()
    assert log == [] and len(room) == 5 and room.busy(R)
    for expected in range(1, 6):
        engine.inflight -= 1  # a request ended ...
        room.poke(R)  # ... and the proxy told the room
        await _settle()
        assert log == [float(s) for s in range(1, expected + 1)]
    await asyncio.gather(*tasks)
    assert len(room) == 0 and room.reserved(R) == 0


async def test_newcomer_does_not_jump_the_queue_when_room_appears() -> None:
    engine = Engine(slots=1)
    engine.inflight = 1
    room = _room(engine, recheck_interval_s=60)
    log: list[float] = []
    first = asyncio.create_task(_admit(room, engine, 1.0, log))
    await _settle()
    engine.inflight = 0  # room appeared, nobody poked yet
    late = asyncio.create_task(_admit(room, engine, 9.0, log))  # worse score, arrives now
    await _settle()
    assert log == [1.0]  # the pass the newcomer triggered released the better waiter
    engine.inflight = 0
    room.poke(R)
    await asyncio.gather(first, late)
    assert log == [1.0, 9.0]


async def test_timer_releases_when_room_appears_without_poke() -> None:
    engine = Engine(slots=1)
    engine.inflight = 1
    room = _room(engine, recheck_interval_s=0.01)
    log: list[float] = []
    task = asyncio.create_task(_admit(room, engine, 1.0, log))
    await asyncio.sleep(0.05)
    assert log == []
    engine.inflight = 0  # e.g. a fresh scrape shows room
    await asyncio.wait_for(task, 1.0)
    assert log == [1.0]


async def test_overflow_rejects_the_worse_request_with_429() -> None:
    registry = CollectorRegistry()
    engine = Engine(slots=0)
    room = _room(engine, registry, max_queue=2, max_wait_s=5.0)
    waiting = [asyncio.create_task(room.wait(R, s, "a")) for s in (1.0, 2.0)]
    await _settle()
    with pytest.raises(RateLimited) as info:
        await room.wait(R, 3.0, "b")
    err = info.value
    assert err.status == 429 and err.error_type == "rate_limit_error"
    assert err.headers["retry-after"] == "2" and err.headers["retry-after-ms"] == "2000"
    assert (
        registry.get_sample_value(
            "kvgate_admission_rejected_total", {"priority_class": "b", "reason": "queue_full"}
        )
        == 1.0
    )
    # A better-ranked newcomer evicts the worst waiter instead.
    better = asyncio.create_task(room.wait(R, 0.5, "b"))
    await _settle()
    with pytest.raises(RateLimited):
        await waiting[1]
    assert len(room) == 2 and not waiting[0].done() and not better.done()
    engine.slots = 5
    room.poke(R)
    await asyncio.gather(waiting[0], better)
    assert len(room) == 0


async def test_wait_bound_answers_429_and_leaves_no_trace() -> None:
    registry = CollectorRegistry()
    engine = Engine(slots=0)
    room = _room(engine, registry, max_wait_s=0.05)
    with pytest.raises(RateLimited) as info:
        await room.wait(R, 1.0, "a")
    assert "waited" in info.value.message
    assert len(room) == 0 and not room.busy(R) and room.reserved(R) == 0
    assert (
        registry.get_sample_value(
            "kvgate_admission_rejected_total", {"priority_class": "a", "reason": "timeout"}
        )
        == 1.0
    )
    assert registry.get_sample_value("kvgate_admission_queue_depth", {"priority_class": "a"}) == 0


async def test_disconnect_while_queued_leaves_at_once() -> None:
    registry = CollectorRegistry()
    engine = Engine(slots=1)
    engine.inflight = 1
    room = _room(engine, registry, recheck_interval_s=60)
    log: list[float] = []
    gone = asyncio.create_task(_admit(room, engine, 1.0, log))
    stays = asyncio.create_task(_admit(room, engine, 2.0, log))
    await _settle()
    assert registry.get_sample_value("kvgate_admission_queue_depth", {"priority_class": "a"}) == 2
    gone.cancel()  # what the proxy does when the client disconnects
    await _settle()
    assert gone.cancelled()
    assert len(room) == 1
    assert registry.get_sample_value("kvgate_admission_queue_depth", {"priority_class": "a"}) == 1
    assert (
        registry.get_sample_value(
            "kvgate_admission_wait_seconds_count", {"priority_class": "a", "outcome": "disconnect"}
        )
        == 1
    )
    engine.inflight = 0
    room.poke(R)
    await stays
    assert log == [2.0]


async def test_cancel_after_release_gives_the_place_to_the_next() -> None:
    engine = Engine(slots=1)
    engine.inflight = 1
    room = _room(engine, recheck_interval_s=60)
    log: list[float] = []
    first = asyncio.create_task(_admit(room, engine, 1.0, log))
    second = asyncio.create_task(_admit(room, engine, 2.0, log))
    await _settle()
    engine.inflight = 0
    room.poke(R)  # releases `first` (reserved), `second` still waits
    assert room.reserved(R) == 1
    first.cancel()  # ... but its client vanished before the task resumed
    await _settle()
    assert first.cancelled()
    await asyncio.wait_for(second, 1.0)
    assert log == [2.0] and room.reserved(R) == 0 and len(room) == 0


async def test_close_turns_waiters_away() -> None:
    engine = Engine(slots=0)
    room = _room(engine)
    task = asyncio.create_task(room.wait(R, 1.0, "a"))
    await _settle()
    room.close()
    with pytest.raises(RateLimited):
        await task
    with pytest.raises(RateLimited):
        await room.wait(R, 1.0, "a")


async def test_no_request_lost_under_churn() -> None:
    """Random arrivals, disconnects, timeouts and completions: every request is accounted."""
    rng = random.Random(7)
    engine = Engine(slots=3)
    room = _room(engine, max_queue=20, max_wait_s=0.3, recheck_interval_s=0.01)
    outcomes: dict[str, int] = {"served": 0, "429": 0, "cancelled": 0}

    async def client(score: float) -> None:
        try:
            await room.wait(R, score, "a")
        except RateLimited:
            outcomes["429"] += 1
            return
        engine.inflight += 1
        try:
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            outcomes["served"] += 1
        finally:
            engine.inflight -= 1
            room.poke(R)

    tasks = []
    for _ in range(200):
        tasks.append(asyncio.create_task(client(rng.random())))
        if rng.random() < 0.15:
            rng.choice(tasks).cancel()
        await asyncio.sleep(rng.uniform(0, 0.002))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)] == []
    assert sum(outcomes.values()) == 200
    assert outcomes["served"] > 0
    assert len(room) == 0 and room.reserved(R) == 0 and engine.inflight == 0


async def test_held_back_class_lets_a_better_class_pass() -> None:
    """The best-scored waiter is of a held-back class: the next one with room goes instead."""
    engine = Engine(slots=2)
    engine.inflight = 2
    room = _room(engine, recheck_interval_s=60)
    log: list[float] = []

    async def admit(score: float, cls: str) -> None:
        await room.wait(R, score, cls, class_rank=0 if cls == "a" else 1)
        engine.inflight += 1
        log.append(score)

    aged_b = asyncio.create_task(admit(1.0, "b"))
    fresh_a = asyncio.create_task(admit(5.0, "a"))
    await _settle()
    engine.inflight = 1  # one place free: only class "a" may take the last one
    room.poke(R)
    await _settle()
    assert log == [5.0]
    engine.inflight = 0
    room.poke(R)
    await asyncio.gather(aged_b, fresh_a)
    assert log == [5.0, 1.0]
    assert len(room) == 0 and room.reserved(R) == 0


async def test_reserved_weight_is_offered_until_the_waiter_resumes() -> None:
    seen: list[tuple[int, int]] = []
    gate = {"open": False}

    def has_room(replica: ReplicaId, reserved: int, weight_r: int, cls: str, weight: int) -> bool:
        seen.append((reserved, weight_r))
        return gate["open"] and reserved + weight_r // 100 < 3  # 200 reserved weight counts 2

    room = WaitingRoom(
        has_room, max_queue=10, max_wait_s=1.0, retry_after_s=1.0, recheck_interval_s=60
    )
    big = asyncio.create_task(room.wait(R, 1.0, "a", 200))
    small = asyncio.create_task(room.wait(R, 2.0, "a", 0))
    await _settle()
    gate["open"] = True
    room.poke(R)  # one pass: releases `big`, then sees its reservation and holds `small`
    assert room.reserved(R) == 1 and (1, 200) in seen and not small.done()
    await big
    room.poke(R)
    await small
    assert room.reserved(R) == 0


async def test_lighter_waiters_of_the_same_class_do_not_bypass_a_heavy_head() -> None:
    budget = {"free": 100}

    def has_room(replica: ReplicaId, reserved: int, weight_r: int, cls: str, weight: int) -> bool:
        return weight + weight_r <= budget["free"]

    room = WaitingRoom(
        has_room, max_queue=10, max_wait_s=1.0, retry_after_s=1.0, recheck_interval_s=60
    )
    heavy = asyncio.create_task(room.wait(R, 1.0, "batch", 500, class_rank=2))
    light = asyncio.create_task(room.wait(R, 2.0, "batch", 10, class_rank=2))
    urgent = asyncio.create_task(room.wait(R, 3.0, "interactive", 10, class_rank=0))
    await _settle()
    # The heavy head does not fit; only the better class may pass it, the same class waits.
    assert urgent.done() and not heavy.done() and not light.done()
    await urgent
    budget["free"] = 1000
    room.poke(R)
    await asyncio.gather(heavy, light)


async def test_backfill_lets_lighter_same_class_waiters_pass_only_within_its_window() -> None:
    budget = {"free": 100}
    now = {"t": 0.0}

    def has_room(replica: ReplicaId, reserved: int, weight_r: int, cls: str, weight: int) -> bool:
        return weight + weight_r <= budget["free"]

    room = WaitingRoom(
        has_room,
        max_queue=10,
        max_wait_s=60.0,
        retry_after_s=1.0,
        recheck_interval_s=60,
        clock=lambda: now["t"],
        backfill_s=3.0,
    )
    heavy = asyncio.create_task(room.wait(R, 1.0, "batch", 500, class_rank=2))
    light = asyncio.create_task(room.wait(R, 2.0, "batch", 10, class_rank=2))
    await _settle()
    # Within the window: the light one goes past the heavy head, which keeps its place.
    assert light.done() and not heavy.done()
    await light
    now["t"] = 3.5
    late = asyncio.create_task(room.wait(R, 4.0, "batch", 10, class_rank=2))
    await _settle()
    # Past the window the head blocks its class again: no starvation by a stream of light ones.
    assert not late.done() and not heavy.done()
    budget["free"] = 1000
    room.poke(R)
    await asyncio.gather(heavy, late)
    assert len(room) == 0
