"""`ClientGuard`'s per-address count is released on every way a connection ends, and the
guard handed to a worker process keeps its limits but not the parent's counts."""

from __future__ import annotations

import asyncio
import pickle

import httpx

from gateway.protocol import ClientGuard, guarded_protocol
from gateway.testing.servers import gateway, sim_engines


def test_a_pickled_guard_keeps_limits_and_forgets_counts() -> None:
    guard = ClientGuard(1.5, 7.0, 3, per_ip={"10.0.0.1": 2})
    copy = pickle.loads(pickle.dumps(guard))
    assert (copy.header_timeout_s, copy.body_timeout_s, copy.max_connections_per_ip) == (
        1.5,
        7.0,
        3,
    )
    assert copy.per_ip == {} and guard.per_ip == {"10.0.0.1": 2}


def test_each_factory_has_its_own_guard() -> None:
    a, b = guarded_protocol(max_connections_per_ip=2), guarded_protocol(max_connections_per_ip=2)
    assert a.keywords["guard"] is not b.keywords["guard"]  # type: ignore[attr-defined]


async def test_the_count_returns_to_zero_whatever_ends_the_connection() -> None:
    server = {"header_timeout_s": 0.3, "body_timeout_s": 0.3, "max_connections_per_ip": 3}
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, server=server, health={"interval_s": 60}) as gw,
    ):
        guard: ClientGuard = gw.server._server.config.http.keywords["guard"]  # type: ignore[attr-defined]
        host, port = gw.server.host, gw.server.port
        # 1: a client that connects and hangs up at once.
        _, w = await asyncio.open_connection(host, port)
        w.close()
        await w.wait_closed()
        # 2: one cut off by the header deadline.
        r2, w2 = await asyncio.open_connection(host, port)
        w2.write(b"GET /health HTTP/1.1\r\n")
        await w2.drain()
        assert await asyncio.wait_for(r2.read(), 3) is not None
        w2.close()
        # 3: one refused over the cap, while three are held open.
        held = [await asyncio.open_connection(host, port) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert sum(guard.per_ip.values()) == 3
        r4, w4 = await asyncio.open_connection(host, port)
        await asyncio.wait_for(r4.read(), 3)
        w4.close()
        for _, w in held:
            w.close()
        # 4: ordinary keep-alive requests, then the client closes.
        async with httpx.AsyncClient(base_url=gw.url) as http:
            for _ in range(3):
                assert (await http.get("/health")).status_code == 200
        for _ in range(50):
            if not guard.per_ip:
                break
            await asyncio.sleep(0.02)
        assert guard.per_ip == {}
