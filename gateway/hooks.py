"""Seams the feature packages plug into the request path (see docs/architecture.md).

All hooks live on `GatewayState` (gateway/state.py); each defaults to "absent" so the
request path pays nothing for a feature that is not configured:

* `state.admission: AdmissionGate | None` -- `classify` resolves the priority class before
  routing; after the routing decision `must_wait` (sync, free) says whether the chosen
  replica is saturated, and only then `wait` queues (or raises `RateLimited`, 429);
  `finished(request, replica)` is called
  after the in-flight slot of a request is released, on every exit path; `first_byte(request,
  replica)` once per request at its first response byte, or before `finished` when none
  arrived (the prefill is over either way).
* `state.payload: PayloadShaper | None` -- the body bytes to send to one replica, given
  (request, body, raw bytes, replica): the engine's `priority` set or stripped
  (gateway.admission.engine_order). None: the client's bytes as they came.
* `state.placements: SessionPlacements | None` -- where the session lives (lookup before
  choosing -> `RouteRequest.sticky_replica`; record after headers arrived). Default: a
  local in-memory LRU; the store package swaps in a shared one.
* `state.dispatcher: Dispatcher | None` -- may take over forwarding of a request (PD
  hand-off). It receives a `ForwardContext` with the proxy's own leg-opening helper and
  returns the `Leg` whose response the proxy relays, or None to decline.
* `state.meters: list[RequestMeter]` -- called once per request at its end, before the
  observers, with the request's ASGI scope and a `RequestUse` (status, whether an engine
  took the prompt, the engine's `usage`): the features that left something in the scope
  (gateway.auth: the key's usage series, the quota ticket's settlement) close it there,
  so the outcome stage knows nothing of them. Quick, never raising.
* `state.observers: list[OutcomeObserver]` -- called once per request with the final
  `RequestOutcome` (cost accounting, trace capture). Must be quick and must not raise;
  schedule I/O elsewhere. The router's `ObservesPlacement.placed` and
  `ObservesOutcome.finished` are called by the proxy itself when it implements them.
* `state.tracer: RequestTracer | None` -- OpenTelemetry spans of each proxied request
  (gateway.tracing); `begin` is called once the request is understood, the returned
  `RequestSpans` is told the route, the admission wait, each attempt, the first token and
  the end.
* `state.dispatch_observers: list[DispatchObserver]` -- called with (request, replica, body)
  each time an attempt is sent to a replica, before its response arrives (KV cache events
  count the prompt as about to be cached there). Quick, never raising, never blocking.
* `state.prefill_observers: list[PrefillObserver]` -- called with the request once its
  prefill is over: at its first response byte, or at its end when none came (failure,
  disconnect); may be called more than once for one request (idempotent). Quick, never
  raising (gateway.same_prompt lets the copies of a prompt go).
* `state.pre_route: PreRoute | None` -- called with (request, body) just before the
  routing decision; returns None (route now) or an awaitable the proxy awaits first (KV
  cache events tokenize a prompt they do not know yet, bounded by their budget). Must be
  quick when it returns None; the awaitable must end on its own within its budget.
* `state.cluster.publish_load(replica, EngineLoad)` -- the scraper's input.
* `state.services: list[Service]` -- started in order in the lifespan, stopped in reverse.
* `state.tiers: Tiers | None` -- tiered public model names (gateway.tiers): the
  inbound stage asks it for the entry tier, gateway.proxy.tiered for an answer's checks and
  the next tier; each attempt's `RequestOutcome.tier` says which tier it ran on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.asgi import Scope
from gateway.forecast import Forecast
from gateway.types import (
    Choice,
    ClusterView,
    Endpoint,
    ReplicaId,
    RouteRequest,
    SessionKey,
    TierDecision,
)

if TYPE_CHECKING:
    from gateway.forward import Leg


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How one request ended. Token counts come from the response `usage` when present."""

    request: RouteRequest | None  # None when the request failed before it was understood
    request_id: str
    endpoint: str
    replica: ReplicaId | None  # the replica that produced the response (None: gateway error)
    status: int
    ok: bool
    stream: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttfb_s: float | None = None
    latency_s: float = 0.0
    retries: int = 0
    disconnected: bool = False
    error_code: str | None = None
    started_at: float = 0.0  # wall clock (time.time) at arrival
    # The JSON body as forwarded (aliases resolved). Observers must not mutate it; it lets
    # one re-send the prompt (pools' prefix warming) without keeping bodies elsewhere.
    body: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # The request headers as forwarded to the engine (a reference, not a copy): a re-sent
    # prompt carries the client's credentials, as engines started with an API key require.
    headers: Sequence[tuple[bytes, bytes]] | None = field(default=None, repr=False, compare=False)
    # The router's cache estimate at dispatch (None: its policy estimates nothing).
    forecast: Forecast | None = None
    # The tier this attempt ran on and why, for a tiered model name (gateway.tiers); an
    # escalated request has one outcome per tier it ran on.
    tier: TierDecision | None = None


