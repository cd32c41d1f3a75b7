"""A client's own PD hand-off fields never reach an engine (issue 19, defect 7): with them a
client made the simulated engine connect to an address of its choosing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.pd.decision import without_client_pd_fields
from gateway.testing.servers import gateway, sim_engines


@contextlib.asynccontextmanager
async def _listener() -> AsyncIterator[tuple[int, list[int]]]:
    """A port the client would like the engine to reach, and the connections it got."""
    seen: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()


def _body(port: int) -> dict[str, object]:
    return {
        "model": "kvgate-sim",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_request_id": "x",
        },
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": 7,
    }


@pytest.mark.parametrize("allowed", [False, True])
async def test_client_pd_fields_are_stripped_unless_allowed(allowed: bool) -> None:
    async with (
        _listener() as (port, seen),
        sim_engines(1, "tiny") as engines,
        gateway(engines, pd={"allow_client_fields": allowed}, health={"interval_s": 60}) as gw,
    ):
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            resp = await http.post("/v1/chat/completions", json=_body(port))
        assert resp.status_code == 200, resp.text
        record = engines[0].request_log[-1]
        if allowed:
            assert record.pd == "decode" and seen
        else:
            assert record.pd is None and not seen


def test_stripping_leaves_other_bodies_alone() -> None:
    assert without_client_pd_fields({"model": "m", "messages": []}) is None
    stripped = without_client_pd_fields(
        {"model": "m", "bootstrap_room": 1, "bootstrap_port": 2, "bootstrap_host": "h"}
    )
    assert stripped == {"model": "m"}
