"""The traffic panel's cache forecast: predicted against reported prefix-cache hits
(gateway.forecast), totals read back from the gateway's own `kvgate_cache_*` series."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gateway.console.counters import read_series

_PREDICTED = "kvgate_cache_predicted_tokens_total"
_BEST = "kvgate_cache_best_tokens_total"
_ACHIEVED = "kvgate_cache_achieved_tokens_total"
_COUNT = "kvgate_cache_prediction_error_tokens_count"


def cache_forecast(registry: CollectorRegistry) -> dict[str, Any] | None:
    """Totals since start over every replica and policy; None before any request had both
    a prediction and the engine's `cached_tokens`."""
    series = read_series(registry, (_PREDICTED, _BEST, _ACHIEVED, _COUNT))
    total = {name: sum(values.values()) for name, values in series.items()}
    requests = int(total[_COUNT])
    if not requests:
        return None
    predicted, achieved = total[_PREDICTED], total[_ACHIEVED]
    return {
        "requests": requests,
        "predicted_tokens": int(predicted),
        "best_tokens": int(total[_BEST]),
        "achieved_tokens": int(achieved),
        "achieved_over_predicted": round(achieved / predicted, 4) if predicted else None,
    }