OutcomeObserver = Callable[[RequestOutcome], None]


@dataclass(frozen=True, slots=True)
class RequestUse:
    """What one request used, for the meters (`state.meters`) at its end."""

    status: int
    ok: bool
    # An engine took the prompt, or may have (the client left while it was being sent);
    # False: refused before any engine worked on it (no replica, connections refused).
    engaged: bool
    usage: Mapping[str, Any] | None  # the engine's `usage`; None: it gave none (or not read)


RequestMeter = Callable[[Scope, RequestUse], None]


@dataclass(frozen=True, slots=True)
class InboundRewrite:
    """A feature's rewrite of every proxied JSON body, before the request is understood
    (gateway.pd: the engine-steering fields a client may not send). `body(body)` returns
    the new body, or None when it leaves it as it is (the usual case, free); the request
    headers in `drop_headers` are never forwarded."""

    body: Callable[[dict[str, Any]], dict[str, Any] | None]
    drop_headers: frozenset[bytes] = frozenset()


DispatchObserver = Callable[[RouteRequest, ReplicaId, Mapping[str, Any]], None]
PreRoute = Callable[[RouteRequest, Mapping[str, Any]], Awaitable[None] | None]
PrefillObserver = Callable[[RouteRequest], None]


class PayloadShaper(Protocol):
    """What the gateway adds to a body per replica (gateway.admission.engine_order)."""

    def __call__(
        self, request: RouteRequest, body: Mapping[str, Any], raw: bytes, replica: ReplicaId
    ) -> bytes:
        """The bytes to send `replica`: `raw` itself when nothing changes."""
        ...

    def body(
        self,
        request: RouteRequest,
        body: Mapping[str, Any],
        replica: ReplicaId,
        *,
        prefills: bool = True,
    ) -> Mapping[str, Any]:
        """The same as a parsed body, for dispatchers that build their own legs;
        `prefills=False` for a leg that receives its prompt as KV (a PD decode leg)."""
        ...


Release = Callable[[], None]


class AdmissionGate(Protocol):
    """See gateway.admission.gate for the full contract."""

    def classify(
        self, request: RouteRequest, body: Any, headers: list[tuple[bytes, bytes]]
    ) -> RouteRequest: ...

    def must_wait(self, request: RouteRequest, replica: ReplicaId, view: ClusterView) -> bool: ...

    async def wait(self, request: RouteRequest, replica: ReplicaId) -> float:
        """Queue until `replica` has room, or raise a GatewayError (429)."""
        ...

    def first_byte(self, request: RouteRequest, replica: ReplicaId | None) -> None:
        """The request's prefill is over: its first response byte, or its end without one
        (`replica` None when no leg opened). Once per request, before `finished`."""
        ...

    def finished(self, request: RouteRequest, replica: ReplicaId | None) -> None: ...


class AttemptSpan(Protocol):
    def headers(self, base: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """`base` with this attempt as the engine's parent span (when propagating)."""
        ...

    def mark_headers(self) -> None: ...

    def end(
        self, status: int | None = None, code: str | None = None, message: str = ""
    ) -> None: ...


class RequestSpans(Protocol):
    """See gateway.tracing.spans.RequestSpan."""

    def forward_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]: ...

    def route(
        self, start_ns: int, policy: str, reason: str, replica: str | None, ranked: int
    ) -> None: ...

    def queued(self, start_ns: int, priority_class: str, replica: str, outcome: str) -> None: ...

    def upstream(self, replica: str, attempt: int) -> AttemptSpan: ...

    def first_token(self, end_ns: int, replica: str) -> None: ...

    def finish(
        self, status: int, replica: str | None, retries: int, error_code: str | None
    ) -> None: ...


