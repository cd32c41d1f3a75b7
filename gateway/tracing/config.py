"""`tracing:` settings: trace context to the engines, and the gateway's own spans."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TracingSettings(BaseModel):
    """Propagation is on by default and costs a header per request; spans are off, and
    need the `otel` extra (`pip install 'kvgate[otel]'`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    propagate: bool = Field(
        True,
        description="send engines a W3C traceparent: the caller's trace with the gateway's "
        "span as parent, or a new trace (tracestate is relayed unchanged); off, a client's "
        "traceparent passes through untouched",
    )
    enabled: bool = Field(
        False,
        description="OpenTelemetry spans for each proxied request: route decision, admission "
        "queueing, upstream time to headers, first token (needs kvgate[otel])",
    )
    exporter: Literal["otlp", "console", "none"] = Field(
        "otlp",
        description="otlp: OTLP over HTTP/protobuf; console: spans printed to stdout; none: "
        "spans made but not exported (for a processor added in code)",
    )
    endpoint: str | None = Field(
        None,
        description="OTLP traces URL, e.g. http://collector:4318/v1/traces; unset, the SDK "
        "reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    service_name: str | None = Field(
        None,
        description="service.name of the spans; unset: OTEL_SERVICE_NAME, else kvgate",
    )
