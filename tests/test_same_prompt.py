"""Copies of a prompt in prefill: the hold itself, then through the openai client in front of
simulated engines whose prefill takes time, where the copies' cached tokens show it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from gateway.prefill_meter import PrefillMeter
from gateway.same_prompt import SLACK, SLACK_S, SamePromptHold, chain
from gateway.testing.servers import gateway, sim_engines
from gateway.types import RouteRequest


def req(rid: str, session: str = "s", last: int = 7, tokens: int = 9000) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        model="m",
        session_key=session,
        prompt_tokens=tokens,
        prefix_hashes=(1, 2, last),
        block_tokens=16,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_copy_waits_for_the_first_one_s_first_token() -> None:
    hold = SamePromptHold(PrefillMeter(), max_wait_s=10.0)
    assert hold.before_route(req("a"), {}) is None  # nothing in prefill: the first goes
    hold.dispatched(req("a"), "r0", {})
    assert hold.before_route(req("a"), {}) is None  # its own retry does not wait for itself
    waiting = asyncio.ensure_future(hold.before_route(req("b"), {}))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert not waiting.done()
    hold.dispatched(req("b"), "r0", {})  # a copy sent anyway does not take the lead
    hold.prefilled(req("a"))
    await asyncio.wait_for(waiting, 1.0)
    assert hold.leads == 0
    hold.prefilled(req("a"))  # again: nothing
    # Another conversation, length or prompt never waits.
    hold.dispatched(req("c"), "r0", {})
    for other in (req("d", session="t"), req("d", tokens=9001), req("d", last=8)):
        assert hold.before_route(other, {}) is None


async def test_the_wait_is_bounded_by_the_first_copy_s_expected_prefill() -> None:
    clock = Clock()
    meter = PrefillMeter(min_samples=1)
    # The replica prefilled 10,000 tokens in one second.
    meter.dispatched("x", "r0", 10_000, clock.now)
    meter.first_token("x", clock.now + 1.0)
    clock.now += 1.0
    hold = SamePromptHold(meter, max_wait_s=10.0, clock=clock)
    meter.dispatched("a", "r0", 9000, clock.now)
    hold.dispatched(req("a"), "r0", {})
    clock.now += SLACK * 0.9 + SLACK_S - 0.01
    waits = hold.before_route(req("b"), {})
    assert asyncio.iscoroutine(waits)
    waits.close()  # not awaited: only whether it would wait
    clock.now += 0.02
    assert hold.before_route(req("b"), {}) is None  # past the expected prefill: go
    # A first copy whose first byte never came in time gives the lead to the next one.
    clock.now += 1.0
    hold.dispatched(req("b"), "r0", {})
    assert hold.leads == 1
    waits = hold.before_route(req("c"), {})
    assert asyncio.iscoroutine(waits)
    waits.close()
    hold.prefilled(req("a"))  # the old lead's late first byte lets nothing go
    assert hold.leads == 1
    hold.prefilled(req("b"))
    assert hold.leads == 0
    # With no speed measured, the setting bounds it.
    hold = SamePromptHold(PrefillMeter(), max_wait_s=0.05)
    hold.dispatched(req("a"), "r1", {})
    ready = hold.before_route(req("b"), {})
    assert ready is not None
    await asyncio.wait_for(ready, 1.0)  # over budget: it returns by itself


async def test_a_chained_hook_waits_for_both_in_turn() -> None:
    calls: list[str] = []

    async def slow() -> None:
        calls.append("first")

    async def later() -> None:
        calls.append("then")

    hook = chain(lambda r, b: slow(), lambda r, b: later())
    ready = hook(req("a"), {})
    assert ready is not None
    await ready
    assert calls == ["first", "then"]
    assert chain(lambda r, b: None, lambda r, b: None)(req("a"), {}) is None


MODEL = "kvgate-sim"
# Some 6,000 tokens: on `domestic` (4,096 tokens per step) more than one step of prefill.
PROMPT = "Summarise the design review below in five bullet points.\n" + "".join(
    f"Finding {i}: the storage layer retries writes {i} times before it reports a fault.\n"
    for i in range(330)
)


async def copies(settings: dict[str, Any]) -> tuple[list[tuple[str, int, int]], str]:
    async with (
        sim_engines(2, "domestic", time_scale=0.25) as engines,
        gateway(engines, **settings) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):

        async def ask() -> tuple[str, int, int]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1
            )
            usage = raw.parse().usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            return raw.headers["x-kvgate-replica"], usage.prompt_tokens, cached

        answers = await asyncio.gather(*(ask() for _ in range(4)))
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(gw.url + "/metrics")).text
        return answers, metrics


@pytest.mark.parametrize("wait_s", [10.0, 0.0])
async def test_four_copies_sent_at_once_prefill_once(wait_s: float) -> None:
    answers, metrics = await copies({"routing": {"same_prompt_wait_s": wait_s}})
    assert len({replica for replica, _, _ in answers}) == 1, answers
    prompt = answers[0][1]
    assert prompt > 5000
    cached = sorted(c for _, _, c in answers)
    waited = 'kvgate_same_prompt_waits_total{outcome="prefilled"} 3.0' in metrics
    if wait_s:
        # One prefill: the three others find all of it cached but the last partial block.
        assert cached[0] == 0 and all(c >= prompt - 32 for c in cached[1:]), answers
        assert waited
    else:
        # Sent together, the copies compute what the first had not cached when they came.
        assert sum(cached) < 3 * (prompt - 32), answers
        assert "kvgate_same_prompt_waits_total" not in metrics
