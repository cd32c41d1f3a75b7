"""PD hand-off legs carry the gateway's include_usage; the client still sees no usage chunk."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.hooks import RequestOutcome
from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_handoff_stream_without_include_usage(rig_factory: Any, protocol: str) -> None:
    async with rig_factory([B, P, D], protocol=protocol) as rig:
        seen: list[RequestOutcome] = []
        rig.state.observers.append(seen.append)
        async with openai.AsyncOpenAI(
            base_url=rig.url + "/v1", api_key="x", max_retries=0
        ) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="kvgate-sim",
                messages=[{"role": "user", "content": "u " * 4000}],
                max_tokens=5,
                stream=True,
            )
            assert raw.headers["x-kvgate-replica"] == "d0"  # served by the hand-off
            chunks = [c async for c in raw.parse()]
        assert chunks and all(c.choices and c.usage is None for c in chunks)
        await rig.settle()
        (dec,) = rig.records("d0")
        assert dec.pd == "decode" and dec.output_tokens == 5
        (outcome,) = seen
        assert outcome.ok and outcome.completion_tokens == 5
        assert outcome.prompt_tokens and outcome.prompt_tokens > 1000
        assert outcome.cached_tokens is not None
