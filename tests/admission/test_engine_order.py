"""The `priority` engines see: class first, shortest uncached prefill first within it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from gateway.admission.classes import ClassMap
from gateway.admission.config import AdmissionSettings, EnginePrioritySettings, PriorityClass
from gateway.admission.engine_order import EnginePayload, prefill_rank, with_priority
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, replica_config
from gateway.types import ReplicaId, RouteRequest, SessionKey

MODEL = "kvgate-sim"
A, B = ReplicaId("a"), ReplicaId("b")
CLASSES = ClassMap.from_settings(
    AdmissionSettings(
        enabled=True,
        classes=(
            PriorityClass(name="interactive", engine_priority=-10),
            PriorityClass(name="default"),
            PriorityClass(name="batch", engine_priority=10),
        ),
    )
)


def _req(prompt_tokens: int, priority_class: str = "default") -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model=MODEL,
        session_key=SessionKey("s"),
        prompt_tokens=prompt_tokens,
        priority_class=priority_class,
    )


@pytest.mark.parametrize(
    ("uncached", "rank"),
    [(0, 0), (4095, 0), (4096, 1), (8191, 1), (8192, 2), (100_000, 5), (10**9, 7)],
)
def test_rank_is_one_per_doubling_past_twice_the_step(uncached: int, rank: int) -> None:
    assert prefill_rank(uncached, 2048, 8) == rank


def test_class_dominates_size() -> None:
    shaper = EnginePayload(EnginePrioritySettings(), frozenset({A}), classes=CLASSES)
    body: dict[str, Any] = {"model": MODEL, "priority": "batch"}
    raw = orjson.dumps(body)

    def sent(req: RouteRequest, replica: ReplicaId = A) -> dict[str, Any]:
        out: dict[str, Any] = orjson.loads(shaper(req, body, raw, replica))
        return out

    # No prefix index here: the whole prompt is uncached.
    # Three ranks by default: under 4096 uncached tokens, under 8192, the rest.
    assert sent(_req(100_000, "interactive"))["priority"] == -10 * 3 + 2
    assert sent(_req(10, "default"))["priority"] == 1 * 3
    assert sent(_req(5000, "default"))["priority"] == 1 * 3 + 1
    assert sent(_req(100_000, "default"))["priority"] == 1 * 3 + 2
    assert sent(_req(10, "batch"))["priority"] == 10 * 3
    # The longest interactive prefill still runs before the shortest default one.
    assert sent(_req(10**9, "interactive"))["priority"] < sent(_req(1, "default"))["priority"]
    # An engine without priority scheduling would answer 400: the field goes.
    assert sent(_req(10, "batch"), B) == {"model": MODEL}
    assert body == {"model": MODEL, "priority": "batch"}  # the caller's body is not mutated


def test_without_size_rank_the_class_priority_is_sent_as_configured() -> None:
    off = EnginePrioritySettings(shortest_prefill_first=False)
    shaper = EnginePayload(off, frozenset({A}), classes=CLASSES)
    body: dict[str, Any] = {"model": MODEL}
    raw = orjson.dumps(body)
    assert orjson.loads(shaper(_req(50_000, "batch"), body, raw, A))["priority"] == 10
    assert shaper(_req(50_000, "batch"), body, raw, B) is raw  # nothing to strip: no copy


def test_without_admission_the_clients_integer_is_the_class() -> None:
    shaper = EnginePayload(EnginePrioritySettings(), frozenset({A}))
    plain: dict[str, Any] = {"model": MODEL}
    assert orjson.loads(shaper(_req(9000), plain, orjson.dumps(plain), A))["priority"] == 2
    given: dict[str, Any] = {"model": MODEL, "priority": -1}
    assert orjson.loads(shaper(_req(9000), given, orjson.dumps(given), A))["priority"] == -3 + 2
    # Not an integer, or an engine without priority scheduling: the client's bytes go as
    # they came (the engine answers them).
    odd: dict[str, Any] = {"model": MODEL, "priority": "batch"}
    odd_raw = orjson.dumps(odd)
    assert shaper(_req(9000), odd, odd_raw, A) is odd_raw
    assert shaper(_req(9000), given, odd_raw, B) is odd_raw


def test_higher_first_engines_get_the_negated_order() -> None:
    """SGLang runs larger values first: the same order is sent negated, the client's own
    integer included (it is read in vLLM's sense, lower first)."""
    shaper = EnginePayload(
        EnginePrioritySettings(), frozenset({A, B}), higher_first=frozenset({B}), classes=CLASSES
    )
    body: dict[str, Any] = {"model": MODEL}
    raw = orjson.dumps(body)

    def sent(request: RouteRequest, replica: ReplicaId) -> int:
        value = orjson.loads(shaper(request, body, raw, replica))["priority"]
        assert isinstance(value, int)
        return value

    for request in (_req(100_000, "interactive"), _req(10), _req(5000, "batch")):
        assert sent(request, B) == -sent(request, A)
    assert sent(_req(10**9, "interactive"), B) > sent(_req(1), B)
    plain = EnginePayload(
        EnginePrioritySettings(shortest_prefill_first=False),
        frozenset({B}),
        higher_first=frozenset({B}),
    )
    given: dict[str, Any] = {"model": MODEL, "priority": 4}
    assert orjson.loads(plain(_req(10), given, orjson.dumps(given), B))["priority"] == -4
    # Flagged higher-first but without priority scheduling: the bytes go as they came.
    unflagged = EnginePayload(EnginePrioritySettings(), frozenset(), higher_first=frozenset({B}))
    assert unflagged(_req(10), given, raw, B) is raw


def test_with_priority_copies_only_when_it_must() -> None:
    body: dict[str, Any] = {"model": MODEL, "priority": 3}
    raw = orjson.dumps(body)
    assert with_priority(body, raw, 3) is raw
    assert orjson.loads(with_priority(body, raw, 4)) == {"model": MODEL, "priority": 4}
    assert orjson.loads(with_priority(body, raw, None)) == {"model": MODEL}
    assert with_priority({"model": MODEL}, b"x", None) == b"x"


async def test_a_cached_turn_outranks_a_new_long_context() -> None:
    """Through the gateway's default routing: the second turn of a conversation reaches
    the engine with rank 0 (its history is cached there), its first turn and a new
    conversation of the same length with a higher rank."""
    engine = SimEngine(PROFILES["instant"], index=0, priority_scheduling=True)
    plain = SimEngine(PROFILES["instant"], index=1)
    for e in (engine, plain):
        await e.start()
    try:
        replicas = replica_config([engine], priority_scheduling=True)
        async with (
            gateway([engine], replicas=replicas) as gw,
            AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            history = " ".join(f"fact {i} is {i * 7}." for i in range(4000))
            first = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": history}],
                max_tokens=4,
            )
            assert first.usage is not None and first.usage.prompt_tokens > 8192
            answer = first.choices[0].message.content or ""
            await client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": history},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "And fact 3?"},
                ],
                max_tokens=4,
            )
            other = " ".join(f"note {i} says {i * 3}." for i in range(4000))
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": other}], max_tokens=4
            )
        ranks = [r.priority for r in engine.request_log]
        assert len(ranks) == 3
        assert ranks[0] >= 2 and ranks[2] >= 2
        assert ranks[1] == 0
        # An engine not marked priority_scheduling is sent the client's bytes: a client
        # priority reaches it as it came (and vLLM would answer it with a 400).
        async with (
            gateway([plain]) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200
            assert gw.state.payload is None
        assert [r.priority for r in plain.request_log] == [0]
    finally:
        for e in (engine, plain):
            await e.stop()


async def test_an_sglang_engine_is_sent_the_order_it_runs_first() -> None:
    """`engine: sglang` replicas run larger values first: the cached turn gets the largest."""
    engine = SimEngine(PROFILES["instant"], index=0, flavor="sglang", priority_scheduling=True)
    await engine.start()
    try:
        replicas = replica_config([engine], priority_scheduling=True, engine="sglang")
        async with (
            gateway([engine], replicas=replicas) as gw,
            AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            history = " ".join(f"fact {i} is {i * 7}." for i in range(4000))
            first = await client.completions.create(model=MODEL, prompt=history, max_tokens=4)
            assert first.usage is not None and first.usage.prompt_tokens > 8192
            await client.completions.create(
                model=MODEL, prompt=history + " And fact 3?", max_tokens=4
            )
        ranks = [r.priority for r in engine.request_log]
        assert ranks[0] <= -2 and ranks[1] == 0
    finally:
        await engine.stop()


def test_engine_auto_follows_the_detected_kind_and_sends_nothing_while_unknown() -> None:
    kinds: dict[ReplicaId, bool | None] = {A: None, B: True}
    shaper = EnginePayload(
        EnginePrioritySettings(shortest_prefill_first=False),
        frozenset({A, B}),
        classes=CLASSES,
        detected=frozenset({A, B}),
        runs_higher_first=kinds.get,
    )
    body: dict[str, Any] = {"model": MODEL}
    req = _req(10, "interactive")
    # Unknown direction: the field is left out rather than risk an inverted order.
    assert shaper.wanted(req, body, A) is None
    # SGLang by its metrics (larger first): the interactive class's -10 is sent as 10.
    assert shaper.wanted(req, body, B) == 10
    kinds[A] = False  # vLLM: lower first, sent as is
    assert shaper.wanted(req, body, A) == -10
