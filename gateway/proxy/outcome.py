"""Outcome stage: once per request, on every exit path -- metrics, the router, observers."""

from __future__ import annotations

import logging
import time

from gateway.hooks import RequestOutcome, RequestUse
from gateway.proxy.exchange import Exchange
from gateway.state import GatewayState
from gateway.types import Endpoint, ReplicaId
from gateway.usage import usage_tokens

log = logging.getLogger("kvgate.proxy")


class Outcome:
    __slots__ = ("_endpoint", "_state")

    def __init__(self, state: GatewayState, endpoint: Endpoint) -> None:
        self._state = state
        self._endpoint = endpoint.value

    def finish(self, ex: Exchange, replica: ReplicaId | None) -> None:
        state = self._state
        request, call = ex.request, ex.call
        latency = time.perf_counter() - ex.t0
        ttfb = call.ttfb - ex.t0 if call.ttfb is not None else None
        stream = request.stream if request is not None else False
        state.metrics.request_done(self._endpoint, replica or "", ex.status, stream, latency, ttfb)
        if request is not None and replica is not None and state.router_finished is not None:
            state.router_finished(request, replica, ex.ok, latency)
        if meters := state.meters:
            use = RequestUse(ex.status, ex.ok, ex.reached or call.disconnected, ex.usage)
            for meter in meters:
                meter(ex.scope, use)
        observers = state.observers
        if not observers:
            return
        prompt, cached, completion = usage_tokens(ex.usage)
        outcome = RequestOutcome(
            request=request,
            request_id=ex.request_id,
            endpoint=self._endpoint,
            replica=replica,
            status=ex.status,
            ok=ex.ok,
            stream=stream,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            ttfb_s=ttfb,
            latency_s=latency,
            retries=ex.retries,
            disconnected=call.disconnected,
            error_code=ex.error_code,
            started_at=ex.started_at,
            body=ex.body if request is not None else None,
            headers=ex.headers if request is not None else None,
            forecast=ex.forecast,
            tier=ex.tier,
        )
        for observer in observers:
            try:
                observer(outcome)
            except Exception:  # an observer bug must not break the response path
                log.exception("outcome observer %r failed", observer)
