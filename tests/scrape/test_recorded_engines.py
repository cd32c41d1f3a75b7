"""The quiet rule over the `/metrics` the real engines expose.

The series vLLM 0.33 and SGLang 0.5.23 register (names, kinds, label names: recorded from
their wheels in tests/fixtures/engines/) are rendered as an exposition with the values of
an idle engine, and of a busy one, served over HTTP and read by the gateway's scraper: an
idle recorded engine counts as quiet (read every `idle_interval_s`, its load fresh that much
longer), one with a request running or waiting does not.
"""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.scrape.config import EngineKind
from gateway.serving import RunningServer, start_server
from gateway.types import ReplicaId, ReplicaState
from tests.kvevents.engine_fixtures import SGLANG, VLLM, load

# The queue gauges each engine's dialect reads (gateway.scrape.adapters).
QUEUES = {
    VLLM: ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    SGLANG: ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}
KINDS = {VLLM: EngineKind.VLLM, SGLANG: EngineKind.SGLANG}


def label_names(series: dict[str, Any]) -> list[str]:
    """The recorded label names; a few series record only their source, a literal list."""
    if "labels" in series:
        return list(series["labels"])
    try:
        names = ast.literal_eval(series["labelnames_source"])
    except (ValueError, SyntaxError):
        return []
    return [str(n) for n in names]


def label_values(series: dict[str, Any]) -> str:
    values = {k: "0" for k in label_names(series)}
    values.update({k: "m" for k in ("model_name",) if k in values})
    if series["name"] == "vllm:cache_config_info":
        values = {k: "None" for k in label_names(series)}
        values.update(engine="0", num_gpu_blocks="1000", block_size="16")
    return ",".join(f'{k}="{v}"' for k, v in values.items())


def exposition(engine: str, running: int, waiting: int) -> str:
    """Every recorded series, in the text format prometheus-client writes for its kind."""
    lines: list[str] = []
    running_name, waiting_name = QUEUES[engine]
    for s in load(engine, "metrics.json")["series"]:
        name, kind, labels = s["name"], s["kind"].lower(), label_values(s)
        base = name.removesuffix("_total")
        sep = "," if labels else ""
        lines.append(f"# TYPE {base if kind == 'counter' else name} {kind}")
        if kind == "counter":
            lines.append(f"{base}_total{{{labels}}} 0.0")
            lines.append(f"{base}_created{{{labels}}} 1.7e9")
        elif kind in ("histogram", "gaugehistogram"):
            lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} 0.0')
            if kind == "histogram":
                lines += [f"{name}_count{{{labels}}} 0.0", f"{name}_sum{{{labels}}} 0.0"]
            else:
                lines += [f"{name}_gcount{{{labels}}} 0.0", f"{name}_gsum{{{labels}}} 0.0"]
        elif kind == "summary":
            lines += [f"{name}_count{{{labels}}} 0.0", f"{name}_sum{{{labels}}} 0.0"]
        else:
            value = {running_name: running, waiting_name: waiting}.get(name, 0)
            lines.append(f"{name}{{{labels}}} {float(value)}")
    return "\n".join(lines) + "\n"


class Engine:
    """Serves one exposition at /metrics; `text` can be swapped between reads."""

    def __init__(self) -> None:
        self.text = ""

        async def metrics(_request: Request) -> Response:
            return Response(self.text, media_type="text/plain; version=0.0.4")

        self.app = Starlette(routes=[Route("/metrics", metrics)])


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, RunningServer]]:
    e = Engine()
    server = await start_server(e.app)
    try:
        yield e, server
    finally:
        await server.stop()


@pytest.mark.parametrize("recorded", [VLLM, SGLANG])
async def test_an_idle_recorded_engine_is_quiet_and_a_busy_one_is_not(
    recorded: str, engine: tuple[Engine, RunningServer]
) -> None:
    e, server = engine
    settings = ScrapeSettings(interval_s=0.25, idle_interval_s=5.0)
    target = ReplicaState(ReplicaId("e0"), server.url)
    scraper = MetricsScraper(settings, lambda: [target], in_flight={})
    await scraper.start()
    try:
        e.text = exposition(recorded, running=0, waiting=0)
        idle = await scraper.scrape_once(target)
        assert idle is not None and scraper.kinds[target.id] is KINDS[recorded]
        assert idle.waiting == 0 and idle.running == 0
        assert idle.grace_s == settings.quiet_grace_s > 0  # read every idle_interval_s
        for running, waiting in ((1, 0), (0, 2), (3, 4)):
            e.text = exposition(recorded, running=running, waiting=waiting)
            busy = await scraper.scrape_once(target)
            assert busy is not None and (busy.running, busy.waiting) == (running, waiting)
            assert busy.grace_s == 0.0  # read every interval_s
    finally:
        await scraper.stop()
