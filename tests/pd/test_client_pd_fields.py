"""A client's own PD hand-off fields never reach an engine (issue 19, defect 7): with them a
client made the simulated engine connect to an address of its choosing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.pd.decision import without_client_pd_fields
from gateway.serving import start_server
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
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


# -- issue 44 item 7 / issue 47 item 11: every engine-steering field, on every route --------

STEERING = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"},
    "ec_transfer_params": {"consumer_zmq": "tcp://10.9.9.9:1"},
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 1,
    "bootstrap_room": 7,
    "bootstrap_pair_key": "k",
    "routed_dp_rank": 1,
    "data_parallel_rank": 1,
    "disagg_prefill_dp_rank": 1,
}
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/embeddings": {"input": "hi"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/pooling": {"input": "hi"},
}


class Recorder:
    """ASGI wrapper around a sim engine: what each request that reached it carried."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, dict[str, Any], list[tuple[bytes, bytes]]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        self.seen.append((scope["path"], json.loads(raw), list(scope["headers"])))
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@pytest.mark.parametrize("allowed", [False, True])
async def test_every_steering_field_and_header_is_stripped_on_every_route(allowed: bool) -> None:
    engine = SimEngine(PROFILES["instant"], index=0)
    recorder = Recorder(engine.app)
    engine.server = await start_server(recorder, "127.0.0.1", 0)
    try:
        async with (
            gateway(
                [engine],
                pd={"allow_client_fields": allowed},
                health={"interval_s": 60},
                models={"discover": False},
            ) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            for path, body in ROUTES.items():
                await http.post(
                    path,
                    json={"model": "kvgate-sim", **body, **STEERING},
                    headers={"X-data-parallel-rank": "1"},
                )
    finally:
        await engine.stop()
    assert {path for path, _, _ in recorder.seen} == set(ROUTES)
    for path, body, headers in recorder.seen:
        names = {name for name, _ in headers}
        if allowed:
            assert STEERING.keys() <= body.keys(), path
            assert b"x-data-parallel-rank" in names, path
        else:
            assert not STEERING.keys() & body.keys(), (path, body)
            assert b"x-data-parallel-rank" not in names, path
            assert body["model"] == "kvgate-sim"


def test_the_stripped_fields_are_the_engines_steering_fields() -> None:
    assert without_client_pd_fields({"model": "m", **STEERING}) == {"model": "m"}
