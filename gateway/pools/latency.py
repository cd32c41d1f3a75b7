"""Recent time to first byte per pool, and how the controller reads it as utilisation.

Slot counts say how many sequences a replica holds, not how fast it prefills: a slow-prefill
pool can sit under its low watermark while requests already queue behind one long prompt.
The first-byte times the gateway sees are the direct measure of that queueing, so with a
`ttft_target_s` the controller treats a pool's recent TTFT quantile as a utilisation too:
a quantile at the target reads as the high watermark (traffic stops moving onto the pool,
and moves off it beyond), one at `low/high` of the target as the low watermark.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping


class TtftWindow:
    """First-byte times per pool over the last `window_s` seconds (bounded per pool)."""

    def __init__(self, pools: Iterable[str], window_s: float, max_samples: int = 4096) -> None:
        self._window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=max_samples) for name in pools
        }

    def add(self, pool: str, at: float, ttfb_s: float) -> None:
        samples = self._samples.get(pool)
        if samples is not None:
            samples.append((at, ttfb_s))

    def quantiles(self, now: float, q: float) -> dict[str, float | None]:
        """The `q` quantile (nearest rank) per pool; None for a pool with no recent sample."""
        out: dict[str, float | None] = {}
        for pool, samples in self._samples.items():
            while samples and samples[0][0] < now - self._window_s:
                samples.popleft()
            values = sorted(v for _, v in samples)
            out[pool] = values[min(len(values) - 1, int(q * len(values)))] if values else None
        return out


def with_latency(
    util: Mapping[str, float | None],
    ttft: Mapping[str, float | None],
    target_s: float,
    high_watermark: float,
) -> dict[str, float | None]:
    """Each pool's utilisation raised to its latency pressure `high * ttft / target`.
    A pool without healthy replicas (None) stays None; one without recent TTFT keeps its
    slot-based figure."""
    out: dict[str, float | None] = {}
    for pool, u in util.items():
        t = ttft.get(pool)
        out[pool] = u if u is None or t is None else max(u, high_watermark * t / target_s)
    return out
