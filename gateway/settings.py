"""Root settings: a YAML file (``kvgate serve -c FILE``) with ``KVGATE_`` environment overrides.

Precedence, highest first: environment (``KVGATE_SERVER__PORT=9000``; ``__`` nests, JSON
for lists such as ``KVGATE_REPLICAS``), then the YAML file / keyword values, then defaults.
A feature adds its section as one field here whose model lives in its own package.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from gateway.admission.config import AdmissionSettings, EnginePrioritySettings
from gateway.auth.config import AuthSettings
from gateway.console.config import ConsoleSettings
from gateway.discovery.config import DiscoverySettings
from gateway.epp.config import EppSettings
from gateway.errors import ConfigError
from gateway.kvevents.config import KVEventsSettings
from gateway.pd.config import PDSettings
from gateway.pools.config import PoolsSettings
from gateway.routing import RoutingSettings
from gateway.scrape.config import ScrapeSettings
from gateway.store.config import StoreSettings
from gateway.tiers.config import TiersSettings
from gateway.trace.config import TraceCaptureSettings
from gateway.tracing.config import TracingSettings
from gateway.types import Role
from gateway.upstream.base import DEFAULT_MAX_RESPONSE_BYTES

ENV_PREFIX = "KVGATE_"
CONFIG_FILE_ENV = "KVGATE_CONFIG_FILE"
# How long an idle client connection stays open. uvicorn's own default (5 s) equals the
# idle expiry of httpx and the openai SDK, so a client reusing a connection the server is
# closing at that instant gets a reset; the side that closes first must be the client.
DEFAULT_KEEP_ALIVE_S = 75.0


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineKind(str, Enum):
    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"


class PriorityOrder(str, Enum):
    """Which `priority` values an engine's priority scheduling runs first."""

    LOWER_FIRST = "lower_first"  # vLLM; SGLang with --schedule-low-priority-values-first
    HIGHER_FIRST = "higher_first"  # SGLang's default


class ServerSettings(Section):
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = pick a free one)")
    workers: int = Field(1, ge=1, le=256, description="worker processes")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = Field(False, description="uvicorn access log (costs throughput)")
    proxy_headers: bool = Field(
        False, description="trust X-Forwarded-For/-Proto from forwarded_allow_ips (behind an LB)"
    )
    forwarded_allow_ips: str = Field("127.0.0.1", description="comma-separated IPs, or *")
    keep_alive_s: float = Field(
        DEFAULT_KEEP_ALIVE_S,
        gt=0,
        description="idle client connections stay open this long; "
        "keep it above the clients' and load balancer's idle timeouts (httpx and the openai "
        "SDK drop idle connections after 5 s, uvicorn's own default), so that the client, not "
        "the gateway, closes an idle connection and no request is sent into a closing one",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's headers must arrive within this long of its first "
        "byte (a new connection's first request: of the connection), else 408 and close",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a request's body must arrive within this long of its headers, "
        "else the connection is closed",
    )
    max_connections_per_ip: int = Field(
        0,
        ge=0,
        description="open client connections per client address and worker (0 = no "
        "cap; behind a load balancer every connection comes from its address); past it 429",
    )

    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="on SIGTERM/SIGINT, how long requests and streams in flight "
        "may take to finish before they are cancelled and the process exits",
    )
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        le=300,
        description="on SIGTERM, /ready answers 503 this long before the "
        "listener closes, so a load balancer (a Kubernetes readiness probe) stops sending "
        "first; set it to the probe's period times its failure threshold",
    )

    def protocol(self) -> Any:
        """uvicorn's `http=` argument: httptools with these request deadlines and cap."""
        from gateway.protocol import guarded_protocol

        return guarded_protocol(
            self.header_timeout_s, self.body_timeout_s, self.max_connections_per_ip
        )


