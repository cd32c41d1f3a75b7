"""`scrape:` settings section (one field on the root settings model)."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_INTERVAL_S = 0.25
DEFAULT_STALE_AFTER_S = 2.0
# A quiet replica is read this often: the idle fleet's scrapes were most of an idle
# gateway's CPU (200 replicas: 5.0% of a core at 1 s, 2.1% at 5 s, health probes included).
DEFAULT_IDLE_INTERVAL_S = 10.0


class EngineKind(str, Enum):
    """Which metric dialect a replica speaks; `auto` detects it from the metric prefixes."""

    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"


class ScrapeSettings(BaseModel):
    """How often and how patiently the gateway reads each replica's `/metrics`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="poll replicas' /metrics in the background")
    interval_s: float = Field(
        default=DEFAULT_INTERVAL_S,
        gt=0,
        le=60,
        description="seconds between two scrapes of a replica",
    )
    idle_interval_s: float = Field(
        default=DEFAULT_IDLE_INTERVAL_S,
        gt=0,
        le=60,
        description="seconds between two scrapes of a quiet replica: nothing running or "
        "waiting at its last scrape and nothing in flight from this gateway. Its load stays "
        "fresh that much longer; the gateway's next request to it scrapes it at once and "
        "restores interval_s. Another gateway sharing the store that begins sending it "
        "requests has it read within about a lease period; load that clients of no kvgate "
        "put on it shows within this time. Equal to interval_s (or below) scrapes every "
        "replica at one rate",
    )
    timeout_s: float = Field(default=1.0, gt=0, le=60, description="per-scrape HTTP timeout")
    stale_after_s: float = Field(
        default=DEFAULT_STALE_AFTER_S,
        gt=0,
        description="a snapshot older than this is unknown load, which policies treat as saturated",
    )
    path: str = Field(default="/metrics", description="metrics path appended to each replica URL")
    select_series: bool = Field(
        default=True,
        description="after a first whole read, ask each engine for only the series kvgate "
        "reads (prometheus-client's name[] query at <path>/, where vLLM mounts that app): "
        "a fraction of the bytes to render, send and parse. An engine that answers it short "
        "(SGLang, vLLM with several API servers: multiprocess collection) or refuses it is "
        "read whole",
    )
    engine: EngineKind = Field(
        default=EngineKind.AUTO, description="default dialect for every replica"
    )
    engines: dict[str, EngineKind] = Field(
        default_factory=dict, description="per-replica dialect override, keyed by replica id"
    )
    shared: bool = Field(
        default=True,
        description="with store.backend redis: gateways sharing the store scrape each "
        "replica once between them (a lease per replica) and read the others' loads",
    )
    lease_ttl_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="a shared-scrape lease expires this long after its holder last renewed "
        "it; another gateway takes the replica over within about 4/3 of it",
    )

    @model_validator(mode="after")
    def _stale_covers_interval(self) -> ScrapeSettings:
        # A limit below one interval would flag every healthy replica as unknown between scrapes.
        if self.stale_after_s <= self.interval_s:
            raise ValueError("stale_after_s must be larger than interval_s")
        if self.lease_ttl_s <= self.interval_s:
            raise ValueError("lease_ttl_s must be larger than interval_s")
        if not self.path.startswith("/"):
            raise ValueError("path must start with '/'")
        return self

    @property
    def quiet_grace_s(self) -> float:
        """Seconds a quiet replica's load stays fresh beyond `stale_after_s`: the longer
        wait before its next read, so that it never turns stale (unknown, so saturated)
        between two reads that succeed."""
        return max(0.0, self.idle_interval_s - self.interval_s)

    def engine_for(self, replica_id: str) -> EngineKind:
        return self.engines.get(replica_id, self.engine)
