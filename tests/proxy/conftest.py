"""Fixtures shared by the proxy route tests: simulated engines, a gateway in front of them
and the official openai client on it. A module overrides `engines` (or `client`) for its
own count or client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(3, "instant") as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(engines) as gw:
        yield gw


@pytest.fixture
async def client(gw: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        yield client
