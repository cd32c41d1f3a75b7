"""The sampler: every `sample_interval_s`, one snapshot of the gateway into the history.

It runs in the lifespan, off the request path. It reads the cluster (health, in-flight,
scraped engine loads), the gateway's own Prometheus series (requests, errors, decisions,
admission, PD), the pools' weights and the per-request measurements when they are on. Each
sample is stored serialised (orjson bytes), so the history costs a few kilobytes per
sample and serving it is a join.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from gateway.console.counters import Rates, Samples, by_label, read_series, replica_failures
from gateway.console.fleet import Fleet
from gateway.console.measure import Measurements
from gateway.console.watch import Watch

log = logging.getLogger("kvgate.console")


# Per-replica error shares span this long: one sample interval holds too few attempts
# on a replica the router steers away from to say anything.
ERROR_WINDOW_S = 60.0


def error_shares(
    window: deque[tuple[float, dict[str, float]]],
) -> dict[str, float | None]:
    """Per replica, the share of its attempts that failed between the oldest and the
    newest totals in `window` (None: no attempt in that span)."""
    if len(window) < 2:
        return {}
    (_, first), (_, last) = window[0], window[-1]
    out: dict[str, float | None] = {}
    for key, value in last.items():
        if not key.startswith("attempts:"):
            continue
        replica = key.removeprefix("attempts:")
        attempts = value - first.get(key, 0.0)
        failed = last.get(f"failed:{replica}", 0.0) - first.get(f"failed:{replica}", 0.0)
        # A counter that went down was reset: no share until the window is past it.
        out[replica] = min(1.0, failed / attempts) if attempts > 0 and failed >= 0 else None
    return out


class Sampler:
    def __init__(
        self,
        fleet: Fleet,
        measurements: Measurements,
        watch: Watch,
        *,
        interval_s: float,
        idle_interval_s: float | None = None,
        history_s: float,
        live_session_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.measurements = measurements
        self.watch = watch
        self.interval_s = interval_s
        # While idle (nobody reads the console, no request began): one sample this often.
        self.idle_interval_s = max(interval_s, idle_interval_s or interval_s)
        self._history_s = history_s
        self._active = False  # a request began since the last sample
        self._last_sample = -math.inf
        self.samples_taken = 0
        fleet.cluster.on_busy(self._request_began)
        self._live_session_s = live_session_s
        self._clock = clock
        self._history: deque[tuple[float, bytes]] = deque(
            maxlen=max(1, round(history_s / interval_s))
        )
        self._rates = Rates()
        self.rates: dict[str, float] = {}
        self._error_window: deque[tuple[float, dict[str, float]]] = deque()
        self.error_shares: dict[str, float | None] = {}
        self.series: Samples = {}
        self._task: asyncio.Task[None] | None = None

    # -- lifespan ---------------------------------------------------------------------
    async def start(self) -> None:
        self.sample_once()
        self._task = asyncio.create_task(self._run(), name="kvgate-console-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.watch.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self.due():
                    self.sample_once()
            except Exception:  # the sampler must outlive one bad round; say so
                log.exception("console sample failed")

    def _request_began(self, _replica: str) -> None:
        self._active = True

    def idle(self) -> bool:
        """Nobody reads the console, no request began since the last sample, none runs."""
        if self._active or self.watch.read_recently:
            return False
        return not any(self.fleet.cluster.in_flight.values())

    def due(self) -> bool:
        """Whether the sampler's tick (every `interval_s`) takes a sample."""
        if not self.idle():
            return True
        # Half a tick early counts: ticks drift by the time a sample takes.
        return self._clock() - self._last_sample >= self.idle_interval_s - self.interval_s / 2

    # -- sampling ---------------------------------------------------------------------
    def sample_once(self) -> dict[str, Any]:
        now = self._clock()
        self._active = False
        self._last_sample = now
        self.samples_taken += 1
        self.watch.tick()
        self.series = series = read_series(self.fleet.registry)
        totals = self._totals(series)
        self.rates = rates = self._rates.update(now, totals)
        window = self._error_window
        window.append(
            (now, {k: v for k, v in totals.items() if k.startswith(("failed:", "attempts:"))})
        )
        while len(window) > 2 and window[1][0] <= now - ERROR_WINDOW_S:
            window.popleft()
        self.error_shares = error_shares(window)
        sample = self._sample(now, series, rates)
        history = self._history
        history.append((now, orjson.dumps(sample, option=orjson.OPT_NON_STR_KEYS)))
        while history[0][0] < now - self._history_s:  # idle samples are sparser
            history.popleft()
        self.measurements.forget(list(self.fleet.cluster.in_flight))
        return sample

    def _totals(self, series: Samples) -> dict[str, float]:
        totals: dict[str, float] = {}
        requests = series["kvgate_requests_total"]
        totals["requests"] = sum(requests.values())
        for replica, value in by_label(requests, "replica").items():
            totals[f"requests:{replica}"] = value
        for replica, (bad, attempts) in replica_failures(series).items():
            totals[f"failed:{replica}"] = bad
            totals[f"attempts:{replica}"] = attempts
        totals["errors"] = 0.0
        for status, value in by_label(requests, "status").items():
            if status.startswith(("4", "5")):
                totals["errors"] += value
        totals["rejected"] = sum(series["kvgate_admission_rejected_total"].values())
        for reason, value in by_label(series["kvgate_routing_decisions_total"], "reason").items():
            totals[f"decision:{reason}"] = value
        for name, value in by_label(
            series["kvgate_pd_decisions_total"], "decision", "reason"
        ).items():
            totals[f"pd:{name}"] = value
        if self.watch.measuring:
            m = self.measurements
            for key, value in m.totals().items():
                totals[f"tokens:{key}"] = value
            for replica, tally in m.tallies.items():
                totals[f"tokens:{replica}"] = float(tally.prompt + tally.completion)
        return totals

    def _sample(self, now: float, series: Samples, rates: dict[str, float]) -> dict[str, Any]:
        fleet = self.fleet
        measuring = self.watch.measuring
        replicas: dict[str, Any] = {}
        for row in fleet.rows():
            rid = row["id"]
            p50 = None
            if measuring and (q := self.measurements.ttft(rid, (0.5,))) is not None:
                p50 = q[0]
            replicas[rid] = {
                "health": row["health"],
                "in_flight": row["in_flight"],
                "waiting": row["waiting"],
                "kv": row["kv_usage"],
                "hit": row["prefix_hit_rate"],
                "rps": rates.get(f"requests:{rid}", 0.0) if rates else None,
                "err": self.error_shares.get(rid),
                "tps": rates.get(f"tokens:{rid}", 0.0) if measuring and rates else None,
                "ttft_p50": p50,
            }
        prompt, output = rates.get("tokens:prompt"), rates.get("tokens:completion")
        cached = rates.get("tokens:cached")
        return {
            "t": now,
            "measuring": measuring,
            "requests_per_s": rates.get("requests"),
            "errors_per_s": rates.get("errors"),
            "rejected_per_s": rates.get("rejected"),
            "tokens_per_s": None if prompt is None or output is None else prompt + output,
            "output_tokens_per_s": output,
            "cached_share": cached / prompt if prompt and cached is not None else None,
            "live_sessions": self.measurements.live_sessions(self._live_session_s)
            if measuring
            else None,
            "queued": by_label(series["kvgate_admission_queue_depth"], "priority_class"),
            "weights": fleet.pool_weights(),
            "pd_per_s": {k[3:]: v for k, v in rates.items() if k.startswith("pd:")},
            "replicas": replicas,
        }

    def since(self, t: float) -> bytes:
        """The samples after wall time `t`, as one JSON array."""
        return b"[" + b",".join(raw for at, raw in self._history if at > t) + b"]"

    def __len__(self) -> int:
        return len(self._history)