class ReplicaSettings(Section):
    id: str = Field(
        "",
        description="stable replica id, shown in x-kvgate-replica, error messages and "
        "metric labels; default: an opaque one derived from the url (r-<10 hex>), so the "
        "engine's address is never shown; give `id` to show a name of your choosing",
    )
    url: str = Field(..., description="base URL of the engine, e.g. http://10.0.0.5:8000")
    weight: float = Field(1.0, gt=0, le=1000, description="share of the hash ring")
    models: tuple[str, ...] = Field((), description="models served; empty = discover")
    engine: EngineKind = Field(EngineKind.AUTO, description="engine kind for metric scraping")
    pool: str | None = Field(None, description="hardware pool name")
    role: Role = Field(Role.BOTH, description="both | prefill | decode")
    priority_scheduling: bool = Field(False, description="engine runs priority scheduling")
    priority_order: PriorityOrder | None = Field(
        None,
        description="which priority values the engine runs first; unset = the engine "
        "kind's default (higher_first for sglang, else lower_first)",
    )
    price_per_hour: float = Field(
        0.0,
        ge=0,
        description="what this replica costs per hour, for kvgate_replica_cost_total "
        "(0 = its pool's price per replica-hour, else unpriced)",
    )

    def runs_higher_first(self) -> bool:
        """Whether larger `priority` values run first on this engine."""
        if self.priority_order is not None:
            return self.priority_order is PriorityOrder.HIGHER_FIRST
        return self.engine is EngineKind.SGLANG

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://10.0.0.5:8000")
        # Request paths are appended to the URL: after a '?' or '#' they would land in the
        # query or the fragment and every request would go to the wrong path.
        if parts.query or parts.fragment or value.endswith(("?", "#")):
            raise ValueError("must not have a query or a #fragment (request paths are appended)")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _default_id(self) -> ReplicaSettings:
        if not self.id:
            # Stable across restarts and gateways (the hash ring and placements rely on
            # it), and says nothing of where the engine is.
            digest = hashlib.sha256(self.url.encode()).hexdigest()[:10]
            object.__setattr__(self, "id", f"r-{digest}")
        return self


class EmbeddedSimSettings(Section):
    """Simulated engines started in-process when no replicas are configured."""

    replicas: int = Field(4, ge=1, le=64)
    profile: str = Field("h200-sparse", description="gateway.sim hardware profile name")
    time_scale: float = Field(
        1.0, gt=0, description="simulated time runs this many times faster than real time"
    )
    model: str = Field("kvgate-sim", description="model name the simulated engines serve")


class LineageHeaders(Section):
    """One client's parent/child agent headers: a request naming a parent starts where the
    parent's session is placed, then its own session sticks on its own.

    `agent` names the request's own agent (its session); `parent` the agent that started
    it. `scope`, when set, names the run every agent of it shares (Claude Code's session
    id): agent ids are read within it, and an agent with no `parent` header is a child of
    the run's top-level agent, whose session is the scope itself.
    """

    agent: str = Field(min_length=1, description="header naming the request's own agent")
    parent: str = Field(min_length=1, description="header naming the agent that started it")
    scope: str | None = Field(
        None, min_length=1, description="header naming the run the agent ids belong to"
    )


# Claude Code sends its session id on every request of a run and `x-claude-code-agent-id`
# on a subagent's (plus the parent agent's id when a subagent started it); OpenCode sends
# a child session's own id in `X-Session-Id` and its parent's in `x-parent-session-id`.
DEFAULT_LINEAGE_HEADERS = (
    LineageHeaders(
        agent="x-claude-code-agent-id",
        parent="x-claude-code-parent-agent-id",
        scope="x-claude-code-session-id",
    ),
    LineageHeaders(agent="X-Session-Id", parent="X-Parent-Session-Id"),
)


