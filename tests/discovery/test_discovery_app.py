"""A gateway whose replicas come only from DNS: simulated engines join and leave live."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import openai

from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, sim_engines
from tests.discovery.dns_server import Zone, dns_server

NAME = "_http._tcp.sim.test"


def publish(zone: Zone, engines: list[SimEngine]) -> None:
    with zone.lock:
        zone.srv[NAME] = [(f"e{e.index}.sim.test", urlsplit(e.url).port or 0) for e in engines]
        for e in engines:
            zone.a[f"e{e.index}.sim.test"] = ["127.0.0.1"]


async def wait_for(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_engines_join_and_leave_without_a_restart() -> None:
    zone = Zone()
    async with sim_engines(3, profile="instant") as engines:
        publish(zone, engines[:2])
        with dns_server(zone) as ns:
            discovery = {
                "dns": [{"name": NAME}],
                "nameservers": [ns],
                "interval_s": 0.1,
                "remove_after": 1,
            }
            async with gateway(engines, replicas=[], discovery=discovery) as gw:
                cluster = gw.state.cluster
                # The first resolution ran before the gateway took traffic.
                assert sorted(cluster.members) == [
                    f"e0.sim.test:{urlsplit(engines[0].url).port}",
                    f"e1.sim.test:{urlsplit(engines[1].url).port}",
                ]
                async with openai.AsyncOpenAI(
                    base_url=gw.url + "/v1", api_key="-", max_retries=0
                ) as client:

                    async def served_by(round_: int) -> set[str]:
                        # New sessions each round: placed ones stay where they are (sticky).
                        seen = set()
                        for i in range(32):
                            raw = await client.chat.completions.with_raw_response.create(
                                model="kvgate-sim",
                                max_tokens=2,
                                messages=[{"role": "user", "content": f"hello {i}"}],
                                extra_headers={"X-Session-Id": f"r{round_}-s{i}"},
                            )
                            seen.add(raw.headers["x-kvgate-replica"].partition(".")[0])
                        return seen

                    assert await served_by(0) == {"e0", "e1"}
                    publish(zone, engines)
                    await wait_for(lambda: len(cluster.members) == 3)
                    assert await served_by(1) == {"e0", "e1", "e2"}
                    publish(zone, engines[1:])
                    with zone.lock:
                        del zone.a["e0.sim.test"]
                    await wait_for(lambda: len(cluster.members) == 2)
                    assert await served_by(2) == {"e1", "e2"}
                    async with httpx.AsyncClient() as http:
                        metrics = (await http.get(gw.url + "/metrics")).text
                    assert f'kvgate_discovery_replicas{{target="{NAME}"}} 2.0' in metrics


async def test_no_embedded_engines_when_dns_names_none() -> None:
    with dns_server(Zone()) as ns:
        discovery = {"dns": [{"name": NAME}], "nameservers": [ns]}
        async with gateway([], replicas=[], discovery=discovery) as gw:
            assert not gw.state.cluster.members and "sim" not in gw.state.extras
            async with httpx.AsyncClient() as http:
                ready = await http.get(gw.url + "/ready")
            assert ready.status_code == 503 and ready.json()["healthy_replicas"] == 0
