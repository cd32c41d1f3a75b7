"""`ConsoleRuntime`: everything the console hangs on an app (built once by `install`)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.console.config import ConsoleSettings, Measure
from gateway.console.events import EventLog
from gateway.console.fleet import Fleet
from gateway.console.measure import Measurements
from gateway.console.sampler import Sampler
from gateway.console.sessions import SessionTable
from gateway.console.watch import Watch, WatchMode
from gateway.state import GatewayState


def resolve_measure(measure: Measure, state: GatewayState) -> WatchMode:
    """`auto`: measure from start-up when the proxy already builds an outcome and asks
    streams for usage for another observer (the token metrics, pools, trace capture: all
    installed before the console), so measuring adds a few dictionary updates per request;
    otherwise only while someone reads the console."""
    if measure != "auto":
        return measure
    return "always" if state.observers else "watched"


@dataclass(eq=False)
class ConsoleRuntime:
    settings: ConsoleSettings
    state: GatewayState
    fleet: Fleet
    measurements: Measurements
    watch: Watch
    sampler: Sampler

    @classmethod
    def build(cls, state: GatewayState, settings: ConsoleSettings) -> ConsoleRuntime:
        events = EventLog(settings.history_s)
        fleet = Fleet(state, events)
        measurements = Measurements(state.cluster, SessionTable(settings.max_sessions))
        watch = Watch(
            state.observers,
            measurements.observe,
            resolve_measure(settings.measure, state),
            settings.watch_idle_s,
            on_attach=measurements.reset,
        )
        sampler = Sampler(
            fleet,
            measurements,
            watch,
            interval_s=settings.sample_interval_s,
            idle_interval_s=settings.idle_sample_interval_s,
            history_s=settings.history_s,
            live_session_s=settings.live_session_s,
        )
        return cls(settings, state, fleet, measurements, watch, sampler)

    async def start(self) -> None:
        await self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()
