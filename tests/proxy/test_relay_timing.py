"""The relay feeds the stream timer: time to first token, inter-token latency and time per
output token land in /metrics for streams through the gateway (issue 21)."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.testing.servers import gateway, sim_engines

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