class SessionSettings(Section):
    header: str = Field("X-Session-Id", description="request header carrying a session id")
    agent_headers: list[str] = Field(
        ["X-Claude-Code-Session-Id", "session-id", "session_id", "x-opencode-session"],
        description="session headers agent tools send on their own (Claude Code, Codex, "
        "OpenCode), read as session ids when `header` is absent; [] turns them off",
    )
    lineage_headers: tuple[LineageHeaders, ...] = Field(
        DEFAULT_LINEAGE_HEADERS,
        description="parent/child agent headers (Claude Code, OpenCode; add your own pair): "
        "a child's first request starts on its parent's replica, then sticks on its own; "
        "[] turns them off",
    )
    priority_header: str = Field("X-Priority", description="header naming a priority class")
    tenant_header: str = Field("X-Tenant-Id", description="header naming the tenant")
    block_tokens: int = Field(
        512,
        ge=1,
        le=4096,
        description="tokens per prefix-hash block (x 4 bytes of prompt); "
        "larger blocks cost less CPU per request, smaller ones see shorter shared prefixes",
    )
    max_prefix_blocks: int = Field(
        2048,
        ge=0,
        le=1 << 20,
        description="prefix blocks hashed per request (0 = none); "
        "the default covers a million tokens at 512-token blocks",
    )
    completion_key_chars: int = Field(
        1024,
        ge=1,
        description="leading prompt characters that key a /v1/completions session "
        "when it has no lineage",
    )
    lineage: bool = Field(
        True,
        description="without a session header or prompt_cache_key, infer each "
        "conversation from its prompt (gateway.lineage) and key its session on that",
    )
    user_is_session: bool = Field(
        False,
        description="treat the body's `user` as a session id (many clients send one "
        "`user` for all their conversations, so it is off unless you know yours do not)",
    )
    lineage_capacity_factor: float = Field(
        4.0,
        gt=0,
        description="lineage index size: this times the cluster's scraped KV "
        "capacity, in hash blocks (it remembers conversations longer than engines keep "
        "them, so one that comes back after an eviction is still recognised and sent back)",
    )
    lineage_max_blocks: int = Field(
        1 << 22,
        ge=1024,
        description="hard bound of the lineage index, in hash blocks (about 150 bytes each)",
    )
    max_lineages: int = Field(1 << 18, ge=1, description="conversations the index remembers")
    lineage_slack_tokens: int = Field(
        0,
        ge=0,
        description="trailing tokens of a conversation's last prompt its next turn "
        "may differ in and still continue it (for clients that re-render their last message)",
    )


class ResponsesSettings(Section):
    """Stored Responses (`GET|DELETE /v1/responses/{id}`, `.../cancel`, `.../input_items`)."""

    locate: bool = Field(
        True,
        description="an id with no recorded placement (aged out, recorded by another "
        "gateway, lost in a restart) is looked for by asking every healthy replica "
        "`GET /v1/responses/{id}` at once; false: it is a 404 straight away",
    )


class OutlierSettings(Section):
    """Ejection of replicas that answer but fail requests (Envoy's outlier detection).

    Envoy's defaults where they fit kvgate's small fleets: 5 consecutive 5xx, a 10 s window,
    30 s base ejection growing with each ejection up to 300 s, at most 10% of the replicas
    ejected (always at least one may be, never the last in service). Envoy's success-rate
    check needs 5 hosts and 100 requests each; kvgate fleets are often 2-4 replicas, so the
    share check compares a replica with the rest of the fleet from 20 requests on.
    """

    enabled: bool = Field(True, description="eject replicas whose answers fail far more often")
    consecutive_5xx: int = Field(
        5, ge=2, description="5xx answers in a row, each to a different request, that eject"
    )
    interval_s: float = Field(10.0, gt=0, description="window the 5xx shares are taken over")
    request_volume: int = Field(
        20,
        ge=1,
        description="different requests a replica (and the rest of the fleet) must have "
        "answered in the window before its share is judged",
    )
    min_failure_share: float = Field(
        0.2, gt=0, le=1, description="a 5xx share below this never ejects"
    )
    failure_share_factor: float = Field(
        2.0,
        ge=1,
        description="eject when the replica's 5xx share is at least this many times the "
        "share of the rest of the fleet (a fleet-wide failure ejects nobody)",
    )
    base_ejection_s: float = Field(
        30.0, gt=0, description="first ejection's length; each further one adds as much"
    )
    max_ejection_s: float = Field(300.0, gt=0, description="longest ejection")
    max_ejection_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="most replicas outlier-ejected at once, as a share of the fleet "
        "(at least one may always be)",
    )


