"""`console:` settings section (one field on the root settings model)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Measure = Literal["auto", "watched", "always", "off"]


class ConsoleSettings(BaseModel):
    """The web console at `path` and its admin endpoints under `/admin/`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="serve the console and its admin JSON")
    path: str = Field(default="/console", description="where the page is served")
    sample_interval_s: float = Field(
        default=2.0, gt=0, le=60, description="seconds between two history samples"
    )
    idle_sample_interval_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="seconds between two history samples while idle: nobody read the "
        "console or its JSON within watch_idle_s and no request began since the last "
        "sample (a sample reads every series of the gateway: over hundreds of replicas, a "
        "share of an idle gateway's CPU). The first request or read samples at "
        "sample_interval_s again",
    )
    history_s: float = Field(
        default=900.0, gt=0, le=86400, description="how much history the gateway keeps in memory"
    )
    measure: Measure = Field(
        default="auto",
        description=(
            "per-request figures (tokens, TTFT per replica, sessions): `auto` measures "
            "always when another feature already observes every request (metrics.tokens, "
            "the default), else as `watched`; `watched` while the console or its JSON was "
            "read in the last watch_idle_s; `always`; or `off`"
        ),
    )
    watch_idle_s: float = Field(
        default=300.0, gt=0, description="`watched` stops measuring after this long unread"
    )
    live_session_s: float = Field(
        default=300.0, gt=0, description="a session seen this recently counts as live"
    )
    max_sessions: int = Field(
        default=20000, ge=1, description="sessions the console remembers (least recent dropped)"
    )
    local_only: bool = Field(
        default=False, description="answer the admin JSON only to loopback clients"
    )

    @model_validator(mode="after")
    def _check(self) -> ConsoleSettings:
        if not self.path.startswith("/") or self.path.endswith("/") or self.path.startswith("/v1"):
            raise ValueError("path must start with '/', not end with '/' and not be under /v1")
        if self.history_s < self.sample_interval_s:
            raise ValueError("history_s must be at least sample_interval_s")
        return self


def console_url(host: str, port: int, path: str) -> str:
    """Where a browser on this machine finds the console of a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"
