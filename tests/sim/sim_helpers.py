from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.profiles import HardwareProfile, get_profile


def test_profile(**changes: object) -> HardwareProfile:
    """Small and fast: 64 blocks of 16 tokens, steps of a few milliseconds."""
    return get_profile("tiny").scaled(name="test", **changes)


test_profile.__test__ = False  # type: ignore[attr-defined]


def chat_body(content: str, **extra: object) -> dict[str, object]:
    return {"model": "kvgate-sim", "messages": [{"role": "user", "content": content}], **extra}


async def scrape(
    client: httpx.AsyncClient, url: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of one /metrics page keyed by (sample name, sorted labels)."""
    text = (await client.get(f"{url}/metrics")).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all((k, want) in ls for k, want in labels.items())
    )


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
