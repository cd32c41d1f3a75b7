"""A tiered request (gateway.tiers): its answer checked, and re-run a tier up when it fails.

Each attempt is a whole request of its own to the pipeline (identity, routing, admission,
relay, settle and outcome: every slot it took is released before the next one starts),
with the client's `send` replaced by `Held`, which keeps the answer instead of sending it.
When the tier's answer passes its checks (or the tier never escalates, or it is the top),
the held answer goes out with `x-kvgate-tier` and `x-kvgate-tier-reason`. Requests whose
answer is not checked (streams without `on_error`, tiers without `escalate`) are relayed
as they arrive, only with those two headers added.

A stream is held only until its response starts (`Held.stream_through`): an error status
before the first byte escalates, after that the stream goes through unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.asgi import Message, Send
from gateway.errors import GatewayError
from gateway.hooks import Tiers
from gateway.proxy.exchange import Exchange, RawHeaders
from gateway.types import Endpoint, TierDecision

TIER_HEADER = b"x-kvgate-tier"
REASON_HEADER = b"x-kvgate-tier-reason"
_SSE = b"text/event-stream"


def tier_headers(decision: TierDecision) -> RawHeaders:
    return [(TIER_HEADER, decision.tier.encode()), (REASON_HEADER, decision.reason.encode())]


def labelled(send: Send, decision: TierDecision) -> Send:
    """`send` with the tier headers added to the response start."""

    async def send_labelled(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], *tier_headers(decision)]}
        await send(message)

    return send_labelled


class Held:
    """An ASGI `send` that keeps a response; a stream that started well goes through."""

    __slots__ = ("body", "complete", "headers", "passed", "send", "status")

    def __init__(self, send: Send, decision: TierDecision) -> None:
        self.send = labelled(send, decision)
        self.status = 0
        self.headers: RawHeaders = []
        self.body: list[bytes] = []
        self.complete = False
        self.passed = False  # a stream that started with a success goes straight out

    async def __call__(self, message: Message) -> None:
        if self.passed:
            await self.send(message)
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            content_type = next((v for n, v in self.headers if n == b"content-type"), b"")
            if self.status < 400 and content_type.startswith(_SSE):
                self.passed = True
                await self.send(message)
            return
        self.body.append(message.get("body", b""))
        if not message.get("more_body", False):
            self.complete = True

    @property
    def payload(self) -> bytes:
        return b"".join(self.body)

    async def release(self) -> None:
        if self.passed or not self.status:
            return
        payload = self.payload
        await self.send(
            {"type": "http.response.start", "status": self.status, "headers": self.headers}
        )
        await self.send({"type": "http.response.body", "body": payload, "more_body": False})


async def run_tiered(
    ex: Exchange,
    tiers: Tiers,
    endpoint: Endpoint,
    route_and_relay: Callable[[Exchange], Awaitable[None]],
    retier: Callable[[Exchange, TierDecision], Exchange],
) -> None:
    decision = ex.tier
    assert decision is not None and ex.request is not None
    client_send = ex.send
    stream = ex.request.stream
    if not tiers.escalates(decision, stream):
        ex.send = labelled(client_send, decision)
        await route_and_relay(ex)
        tiers.served(decision, ex.usage, final=True)
        return
    request_body: dict[str, Any] = ex.body or {}
    while True:
        held = Held(client_send, decision)
        ex.send = held
        await route_and_relay(ex)
        call = ex.call
        if call.disconnected or held.passed or not held.complete:
            tiers.served(decision, ex.usage, final=True)
            return
        check = tiers.failed(decision, endpoint, held.status, held.payload, request_body)
        following = tiers.escalate(decision, check) if check is not None else None
        tiers.served(decision, ex.usage, final=following is None)
        if following is None:
            await held.release()
            return
        # Nothing reached the client: the next attempt starts as a fresh request would.
        try:
            retiered = retier(ex, following)
        except GatewayError:
            await held.release()  # the next tier is not served: the answer there is
            return
        call.started, call.ttfb, call.watching = False, None, True
        ex, decision = retiered, following
