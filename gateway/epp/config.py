"""The `epp:` section: how `kvgate epp` listens and what it holds (gateway.epp)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# llm-d's EPP re-streams bodies in chunks of at most this many bytes (under gRPC's and
# Envoy's per-message limits with room for framing).
MAX_CHUNK_BYTES = 62_000


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class InferencePoolRef(_Section):
    """An InferencePool (inference.networking.k8s.io/v1) whose pods are the replicas."""

    name: str = Field(..., min_length=1, description="the InferencePool's name")
    namespace: str = Field(
        "", description="its namespace; empty: the pod's own (service account), else default"
    )
    resync_s: float = Field(
        300.0, gt=0, le=3600, description="a full re-list at least this often (watch restarts)"
    )


class EppSettings(_Section):
    host: str = Field("0.0.0.0", description="gRPC listen address")
    port: int = Field(9002, ge=1, le=65535, description="gRPC port (9002: the GIE convention)")
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="the longest the header response is held waiting for the request body's "
        "end (then 408)",
    )
    chunk_bytes: int = Field(
        MAX_CHUNK_BYTES,
        ge=1024,
        le=MAX_CHUNK_BYTES,
        description="largest body chunk re-streamed to Envoy",
    )
    max_endpoints: int = Field(
        4,
        ge=1,
        le=64,
        description="primary plus fallbacks in x-gateway-destination-endpoint",
    )
    per_attempt_headers: bool = Field(
        True,
        description="also set x-gateway-destination-endpoint-<n> (n = 0..) per ranked "
        "endpoint, for plain Envoy's per-attempt ORIGINAL_DST clusters (deploy/epp)",
    )
    pool: InferencePoolRef | None = Field(
        None, description="replicas from this InferencePool (needs the Kubernetes API)"
    )
    grace_s: float = Field(
        5.0, ge=0, le=600, description="on stop, streams in flight get this long to finish"
    )