class HealthSettings(Section):
    enabled: bool = Field(True, description="actively probe each replica")
    path: str = Field("/health", description="probe path")
    interval_s: float = Field(2.0, gt=0, description="seconds between probes")
    idle_interval_s: float = Field(
        4.0,
        gt=0,
        description="seconds between probes of a quiet replica (under the 5 s vLLM and SGLang "
        "keep an idle connection, so the probes keep one open and the quiet scrapes reuse "
        "it; a new connection costs several times a request's CPU): healthy, its last probe "
        "passed, its engine load says nothing runs or waits (read at scrape.idle_interval_s) "
        "and this gateway sent it no request within this time. A request to it probes it at "
        "once (at most every interval_s) and a failed probe restores interval_s, so a quiet "
        "engine whose core died is out within idle_interval_s + (failure_threshold - 1) * "
        "interval_s. At or below interval_s every replica is probed at one rate",
    )
    timeout_s: float = Field(1.0, gt=0, description="probe timeout")
    failure_threshold: int = Field(3, ge=1, description="consecutive failures that eject")
    success_threshold: int = Field(2, ge=1, description="half-open successes that re-admit")
    cooldown_s: float = Field(5.0, ge=0, description="ejection time before half-open")
    passive: bool = Field(
        True,
        description="count proxied connect errors (refused, reset before any byte) "
        "against a replica; never a request's own timeout or a status the engine answered",
    )
    canary: bool = Field(
        True,
        description="after a proxied request's response-header timeout, send that "
        "replica a one-token request; no answer within canary_timeout_s ejects it (stalled)",
    )
    canary_timeout_s: float = Field(5.0, gt=0, description="deadline of the stall canary")
    outlier: OutlierSettings = Field(default_factory=OutlierSettings)


class RetrySettings(Section):
    max_attempts: int = Field(3, ge=1, le=16, description="attempts per request, first included")
    budget_s: float = Field(
        15.0, gt=0, description="stop retrying this long after the first failure"
    )
    backoff_s: float = Field(0.0, ge=0, le=10, description="pause between attempts")


class TimeoutSettings(Section):
    connect_s: float = Field(3.0, gt=0, description="TCP connect to a replica")
    response_headers_s: float = Field(
        600.0, gt=0, description="request sent -> response headers (covers long prefills)"
    )
    read_s: float = Field(600.0, gt=0, description="max gap between two body chunks")
    probe_s: float = Field(2.0, gt=0, description="GET requests to replicas (models)")


class LimitSettings(Section):
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="request body limit")
    max_json_depth: int = Field(64, ge=4, le=1000, description="deepest JSON nesting accepted")
    max_response_bytes: int = Field(
        DEFAULT_MAX_RESPONSE_BYTES,
        ge=1024,
        description="largest JSON body read whole from "
        "an engine (answers, probes, model lists); past it the client gets a 502 and the engine "
        "connection is dropped. SSE streams and other bodies (audio) are relayed as they "
        "arrive and not bounded",
    )


class ModelsSettings(Section):
    cache_ttl_s: float = Field(5.0, ge=0, description="GET /v1/models cache lifetime")
    discover: bool = Field(True, description="ask replicas for their models at start-up")
    refresh_s: float = Field(30.0, gt=0, description="re-discover replicas' models this often")