class RequestTracer(Protocol):
    def begin(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        incoming: bytes | None,
        start_ns: int,
        attributes: dict[str, str],
    ) -> RequestSpans: ...


class SessionPlacements(Protocol):
    async def lookup(self, key: SessionKey) -> ReplicaId | None: ...

    async def record(self, key: SessionKey, replica: ReplicaId) -> None: ...

    async def link_response(self, response: str, root: str) -> None:
        """The answer `response` continues the Responses chain `root` opened (digests)."""

    async def response_root(self, response: str) -> str | None:
        """The root `link_response` recorded for `response`, or None."""

    async def share(self) -> None:
        """Return once what was recorded so far can be read by other gateways (at once
        when nothing is shared). Best effort: a slow or failed store returns anyway."""


class Tiers(Protocol):
    """Tiered public model names, as the request path asks them (gateway.tiers.runtime):
    the entry tier in inbound, then in gateway.proxy.tiered whether an answer is held to be
    checked, the check it failed, the next tier, and what each attempt served."""

    def entry(
        self,
        model: str,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        headers: Sequence[tuple[bytes, bytes]],
        *,
        session: str | None = None,
        api_key: str | None = None,
        tenant: str | None = None,
        priority_class: str | None = None,
    ) -> TierDecision | None:
        """The tier a request for `model` enters; None: `model` is no tiered name."""
        ...

    def escalates(self, decision: TierDecision, stream: bool) -> bool: ...

    def failed(
        self,
        decision: TierDecision,
        endpoint: Endpoint,
        status: int,
        payload: bytes,
        request: Mapping[str, Any],
    ) -> str | None: ...

    def escalate(self, decision: TierDecision, check: str) -> TierDecision | None: ...

    def served(
        self, decision: TierDecision, usage: Mapping[str, Any] | None, final: bool
    ) -> None: ...


class Service(Protocol):
    """A background component with a lifespan (scraper, store sync, trace writer...)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class ForwardContext:
    """Everything a dispatcher needs to forward one request its own way."""

    request: RouteRequest
    body: dict[str, Any]  # the parsed JSON body (do not mutate; copy to change)
    raw_body: bytes
    path: str  # the route, with the client's query string if it sent one
    headers: list[tuple[bytes, bytes]]  # filtered request headers, x-request-id included
    choice: Choice
    view: ClusterView
    open_leg: Callable[[ReplicaId, bytes, list[tuple[bytes, bytes]] | None], Awaitable[Leg]]
    """`await open_leg(replica, body, headers=None)`: send `body` to `replica` at the same
    path and return once response headers arrived. In-flight accounting, passive health
    and error mapping are included; `leg.aclose()` must be called (the proxy does it for
    the leg you return)."""
    leg_body: Callable[[ReplicaId, bool], Mapping[str, Any]]
    """`leg_body(replica, prefills)`: `body` as `replica` must see it (`state.payload`'s
    per-replica fields, such as the engine `priority`); `body` itself when none apply.
    `prefills` is False for a leg that receives its prompt as KV."""


class Dispatcher(Protocol):
    async def dispatch(self, ctx: ForwardContext) -> Leg | None:
        """Return the leg whose response goes to the client, or None to let the proxy send."""
        ...


class LocalPlacements:
    """Default `SessionPlacements`: a bounded in-process LRU (per gateway process)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._map: OrderedDict[SessionKey, ReplicaId] = OrderedDict()
        self._roots: OrderedDict[str, str] = OrderedDict()

    async def lookup(self, key: SessionKey) -> ReplicaId | None:
        return self._map.get(key)

    async def record(self, key: SessionKey, replica: ReplicaId) -> None:
        m = self._map
        if m.get(key) == replica:
            m.move_to_end(key)
            return
        m[key] = replica
        m.move_to_end(key)
        if len(m) > self.capacity:
            m.popitem(last=False)

    async def link_response(self, response: str, root: str) -> None:
        roots = self._roots
        roots[response] = root
        roots.move_to_end(response)
        if len(roots) > self.capacity:
            roots.popitem(last=False)

    async def response_root(self, response: str) -> str | None:
        return self._roots.get(response)

    async def share(self) -> None:
        return None
