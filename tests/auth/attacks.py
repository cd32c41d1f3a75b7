"""The issue's attempts on the front door, each a function of a gateway's URL: run against
in-process gateways (test_quota_drain) and a real `kvgate serve` (test_attacks)."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.auth.limits import WINDOW_S

MODEL = "kvgate-sim"
PROMPT_4K2 = "word " * 3360  # 16,800 characters: 4,200 tokens by the gateway's estimate


async def clear_of_a_window_edge(need_s: float) -> None:
    """Wait for the next quota minute when fewer than `need_s` seconds are left in this one.

    Budgets are a sliding minute: past the edge, the previous minute's charges weigh
    (1 - elapsed share) and a drained budget admits one stream more. A drain that crosses
    the edge would then count one more served request than the budget, by design."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < need_s:
        await asyncio.sleep(left + 0.05)


def _count_tokens(line: str) -> int:
    return 1 if line.startswith("data:") and '"content":"' in line else 0


async def drained_output(url: str, key: str, streams: int, read: int) -> list[int | str]:
    """`streams` streams one after the other, each read to `read` tokens, then dropped.
    Returns per stream the tokens it got, or the status it was refused with ("429")."""
    out: list[int | str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(streams):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "write"}],
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"authorization": f"Bearer {key}"}
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    out.append(str(resp.status_code))
                    continue
                got = 0
                async for line in resp.aiter_lines():
                    got += _count_tokens(line)
                    if got >= read:
                        break  # leaving the block drops the connection
                out.append(got)
    return out


async def drained_input(url: str, key: str, prompts: int) -> list[int | str]:
    """`prompts` 4.2K-token prompts one after the other, each dropped after its first token.
    Returns per prompt the tokens read (1) or the refusal's status."""
    out: list[int | str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(prompts):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT_4K2}],
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"authorization": f"Bearer {key}"}
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    out.append(str(resp.status_code))
                    continue
                got = 0
                async for line in resp.aiter_lines():
                    got += _count_tokens(line)
                    if got:
                        break
                out.append(got)
    return out
