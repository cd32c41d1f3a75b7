"""Gateway errors name the replica, never the engine's address (issue 19, item 8)."""

from __future__ import annotations

import httpx

from gateway.sim.faults import FaultConfig
from gateway.testing.servers import gateway, sim_engines

CHAT = "/v1/chat/completions"
BODY = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_refused_and_timed_out_engines_are_named_by_replica_id() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(
            engines,
            timeouts={"response_headers_s": 0.3},
            health={"interval_s": 60},
            models={"discover": True},
        ) as gw,
    ):
        address = f"{engines[0].host}:{engines[0].port}"
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            assert (await http.get("/v1/models")).status_code == 200  # pools a connection
            await engines[0].set_faults(FaultConfig(slow=2.0))
            resp = await http.post(CHAT, json=BODY)
            assert resp.status_code == 504
            message = resp.json()["error"]["message"]
            assert (
                "replica e0" in message and address not in message and "/v1/models" not in message
            )
            await engines[0].set_faults(FaultConfig(refuse=True))
            resp = await http.post(CHAT, json=BODY)
            assert resp.status_code == 502, resp.text
            message = resp.json()["error"]["message"]
            assert "replica e0" in message and address not in message and "127.0.0.1" not in message
