"""gateway.accounting end to end: tokens, end-to-end latency and cost per model and replica."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.testing.servers import gateway, replica_config, sim_engines

MODEL = "kvgate-sim"
PRICE = 3600.0  # price units per hour = 1 per second busy


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == name)


async def test_tokens_latency_and_cost_match_what_the_engines_reported() -> None:
    async with sim_engines(2, "tiny") as engines:
        replicas = replica_config(engines, price_per_hour=PRICE)
        async with (
            gateway(engines, replicas=replicas) as gw,
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0) as client,
        ):
            prompt = completion = cached = 0
            messages = [{"role": "user", "content": "a shared preamble " * 50}]
            for i in range(6):
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=5,
                    extra_headers={"X-Session-Id": f"s{i % 2}"},
                )
                usage = raw.parse().usage
                assert usage is not None
                prompt += usage.prompt_tokens
                completion += usage.completion_tokens
                details = usage.prompt_tokens_details
                cached += details.cached_tokens or 0 if details is not None else 0
            # A stream whose client did not ask for usage still counts its output tokens.
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=7, stream=True
            )
            chunks = [c async for c in stream]
            assert all(c.usage is None for c in chunks)  # the usage event was not relayed
            async with httpx.AsyncClient() as http:
                metrics = samples((await http.get(gw.url + "/metrics")).text)
    assert total(metrics, "kvgate_generation_tokens_total") == completion + 7
    assert total(metrics, "kvgate_prompt_tokens_total") > prompt  # the stream's prompt too
    assert total(metrics, "kvgate_cached_prompt_tokens_total") >= cached > 0
    assert total(metrics, "kvgate_e2e_request_latency_seconds_count") == 7
    labels = {dict(k[1]).get("model") for k in metrics if k[0] == "kvgate_generation_tokens_total"}
    assert labels == {MODEL}
    # Sequential requests: busy time is the sum of their latencies, at 1 unit per second.
    cost = total(metrics, "kvgate_replica_cost_total")
    busy = total(metrics, "kvgate_e2e_request_latency_seconds_sum")
    assert 0 < cost <= busy * 1.01 and cost > busy * 0.5


async def test_tokens_off_installs_no_observer() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, metrics={"tokens": False}) as gw,
    ):
        assert gw.state.observers == []
