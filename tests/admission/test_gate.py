"""The gate against live-looking cluster views: fast path, saturation, release, abilities."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.config import AdmissionSettings
from gateway.admission.gate import AdmissionGate
from gateway.errors import BadRequest, RateLimited
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

A = ReplicaId("a")
B = ReplicaId("b")


class Cluster:
    """Holds mutable load and in-flight counts and publishes frozen views, like the app."""

    def __init__(self) -> None:
        self.inflight: dict[ReplicaId, int] = {A: 0, B: 0}
        self.loads: dict[ReplicaId, EngineLoad | None] = {A: None, B: None}
        self.healthy = {A: True, B: True}

    def scrape(self, replica: ReplicaId, waiting: float, kv: float = 0.1) -> None:
        self.loads[replica] = EngineLoad(
            waiting=waiting, running=1, kv_usage=kv, scraped_at=time.monotonic()
        )

    def view(self) -> ClusterView:
        replicas = tuple(
            ReplicaState(id=r, url=f"http://{r}", healthy=self.healthy[r], load=self.loads[r])
            for r in (A, B)
        )
        return ClusterView(replicas=replicas, now=time.monotonic(), in_flight=self.inflight)


class PrefixIndex:
    def __init__(self) -> None:
        self.asked: list[tuple[str, ReplicaId]] = []

    def choose(self, request: RouteRequest, view: ClusterView) -> None:  # pragma: no cover
        raise AssertionError("not used")

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        self.asked.append((request.request_id, replica))
        return 7_900 if request.request_id == "warm" else 0


def _req(
    rid: str, cls: str = "default", prompt: int = 100, tenant: str | None = None
) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        model="m",
        session_key=SessionKey(rid),
        prefix_hashes=(1, 2, 3),
        prompt_tokens=prompt,
        max_tokens=32,
        priority_class=cls,
        tenant=tenant,
    )


def _gate(cluster: Cluster, policy: object | None = None, **kw: object) -> AdmissionGate:
    raw: dict[str, object] = {
        "enabled": True,
        "saturation": {"max_waiting": 2, "max_kv_usage": 0.9},
        "recheck_interval_s": 0.01,
        "max_wait_s": 2.0,
    }
    raw.update(kw)
    return AdmissionGate(
        AdmissionSettings.model_validate(raw),
        cluster.view,
        registry=CollectorRegistry(),
        policy=policy,
    )


async def _go(gate: AdmissionGate, cluster: Cluster, req: RouteRequest, log: list[str]) -> None:
    if gate.must_wait(req, A, cluster.view()):
        await gate.wait(req, A)
    cluster.inflight[A] += 1
    log.append(req.request_id)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fast_path_when_not_saturated() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=0)
    gate = _gate(cluster)
    assert not gate.must_wait(_req("p"), A, cluster.view())
    cluster.inflight[A] = 1  # sent one since that scrape: estimated queue 1 < 2
    assert not gate.must_wait(_req("p"), A, cluster.view())
    cluster.inflight[A] = 2  # estimated queue 2: saturated
    assert gate.must_wait(_req("p"), A, cluster.view())
    assert not gate.must_wait(_req("p"), B, cluster.view())  # B idle with unknown load: admits


async def test_saturated_replica_holds_requests_until_one_finishes() -> None:
    cluster = Cluster()
    cluster.inflight[A] = 5
    cluster.scrape(A, waiting=2)  # exactly at the threshold
    gate = _gate(cluster)
    log: list[str] = []
    tasks = [
        asyncio.create_task(_go(gate, cluster, _req("batch-long", "batch", 20_000), log)),
        asyncio.create_task(_go(gate, cluster, _req("short", "default", 50), log)),
        asyncio.create_task(_go(gate, cluster, _req("urgent", "interactive", 9_000), log)),
        asyncio.create_task(_go(gate, cluster, _req("long", "default", 20_000), log)),
    ]
    await _settle()
    assert log == []
    # Requests that were waiting in the engine finish one by one: each frees one place.
    for _ in range(4):
        cluster.inflight[A] -= 1
        gate.finished(_req("done"), A)
        await _settle()
    await asyncio.gather(*tasks)
    assert log == ["urgent", "short", "long", "batch-long"]


async def test_fresh_scrape_with_room_releases_without_completion() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=5)
    gate = _gate(cluster)
    log: list[str] = []
    tasks = [asyncio.create_task(_go(gate, cluster, _req(f"r{i}"), log)) for i in range(4)]
    await asyncio.sleep(0.05)
    assert log == []
    cluster.scrape(A, waiting=0)  # engine drained: room for two before the threshold
    await asyncio.sleep(0.05)
    assert len(log) == 2
    cluster.scrape(A, waiting=0)  # next scrape: room again
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert len(log) == 4


async def test_stale_load_with_work_in_flight_counts_as_saturated() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=0)
    gate = _gate(cluster)
    view = cluster.view()
    stale = ClusterView(
        replicas=view.replicas, now=view.now + 10, in_flight=cluster.inflight, stale_after=2.0
    )
    assert not gate.must_wait(_req("p"), A, stale)  # idle: admit
    cluster.inflight[A] = 1
    assert gate.must_wait(_req("p"), A, stale)


async def test_unhealthy_or_unknown_replica_is_never_held() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=50)
    cluster.healthy[A] = False
    gate = _gate(cluster)
    assert not gate.must_wait(_req("p"), A, cluster.view())
    assert not gate.must_wait(_req("p"), ReplicaId("gone"), cluster.view())


async def test_prefix_index_ability_ranks_a_warm_long_prompt_as_short() -> None:
    cluster = Cluster()
    cluster.inflight[A] = 5
    cluster.scrape(A, waiting=2)
    index = PrefixIndex()
    gate = _gate(cluster, policy=index)
    log: list[str] = []
    cold = asyncio.create_task(_go(gate, cluster, _req("cold", prompt=8_000), log))
    await _settle()
    warm = asyncio.create_task(_go(gate, cluster, _req("warm", prompt=8_000), log))
    await _settle()
    cluster.inflight[A] -= 1
    gate.finished(_req("done"), A)
    await _settle()
    assert log == ["warm"]
    assert ("warm", A) in index.asked
    cluster.inflight[A] -= 1
    gate.finished(_req("done"), A)
    await asyncio.gather(cold, warm)


async def test_tenant_history_feeds_the_prediction() -> None:
    cluster = Cluster()
    cluster.inflight[A] = 5
    cluster.scrape(A, waiting=2)
    gate = _gate(cluster)
    for _ in range(5):
        gate.record_output("terse", 1)
    assert gate.history.average("terse") == pytest.approx(1.0)
    log: list[str] = []
    t1 = asyncio.create_task(_go(gate, cluster, _req("chatty", prompt=10, tenant="new"), log))
    await _settle()
    t2 = asyncio.create_task(_go(gate, cluster, _req("terse", prompt=10, tenant="terse"), log))
    await _settle()
    for _ in range(2):
        cluster.inflight[A] -= 1
        gate.finished(_req("done"), A)
        await _settle()
    await asyncio.gather(t1, t2)
    assert log == ["terse", "chatty"]


async def test_timeout_is_a_429_and_close_turns_away() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=5)
    gate = _gate(cluster, max_wait_s=0.05)
    with pytest.raises(RateLimited):
        await gate.wait(_req("x"), A)
    task = asyncio.create_task(gate.wait(_req("y"), A))
    await _settle()
    gate.close()
    with pytest.raises(RateLimited):
        await task


def test_classify() -> None:
    cluster = Cluster()
    gate = _gate(cluster, key_classes={"sk-bot": "batch"})
    gate = AdmissionGate(gate.settings, cluster.view, priority_header="X-Priority")
    req = _req("x")
    auth = [(b"authorization", b"Bearer sk-bot"), (b"x-priority", b"interactive")]
    assert gate.classify(req, {}, auth).priority_class == "batch"
    assert gate.classify(req, {}, auth[1:]).priority_class == "interactive"
    assert gate.classify(req, {"priority": "batch"}, []).priority_class == "batch"
    assert gate.classify(req, {}, []) is req  # already "default": no copy
    with pytest.raises(BadRequest) as info:
        gate.classify(req, {}, [(b"x-priority", b"gold")])
    assert info.value.param == "x-priority"


async def test_lower_class_is_held_back_before_saturation() -> None:
    cluster = Cluster()
    cluster.inflight[A] = 6
    cluster.scrape(A, waiting=0)
    gate = _gate(
        cluster,
        saturation={"max_waiting": None, "max_kv_usage": None, "max_inflight": 8},
        classes=[{"name": "interactive"}, {"name": "batch", "holdback": 0.25}],
        default_class="batch",
    )
    view = cluster.view()
    assert gate.must_wait(_req("b", "batch"), A, view)  # 6 of 8: batch stops at 6
    assert not gate.must_wait(_req("i", "interactive"), A, view)
    cluster.inflight[A] = 8
    assert gate.must_wait(_req("i", "interactive"), A, cluster.view())


async def test_prompt_token_budget_keeps_long_prefills_apart() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=0)
    gate = _gate(
        cluster,
        saturation={"max_waiting": None, "max_kv_usage": None, "max_prompt_tokens": 10_000},
        classes=[{"name": "interactive"}, {"name": "batch", "holdback": 0.5}],
        default_class="batch",
    )
    long1 = _req("long1", "batch", prompt=8_000)
    assert not gate.must_wait(long1, A, cluster.view())  # alone: goes, even if big
    cluster.inflight[A] += 1
    assert gate.prompt_tokens_in_flight(A) == 8_000
    long2 = _req("long2", "batch", prompt=8_000)
    short = _req("short", "interactive", prompt=500)
    assert gate.must_wait(long2, A, cluster.view())
    assert not gate.must_wait(short, A, cluster.view())  # 8 500 <= 10 000
    cluster.inflight[A] += 1
    waiting = asyncio.create_task(gate.wait(long2, A))
    await _settle()
    assert not waiting.done()
    cluster.inflight[A] -= 1
    gate.finished(long1, A)
    await _settle()
    # 500 + 8 000 tokens would exceed batch's held-back budget of 5 000: still waiting.
    assert not waiting.done()
    cluster.inflight[A] -= 1
    gate.finished(short, A)  # nothing in flight now: the long batch prefill goes alone
    await asyncio.wait_for(waiting, 1.0)
    assert gate.prompt_tokens_in_flight(A) == 8_000
    gate.finished(long2, None)  # e.g. it failed before reaching a replica
    assert gate.prompt_tokens_in_flight(A) == 0


async def test_backfill_lets_short_prompts_past_a_long_one_waiting_for_the_budget() -> None:
    cluster = Cluster()
    cluster.scrape(A, waiting=0)
    now = {"t": 100.0}
    settings = AdmissionSettings.model_validate(
        {
            "enabled": True,
            "saturation": {"max_waiting": None, "max_kv_usage": None, "max_prompt_tokens": 10_000},
            "recheck_interval_s": 0.01,
            "max_wait_s": 2.0,
            "backfill_s": 4.0,
            "classes": [{"name": "batch"}],
            "default_class": "batch",
        }
    )
    gate = AdmissionGate(settings, cluster.view, clock=lambda: now["t"])
    log: list[str] = []
    await _go(gate, cluster, _req("long1", "batch", prompt=8_000), log)
    long2 = asyncio.create_task(_go(gate, cluster, _req("long2", "batch", prompt=8_000), log))
    await _settle()
    now["t"] += 2.0
    # Queued 2 s later, the short one ranks behind long2 (its size head start is smaller
    # than 2 s), yet fits the budget (8 000 + 500) and is let by while long2 cannot go.
    await asyncio.wait_for(_go(gate, cluster, _req("short", "batch", prompt=500), log), 1.0)
    assert log == ["long1", "short"] and not long2.done()
    gate.close()
    with pytest.raises(RateLimited):
        await long2
