"""OpenTelemetry spans of proxied requests, read back with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.errors import ConfigError
from gateway.sim.faults import FaultConfig
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.traceparent import parse
from gateway.tracing.spans import Tracing

MODEL = "kvgate-sim"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{TRACE}-{CALLER_SPAN}-01"
TRACED = {"enabled": True, "exporter": "none"}


@contextlib.asynccontextmanager
async def traced_gateway(
    engines: Sequence[SimEngine], **settings: Any
) -> AsyncIterator[tuple[RunningGateway, InMemorySpanExporter]]:
    settings.setdefault("models", {"discover": False})
    async with gateway(engines, tracing=TRACED, **settings) as gw:
        exporter = InMemorySpanExporter()
        tracing = gw.state.extras["tracing"]
        assert isinstance(tracing, Tracing)
        tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
        yield gw, exporter


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def hex_span(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)


async def test_a_stream_makes_request_route_upstream_and_first_token_spans() -> None:
    async with sim_engines(2, "tiny") as engines, traced_gateway(engines) as (gw, exporter):
        async with client(gw) as c:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "tell me"}],
                max_tokens=6,
                stream=True,
                extra_headers={"traceparent": CALLER, "x-request-id": "r-1"},
            )
            async for _ in stream:
                pass
        spans = by_name(exporter.get_finished_spans())
    [request] = spans["kvgate.request"]
    [route] = spans["kvgate.route"]
    [upstream] = spans["kvgate.upstream"]
    [first] = spans["kvgate.first_token"]
    assert "kvgate.admission.queue" not in spans  # nothing waited
    # One trace, the caller's; the request span hangs under the caller's span.
    for span in (request, route, upstream, first):
        assert f"{span.context.trace_id:032x}" == TRACE
    assert request.parent is not None and f"{request.parent.span_id:016x}" == CALLER_SPAN
    for span in (route, upstream, first):
        assert span.parent is not None and span.parent.span_id == request.context.span_id
    replica = request.attributes["kvgate.replica"]
    assert replica in ("e0", "e1")
    assert route.attributes["kvgate.replica"] == replica
    assert route.attributes["kvgate.policy"] and route.attributes["kvgate.reason"]
    assert upstream.attributes["kvgate.replica"] == replica
    assert upstream.attributes["http.response.status_code"] == 200
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["kvgate.request_id"] == "r-1"
    # Time order: route, then the attempt, then the first token, all inside the request.
    assert request.start_time <= route.start_time <= route.end_time <= upstream.start_time
    assert upstream.end_time <= first.end_time <= request.end_time
    assert first.start_time == upstream.end_time
    # The engine's parent is the attempt's span.
    engine = next(e for e in engines if f"e{e.index}" == replica)
    [(_, traceparent, _)] = [t for t in engine.trace_contexts if t[0] == "r-1"]
    got = parse(traceparent.encode() if traceparent else None)
    assert got is not None and got.trace_id.decode() == TRACE
    assert got.parent_id.decode() == hex_span(upstream)


async def test_a_failover_is_two_upstream_spans_the_first_failed() -> None:
    async with sim_engines(2, "instant") as engines:
        await engines[0].set_faults(FaultConfig(error=503))
        async with traced_gateway(
            engines,
            routing={"policy": "round_robin"},
            health={"passive": False},
        ) as (gw, exporter):
            async with client(gw) as c:
                for i in range(2):  # round robin: one of the two starts on e0
                    await c.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"x{i}"}],
                        max_tokens=2,
                        extra_headers={"x-request-id": f"f-{i}"},
                    )
            spans = exporter.get_finished_spans()
    failed_over = [
        s for s in spans if s.name == "kvgate.request" and s.attributes["kvgate.retries"] == 1
    ]
    [request] = failed_over
    trace_id = request.context.trace_id
    attempts = sorted(
        (s for s in spans if s.name == "kvgate.upstream" and s.context.trace_id == trace_id),
        key=lambda s: s.attributes["kvgate.attempt"],
    )
    assert [a.attributes["kvgate.replica"] for a in attempts] == ["e0", "e1"]
    assert attempts[0].attributes["http.response.status_code"] == 503
    assert not attempts[0].status.is_ok and attempts[1].status.is_ok
    assert request.attributes["kvgate.replica"] == "e1"
    # A new trace (no caller context): the request span is its root, sampled.
    assert request.parent is None and request.context.trace_flags.sampled
    sent = [
        tp
        for e in engines
        for rid, tp, _ in e.trace_contexts
        if rid == request.attributes["kvgate.request_id"]
    ]
    assert sorted(
        p.parent_id.decode() for p in map(parse, (s.encode() for s in sent if s)) if p
    ) == sorted(hex_span(a) for a in attempts)


async def test_a_request_that_waits_in_admission_has_a_queue_span() -> None:
    slow = PROFILES["tiny"].scaled(decode_base_s=0.02, max_num_seqs=4)
    engine = SimEngine(slow, index=0)
    await engine.start()
    admission = {
        "enabled": True,
        "saturation": {"max_inflight": 1, "max_waiting": None, "max_kv_usage": None},
        "max_wait_s": 10.0,
        "recheck_interval_s": 0.02,
    }
    try:
        async with traced_gateway([engine], admission=admission) as (gw, exporter):
            async with client(gw) as c:
                await asyncio.gather(
                    *(
                        c.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": f"q{i}"}],
                            max_tokens=10,
                            extra_headers={"x-priority": "default"},
                        )
                        for i in range(2)
                    )
                )
            spans = by_name(exporter.get_finished_spans())
    finally:
        await engine.stop()
    [queued] = spans["kvgate.admission.queue"]
    assert queued.attributes["kvgate.outcome"] == "released"
    assert queued.attributes["kvgate.replica"] == "e0"
    assert queued.attributes["kvgate.priority_class"] == "default"
    assert queued.end_time - queued.start_time > 50_000_000  # waited for the other (~0.2 s)
    parent = next(s for s in spans["kvgate.request"] if s.context.span_id == queued.parent.span_id)  # type: ignore[union-attr]
    route = next(s for s in spans["kvgate.route"] if s.parent.span_id == parent.context.span_id)  # type: ignore[union-attr]
    assert route.end_time <= queued.start_time


@pytest.mark.parametrize("exporter", ["console", "otlp"])
def test_exporters_build_from_settings_and_the_otel_environment(
    exporter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.tracing.config import TracingSettings
    from gateway.tracing.spans import make_provider

    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-under-test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    if exporter == "otlp" and _otlp_protos_shadowed():
        # One `pip install '.[test]'` into a new environment can install xds-protos last:
        # then the exporter cannot work, and the gateway must say why and how to mend it.
        with pytest.raises(ConfigError, match="force-reinstall --no-deps opentelemetry-proto"):
            make_provider(TracingSettings(enabled=True, exporter="otlp"))
        return
    provider = make_provider(TracingSettings(enabled=True, exporter=exporter))  # type: ignore[arg-type]
    try:
        assert provider.resource.attributes["service.name"] == "gw-under-test"
    finally:
        provider.shutdown()
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    provider = make_provider(TracingSettings(enabled=True, exporter="none"))
    assert provider.resource.attributes["service.name"] == "kvgate"
    named = make_provider(TracingSettings(enabled=True, exporter="none", service_name="edge"))
    assert named.resource.attributes["service.name"] == "edge"


async def test_a_request_that_failed_on_every_attempt_reports_its_retries() -> None:
    """Three attempts, all 503: the outcome and the request span say 2 retries, not 0."""
    seen: list[int] = []
    async with sim_engines(3, "instant") as engines:
        for engine in engines:
            await engine.set_faults(FaultConfig(error=503))
        async with traced_gateway(engines, health={"passive": False}) as (gw, exporter):
            gw.state.observers.append(lambda outcome: seen.append(outcome.retries))
            async with client(gw) as c:
                with pytest.raises(openai.APIStatusError) as failed:
                    await c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
                    )
            spans = exporter.get_finished_spans()
    assert failed.value.status_code in (502, 503)
    [request] = [s for s in spans if s.name == "kvgate.request"]
    assert request.attributes["kvgate.retries"] == 2
    assert seen == [2]


async def test_a_traced_upload_reaches_the_engine_whole() -> None:
    """With tracing on, a multipart upload is forwarded as the client sent it (it once took
    the traced branch, which built the payload from the empty JSON body)."""
    audio = bytes(range(256)) * 4096
    async with sim_engines(1, "instant") as engines, traced_gateway(engines) as (gw, exporter):
        async with client(gw) as c:
            raw = await c.audio.transcriptions.with_raw_response.create(
                model=MODEL, file=("talk.wav", audio, "audio/wav")
            )
        assert raw.parse().text == f"simulated transcript of {len(audio)} bytes"
        assert [size for _, size in engines[0].uploads] == [len(audio)]
        spans = by_name(exporter.get_finished_spans())
    [upstream] = spans["kvgate.upstream"]
    assert upstream.attributes["http.response.status_code"] == 200


def _otlp_protos_shadowed() -> bool:
    from opentelemetry.proto.common.v1 import common_pb2

    return not hasattr(common_pb2, "InstrumentationScope")


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (ImportError("cannot import name 'InstrumentationScope'"), "force-reinstall --no-deps"),
        (ModuleNotFoundError("gone", name="opentelemetry.proto.trace.v1"), "force-reinstall"),
        (ModuleNotFoundError("gone", name="opentelemetry.exporter"), "kvgate[otel]"),
    ],
)
def test_an_otlp_exporter_that_does_not_import_is_a_config_error_naming_the_fix(
    failure: ImportError, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    from gateway.tracing.config import TracingSettings
    from gateway.tracing.spans import make_provider

    real_import = builtins.__import__

    def failing(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("opentelemetry.exporter.otlp"):
            raise failure
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", failing)
    with pytest.raises(ConfigError, match=re.escape(says)):
        make_provider(TracingSettings(enabled=True, exporter="otlp"))
