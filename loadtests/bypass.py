"""What happens to the engines besides the router's traffic, during a replay.

* `send_bypass`: other clients of the engines, requests sent to them straight.
* `drop_caches`: replicas that lose their whole KV cache at one moment (a restart's empty
  cache), through the simulated engine's POST /sim/drop_cache.

Other clients:

A batch job or a second router sharing the replicas fills their KV caches with prompts the
router never saw, and so evicts what its conversations left there; only the engines' own
KV cache events tell a router that. Each request here opens with text no other request
sends (a fresh hash chain from its first block) and asks for one token, so it costs the
engine a prefill and the prompt's worth of KV blocks, nothing else.

The sender keeps a steady rate over the chosen engines in turn and at most `max_open`
requests unanswered per engine: an engine that falls behind is skipped for that tick (the
skip is counted), not buried under a backlog the routed traffic would then queue behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

# The simulated engines count 4 characters a token (gateway.sim.tokenizer).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class BypassLoad:
    rate: float  # requests per wall second, over all the chosen engines
    tokens: int  # prompt tokens per request
    engines: int  # the first this many engines (0: every engine)
    max_open: int = 4  # unanswered requests per engine before its turn is skipped


@dataclass
class BypassCount:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0

    def label(self, load: BypassLoad, targets: int) -> str:
        return (
            f"bypass: {self.sent} requests of {load.tokens} tokens straight to {targets} "
            f"engine(s) ({self.ok} answered, {self.failed} failed, {self.skipped} turns "
            f"skipped behind {load.max_open} unanswered)"
        )


def prompt(tokens: int) -> str:
    """Text of `tokens` simulated tokens that no other request opens with."""
    head = f"{uuid.uuid4().hex} unrelated batch job input: "
    body = "lorem ipsum dolor sit amet " * (tokens * CHARS_PER_TOKEN // 27 + 1)
    return (head + body)[: tokens * CHARS_PER_TOKEN]


async def send_bypass(
    urls: Sequence[str], load: BypassLoad, model: str, stop: asyncio.Event
) -> BypassCount:
    """Send `load` to `urls` until `stop` is set, then wait for what is unanswered."""
    targets = list(urls[: load.engines] if load.engines else urls)
    count = BypassCount()
    open_: dict[str, int] = dict.fromkeys(targets, 0)
    tasks: set[asyncio.Task[None]] = set()

    async def one(http: httpx.AsyncClient, url: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt(load.tokens)}],
            "max_tokens": 1,
        }
        try:
            r = await http.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code == 200:
                count.ok += 1
            else:
                count.failed += 1
        except httpx.HTTPError:
            count.failed += 1
        finally:
            open_[url] -= 1

    async with httpx.AsyncClient(timeout=300.0) as http:
        period = 1.0 / load.rate
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        try:
            for url in itertools.cycle(targets):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - loop.time()))
                if stop.is_set():
                    break
                next_at += period
                if open_[url] >= load.max_open:
                    count.skipped += 1
                    continue
                open_[url] += 1
                count.sent += 1
                task = asyncio.create_task(one(http, url))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            # Cancelled (the benchmark interrupted): no request outlives the client.
            for task in list(tasks):
                task.cancel()
    return count


async def drop_caches(urls: Sequence[str], delay_s: float, stop: asyncio.Event) -> str:
    """After `delay_s` (unless `stop` is set first), drop every cache of `urls` at once."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay_s)
    if stop.is_set():
        return f"caches not dropped: the replay ended within {delay_s:.1f} s"
    async with httpx.AsyncClient(timeout=10.0) as http:
        answers = await asyncio.gather(*(http.post(f"{u}/sim/drop_cache") for u in urls))
    blocks = sum(int(a.json()["dropped_blocks"]) for a in answers if a.status_code == 200)
    failed = sum(a.status_code != 200 for a in answers)
    note = f"caches of {len(urls)} engine(s) dropped after {delay_s:.1f} s ({blocks} blocks"
    return note + (f", {failed} refused)" if failed else ")")
