"""Forks through the official openai client, no session header: four subagents started at
once from a conversation's whole history land on the replica holding it, under the default
policy and under `cost` (whose prefill meter the gateway feeds from real first tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from gateway.testing.servers import gateway, sim_engines

MODEL = "kvgate-sim"
REPLICAS = 4
PREAMBLE = "You are a coding agent with these tools:\n" + "".join(
    f"- tool_{i}(path, query): reads and edits files of the repository, returns JSON\n"
    for i in range(60)
)


async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
    )
    return raw.headers["x-kvgate-replica"], raw.parse().choices[0].message.content or ""


@pytest.mark.parametrize("policy", [None, "cost"])
async def test_four_parallel_forks_land_on_their_conversations_replica(
    policy: str | None,
) -> None:
    settings: dict[str, Any] = {} if policy is None else {"routing": {"policy": policy}}
    async with (
        sim_engines(REPLICAS, "instant") as engines,
        gateway(engines, **settings) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        # Other conversations first, so that the replicas are not all empty.
        for n in range(6):
            await ask(
                client,
                [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": f"job {n}"}],
            )
        messages = [
            {"role": "system", "content": PREAMBLE},
            {"role": "user", "content": "Refactor the storage layer. " + "context " * 400},
        ]
        homes = []
        for turn in range(4):
            home, answer = await ask(client, messages)
            homes.append(home)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"tool result {turn}: " + "ok " * 300},
            ]
        assert len(set(homes)) == 1, homes
        forks = await asyncio.gather(
            *(
                ask(client, [*messages, {"role": "user", "content": f"Subagent {k}: check {k}"}])
                for k in range(4)
            )
        )
        assert [replica for replica, _ in forks] == [homes[0]] * 4
        # The parent resumes with their results appended, on its replica still.
        results = "\n".join(f"result {k}: {answer}" for k, (_, answer) in enumerate(forks))
        home, _ = await ask(client, [*messages, {"role": "user", "content": results}])
        assert home == homes[0]
