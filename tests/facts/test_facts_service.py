"""The engine facts service against an engine stand-in on loopback whose answers the test
changes: what it does with answers it cannot read, with replicas that leave, with a
listener that fails, and with a re-read that fails after a good one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.facts.read import EngineFacts, from_server_info, from_vllm
from gateway.facts.service import EngineFactsService
from gateway.serving import RunningServer, start_server
from gateway.types import ReplicaId

E = ReplicaId("e")
INFO = {"page_size": 16, "schedule_low_priority_values_first": False, "served_model_name": "m"}


class Engine:
    """Serves `/server_info` as `info` says: a JSON body, "garbage" (200, not JSON) or
    None (404); `/kv_event_sources` is always 404 (an SGLang engine)."""

    def __init__(self) -> None:
        self.info: Any = INFO
        self.headers: list[str | None] = []

    def app(self) -> Starlette:
        async def server_info(request: Request) -> Response:
            self.headers.append(request.headers.get("authorization"))
            if self.info is None:
                return PlainTextResponse("no", status_code=404)
            if self.info == "garbage":
                return PlainTextResponse("<html>")
            return JSONResponse(self.info)

        async def missing(request: Request) -> Response:
            return PlainTextResponse("no", status_code=404)

        return Starlette(
            routes=[Route("/server_info", server_info), Route("/kv_event_sources", missing)]
        )


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, RunningServer]]:
    e = Engine()
    server = await start_server(e.app())
    try:
        yield e, server
    finally:
        await server.stop()


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def test_an_unreadable_answer_is_retried_until_the_engine_describes_itself(
    engine: tuple[Engine, RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvgate.facts")
    e, server = engine
    e.info = "garbage"
    service = EngineFactsService(
        lambda: {E: server.url}, retry_s=0.05, headers={"authorization": "Bearer k"}
    )
    await service.start()
    try:
        await until(lambda: len(e.headers) >= 3)
        assert service.get(E) is None
        e.info = INFO
        await until(lambda: service.get(E) is not None)
        assert service.runs_higher_first(E) is True and service.reads == 1
        assert set(e.headers) == {"Bearer k"}  # the upstream's auth headers go along
        said = [r.getMessage() for r in caplog.records if "facts unknown" in r.getMessage()]
        assert len(said) == 1  # once per reason, not once per retry
    finally:
        await service.stop()


async def test_a_failing_listener_neither_stops_the_others_nor_the_reads(
    engine: tuple[Engine, RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    _, server = engine
    service = EngineFactsService(lambda: {E: server.url})
    heard: list[tuple[ReplicaId, str, EngineFacts]] = []

    def broken(replica: ReplicaId, url: str, facts: EngineFacts) -> None:
        raise RuntimeError("listener bug")

    service.listeners += [broken, lambda *args: heard.append(args)]
    await service.start()
    try:
        await until(lambda: bool(heard))
        assert heard[0][:2] == (E, server.url) and heard[0][2].page_size == 16
        assert any("listener failed" in r.getMessage() for r in caplog.records)
        service.readmitted(E)
        await until(lambda: len(heard) == 2)
    finally:
        await service.stop()


async def test_a_failed_re_read_keeps_the_old_facts_and_a_departed_replica_is_dropped(
    engine: tuple[Engine, RunningServer],
) -> None:
    e, server = engine
    members = {E: server.url}
    service = EngineFactsService(lambda: dict(members), retry_s=0.05)
    await service.start()
    try:
        await until(lambda: service.get(E) is not None)
        e.info = None
        asked = len(e.headers)
        service.readmitted(E)
        await until(lambda: len(e.headers) >= asked + 3)  # tried again and again
        assert service.get(E) is not None and service.get(E) == from_server_info(INFO)
        e.info = {**INFO, "page_size": 32}
        await until(lambda: (f := service.get(E)) is not None and f.page_size == 32)
        members.clear()
        service.wake()
        await until(lambda: service.get(E) is None)
        assert service.capacity(E) is None
    finally:
        await service.stop()
    await service.stop()  # stopping twice is harmless


def test_server_info_values_of_the_wrong_type_are_unknown_not_guessed() -> None:
    facts = from_server_info(
        {
            "page_size": True,
            "max_total_num_tokens": -5,
            "enable_metrics": "yes",
            "schedule_low_priority_values_first": 1,
            "model_path": "/models/m",
            "kv_events": "zmq",
        }
    )
    assert facts == EngineFacts("sglang", models=("/models/m",))
    assert from_vllm(None, None) == EngineFacts("vllm", runs_higher_first=False)
    cards = {"data": [{"id": "a"}, {"id": 3}, "b", {"object": "model"}]}
    assert from_vllm([], cards).models == ("a",)
