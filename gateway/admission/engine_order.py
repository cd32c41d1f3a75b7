"""What `priority` each engine sees: the request's class first, then, within a class, the
shortest uncached prefill first.

An engine started with vLLM's `--scheduling-policy priority` takes waiting requests by
`priority` (lower first), then by arrival. Only the gateway knows how much of a prompt the
chosen replica already holds, so it can turn that queue into shortest-uncached-prefill
first: a turn that extends a cached conversation by a few thousand tokens no longer waits
behind a new 100K-token context that arrived a moment earlier. Ranks are coarse (powers of
two of `step_tokens`, the last one open-ended), so requests of one rank keep their arrival
order and every long prefill shares the last rank: a long new context waits behind short
ones, never behind a stream of slightly shorter long ones (which raised the p99).

    rank     = 0 below 2 x step_tokens, else floor(log2(uncached / step_tokens)), < levels
    priority = class priority x levels + rank

The class (admission's, else the client's integer `priority`) always dominates: ranks stay
below `levels`, so one class step outweighs any size difference.

The gateway reads and writes these values in vLLM's sense (lower first). An engine that
runs larger values first (SGLang's default, `priority_order: higher_first`) is sent the
negated value, so both kinds serve the same order; a client's own integer is read in
vLLM's sense too.

Replicas not marked `priority_scheduling` get the body unchanged, except that with
admission on the field is stripped (such engines answer 400 to any non-zero priority, and a
class name is never engine input). The body is re-serialised only when it must change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.admission.classes import BODY_FIELD, ClassMap
from gateway.admission.config import EnginePrioritySettings
from gateway.policy import EstimatesCachedTokens
from gateway.types import ReplicaId, RouteRequest


def prefill_rank(uncached_tokens: int, step_tokens: int, levels: int) -> int:
    """0 for prefills under 2 x `step_tokens`, one more per doubling, at most `levels` - 1."""
    if uncached_tokens < 2 * step_tokens:
        return 0
    return min(levels - 1, int(math.log2(uncached_tokens / step_tokens)))


def with_priority(body: Mapping[str, Any], raw: bytes, wanted: int | None) -> bytes:
    """`raw` with the body's `priority` set to `wanted`, or removed when `wanted` is None."""
    shaped = priority_body(body, wanted)
    return raw if shaped is body else orjson.dumps(shaped)


def priority_body(body: Mapping[str, Any], wanted: int | None) -> Mapping[str, Any]:
    """`body` with `priority` set to `wanted` (removed when None); `body` itself if so already."""
    if wanted is None:
        if BODY_FIELD not in body:
            return body
        out = dict(body)
        del out[BODY_FIELD]
        return out
    current = body.get(BODY_FIELD)
    if current == wanted and type(current) is int:
        return body
    return {**body, BODY_FIELD: wanted}


class _Keep:
    """The client's field goes as it came."""


KEEP = _Keep()


class EnginePayload:
    """The body bytes for one attempt on one replica: a `gateway.hooks.PayloadShaper`."""

    def __init__(
        self,
        settings: EnginePrioritySettings,
        priority_replicas: frozenset[ReplicaId],
        *,
        higher_first: frozenset[ReplicaId] = frozenset(),
        classes: ClassMap | None = None,
        cache: object | None = None,
        detected: frozenset[ReplicaId] = frozenset(),
        runs_higher_first: Callable[[ReplicaId], bool | None] | None = None,
    ) -> None:
        self._settings = settings
        self._replicas = priority_replicas
        self._negate = higher_first & priority_replicas
        # Replicas whose direction is read from the engine (`engine: auto`, no
        # `priority_order`): `runs_higher_first` says it, or None while unknown, and then
        # no priority is sent at all (a lower-first value on a larger-first engine would
        # invert every class).
        self._detected = detected & priority_replicas
        self._direction = runs_higher_first
        self._classes = classes
        # Only policies with a prefix index can say what the chosen replica holds.
        self._cache = cache if isinstance(cache, EstimatesCachedTokens) else None

    def __call__(
        self, request: RouteRequest, body: Mapping[str, Any], raw: bytes, replica: ReplicaId
    ) -> bytes:
        wanted = self.wanted(request, body, replica)
        return raw if isinstance(wanted, _Keep) else with_priority(body, raw, wanted)

    def body(
        self,
        request: RouteRequest,
        body: Mapping[str, Any],
        replica: ReplicaId,
        *,
        prefills: bool = True,
    ) -> Mapping[str, Any]:
        """The parsed body for a leg to `replica` (PD builds its legs from it); a decode
        leg (`prefills=False`) receives its prompt as KV, so it ranks as nothing to prefill."""
        wanted = self.wanted(request, body, replica, uncached=None if prefills else 0)
        return body if isinstance(wanted, _Keep) else priority_body(body, wanted)

    def wanted(
        self,
        request: RouteRequest,
        body: Mapping[str, Any],
        replica: ReplicaId,
        *,
        uncached: int | None = None,
    ) -> int | _Keep | None:
        """The `priority` to send `replica` (None: none), or KEEP for the client's own."""
        classes = self._classes
        if replica not in self._replicas:
            return KEEP if classes is None else None
        if classes is not None:
            base = classes.engine_priority.get(request.priority_class, 0)
        else:
            given = body.get(BODY_FIELD, 0)
            if isinstance(given, bool) or not isinstance(given, int):
                return KEEP  # not ours to interpret: the engine answers it
            base = given
        negate = replica in self._negate
        if replica in self._detected:
            found = self._direction(replica) if self._direction is not None else None
            if found is None:
                return None
            negate = found
        settings = self._settings
        if not settings.shortest_prefill_first:
            if classes is None and not negate:
                return KEEP
            value = base
        else:
            if uncached is None:
                uncached = self.uncached(request, replica)
            value = base * settings.levels + prefill_rank(
                uncached, settings.step_tokens, settings.levels
            )
        return -value if negate else value

    def uncached(self, request: RouteRequest, replica: ReplicaId) -> int:
        cached = self._cache.cached_tokens(request, replica) if self._cache is not None else 0
        return max(0, request.prompt_tokens - cached)

    def rank(self, request: RouteRequest, replica: ReplicaId) -> int:
        s = self._settings
        return prefill_rank(self.uncached(request, replica), s.step_tokens, s.levels)
