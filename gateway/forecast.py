"""Predicted against achieved prefix-cache hits, per request.

When a request is dispatched, the router's own estimate (`EstimatesCachedTokens`) gives
the cached prompt tokens it expects on the chosen replica and the most any replica holds;
when the answer comes back, the engine's `cached_tokens` says what it really reused. The
three go to `kvgate_cache_*` (gateway.metrics), to the trace capture and to the console,
so a low hit rate can be told apart: the traffic shares little (best is low), the router
chose badly (predicted below best), or the index is wrong (achieved far from predicted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.types import ReplicaId, ReplicaState, RouteRequest

Estimate = Callable[[RouteRequest, ReplicaId], int]


@dataclass(frozen=True, slots=True)
class Forecast:
    policy: str
    predicted: int  # cached tokens expected on the chosen replica
    best: int  # the most any candidate replica was estimated to hold


def forecast(
    estimate: Estimate,
    request: RouteRequest,
    chosen: ReplicaId,
    replicas: Sequence[ReplicaState],
    policy: str,
) -> Forecast:
    """Ask the router before the placement is recorded (which would count the request's
    own prompt as cached). O(replicas) estimates: dispatch, not the decision, pays it."""
    predicted = estimate(request, chosen)
    best = predicted
    for replica in replicas:
        if replica.id != chosen and replica.serves(request.model):
            held = estimate(request, replica.id)
            best = max(best, held)
    return Forecast(policy, predicted, best)
