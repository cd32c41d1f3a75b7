"""How late the event loop wakes: `kvgate_event_loop_lag_seconds` (listed in
`gateway.app.FEATURE_INSTALLERS`).

Every request, relay and health probe of a gateway process runs on one event loop, so
anything that holds it (a long synchronous step, a thread holding the interpreter lock, a
collection) delays them all by as much. A timer asks to wake every `LAG_INTERVAL_S` and
records how much later than asked it woke. That samples: a stall shows up when a wake-up
falls inside it, so short stalls are seen in proportion to how often they happen.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Histogram

from gateway.state import GatewayState

LAG_INTERVAL_S = 0.05
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    """The timer, as a service of the gateway's lifespan."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = LAG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram(
            "kvgate_event_loop_lag_seconds",
            f"How much later than asked the event loop woke a timer set every {interval_s:g} s",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvgate-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval, observe = self.interval_s, self.histogram.observe
        while True:
            asked = loop.time() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, loop.time() - asked))


def install(state: GatewayState) -> None:
    state.services.append(LoopLag(state.metrics.registry))
