"""Header-free agent conversations through the official openai client, default settings:
each stays on one replica in either message layout, while sessions sharing a preamble
spread over the replicas."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import openai
import pytest

from gateway.testing.servers import gateway, sim_engines

MODEL = "kvgate-sim"
REPLICAS = 4
PREAMBLE = "You are a coding agent with these tools:\n" + "".join(
    f"- tool_{i}(path, query): reads and edits files of the repository, returns JSON\n"
    for i in range(120)
)


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with (
        sim_engines(REPLICAS, "instant") as engines,
        gateway(engines) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        yield client


async def converse(client: openai.AsyncOpenAI, task: str, turns: int, layout: str) -> list[str]:
    """An agent loop with no session header; returns the replica of every turn."""
    history: list[str] = [f"Task: {task}"]
    replicas: list[str] = []
    for turn in range(turns):
        if layout == "growing":
            messages = [
                {"role": "system", "content": PREAMBLE},
                {"role": "user", "content": "\n".join(history)},
            ]
        else:
            messages = [{"role": "system", "content": PREAMBLE}] + [
                {"role": "user" if i % 2 == 0 else "assistant", "content": text}
                for i, text in enumerate(history)
            ]
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,  # type: ignore[arg-type]
        )
        replicas.append(raw.headers["x-kvgate-replica"])
        answer = raw.parse().choices[0].message.content or ""
        history += [answer, f"tool result {turn} for {task}: " + "ok " * 60]
    return replicas


@pytest.mark.parametrize("layout", ["growing", "turns"])
async def test_agent_conversations_stick_without_a_header_and_spread(
    client: openai.AsyncOpenAI, layout: str
) -> None:
    runs = await asyncio.gather(
        *(converse(client, f"fix issue #{n} in module {n * 31}", 6, layout) for n in range(20))
    )
    for replicas in runs:
        assert len(set(replicas)) == 1, replicas
    homes = Counter(replicas[0] for replicas in runs)
    # 20 sessions sharing one preamble: every replica takes some, none takes most.
    assert len(homes) == REPLICAS, homes
    assert max(homes.values()) <= 8, homes


async def test_completions_with_a_growing_prompt_stick(client: openai.AsyncOpenAI) -> None:
    served: list[str] = []
    for k in range(2):
        prompt = PREAMBLE + f"Session {k}.\n"
        homes = []
        for turn in range(5):
            prompt += f"Observation {turn}: " + "data " * 80 + "\n"
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=4
            )
            homes.append(raw.headers["x-kvgate-replica"])
        assert len(set(homes)) == 1, homes
        served.append(homes[0])
    # Two sessions, one after the other, at no load: the second may well go where the
    # preamble is cached; each is one lineage of its own (its own key).


async def test_a_turn_sent_during_the_previous_prefill_follows_it() -> None:
    # Agents fire a follow-up (or a parallel tool call) before the earlier answer is back.
    # The earlier request is placed as it is sent, so the follow-up, whose prompt extends
    # it, finds its lineage and its replica, not a replica without its prefix.
    async with (
        sim_engines(REPLICAS, "h200-sparse", time_scale=4.0) as engines,
        gateway(engines) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):

        async def send(messages: list[dict[str, str]]) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
            )
            return raw.headers["x-kvgate-replica"]

        async def pair(n: int) -> tuple[str, str]:
            # ~20K tokens: about 0.35 s of prefill at this time scale.
            task = f"Task {n}: " + f"context line {n} of the repository listing. " * 1800
            first = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": task}]
            earlier = asyncio.create_task(send(first))
            await asyncio.sleep(0.05)  # the first is in prefill
            follow = [*first, {"role": "assistant", "content": "..."}]
            follow.append({"role": "user", "content": f"and also check module {n}"})
            later = await send(follow)
            return await earlier, later

        # One pair at a time: the earlier request's replica is then the only busy one,
        # which is what would push a follow-up that did not know of it elsewhere.
        for n in range(4):
            a, b = await pair(n)
            assert a == b, (n, a, b)
