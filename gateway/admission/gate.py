"""The admission gate the proxy calls between choosing a replica and sending to it.

Contract with the proxy (all calls on the event loop):

    request = gate.classify(request, body, headers)   # before routing; may raise 400
    choice = router.choose(request, view)
    if gate.must_wait(request, replica, view):        # sync, no allocation: the fast path
        await gate.wait(request, replica)             # may raise RateLimited (429)
    <count the request in flight for `replica` before the next await>
    send state.payload(request, body, raw, replica)   # engine_order: vLLM `priority`
    ...
    at the first response byte (or at the end, whichever comes first), exactly once:
        gate.first_byte(request, replica)   # the prefill is over: frees `max_prefill_tokens`
    finally: <decrement in flight>; gate.finished(request, replica)   # every exit path

`must_wait` is a few dictionary look-ups (plus one small record per request when
`max_prompt_tokens` is set); it is False whenever nobody waits for the replica and it is not
saturated, so admission costs next to nothing at low load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.admission.classes import (
    BODY_FIELD,
    PRIORITY_HEADER,
    ClassMap,
    resolve_class,
)
from gateway.admission.config import AdmissionSettings
from gateway.admission.history import OutputHistory
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.order import Ordering, request_score
from gateway.admission.queue import WaitingRoom
from gateway.admission.saturation import is_saturated
from gateway.auth.middleware import presented_key
from gateway.policy import EstimatesCachedTokens
from gateway.types import ClusterView, ReplicaId, RouteRequest

ViewSource = Callable[[], ClusterView]


class AdmissionGate:
    """Classes, saturation checks and the waiting room for one gateway process."""

    def __init__(
        self,
        settings: AdmissionSettings,
        view_source: ViewSource,
        *,
        registry: CollectorRegistry | None = None,
        policy: object | None = None,
        priority_header: str = PRIORITY_HEADER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.classes = ClassMap.from_settings(settings)
        self.ordering = Ordering.from_settings(settings)
        self.history = OutputHistory()
        # Per class: lower classes are saturated earlier (their holdback).
        self._thresholds = {
            c.name: settings.saturation.held_back(c.holdback) for c in settings.classes
        }
        self._fallback = self._thresholds[settings.classes[-1].name]
        self._header_name = priority_header.lower()
        self._header = self._header_name.encode("latin-1")
        self._view_source = view_source
        self._clock = clock
        # Detected once: only policies with a prefix index can say what is cached where.
        self._cache = policy if isinstance(policy, EstimatesCachedTokens) else None
        # replica -> (scraped_at of the load last seen, in-flight count when first seen)
        self._marks: dict[ReplicaId, tuple[float, int]] = {}
        # Prompt tokens in flight, only kept when a threshold needs them. Keyed by the
        # request object's identity: client-chosen request ids need not be unique.
        sat = settings.saturation
        self._track_prompt = sat.max_prompt_tokens is not None
        self._track_prefill = sat.max_prefill_tokens is not None
        self._track_tokens = self._track_prompt or self._track_prefill
        self._chunk = sat.prefill_chunk_tokens
        self._flight: dict[int, tuple[ReplicaId, int]] = {}
        self._tokens: dict[ReplicaId, int] = {}
        # Requests admitted and still prefilling (no first byte yet): step weight per replica.
        self._prefilling: dict[int, tuple[ReplicaId, int]] = {}
        self._prefill: dict[ReplicaId, int] = {}
        metrics = (
            AdmissionMetrics(registry, tuple(c.name for c in settings.classes))
            if registry is not None
            else None
        )
        self.room = WaitingRoom(
            self._has_room,
            max_queue=settings.max_queue,
            max_wait_s=settings.max_wait_s,
            retry_after_s=settings.retry_after_s,
            recheck_interval_s=settings.recheck_interval_s,
            metrics=metrics,
            clock=clock,
            backfill_s=settings.backfill_s,
        )

    # ---- the request path ----------------------------------------------------------
    def must_wait(self, request: RouteRequest, replica: ReplicaId, view: ClusterView) -> bool:
        """True when the request must queue: others wait for `replica`, or it is saturated
        for the request's class."""
        if self.room.busy(replica):
            return True
        if not self._track_tokens:
            return self._saturated(replica, view, 0, 0, request.priority_class, 0)
        tokens = request.prompt_tokens
        if self._track_prefill and self._cache is not None and request.prefix_hashes:
            tokens = max(0, tokens - self._cache.cached_tokens(request, replica))
        if self._saturated(replica, view, 0, 0, request.priority_class, tokens):
            return True
        self._enter(request, replica, tokens)
        return False

    async def wait(self, request: RouteRequest, replica: ReplicaId) -> float:
        """Queue until `replica` has room; returns seconds waited. Raises `RateLimited`."""
        cached = 0
        if self._cache is not None and request.prefix_hashes:
            cached = self._cache.cached_tokens(request, replica)
        rank = request_score(
            request,
            self._clock(),
            self.ordering,
            cached_tokens=cached,
            tenant_average=self.history.average(request.tenant),
        )
        cls = request.priority_class
        class_rank = self.ordering.class_index.get(cls, len(self.ordering.class_index))
        if not self._track_tokens:
            return await self.room.wait(replica, rank, cls, 0, class_rank)
        tokens = max(0, request.prompt_tokens - cached)
        waited = await self.room.wait(replica, rank, cls, tokens, class_rank)
        self._enter(request, replica, tokens)
        return waited

    def finished(self, request: RouteRequest, replica: ReplicaId | None) -> None:
        """`request` ended, on any path, after its in-flight slot (if any) was released."""
        self._end_prefill(request)
        entry = self._flight.pop(id(request), None) if self._track_prompt else None
        if entry is not None:
            counted, tokens = entry
            left = self._tokens[counted] - tokens
            if left > 0:
                self._tokens[counted] = left
            else:
                del self._tokens[counted]
            self.room.poke(counted)
        if replica is not None and (entry is None or entry[0] != replica):
            self.room.poke(replica)

    def first_byte(self, request: RouteRequest, replica: ReplicaId | None) -> None:
        """`request`'s prefill is over (first response byte, or it ended): its share of the
        prefill budget frees. Idempotent; `finished` does the same for a proxy that never
        calls it."""
        self._end_prefill(request)

    def _end_prefill(self, request: RouteRequest) -> None:
        if not self._track_prefill:
            return
        entry = self._prefilling.pop(id(request), None)
        if entry is None:
            return
        counted, weight = entry
        left = self._prefill[counted] - weight
        if left > 0:
            self._prefill[counted] = left
        else:
            del self._prefill[counted]
        self.room.poke(counted)

    def _step_weight(self, tokens: int) -> int:
        chunk = self._chunk
        return tokens if chunk is None or tokens < chunk else chunk

    def _enter(self, request: RouteRequest, replica: ReplicaId, tokens: int) -> None:
        if self._track_prompt:
            self._flight[id(request)] = (replica, tokens)
            self._tokens[replica] = self._tokens.get(replica, 0) + tokens
        if self._track_prefill:
            weight = self._step_weight(tokens)
            self._prefilling[id(request)] = (replica, weight)
            self._prefill[replica] = self._prefill.get(replica, 0) + weight

    def prompt_tokens_in_flight(self, replica: ReplicaId) -> int:
        return self._tokens.get(replica, 0)

    def prefill_tokens_in_flight(self, replica: ReplicaId) -> int:
        return self._prefill.get(replica, 0)

    def record_output(self, tenant: str | None, completion_tokens: int) -> None:
        self.history.record(tenant, completion_tokens)

    def classify(
        self,
        request: RouteRequest,
        body: Mapping[str, Any],
        headers: Sequence[tuple[bytes, bytes]],
    ) -> RouteRequest:
        """`request` with its resolved class (API key, header, body, default); 400 if unknown."""
        # `headers` are the client's own (the forwarded ones carry the engine's key): the
        # key is read from wherever the front door reads it.
        api_key: str | None = None
        if self.classes.key_classes:
            presented = presented_key(list(headers))
            api_key = presented.decode("latin-1") if presented is not None else None
        header: str | None = None
        for name, value in headers:
            if name == self._header:
                header = value.decode("latin-1")
        resolved = resolve_class(
            self.classes,
            api_key=api_key,
            header=header,
            body_priority=body.get(BODY_FIELD),
            header_name=self._header_name,
        )
        if resolved == request.priority_class:
            return request
        return replace(request, priority_class=resolved)

    def close(self) -> None:
        self.room.close()

    # ---- saturation ----------------------------------------------------------------
    def _has_room(
        self, replica: ReplicaId, reserved: int, reserved_tokens: int, class_name: str, tokens: int
    ) -> bool:
        view = self._view_source()
        return not self._saturated(replica, view, reserved, reserved_tokens, class_name, tokens)

    def _saturated(
        self,
        replica: ReplicaId,
        view: ClusterView,
        reserved: int,
        reserved_tokens: int,
        class_name: str,
        tokens: int,
    ) -> bool:
        state = view.by_id.get(replica)
        if state is None or not state.healthy:
            # Not ours to hold: the proxy fails over or answers the error itself.
            return False
        inflight = view.inflight(replica)
        load = view.load_of(state)
        at_scrape = inflight
        # No engine load (its /metrics is absent): only the gateway's own counts judge it.
        if load is not None and load.engine:
            mark = self._marks.get(replica)
            if mark is None or mark[0] != load.scraped_at:
                self._marks[replica] = (load.scraped_at, inflight)
            else:
                at_scrape = mark[1]
        thresholds = self._thresholds.get(class_name) or self._fallback
        if not self._track_tokens:
            return is_saturated(load, inflight + reserved, at_scrape, thresholds)
        in_flight_tokens = self._tokens.get(replica, 0) + reserved_tokens
        prefill = 0
        if self._track_prefill:
            # Reservations carry uncached tokens; capped per request they weigh at most this.
            chunk = self._chunk
            held = reserved_tokens if chunk is None else min(reserved_tokens, reserved * chunk)
            prefill = self._prefill.get(replica, 0) + held
        return is_saturated(
            load,
            inflight + reserved,
            at_scrape,
            thresholds,
            in_flight_tokens,
            tokens,
            prefill,
            self._step_weight(tokens),
        )