class UpstreamSettings(Section):
    client: Literal["h1", "aiohttp", "httpx"] = Field(
        "h1", description="HTTP client to engines (h1: the lean built-in one; https via aiohttp)"
    )
    max_connections: int = Field(
        1024, ge=1, description="most open connections per engine (h1) or in all (aiohttp, httpx)"
    )
    engine_api_key: SecretStr | None = Field(
        None,
        description="for engines started with --api-key: sent as 'Authorization: Bearer' "
        "on the gateway's own requests (health probes, metric scrapes, model discovery, prefix "
        "warm-ups) and, unless pass_client_authorization, on proxied requests instead of the "
        "client's. Prefer the KVGATE_UPSTREAM__ENGINE_API_KEY environment variable to "
        "writing it in a file",
    )
    pass_client_authorization: bool | None = Field(
        None,
        description="send the client's own Authorization to the engines; default: only "
        "while API keys are off and no engine_api_key is set (then clients may hold the "
        "engines' key themselves, as before)",
    )

    def passes_client_authorization(self, keys_on: bool) -> bool:
        if self.pass_client_authorization is not None:
            return self.pass_client_authorization
        return not keys_on and self.engine_api_key is None

    def auth_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """The header the gateway's own requests to engines carry (none without a key)."""
        if self.engine_api_key is None:
            return ()
        return ((b"authorization", b"Bearer " + self.engine_api_key.get_secret_value().encode()),)


class MetricsSettings(Section):
    tokens: bool = Field(
        True,
        description="count tokens, end-to-end latency and cost per model and replica "
        "(gateway.accounting); streams then carry usage from the engine, which the gateway "
        "asks for and removes again when the client did not ask for it",
    )


