"""OpenTelemetry spans of proxied requests. Imported only with `tracing.enabled`, so the
gateway runs without the SDK installed.

Per request, under the caller's trace (its `traceparent`) or a new one:

    kvgate.request (server)          arrival -> last byte; replica, status, retries
      kvgate.route                   the router's choice: policy, reason, replica, ranked
      kvgate.admission.queue         only when it waited: class, replica, outcome
      kvgate.upstream (client) x N   one per attempt, send -> response headers; its span id
                                     is the parent the engine sees in `traceparent`
      kvgate.first_token             response headers -> first token event (streams)

The SDK is configured as usual: `OTEL_TRACES_SAMPLER`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`, `OTEL_SDK_DISABLED`. The
provider is the gateway's own, never the process-global one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from gateway.errors import ConfigError
from gateway.traceparent import TRACEPARENT, TRACESTATE, parse
from gateway.tracing.config import TracingSettings

RawHeaders = list[tuple[bytes, bytes]]
DEFAULT_SERVICE_NAME = "kvgate"


def _exporter(settings: TracingSettings) -> SpanExporter | None:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.exporter == "otlp":
        return _otlp_exporter(settings)
    return None


# xds-protos (the epp extra) ships its own, older copies of opentelemetry/proto/*: installed
# after opentelemetry-proto in one pip run, it overwrites the files the OTLP exporter
# imports, and which one pip installs last depends on what the environment held before.
_SHADOWED = (
    "tracing.exporter otlp: the OTLP exporter does not import ({error}). Its protobuf "
    "modules were most likely overwritten by xds-protos (the epp extra), which ships older "
    "copies of opentelemetry/proto/*; `pip install --force-reinstall --no-deps "
    "opentelemetry-proto` puts the exporter's own back (kvgate epp does not use those files)"
)
_MISSING = "tracing.exporter otlp needs the OTLP exporter: pip install 'kvgate[otel]' ({error})"


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and not (exc.name or "").startswith(
            "opentelemetry.proto"
        )
        raise ConfigError((_MISSING if missing else _SHADOWED).format(error=exc)) from exc
    return OTLPSpanExporter(endpoint=settings.endpoint)


def make_provider(settings: TracingSettings) -> TracerProvider:
    attributes = {"service.name": settings.service_name} if settings.service_name else {}
    resource = Resource.create(attributes)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    exporter = _exporter(settings)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def traceparent_of(span: Span) -> bytes:
    sc = span.get_span_context()
    return b"00-%032x-%016x-%02x" % (sc.trace_id, sc.span_id, sc.trace_flags)


def with_traceparent(headers: Sequence[tuple[bytes, bytes]], value: bytes) -> RawHeaders:
    return [h for h in headers if h[0] != TRACEPARENT] + [(TRACEPARENT, value)]


def _caller(headers: Sequence[tuple[bytes, bytes]], incoming: bytes | None) -> object | None:
    """The caller's span as the parent context, or None (a new trace)."""
    parent = parse(incoming)
    if parent is None:
        return None
    state = next((v for n, v in headers if n == TRACESTATE), None)
    sc = SpanContext(
        int(parent.trace_id, 16),
        int(parent.parent_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(parent.flags),
        trace_state=TraceState.from_header([state.decode("latin-1")]) if state else None,
    )
    return trace.set_span_in_context(NonRecordingSpan(sc))


class UpstreamSpan:
    """One attempt: started when it is sent, ending when the engine's headers arrived."""

    __slots__ = ("_ended", "_propagate", "headers_ns", "span")

    def __init__(self, span: Span, propagate: bool) -> None:
        self.span = span
        self.headers_ns: int | None = None
        self._ended = False
        self._propagate = propagate

    def headers(self, base: RawHeaders) -> RawHeaders:
        return with_traceparent(base, traceparent_of(self.span)) if self._propagate else base

    def mark_headers(self) -> None:
        self.headers_ns = time.time_ns()

    def end(self, status: int | None = None, code: str | None = None, message: str = "") -> None:
        """Once (later calls do nothing); a `code` marks the attempt failed."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if code is not None:
            span.set_attribute("kvgate.error_code", code)
            span.set_status(Status(StatusCode.ERROR, message or code))
        span.end(end_time=self.headers_ns)


class RequestSpan:
    """The spans of one request; every method is called on the event loop."""

    __slots__ = ("_ctx", "_last", "_propagate", "_span", "_tracer")

    def __init__(
        self,
        tracer: trace.Tracer,
        propagate: bool,
        headers: Sequence[tuple[bytes, bytes]],
        incoming: bytes | None,
        start_ns: int,
        attributes: dict[str, str],
    ) -> None:
        self._tracer = tracer
        self._propagate = propagate
        self._span = tracer.start_span(
            "kvgate.request",
            context=_caller(headers, incoming),  # type: ignore[arg-type]
            kind=SpanKind.SERVER,
            start_time=start_ns,
            attributes=attributes,
        )
        self._ctx = trace.set_span_in_context(self._span)
        self._last: UpstreamSpan | None = None

    @property
    def span(self) -> Span:
        return self._span

    def forward_headers(self, headers: RawHeaders) -> RawHeaders:
        """The request's headers with this span as the engine's parent (PD legs use them)."""
        if not self._propagate:
            return headers
        return with_traceparent(headers, traceparent_of(self._span))

    def _child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, object]) -> None:
        span = self._tracer.start_span(
            name,
            context=self._ctx,
            start_time=start_ns,
            attributes=attributes,  # type: ignore[arg-type]
        )
        span.end(end_time=end_ns)

    def route(
        self, start_ns: int, policy: str, reason: str, replica: str | None, ranked: int
    ) -> None:
        attributes: dict[str, object] = {
            "kvgate.policy": policy,
            "kvgate.reason": reason,
            "kvgate.ranked": ranked,
        }
        if replica is not None:
            attributes["kvgate.replica"] = replica
        self._child("kvgate.route", start_ns, time.time_ns(), attributes)

    def queued(self, start_ns: int, priority_class: str, replica: str, outcome: str) -> None:
        self._child(
            "kvgate.admission.queue",
            start_ns,
            time.time_ns(),
            {
                "kvgate.priority_class": priority_class,
                "kvgate.replica": replica,
                "kvgate.outcome": outcome,
            },
        )

    def upstream(self, replica: str, attempt: int) -> UpstreamSpan:
        span = self._tracer.start_span(
            "kvgate.upstream",
            context=self._ctx,
            kind=SpanKind.CLIENT,
            attributes={"kvgate.replica": replica, "kvgate.attempt": attempt},
        )
        self._last = upstream = UpstreamSpan(span, self._propagate)
        return upstream

    def first_token(self, end_ns: int, replica: str) -> None:
        """From the last attempt's response headers to `end_ns` (PD legs have no attempt)."""
        last = self._last
        if last is not None and last.headers_ns is not None:
            self._child("kvgate.first_token", last.headers_ns, end_ns, {"kvgate.replica": replica})

    def finish(
        self, status: int, replica: str | None, retries: int, error_code: str | None
    ) -> None:
        span = self._span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("kvgate.retries", retries)
        if replica is not None:
            span.set_attribute("kvgate.replica", replica)
        if error_code is not None:
            span.set_attribute("kvgate.error_code", error_code)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, error_code or str(status)))
        span.end()


class Tracing:
    """The gateway's tracer provider (a Service: its stop flushes and shuts the exporter)."""

    def __init__(self, settings: TracingSettings, provider: TracerProvider | None = None) -> None:
        self.provider = provider if provider is not None else make_provider(settings)
        self._tracer = self.provider.get_tracer("kvgate")
        self._propagate = settings.propagate

    def begin(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        incoming: bytes | None,
        start_ns: int,
        attributes: dict[str, str],
    ) -> RequestSpan:
        return RequestSpan(self._tracer, self._propagate, headers, incoming, start_ns, attributes)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        # Flushing may wait on the collector: off the event loop.
        await asyncio.to_thread(self.provider.shutdown)
