"""The relay feeds the stream timer: time to first token, inter-token latency and time per
output token land in /metrics for streams through the gateway (issue 21)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, sim_engines
from tests.test_token_timing import FIXED, PREFILL_TOKENS_PER_S

# A decode step twice the unit test's: on a busy two-core CI host each step's wake-up comes
# a few milliseconds late, which at 40 ms was already a tenth.
DECODE_STEP_S = 0.08
PROFILE = FIXED.scaled(decode_base_s=DECODE_STEP_S)

MODEL = "kvgate-sim"


def samples(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(name):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def test_streams_record_first_token_itl_and_tpot_and_buffered_ones_do_not() -> None:
    async with (
        sim_engines(1, "tiny") as engines,
        gateway(engines, models={"discover": False}) as gw,
    ):
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            for _ in range(3):
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "tell me"}],
                    max_tokens=6,
                    stream=True,
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
                assert text
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
            )
        async with httpx.AsyncClient(base_url=gw.url) as http:
            body = (await http.get("/metrics")).text
    ttft = samples(body, "kvgate_time_to_first_token_seconds")
    assert ttft["kvgate_time_to_first_token_seconds_count"] == 3  # the buffered one has none
    assert ttft["kvgate_time_to_first_token_seconds_sum"] > 0
    itl = samples(body, "kvgate_inter_token_latency_seconds")
    assert itl["kvgate_inter_token_latency_seconds_count"] >= 3 * 4  # 6 tokens: 5 gaps each
    tpot = samples(body, "kvgate_time_per_output_token_seconds")
    assert tpot["kvgate_time_per_output_token_seconds_count"] == 3


def histogram_mean(text: str, name: str) -> tuple[float, float]:
    got = samples(text, name)
    return got[name + "_sum"] / got[name + "_count"], got[name + "_count"]


async def test_histograms_through_the_gateway_match_the_fixed_timing_profile_within_10_percent() -> (
    None
):
    """The series in /metrics, not just the timer: TTFT is the engine's prefill, TPOT and the
    mean inter-token latency its decode step (issue 21's proof)."""
    engine = SimEngine(PROFILE, index=0)
    await engine.start()
    prefill: list[float] = []
    try:
        async with gateway([engine], models={"discover": False}) as gw:
            async with openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key="k", max_retries=0
            ) as client:
                for i in range(3):
                    # A different prompt each time: no prefix-cache hit shortens the prefill.
                    stream = await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"topic{i} " * 300}],
                        max_tokens=16,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    usage = None
                    async for chunk in stream:
                        usage = chunk.usage or usage
                    assert usage is not None and usage.completion_tokens == 16
                    prefill.append(usage.prompt_tokens / PREFILL_TOKENS_PER_S)
            async with httpx.AsyncClient(base_url=gw.url) as http:
                body = (await http.get("/metrics")).text
    finally:
        await engine.stop()
    ttft, n = histogram_mean(body, "kvgate_time_to_first_token_seconds")
    assert n == 3 and ttft == pytest.approx(sum(prefill) / 3, rel=0.10)
    tpot, n = histogram_mean(body, "kvgate_time_per_output_token_seconds")
    assert n == 3 and tpot == pytest.approx(DECODE_STEP_S, rel=0.10)
    itl, n = histogram_mean(body, "kvgate_inter_token_latency_seconds")
    # 15 gaps per stream, less the tokens that came in the same read as the first one.
    assert 3 * 13 <= n <= 3 * 15 and itl == pytest.approx(DECODE_STEP_S, rel=0.10)