class KvgateSettings(BaseSettings):
    """Everything `build_app` needs. Unknown keys are errors."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    replicas: tuple[ReplicaSettings, ...] = ()
    discovery: DiscoverySettings = Field(
        default_factory=DiscoverySettings, description="replicas from DNS (gateway.discovery)"
    )
    sim: EmbeddedSimSettings = Field(default_factory=EmbeddedSimSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    session: SessionSettings = Field(default_factory=SessionSettings)
    responses: ResponsesSettings = Field(
        default_factory=ResponsesSettings, description="stored Responses and their replicas"
    )
    health: HealthSettings = Field(default_factory=HealthSettings)
    retries: RetrySettings = Field(default_factory=RetrySettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    pools: PoolsSettings | None = Field(None, description="card pools (gateway.pools)")
    tiers: TiersSettings | None = Field(
        None, description="public model names served by tiers of models (gateway.tiers)"
    )
    pd: PDSettings = Field(default_factory=PDSettings, description="prefill/decode hand-off")
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings, description="priority classes and admission queue"
    )
    engine_priority: EnginePrioritySettings = Field(
        default_factory=EnginePrioritySettings,
        description="the `priority` replicas with priority_scheduling see",
    )
    scrape: ScrapeSettings = Field(
        default_factory=ScrapeSettings, description="engine /metrics polling (gateway.scrape)"
    )
    trace_capture: TraceCaptureSettings = Field(
        default_factory=TraceCaptureSettings, description="private trace of proxied requests"
    )
    tracing: TracingSettings = Field(
        default_factory=TracingSettings,
        description="W3C traceparent to the engines, OpenTelemetry spans (gateway.tracing)",
    )
    store: StoreSettings = Field(
        default_factory=StoreSettings, description="shared routing state (gateway.store)"
    )
    kv_events: KVEventsSettings = Field(
        default_factory=KVEventsSettings, description="engine KV cache events (gateway.kvevents)"
    )
    console: ConsoleSettings = Field(
        default_factory=ConsoleSettings, description="the web console (gateway.console)"
    )
    auth: AuthSettings = Field(
        default_factory=AuthSettings, description="API keys, tenants, quotas (gateway.auth)"
    )
    epp: EppSettings = Field(
        default_factory=EppSettings, description="`kvgate epp`: Envoy ext_proc (gateway.epp)"
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> KvgateSettings:
        seen: set[str] = set()
        for replica in self.replicas:
            if replica.id in seen:
                raise ValueError(f"replica id {replica.id!r} is used twice")
            seen.add(replica.id)
        return self

    @model_validator(mode="after")
    def _replica_pools_known(self) -> KvgateSettings:
        if self.pools is not None:
            known = {p.name for p in self.pools.pools}
            for i, replica in enumerate(self.replicas):
                if replica.pool is not None and replica.pool not in known:
                    raise ValueError(f"replicas[{i}].pool {replica.pool!r} is not in pools.pools")
            for i, target in enumerate(self.discovery.dns):
                if target.pool is not None and target.pool not in known:
                    raise ValueError(
                        f"discovery.dns[{i}].pool {target.pool!r} is not in pools.pools"
                    )
        return self

    @property
    def has_replicas(self) -> bool:
        """Replicas are configured or discovered (else `kvgate serve` embeds simulated ones)."""
        return bool(self.replicas or self.discovery.dns or self.epp.pool is not None)

    @model_validator(mode="after")
    def _auth_refers_to_known_names(self) -> KvgateSettings:
        classes = {c.name for c in self.admission.classes}
        grants = [*self.auth.keys, *self.auth.tenants.values()]
        for grant in grants:
            if grant.max_priority is not None and grant.max_priority not in classes:
                raise ValueError(
                    f"auth: max_priority {grant.max_priority!r} is not a class "
                    f"(admission.classes: {sorted(classes)})"
                )
        if self.auth.redis_keys and self.store.backend != "redis":
            raise ValueError("auth.redis_keys needs store.backend: redis")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment wins over the file (passed in as init values): ops override a
        # shipped YAML per deployment without editing it.
        return (env_settings, init_settings)


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per error: dotted key, what is wrong, and the offending value."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (check the spelling against gateway.example.yaml)"
        given = err.get("input")
        shown = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {given!r:.80})"
        lines.append(f"{key}: {msg}{shown}")
    return lines


def _env_problem(exc: SettingsError) -> str:
    field = str(exc).partition('field "')[2].partition('"')[0]
    name = ENV_PREFIX + field.upper() if field else f"a {ENV_PREFIX}* variable"
    cause = exc.__cause__
    return f"{name}: not valid JSON ({cause})" if cause is not None else f"{name}: {exc}"


def load_settings(path: str | Path | None = None, **values: Any) -> KvgateSettings:
    """Load the YAML file (if any) merged with `values`, then environment overrides.

    Raises ConfigError whose message lists every problem with its dotted key.
    """
    data: dict[str, Any] = read_yaml(path) if path else {}
    data.update(values)
    try:
        return KvgateSettings(**data)
    except SettingsError as exc:
        # pydantic-settings could not decode an environment value (JSON for lists/sections).
        raise ConfigError(f"environment: {_env_problem(exc)}") from exc
    except ValidationError as exc:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(describe_errors(exc))) from exc


def _routing_problems(routing: RoutingSettings) -> list[str]:
    from gateway.policy import PolicyContext
    from gateway.routing import build_router

    try:
        build_router(routing, PolicyContext())
    except ConfigError as exc:
        return [f"{exc.param or 'routing'}: {exc.message}"]
    return []


def check_config(path: str | Path) -> list[str]:
    """Every problem in a config file (empty list = valid), including the routing policy."""
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        if not isinstance(exc.__cause__, ValidationError):
            return [exc.message]
        problems = describe_errors(exc.__cause__)
        # The rest of the file is broken, but a bad policy name is worth reporting too.
        raw = read_yaml(path).get("routing")
        try:
            routing = RoutingSettings.model_validate(raw or {})
        except ValidationError:
            return problems
        return problems + _routing_problems(routing)
    return _routing_problems(settings.routing)
