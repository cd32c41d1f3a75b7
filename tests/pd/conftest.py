"""A PD rig: simulated engines with roles behind a real gateway, all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.app import build_app
from gateway.pd.dispatcher import PDDispatcher
from gateway.serving import start_server
from gateway.settings import KvgateSettings
from gateway.sim.cluster import SimCluster
from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.state import GatewayState
from gateway.types import Role

MODEL = "kvgate-sim"
# A ~2000-token prompt under the sim's ~4 characters per token.
LONG_PROMPT = "".join(f"line {i}: the engine keeps the prefix cache warm. " for i in range(160))


@dataclass
class Rig:
    sim: SimCluster
    state: GatewayState
    url: str
    ids: list[str]
    http: httpx.AsyncClient

    def engine(self, replica: str) -> SimEngine:
        return self.sim.engines[self.ids.index(replica)]

    @property
    def dispatcher(self) -> PDDispatcher:
        dispatcher = self.state.dispatcher
        assert isinstance(dispatcher, PDDispatcher)
        return dispatcher

    def records(self, replica: str) -> list[Any]:
        return list(self.engine(replica).request_log)

    async def settle(self) -> None:
        """Wait (briefly) until every in-flight slot was released, then insist on it."""
        for _ in range(200):
            if not any(self.state.cluster.in_flight.values()):
                break
            await asyncio.sleep(0.01)
        assert dict(self.state.cluster.in_flight) == {r: 0 for r in self.ids}

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    async def chat(
        self, content: str = LONG_PROMPT, headers: dict[str, str] | None = None, **extra: Any
    ) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            **extra,
        }
        return await self.http.post("/v1/chat/completions", json=body, headers=headers)


def _replica_id(role: Role, counts: dict[Role, int]) -> str:
    n = counts.get(role, 0)
    counts[role] = n + 1
    return {Role.BOTH: "c", Role.PREFILL: "p", Role.DECODE: "d"}[role] + str(n)


@contextlib.asynccontextmanager
async def pd_rig(
    roles: Sequence[Role],
    *,
    protocol: str = "vllm",
    mode: str = "always",
    profile: str = "h200-dense",
    faults: dict[int, FaultConfig] | None = None,
    bootstrap_timeout_s: float = 5.0,
    time_scale: float = 10.0,
    priority: bool = False,
    **model_pd: Any,
) -> AsyncIterator[Rig]:
    sim = SimCluster(
        len(roles),
        profile,
        roles=list(roles),
        time_scale=time_scale,
        bootstrap_timeout_s=bootstrap_timeout_s,
        priority_scheduling=priority,
    )
    async with sim:
        for index, fault in (faults or {}).items():
            await sim.set_faults(index, fault)
        counts: dict[Role, int] = {}
        ids = [_replica_id(role, counts) for role in roles]
        pd_model = {
            "mode": mode,
            "kv_bytes_per_token": 327_680,
            "link_gbps": 400,
            "min_uncached_tokens": 1024,
            "max_transfer_ms": 100,
            **model_pd,
        }
        settings = KvgateSettings(
            replicas=[
                {
                    "id": rid,
                    "url": url,
                    "role": role.value,
                    "models": [MODEL],
                    "priority_scheduling": priority,
                }
                for rid, url, role in zip(ids, sim.urls, roles, strict=True)
            ],
            routing={"policy": "prefix_affinity"},
            # The PD tests pin replicas through the ring order of the opener keys and
            # the prefix index's 16-token blocks of before lineage routing.
            session={"lineage": False, "block_tokens": 16, "max_prefix_blocks": 256},
            health={"enabled": False},
            models={"discover": False},
            pd={
                "models": {MODEL: pd_model},
                "default": {"protocol": protocol},
                # The sim's bootstrap rendezvous lives on the engine's own HTTP port.
                "bootstrap_ports": {rid: e.port for rid, e in zip(ids, sim.engines, strict=True)},
                "seed": 1,
            },
        )
        app = build_app(settings)
        server = await start_server(app)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
                yield Rig(sim, app.state.gateway, server.url, ids, http)
        finally:
            await server.stop()


@pytest.fixture
def rig_factory() -> Any:
    return pd_rig
