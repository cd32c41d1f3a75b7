"""`store:` settings section (one field on the root `KvgateSettings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.store.connect import parse_store_url

DEFAULT_SESSION_TTL_S = 1800.0
DEFAULT_LOCAL_SESSIONS_MAX = 200_000


class StoreSettings(BaseModel):
    """Where shared routing state lives.

    `memory` keeps everything in the process (the embedded default, no Redis). `redis`
    shares session placements, ejections, health verdicts and recent prefix placements
    between gateway instances, while each instance keeps a local copy so requests are
    served when Redis is slow or down.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["memory", "redis"] = Field("memory", description="memory | redis")
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis://, rediss:// or unix:// (one server); "
        "redis+sentinel://HOST:26379,.../SERVICE[/db] (Sentinel); "
        "redis+cluster://HOST:6379,... (Cluster)",
    )
    key_prefix: str = Field("kvgate", min_length=1, description="namespace of every Redis key")
    session_ttl_s: float = Field(
        DEFAULT_SESSION_TTL_S, gt=0, description="idle time after which a session placement expires"
    )
    local_sessions_max: int = Field(
        DEFAULT_LOCAL_SESSIONS_MAX, ge=1, description="bound of the local placement cache (LRU)"
    )
    op_timeout_s: float = Field(
        0.05, gt=0, le=5, description="budget of the one Redis round trip on a request's path"
    )
    connect_timeout_s: float = Field(0.5, gt=0, description="Redis connect timeout")
    sync_interval_s: float = Field(
        0.1, gt=0, le=10, description="period of the background flush and pull"
    )
    reconnect_max_s: float = Field(5.0, gt=0, description="cap of the reconnect backoff")
    prefix_stream_max: int = Field(
        10_000, ge=100, description="approximate length cap of the shared prefix-placement stream"
    )
    prefix_hashes_shared: int = Field(
        256, ge=1, le=8192, description="leading block hashes shared per prefix placement"
    )
    sticky_load_factor: float | None = Field(
        1.25,
        gt=1.0,
        description="a sticky replica above this factor of the mean in-flight count is "
        "left for the router's choice (the move is recorded); null: always honoured",
    )

    @model_validator(mode="after")
    def _check_url(self) -> StoreSettings:
        if self.backend == "redis":
            parse_store_url(self.url)  # a StoreUrlError (a ValueError) says what is wrong
        return self
