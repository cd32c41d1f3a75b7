from __future__ import annotations

import httpx
import pytest
from pools_helpers import cluster, replica, request, ring_factory, settings, two_pools
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette

from gateway.errors import ConfigError
from gateway.pools.admin import admin_route
from gateway.pools.cost import Usage
from gateway.pools.runtime import PoolsRuntime
from gateway.types import ReplicaId


def test_replica_in_an_unconfigured_pool_is_a_config_error() -> None:
    view = cluster(replica("a", "h200"), replica("b", "h100"))
    with pytest.raises(ConfigError, match="h100"):
        PoolsRuntime(settings(), view.replicas, lambda: view)


def test_runtime_wraps_router_records_cost_and_exports() -> None:
    view = two_pools()
    registry = CollectorRegistry()
    rt = PoolsRuntime(
        settings(controller={"dwell_steps": 1}), view.replicas, lambda: view, registry=registry
    )
    sel = rt.wrap(ring_factory, view.replicas)
    assert rt.served_model("deepseek") == "deepseek-v4-fp4" and rt.served_model("x") == "x"
    choice = sel.choose(request("s"), view)
    assert choice.policy == "pools+consistent_hash"
    rt.record(ReplicaId("domestic-0"), Usage(1000, 500, 10), 0.0, 3.6)
    rt.record(ReplicaId("elsewhere"), Usage(1000, 500, 10), 0.0, 3.6)
    rt.controller.tick()
    payload = rt.admin_payload()
    assert payload["weights"] == {"h200": 0.4, "domestic": 0.6}
    assert payload["last_change"]["code"] == "prefer_cheaper"
    assert payload["cost"]["domestic"]["tokens"] == {
        "prompt": 1000,
        "cached_prompt": 500,
        "generated": 10,
        "total": 1010,
    }
    assert payload["cost"]["all"]["requests"] == 1
    assert payload["models"]["deepseek"] == {"served": "deepseek-v4-fp4", "pools": ["h200"]}
    assert {p["name"]: p["replicas"] for p in payload["pools"]} == {"h200": 3, "domestic": 3}
    assert 'kvgate_pool_weight{pool="domestic"} 0.6' in generate_latest(registry).decode()


async def test_admin_route_serves_json_and_404_when_unconfigured() -> None:
    view = two_pools()
    rt = PoolsRuntime(settings(), view.replicas, lambda: view)
    holder: list[PoolsRuntime | None] = [rt]
    app = Starlette(routes=[admin_route(lambda: holder[0])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        ok = await c.get("/admin/pools")
        assert ok.status_code == 200 and ok.json()["weights"] == {"h200": 0.5, "domestic": 0.5}
        assert (await c.post("/admin/pools")).status_code == 405
        holder[0] = None
        missing = await c.get("/admin/pools")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
