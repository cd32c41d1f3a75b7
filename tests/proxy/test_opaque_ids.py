"""A replica configured without an `id` never shows its address: an opaque stable id in
x-kvgate-replica, error messages and metric labels."""

from __future__ import annotations

import httpx

from gateway.settings import ReplicaSettings
from gateway.testing.process import free_port
from gateway.testing.servers import gateway, sim_engines

MODEL = "kvgate-sim"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_default_id_is_stable_and_opaque() -> None:
    a = ReplicaSettings(url="http://10.0.0.5:8000")
    assert a.id == ReplicaSettings(url="http://10.0.0.5:8000").id and a.id.startswith("r-")
    assert "10.0.0.5" not in a.id and "8000" not in a.id
    assert ReplicaSettings(url="http://10.0.0.6:8000").id != a.id
    assert ReplicaSettings(url="http://10.0.0.5:8000", id="gpu-1").id == "gpu-1"


async def test_no_address_in_headers_errors_or_metrics() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with sim_engines(1, "instant") as engines:
        live = engines[0].url
        replicas = [{"url": live, "models": [MODEL]}, {"url": dead, "models": [MODEL]}]
        async with (
            gateway(engines, replicas=replicas, models={"discover": False}) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            answers = [await http.post("/v1/chat/completions", json=CHAT) for _ in range(8)]
            metrics = (await http.get("/metrics")).text
        # Only the dead one: the client gets the gateway's own error about it.
        only_dead = [{"url": dead, "models": [MODEL]}]
        async with (
            gateway(engines, replicas=only_dead, models={"discover": False}) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            failed = await http.post("/v1/chat/completions", json=CHAT)
    assert failed.status_code >= 500
    served = [r for r in answers if r.status_code == 200]
    assert served and all(r.headers["x-kvgate-replica"].startswith("r-") for r in served)
    shown = " ".join([r.headers.get("x-kvgate-replica", "") + r.text for r in answers])
    shown += failed.text + metrics
    for url in (live, dead):
        assert url.removeprefix("http://") not in shown
