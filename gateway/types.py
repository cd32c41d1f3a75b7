"""Value objects shared by the proxy, the policies, the simulator and the tests.

Everything here is immutable: a policy receives a `RouteRequest` and a `ClusterView` and
must be able to run with no event loop, no I/O and no shared mutable state in sight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Literal, NewType, Protocol

from gateway.errors import ErrorDialect, EventDialect

ReplicaId = NewType("ReplicaId", str)
SessionKey = NewType("SessionKey", str)

EMPTY_INFLIGHT: Mapping[ReplicaId, int] = MappingProxyType({})
_EMPTY_BY_ID: Mapping[ReplicaId, ReplicaState] = MappingProxyType({})


class Role(str, Enum):
    """What a replica does in prefill/decode disaggregation."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class Endpoint(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    MESSAGES = "messages"  # Anthropic's Messages API, as vLLM and SGLang serve it
    COUNT_TOKENS = "count_tokens"  # Anthropic's token counting, as vLLM serves it
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    RERANK = "rerank"
    SCORE = "score"
    CLASSIFY = "classify"
    POOLING = "pooling"
    TRANSCRIPTIONS = "transcriptions"
    TRANSLATIONS = "translations"
    SPEECH = "speech"


# How a route's body names its prompt (gateway.keys reads it; gateway.body validates it):
# "messages": chat messages; "prompt" / "input": a completions-style prompt in that field;
# "responses": `instructions` + `input` items; "anthropic": `system` + messages;
# "either": `messages` when present, else `prompt` (tokenize) or `input` (pooling);
# "tokens": token ids (detokenize); "pair": rerank's query + documents, score's two texts;
# "none": no prompt the gateway reads (multipart audio: forwarded unparsed).
PromptKind = Literal[
    "messages", "prompt", "input", "responses", "anthropic", "either", "tokens", "pair", "none"
]


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One proxied route: where it is served and how its body is read.

    `generates`: the engine decodes tokens for it (admission's output estimate, PD, the KV
    it leaves behind); `errors`: the shape of the gateway's own error bodies on it;
    `multipart`: the body is streamed through unparsed; `events`: the dialect of its
    streams, in which a failure mid-stream is told (gateway.errors.stream_error_event).
    """

    path: str
    prompt: PromptKind
    generates: bool = False
    errors: ErrorDialect = "openai"
    multipart: bool = False
    events: EventDialect = "openai"
    # The body field that names an earlier answer stored on one replica (Responses API).
    continues: str | None = None


ROUTE_SPECS: Mapping[Endpoint, RouteSpec] = MappingProxyType(
    {
        Endpoint.CHAT: RouteSpec("/v1/chat/completions", "messages", generates=True),
        Endpoint.COMPLETIONS: RouteSpec("/v1/completions", "prompt", generates=True),
        Endpoint.EMBEDDINGS: RouteSpec("/v1/embeddings", "input"),
        Endpoint.RESPONSES: RouteSpec(
            "/v1/responses",
            "responses",
            generates=True,
            continues="previous_response_id",
            events="responses",
        ),
        Endpoint.MESSAGES: RouteSpec(
            "/v1/messages", "anthropic", generates=True, errors="anthropic", events="anthropic"
        ),
        Endpoint.COUNT_TOKENS: RouteSpec(
            "/v1/messages/count_tokens", "anthropic", errors="anthropic", events="anthropic"
        ),
        Endpoint.TOKENIZE: RouteSpec("/tokenize", "either"),
        Endpoint.DETOKENIZE: RouteSpec("/detokenize", "tokens"),
        Endpoint.RERANK: RouteSpec("/v1/rerank", "pair"),
        Endpoint.SCORE: RouteSpec("/v1/score", "pair"),
        Endpoint.CLASSIFY: RouteSpec("/v1/classify", "input"),
        Endpoint.POOLING: RouteSpec("/pooling", "either"),
        Endpoint.TRANSCRIPTIONS: RouteSpec("/v1/audio/transcriptions", "none", multipart=True),
        Endpoint.TRANSLATIONS: RouteSpec("/v1/audio/translations", "none", multipart=True),
        Endpoint.SPEECH: RouteSpec("/v1/audio/speech", "input"),
    }
)

# Where each endpoint is served: OpenAI's paths (and Anthropic's), as vLLM serves them.
ENDPOINT_PATHS: Mapping[Endpoint, str] = MappingProxyType(
    {endpoint: spec.path for endpoint, spec in ROUTE_SPECS.items()}
)

# Aliases vLLM also serves for some of them.
EXTRA_PATHS: Mapping[str, Endpoint] = MappingProxyType(
    {
        "/rerank": Endpoint.RERANK,
        "/v2/rerank": Endpoint.RERANK,
        "/score": Endpoint.SCORE,
        "/classify": Endpoint.CLASSIFY,
    }
)

# Client paths forwarded to another engine path: vLLM 0.33 serves classification only at
# `/classify` (SGLang serves both), so `/v1/classify` goes there too.
UPSTREAM_PATHS: Mapping[str, str] = MappingProxyType({"/v1/classify": "/classify"})

_ANTHROPIC_PATHS = frozenset(s.path for s in ROUTE_SPECS.values() if s.errors == "anthropic")


def error_shape(path: str) -> ErrorDialect:
    """The error body shape of the API served at `path`."""
    return "anthropic" if path in _ANTHROPIC_PATHS else "openai"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request: no bodies, no Starlette objects.

    `prefix_hashes` are chained block hashes of the prompt (block i depends on blocks
    0..i), so equal leading entries mean an equal prompt prefix.
    """

    request_id: str
    model: str
    session_key: SessionKey
    key_source: str = "conversation"
    endpoint: Endpoint = Endpoint.CHAT
    prefix_hashes: tuple[int, ...] = ()
    # Hashes of the prompt's first 16, 32, ... bytes (gateway.hashing.opener_hashes): with
    # `prefix_hashes` after them, the chain the conversation lineage is read from.
    opener_hashes: tuple[int, ...] = ()
    block_tokens: int = 16
    prompt_tokens: int = 0
    max_tokens: int | None = None
    priority_class: str = "default"
    tenant: str | None = None
    stream: bool = False
    # Where the shared session store says this session lives, if anywhere (see gateway.store).
    sticky_replica: ReplicaId | None = None

    # The prompt's whole hash chain (openers, then blocks), and (keyed on its lineage) its
    # bytes past the chain's last hash (under a block): what the lineage is read from.
    lineage_hashes: tuple[int, ...] = ()
    lineage_tail: bytes = b""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one replica's engine metrics. `None` fields were not exposed.

    `engine` False: the engine exposes no load (SGLang without `--enable-metrics` answers
    `/metrics` 404); the load is then empty and the gateway's own in-flight and prompt-token
    counts stand in for it (fresh at each scrape, so the replica is not "unknown").

    `grace_s`: seconds this load stays fresh beyond the staleness limit. The scraper reads a
    quiet replica (nothing running or waiting) less often and says so here, so its load
    does not turn unknown between two reads. Judge freshness with `is_fresh`.
    """

    waiting: float
    running: float
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    kv_capacity_tokens: int | None = None
    scraped_at: float = 0.0
    engine: bool = True
    grace_s: float = 0.0

    def is_fresh(self, now: float, stale_after: float) -> bool:
        return now - self.scraped_at <= stale_after + self.grace_s


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """A replica as the policies see it at one instant."""

    id: ReplicaId
    url: str
    weight: float = 1.0
    healthy: bool = True
    models: frozenset[str] = frozenset()
    pool: str | None = None
    role: Role = Role.BOTH
    load: EngineLoad | None = None
    kv_capacity_tokens: int | None = None
    price_per_hour: float = 0.0  # cost accounting only (gateway.accounting)

    def serves(self, model: str) -> bool:
        # An empty model set means "not discovered yet": do not exclude on that alone.
        return not self.models or model in self.models


class CacheEvidence(Protocol):
    """What the engines themselves say they cache (gateway.kvevents), as a policy input.

    `cached_tokens(request)` maps each replica whose cache is known precisely to the
    prompt tokens it holds (weighed by storage tier); replicas it leaves out are unknown
    (no event stream, or one being resynchronised), and so is every replica when it
    returns None (the prompt's tokens are not known yet). Policies keep their own
    approximate estimate for whatever is unknown. Cheap, pure, memoised per request.
    """

    def cached_tokens(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None: ...


class PrefillSignals(Protocol):
    """Per replica, the prefill this gateway sent that has no first token yet and the
    speed it prefills at, measured from its answers (gateway.prefill_meter)."""

    def queued_tokens(self, replica: ReplicaId) -> float: ...

    def queued_requests(self, replica: ReplicaId) -> int: ...

    def speed(self, replica: ReplicaId) -> float | None: ...

    def mean_speed(self) -> float | None: ...

    def mean_request_tokens(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ClusterView:
    """An immutable snapshot of the cluster handed to `Policy.choose`.

    `in_flight` is a read-only mapping over the gateway's live counters. It cannot change
    while a synchronous `choose` runs (the event loop is single-threaded), so policies see a
    consistent picture without the proxy copying the counters on every request.
    """

    replicas: tuple[ReplicaState, ...]
    now: float = 0.0
    stale_after: float = 2.0
    in_flight: Mapping[ReplicaId, int] = field(default_factory=lambda: EMPTY_INFLIGHT)
    by_id: Mapping[ReplicaId, ReplicaState] = field(default_factory=lambda: _EMPTY_BY_ID)
    # Event-fed cache knowledge, when configured (a live object, like `in_flight`).
    cache_evidence: CacheEvidence | None = None
    # Queued prefill and measured prefill speed per replica (a live object too).
    prefill: PrefillSignals | None = None

    def __post_init__(self) -> None:
        if not self.by_id and self.replicas:
            object.__setattr__(self, "by_id", MappingProxyType({r.id: r for r in self.replicas}))

    def inflight(self, replica: ReplicaId) -> int:
        return self.in_flight.get(replica, 0)

    def load_of(self, replica: ReplicaState) -> EngineLoad | None:
        """The replica's scraped load, or None when absent or older than `stale_after`.

        Callers must treat None as *saturated*, never as idle.
        """
        load = replica.load
        if load is None or not load.is_fresh(self.now, self.stale_after):
            return None
        return load

    def healthy(self) -> tuple[ReplicaState, ...]:
        return tuple(r for r in self.replicas if r.healthy)


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's answer: replicas in preference order, and why the first one won."""

    ranked: tuple[ReplicaId, ...]
    reason: str
    policy: str = ""

    @property
    def first(self) -> ReplicaId | None:
        return self.ranked[0] if self.ranked else None


@dataclass(frozen=True, slots=True)
class TierDecision:
    """The tier of a tiered public model name one attempt runs on, and why (gateway.tiers
    decides; the proxy forwards to `model` and reports it in `RequestOutcome.tier`)."""

    public: str
    index: int
    tier: str
    model: str
    reason: str  # "hint", "sticky", "rule:<i>", "default", "spill", "escalated:<check>"
    score: float | None = None
    sticky_key: str | None = None
