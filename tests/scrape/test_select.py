"""Selective scrapes (`name[]`) against `/metrics` served as the engines serve it.

vLLM (`vllm/entrypoints/serve/instrumentator/metrics.py`) answers `GET /metrics` with
prometheus-fastapi-instrumentator's handler (the whole registry; the query ignored) and
mounts prometheus-client's ASGI app for the paths under it, behind a path pattern; its
registry (one API server) is prometheus-client's global kind, whose collectors are known by
name. SGLang mounts the same app the same way over a multiprocess collector, known by no
name. Both are built here from the real library with the series vLLM 0.33 and SGLang 0.5.23
register (tests/fixtures/engines), served by uvicorn on loopback, and read by the gateway's
scraper. SGLang's runs in a subprocess: multiprocess values are chosen when prometheus-client
is imported, by an environment variable.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_asgi_app,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.scrape.adapters import read_samples_of
from gateway.scrape.config import EngineKind
from gateway.scrape.select import SeriesSelection, selective_query
from gateway.serving import RunningServer, start_server
from gateway.testing.servers import sim_engines
from gateway.types import ReplicaId, ReplicaState
from tests.kvevents.engine_fixtures import SGLANG, VLLM, load

ASGI = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_registry(running: int, waiting: int) -> CollectorRegistry:
    """Every series vLLM 0.33 registers, as real prometheus-client metrics."""
    registry = CollectorRegistry(auto_describe=True)
    for s in load(VLLM, "metrics.json")["series"]:
        labels = list(s.get("labels") or [])
        if s["name"] == "vllm:cache_config_info":
            labels = ["num_gpu_blocks", "block_size", "engine"]
        kind = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[s["kind"]]
        metric: Any = kind(s["name"], "recorded", labels, registry=registry)
        values = {k: {"model_name": MODEL, "engine": "0"}.get(k, "x") for k in labels}
        if s["name"] == "vllm:cache_config_info":
            values = {"num_gpu_blocks": "1000", "block_size": "16", "engine": "0"}
        child = metric.labels(**values) if labels else metric
        value = {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting}
        if kind is Gauge:
            child.set(value.get(s["name"], 1.0 if "info" in s["name"] else 0.25))
        elif kind is Counter:
            child.inc(100)
        else:
            child.observe(0.5)
    return registry


def vllm_routes(registry: CollectorRegistry) -> Starlette:
    """vLLM's two `/metrics` routes, in its order: the instrumentator's handler for the
    path itself (what it does: the whole registry, whatever the query), then
    prometheus-client's app for every path under it."""

    async def instrumentator(_request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    mount = Mount("/metrics", app=make_asgi_app(registry=registry))
    mount.path_regex = re.compile("^/metrics(?P<path>.*)$")  # vLLM's redirect workaround
    return Starlette(routes=[Route("/metrics", instrumentator), mount])


class Recorded:
    """An engine app, recording each request's path and query and its body size."""

    def __init__(self, app: ASGI) -> None:
        self.app = app
        self.queries: list[str] = []  # "path?query"
        self.sizes: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.queries.append(f"{scope['path']}?{scope['query_string'].decode()}")

        async def counting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                self.sizes.append(len(message.get("body", b"")))
            await send(message)

        await self.app(scope, receive, counting)


@pytest.fixture
async def vllm_engine() -> AsyncIterator[tuple[Recorded, RunningServer]]:
    recorded = Recorded(vllm_routes(vllm_registry(running=3, waiting=2)))
    server = await start_server(recorded, lifespan="off")
    try:
        yield recorded, server
    finally:
        await server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SGLANG_SERVER = textwrap.dedent(
    """
    import json, sys
    import uvicorn
    from prometheus_client import CollectorRegistry, Gauge, make_asgi_app, multiprocess

    series, port = json.loads(sys.argv[1]), int(sys.argv[2])
    values = {"sglang:num_running_reqs": 3, "sglang:num_queue_reqs": 2, "sglang:token_usage": 0.5}
    for s in series:
        if s["kind"] != "Gauge" or not s.get("labels"):
            continue
        g = Gauge(s["name"], "recorded", s["labels"], multiprocess_mode="mostrecent")
        g.labels(**{k: "0" for k in s["labels"]}).set(values.get(s["name"], 0.0))
    registry = CollectorRegistry()  # as SGLang's add_prometheus_middleware builds it
    multiprocess.MultiProcessCollector(registry)
    uvicorn.run(make_asgi_app(registry=registry), host="127.0.0.1", port=port,
                log_level="warning", lifespan="off")
    """
)


@pytest.fixture
def sglang_engine(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    (tmp_path / "values").mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "values")}
    series = json.dumps(load(SGLANG, "metrics.json")["series"])
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SGLANG_SERVER, series, str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(url + "/metrics", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def scraper_for(
    url: str, *, polled: bool = True, **settings: Any
) -> tuple[MetricsScraper, ReplicaState]:
    """A started scraper of one replica (read in the background too when `polled`)."""
    target = ReplicaState(ReplicaId("e0"), url)
    targets = [target] if polled else []
    scraper = MetricsScraper(ScrapeSettings(**settings), lambda: targets, in_flight={})
    await scraper.start()
    return scraper, target


async def test_vllm_is_read_whole_once_then_only_for_the_series_kvgate_reads(
    vllm_engine: tuple[Recorded, RunningServer],
) -> None:
    recorded, server = vllm_engine
    scraper, target = await scraper_for(server.url)
    try:
        loads = [await scraper.scrape_once(target) for _ in range(3)]
    finally:
        await scraper.stop()
    assert all(load is not None and (load.running, load.waiting) == (3, 2) for load in loads)
    assert loads[-1] is not None and loads[-1].kv_usage == 0.25
    # Whole reads until one is done (the poll loop's and the first here may overlap), then
    # every read selective, at the path prometheus-client's app serves.
    selective = "/metrics/?" + selective_query(read_samples_of(EngineKind.VLLM))
    first = recorded.queries.index(selective)
    assert 1 <= first <= 2 and set(recorded.queries[:first]) == {"/metrics?"}
    assert set(recorded.queries[first:]) == {selective}
    last = recorded.sizes[-1]
    whole = len(
        (await asyncio.to_thread(httpx.get, server.url + "/metrics")).content
    )  # the whole exposition, for scale
    assert last * 10 < whole, (recorded.sizes, whole)


async def test_the_answer_to_a_selective_read_is_what_the_readers_use(
    vllm_engine: tuple[Recorded, RunningServer],
) -> None:
    _, server = vllm_engine
    names = read_samples_of(EngineKind.VLLM)
    async with httpx.AsyncClient() as client:
        whole = (await client.get(server.url + "/metrics")).text
        ignored = (await client.get(server.url + "/metrics?" + selective_query(names))).text
        selected = (await client.get(server.url + "/metrics/?" + selective_query(names))).text
    assert ignored == whole  # the instrumentator's handler answers whole
    samples = {
        line.split("{")[0].split(" ")[0] for line in selected.splitlines() if line[:1] != "#"
    }
    present = {n for n in names if f"\n{n}{{" in "\n" + whole}
    assert samples == present and "vllm:num_requests_running" in samples


async def test_sglang_answers_a_selective_read_with_nothing_and_is_read_whole(
    sglang_engine: str,
) -> None:
    names = read_samples_of(EngineKind.SGLANG)
    async with httpx.AsyncClient() as client:
        selected = await client.get(sglang_engine + "/metrics/?" + selective_query(names))
    # The premise, from prometheus-client itself: a multiprocess registry selects nothing.
    assert selected.status_code == 200 and selected.content == b""
    scraper, target = await scraper_for(sglang_engine)
    try:
        loads = [await scraper.scrape_once(target) for _ in range(3)]
    finally:
        await scraper.stop()
    assert all(load is not None and (load.running, load.waiting) == (3, 2) for load in loads)
    assert all(load is not None and load.kv_usage == 0.5 for load in loads)
    assert scraper.selection.url(target.id, "/metrics") == ("/metrics", False)


async def test_with_select_series_off_every_read_is_whole(
    vllm_engine: tuple[Recorded, RunningServer],
) -> None:
    recorded, server = vllm_engine
    scraper, target = await scraper_for(server.url, select_series=False)
    try:
        for _ in range(3):
            assert await scraper.scrape_once(target) is not None
    finally:
        await scraper.stop()
    assert set(recorded.queries) == {"/metrics?"}


@pytest.mark.parametrize(
    ("flavor", "kind", "selective"),
    [("vllm", EngineKind.VLLM, True), ("sglang", EngineKind.SGLANG, False)],
)
async def test_the_simulated_engines_select_as_their_flavours_do(
    flavor: str, kind: EngineKind, selective: bool
) -> None:
    async with sim_engines(1, "instant", flavor=flavor) as engines:
        for engine in engines:
            scraper, target = await scraper_for(engine.url)
            try:
                for _ in range(3):
                    load = await scraper.scrape_once(target)
                    assert load is not None and load.engine
            finally:
                await scraper.stop()
            assert scraper.kinds[target.id] is kind
            assert scraper.selection.url(target.id, "/m")[1] is selective


def test_an_engine_that_changed_is_learnt_anew_and_one_that_answers_short_is_read_whole() -> None:
    selection = SeriesSelection()
    r = ReplicaId("e0")
    assert selection.url(r, "/metrics") == ("/metrics", False)  # first read: whole
    selection.read_whole(r, EngineKind.VLLM, frozenset({"vllm:a", "vllm:b"}))
    url, selective = selection.url(r, "/metrics")
    assert selective and url.startswith("/metrics/?name%5B%5D=vllm%3A")
    assert selection.url(r, "/metrics?x=1")[0].startswith("/metrics?x=1&name%5B%5D=")
    assert selection.complete(r, frozenset({"vllm:a", "vllm:b"}))
    assert not selection.complete(r, frozenset({"vllm:a"}))
    # A restart dropped `vllm:b` from the engine: the whole read lacks it too. Keep selecting.
    selection.fell_short(r, EngineKind.VLLM, frozenset({"vllm:a"}), frozenset({"vllm:a"}))
    assert selection.url(r, "/metrics")[1] and selection.complete(r, frozenset({"vllm:a"}))
    # The selective answer lacks what the whole one has: read whole from now on.
    selection.fell_short(r, EngineKind.VLLM, frozenset(), frozenset({"vllm:a"}))
    assert selection.url(r, "/metrics") == ("/metrics", False)
    selection.read_whole(r, EngineKind.VLLM, frozenset({"vllm:a"}))
    assert selection.url(r, "/metrics") == ("/metrics", False)
    selection.forget(r)  # left the fleet: a new engine under the id starts afresh
    selection.read_whole(r, EngineKind.VLLM, frozenset({"vllm:a"}))
    assert selection.url(r, "/metrics")[1]


@pytest.mark.parametrize("refusal", [404, 307, 400])
async def test_a_server_that_refuses_the_query_is_read_whole_and_a_5xx_is_not_read_twice(
    refusal: int,
) -> None:
    """404: a server with no route under `/metrics` (TGI); 307: one that redirects it to
    `/metrics` (Starlette's default for a route without the slash); 400: one that refuses
    the query."""
    text = "vllm:num_requests_running 1.0\nvllm:num_requests_waiting 4.0\n"
    seen: list[str] = []
    failing = False

    async def metrics(request: Request) -> Response:
        seen.append(request.url.query)
        if failing:
            return Response(status_code=503)
        if request.url.query or request.url.path.endswith("/"):
            return Response("no", status_code=refusal)
        return Response(text)

    routes = [Route("/metrics", metrics)]
    if refusal == 400:
        routes.append(Route("/metrics/", metrics))
    app = Starlette(routes=routes)
    app.router.redirect_slashes = refusal == 307
    server = await start_server(app)
    scraper, target = await scraper_for(server.url, polled=False)
    try:
        for _ in range(3):
            load = await scraper.scrape_once(target)
            assert load is not None and (load.running, load.waiting) == (1, 4)
        # Whole, then the refused selective read (it reaches this handler only for the
        # 400) and a whole one at once, then whole.
        assert len([q for q in seen if q]) == (1 if refusal == 400 else 0)
        assert len(seen) == (4 if refusal == 400 else 3)
        assert scraper.selection.url(target.id, "/m") == ("/m", False)
        if refusal == 400:
            # A new engine under the id, read selectively, that fails with a 5xx: one read
            # per scrape, not a whole read after it.
            scraper.selection.forget(target.id)
            scraper.selection.read_whole(target.id, EngineKind.VLLM, frozenset({"x"}))
            failing = True
            seen.clear()
            assert await scraper.scrape_once(target) is None
            assert len(seen) == 1 and seen[0]
    finally:
        await scraper.stop()
        await server.stop()
