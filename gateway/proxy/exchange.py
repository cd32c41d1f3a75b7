"""`Exchange`: everything one proxied request carries from arrival to its outcome.

Each stage of the pipeline (gateway.proxy.endpoint) reads what the earlier ones wrote and
fills its own part, so no stage needs more than the exchange as its argument:

* inbound: `body`, `raw` (or `upload`), `request`, `headers`, `path`, `strip_usage`;
* identity: `request` gets its session's sticky replica and its priority class;
* attempts: `leg`, `retries`;
* relay and outcome: `status`, `ok`, `error_code`, `usage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.asgi import Receive, Scope, Send
from gateway.disconnect import CallState
from gateway.errors import ErrorDialect
from gateway.forecast import Forecast
from gateway.types import ReplicaId, RouteRequest, SessionKey, TierDecision

if TYPE_CHECKING:
    from gateway.forward import Leg
    from gateway.hooks import RequestSpans
    from gateway.upload import Upload

RawHeaders = list[tuple[bytes, bytes]]


class Exchange:
    """One request's state (a slotted plain class: one is built per request)."""

    __slots__ = (
        "body",
        "borrowed",
        "call",
        "chain_root",
        "error_code",
        "errors",
        "find_response_id",
        "forecast",
        "headers",
        "leg",
        "named_class",
        "ok",
        "parent_key",
        "path",
        "placed_on",
        "pools",
        "raw",
        "reached",
        "receive",
        "request",
        "request_id",
        "response_id",
        "retries",
        "scope",
        "send",
        "session_header",
        "started_at",
        "status",
        "strip_usage",
        "t0",
        "tier",
        "trace",
        "traceparent",
        "upload",
        "usage",
    )

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: CallState,
        request_id: str,
        t0: float,
        started_at: float,
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.call = call
        self.request_id = request_id
        self.t0 = t0
        self.started_at = started_at  # wall clock, for observers
        # Inbound: set together once the request is understood (None before that).
        self.request: RouteRequest | None = None
        self.body: dict[str, Any] | None = None
        self.raw = b""
        # A body streamed through instead of read (multipart uploads); `raw` is then empty.
        self.upload: Upload | None = None
        self.headers: RawHeaders = []
        self.path = ""
        self.strip_usage = False
        self.named_class = False  # the client asked for a priority class itself
        # Pools the caller's key may land on (None: any).
        self.pools: frozenset[str] | None = None
        # Attempts and relay.
        self.leg: Leg | None = None
        # The replica the last attempt was sent to (the router was told of it then).
        self.placed_on: ReplicaId | None = None
        # An engine may hold the prompt (a leg opened, or an attempt failed past its
        # connection): a quota charge then stands however the request ends.
        self.reached = False
        self.retries = 0
        self.status = 0
        self.ok = False
        self.error_code: str | None = None
        self.usage: dict[str, Any] | None = None
        # The shape of the gateway's own error bodies on this route ("openai", "anthropic").
        self.errors: ErrorDialect = "openai"
        # Responses API: read the answer's id, so a continuation finds its replica.
        self.find_response_id = False
        # Lineage the client named: its parent agent's session, the Responses chain's root
        # (a digest), and whether the sticky replica came from them, not the own session.
        self.parent_key: SessionKey | None = None
        self.chain_root: str | None = None
        self.borrowed = False
        self.forecast: Forecast | None = None  # the router's cache estimate at dispatch
        self.response_id: str | None = None
        # The caller's W3C traceparent, and the spans of this request (tracing enabled).
        self.session_header: str | None = None  # the client's session id, as sent
        # Tiered models (gateway.tiers): the tier this attempt runs on, and why.
        self.tier: TierDecision | None = None
        self.traceparent: bytes | None = None
        self.trace: RequestSpans | None = None
