"""In-process servers for integration tests: simulated engines plus a gateway in front.

    async with sim_engines(2) as engines, gateway(engines) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-")

Everything runs on real uvicorn servers on loopback in the current event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette

from gateway.app import build_app
from gateway.serving import RunningServer, start_server
from gateway.settings import load_settings
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.state import GatewayState


@contextlib.asynccontextmanager
async def sim_engines(
    count: int, profile: str = "tiny", **engine_kwargs: Any
) -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(PROFILES[profile], index=i, **engine_kwargs) for i in range(count)]
    try:
        for engine in engines:
            await engine.start()
        yield engines
    finally:
        for engine in engines:
            if engine.server is not None:
                await engine.stop()


@dataclass
class RunningGateway:
    server: RunningServer
    app: Starlette

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> GatewayState:
        state: GatewayState = self.app.state.gateway
        return state


def replica_config(engines: Sequence[SimEngine], **fields: Any) -> list[dict[str, Any]]:
    """`replicas:` entries for `engines`, ids "e0", "e1", ..."""
    return [{"id": f"e{e.index}", "url": e.url, **fields} for e in engines]


@contextlib.asynccontextmanager
async def gateway(engines: Sequence[SimEngine], **settings: Any) -> AsyncIterator[RunningGateway]:
    """A gateway in front of `engines`; keyword arguments are settings sections."""
    settings.setdefault("replicas", replica_config(engines))
    loaded = load_settings(**settings)
    app = build_app(loaded)
    # Forwarded-address handling as `kvgate serve` sets it (uvicorn's own default trusts
    # X-Forwarded-For from loopback, which a test client on 127.0.0.1 could then forge).
    server = await start_server(
        app,
        http=loaded.server.protocol(),
        proxy_headers=loaded.server.proxy_headers,
        forwarded_allow_ips=loaded.server.forwarded_allow_ips,
    )
    try:
        yield RunningGateway(server, app)
    finally:
        await server.stop()
