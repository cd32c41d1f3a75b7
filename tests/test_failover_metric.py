"""A failover attempt is counted as a routing decision of reason `failover` (issue 19, item 8)."""

from __future__ import annotations

import httpx

from gateway.sim.faults import FaultConfig
from gateway.testing.servers import gateway, sim_engines

BODY = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_failover_is_counted() -> None:
    async with (
        sim_engines(2, "instant") as engines,
        gateway(
            engines, health={"interval_s": 60, "failure_threshold": 100}, models={"discover": False}
        ) as gw,
    ):
        await engines[0].set_faults(FaultConfig(refuse=True))
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for i in range(6):
                resp = await http.post(
                    "/v1/chat/completions", json=BODY, headers={"x-session-id": f"s{i}"}
                )
                assert resp.status_code == 200 and resp.headers["x-kvgate-replica"] == "e1"
            metrics = (await http.get("/metrics")).text
        failovers = [
            line
            for line in metrics.splitlines()
            if line.startswith("kvgate_routing_decisions_total{") and 'reason="failover"' in line
        ]
        assert failovers and sum(float(line.rsplit(" ", 1)[1]) for line in failovers) >= 1, metrics
