"""`trace_capture:` settings section: the gateway writing a private trace of its traffic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.trace.format import DEFAULT_BLOCK_TOKENS


class TraceCaptureSettings(BaseModel):
    """Off by default. When on, every proxied generation request becomes one trace line
    (salted block hashes and lengths only), written by a background thread."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="capture a trace of proxied requests")
    path: str | None = Field(None, description="trace file (appended to when it exists)")
    salt_file: str | None = Field(
        None,
        description="file holding the secret salt (created if missing); default "
        "$KVGATE_TRACE_SALT, else a random salt per process",
    )
    block_tokens: int = Field(
        DEFAULT_BLOCK_TOKENS,
        ge=1,
        le=4096,
        description="trace block size; a multiple of session.block_tokens",
    )
    queue_size: int = Field(
        10_000, ge=1, description="records buffered for the writer; beyond that they are dropped"
    )
    flush_interval_s: float = Field(1.0, gt=0, description="longest time a record stays unwritten")

    @model_validator(mode="after")
    def _path_when_enabled(self) -> TraceCaptureSettings:
        if self.enabled and not self.path:
            raise ValueError("trace_capture.path is required when trace_capture.enabled is true")
        return self
