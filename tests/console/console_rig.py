"""A gateway with pools, admission and a fast console sampler in front of four simulated
engines, and a short mixed load (streamed and not, several sessions and classes)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import openai

from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"
CLASSES = ("interactive", "default", "batch")


def settings(fast: list[SimEngine], cheap: list[SimEngine], **console: Any) -> dict[str, Any]:
    replicas = [{"id": f"fast-{e.index}", "url": e.url, "pool": "fast"} for e in fast]
    replicas += [{"id": f"cheap-{e.index}", "url": e.url, "pool": "cheap"} for e in cheap]
    return {
        "replicas": replicas,
        "pools": {
            "pools": [
                {
                    "name": "fast",
                    "price_per_card_hour": 4.0,
                    "cards_per_replica": 2,
                    "slots_per_replica": 4,
                },
                {
                    "name": "cheap",
                    "price_per_card_hour": 1.0,
                    "cards_per_replica": 2,
                    "slots_per_replica": 4,
                },
            ],
            "controller": {
                "interval_s": 0.5,
                "dwell_steps": 1,
                "max_step": 0.2,
                "min_weight": 0.25,
            },
        },
        "admission": {
            "enabled": True,
            "saturation": {"max_inflight": 2},
            "max_queue": 6,
            "max_wait_s": 0.5,
        },
        "health": {"interval_s": 0.25, "failure_threshold": 2, "cooldown_s": 3, "timeout_s": 2.0},
        "scrape": {"interval_s": 0.25},
        "console": {"sample_interval_s": 0.5, **console},
    }


# The tiny card with room for every conversation's prefix, so prefix hits show.
PROFILE = PROFILES["tiny"].scaled(num_gpu_blocks=1024, max_num_seqs=16)


@contextlib.asynccontextmanager
async def console_gateway(**console: Any) -> AsyncIterator[tuple[RunningGateway, list[SimEngine]]]:
    engines = [SimEngine(PROFILE, index=i % 2, time_scale=3.0) for i in range(4)]
    try:
        for engine in engines:
            await engine.start()
        fast, cheap = engines[:2], engines[2:]
        async with gateway(engines, **settings(fast, cheap, **console)) as gw:
            yield gw, engines
    finally:
        for engine in engines:
            if engine.server is not None:
                await engine.stop()


@dataclass
class Load:
    """Clients sending chat turns until stopped; counts what they got back."""

    url: str
    concurrency: int = 6
    statuses: dict[int, int] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> None:
        counter = itertools.count()
        for worker in range(self.concurrency):
            self._tasks.append(asyncio.create_task(self._run(worker, counter)))

    async def _run(self, worker: int, counter: itertools.count[int]) -> None:
        async with openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=10
        ) as client:
            system = {"role": "system", "content": "You are a terse assistant. " * 8}
            history: list[dict[str, str]] = [system]
            conversation = 0
            while not self._stop.is_set():
                n = next(counter)
                history.append({"role": "user", "content": f"worker {worker} turn {n}: go on"})
                try:
                    reply = await client.chat.completions.create(
                        model=MODEL,
                        messages=history,  # type: ignore[arg-type]
                        max_tokens=12,
                        stream=n % 2 == 0,
                        extra_headers={
                            "X-Session-Id": f"w{worker}-c{conversation}",
                            "X-Priority": CLASSES[worker % 3],
                        },
                    )
                    if n % 2 == 0:
                        text = "".join(
                            [c.choices[0].delta.content or "" async for c in reply if c.choices]
                        )  # type: ignore[union-attr]
                    else:
                        text = reply.choices[0].message.content or ""  # type: ignore[union-attr]
                    history.append({"role": "assistant", "content": text})
                    self.statuses[200] = self.statuses.get(200, 0) + 1
                except openai.APIStatusError as err:
                    self.statuses[err.status_code] = self.statuses.get(err.status_code, 0) + 1
                    await asyncio.sleep(0.05)
                except openai.APIConnectionError:
                    self.statuses[0] = self.statuses.get(0, 0) + 1
                    await asyncio.sleep(0.05)
                if len(history) > 16:  # the conversation ends; the worker starts another
                    history, conversation = [system], conversation + 1

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
