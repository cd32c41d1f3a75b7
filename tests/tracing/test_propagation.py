"""Trace context through the gateway to the engines, spans off (the default)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.traceparent import parse

MODEL = "kvgate-sim"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


async def ask(gw: RunningGateway, headers: dict[str, str], stream: bool = False) -> str:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=stream,
            extra_headers=headers,
        )
        if stream:
            async for _ in raw.parse():
                pass
        return raw.headers["x-request-id"]


def received(engines: list[SimEngine], request_id: str) -> list[tuple[str | None, str | None]]:
    return [(tp, ts) for e in engines for rid, tp, ts in e.trace_contexts if rid == request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_engine_continues_the_callers_trace_under_a_new_parent(
    engines: list[SimEngine], stream: bool
) -> None:
    async with gateway(engines, models={"discover": False}) as gw:
        rid = await ask(gw, {"traceparent": CALLER, "tracestate": "vendor=abc,other=1"}, stream)
    [(traceparent, tracestate)] = received(engines, rid)
    got = parse(traceparent.encode() if traceparent else None)
    assert got is not None
    assert got.trace_id.decode() == TRACE  # the caller's trace
    assert got.parent_id != b"00f067aa0ba902b7"  # the gateway's span, not the caller's
    assert got.flags == 1
    assert tracestate == "vendor=abc,other=1"  # relayed unchanged


async def test_a_request_without_trace_context_starts_one_per_request(
    engines: list[SimEngine],
) -> None:
    async with gateway(engines, models={"discover": False}) as gw:
        first, second = await ask(gw, {}), await ask(gw, {"traceparent": "not-a-traceparent"})
    (a, _), (b, _) = received(engines, first)[0], received(engines, second)[0]
    pa, pb = parse(a.encode() if a else None), parse(b.encode() if b else None)
    assert pa is not None and pb is not None
    assert pa.sampled and pa.trace_id != pb.trace_id


async def test_the_child_is_sent_once_even_across_a_failover(engines: list[SimEngine]) -> None:
    await engines[0].set_faults(FaultConfig(error=503))
    await engines[1].set_faults(FaultConfig(error=503))
    async with (
        gateway(
            engines,
            models={"discover": False},
            health={"passive": False},
            retries={"max_attempts": 2},
        ) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                extra_headers={"traceparent": CALLER, "x-request-id": "r-failover"},
            )
    seen = [tp for e in engines for rid, tp, _ in e.trace_contexts if rid == "r-failover"]
    assert len(seen) == 2  # both replicas tried
    parsed = [parse(tp.encode()) for tp in seen if tp]
    assert all(p is not None and p.trace_id.decode() == TRACE for p in parsed)


async def test_propagation_off_passes_the_callers_header_untouched(
    engines: list[SimEngine],
) -> None:
    async with gateway(engines, models={"discover": False}, tracing={"propagate": False}) as gw:
        rid = await ask(gw, {"traceparent": CALLER})
        bare = await ask(gw, {})
    assert received(engines, rid) == [(CALLER, None)]
    assert received(engines, bare) == [(None, None)]
