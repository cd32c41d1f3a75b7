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

from gateway.types import ReplicaId, RouteRequest

Estimate = Callable[[RouteRequest, ReplicaId], int]
# Candidates asked for the best estimate: the head of the router's ranking. A replica
# holding much more of the prompt than the chosen one ranks near the top for every
# cache-aware policy, while asking every replica cost 0.5 ms a request at 512 replicas
# (loadtests/bench_forecast.py).
BEST_OF = 16


@dataclass(frozen=True, slots=True)
class Forecast:
    policy: str
    predicted: int  # cached tokens expected on the chosen replica
    best: int  # the most the router's first `BEST_OF` candidates were estimated to hold


def forecast(
    estimate: Estimate,
    request: RouteRequest,
    chosen: ReplicaId,
    ranked: Sequence[ReplicaId],
    policy: str,
) -> Forecast:
    """Ask the router before the placement is recorded (which would count the request's
    own prompt as cached); at most `BEST_OF` + 1 estimates."""
    predicted = estimate(request, chosen)
    best = predicted
    for replica in ranked[:BEST_OF]:
        if replica != chosen:
            held = estimate(request, replica)
            best = max(best, held)
    return Forecast(policy, predicted, best)
