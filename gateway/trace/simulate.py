"""`kvgate simulate`: a trace on N simulated engines behind the real routing code, no HTTP.

A discrete-event loop on virtual time. Events are request arrivals and the ends of engine
steps; each engine is a `gateway.sim.engine.EngineModel` (the same model the HTTP sim
server runs). Every arrival is routed by `build_router`'s policy on a `ClusterView` whose
in-flight counts and loads come straight from the engine models (always fresh: the live
gateway sees scrapes a little older). Trace blocks (512 tokens for Mooncake) are re-chunked
to the engine's block size so the engines' prefix caches see the trace's sharing.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gateway.admission.config import EnginePrioritySettings
from gateway.same_prompt import DEFAULT_SAME_PROMPT_WAIT_S, PromptKey, prompt_key, wait_bound
from gateway.sim.engine import EngineModel, RequestHandle, RequestRejected, SimRequest
from gateway.sim.profiles import HardwareProfile, get_profile
from gateway.trace.format import Rechunker, Trace
from gateway.trace.report import ReplayReport, RequestResult
from gateway.trace.routing import PolicyDriver, make_replicas, route_request_for
from gateway.types import ClusterView, EngineLoad, ReplicaId, RouteRequest

DEFAULT_PROFILE = "h200-sparse"
_ARRIVAL, _STEP_END = 1, 0  # at equal times, finish steps before admitting arrivals


@dataclass(frozen=True, slots=True)
class SimulationOptions:
    replicas: int = 4
    policy: str = "consistent_hash"
    policy_config: Mapping[str, Any] = field(default_factory=dict)
    profile: str | HardwareProfile | None = None
    # Divides the trace's arrival times, like `kvgate trace replay --speedup`.
    speedup: float = 1.0
    max_output_tokens: int | None = None
    model: str = "kvgate-sim"
    seed: int = 0
    # False: route as for clients that send no session id (lineage keys them).
    sessions: bool = True
    # Engines run vLLM's priority scheduling and are sent the gateway's `priority`
    # (gateway.admission.engine_order), as replicas flagged `priority_scheduling` are.
    engine_priority: EnginePrioritySettings | None = None
    # `routing.same_prompt_wait_s`: a copy of a prompt in prefill waits for its first token
    # (gateway.same_prompt), as in the proxy; 0 sends every copy at once.
    same_prompt_wait_s: float = DEFAULT_SAME_PROMPT_WAIT_S


@dataclass(frozen=True, slots=True)
class SimulationResult:
    report: ReplayReport
    options: SimulationOptions
    profile: str
    simulated_s: float
    wall_s: float
    preemptions: int
    unrouted: int

    @property
    def speed_factor(self) -> float:
        """Simulated seconds per wall-clock second."""
        return self.simulated_s / self.wall_s if self.wall_s > 0 else float("inf")

    def render(self) -> str:
        o = self.options
        head = (
            f"simulate: {o.replicas} x {self.profile} engines, policy {o.policy}"
            f"{', shortest prefill first' if o.engine_priority is not None else ''};"
            f" {self.simulated_s:,.1f} simulated s in {self.wall_s:.2f} wall s"
            f" ({self.speed_factor:,.0f}x real time), {self.preemptions} preemptions"
        )
        return head + "\n" + self.report.render()

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.report.as_dict(),
            "replicas": self.options.replicas,
            "policy": self.options.policy,
            "engine_priority": self.options.engine_priority is not None,
            "profile": self.profile,
            "simulated_s": self.simulated_s,
            "wall_s": self.wall_s,
            "speed_factor": self.speed_factor,
            "preemptions": self.preemptions,
            "unrouted": self.unrouted,
        }


def _profile(spec: str | HardwareProfile | None) -> HardwareProfile:
    if isinstance(spec, HardwareProfile):
        return spec
    return get_profile(spec or DEFAULT_PROFILE)


def _result(index: int, arrival: float, h: RequestHandle, replica: str) -> RequestResult:
    times = h.token_times
    first = h.first_token_time
    error = None if h.finish_reason in ("stop", "length") else (h.finish_reason or "unfinished")
    return RequestResult(
        index=index,
        start_s=arrival,
        end_s=h.finish_time if h.finish_time is not None else arrival,
        ttft_s=None if first is None else first - arrival,
        itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
        prompt_tokens=h.prompt_tokens,
        output_tokens=h.output_tokens,
        cached_tokens=h.cached_tokens,
        error=error,
        replica=replica,
    )


def simulate(trace: Trace, options: SimulationOptions | None = None) -> SimulationResult:
    """Run the whole trace; deterministic for a given trace and options."""
    o = options or SimulationOptions()
    if o.replicas <= 0:
        raise ValueError("replicas must be positive")
    if o.speedup <= 0:
        raise ValueError("speedup must be positive")
    profile = _profile(o.profile)
    states = make_replicas(o.replicas, o.model)
    ids = [s.id for s in states]
    driver = PolicyDriver(
        o.policy,
        states,
        o.policy_config,
        o.seed,
        block_tokens=trace.block_tokens,
        engine_priority=o.engine_priority,
    )
    ordered = o.engine_priority is not None
    engines = {rid: EngineModel(profile, seed=o.seed, priority_scheduling=ordered) for rid in ids}
    in_flight: dict[ReplicaId, int] = {rid: 0 for rid in ids}
    in_flight_view = MappingProxyType(in_flight)
    busy: dict[ReplicaId, bool] = {rid: False for rid in ids}
    rechunk = Rechunker(trace.block_tokens, profile.block_size)
    bs = profile.block_size
    records = trace.records
    origin = records[0].arrival_s if records else 0.0

    # pending[handle] = (trace index, arrival, replica, route request)
    pending: dict[RequestHandle, tuple[int, float, ReplicaId, RouteRequest]] = {}
    # Copies of a prompt in prefill (gateway.same_prompt): the first copy's handle and the
    # time the others stop waiting for it; the trace indices waiting; their requests.
    leads: dict[PromptKey, tuple[RequestHandle, float]] = {}
    lead_of: dict[RequestHandle, PromptKey] = {}
    held: dict[PromptKey, list[int]] = {}
    waiting: dict[int, RouteRequest] = {}
    sent: set[int] = set()
    results: list[RequestResult] = []
    events: list[tuple[float, int, int, str]] = []
    for i, rec in enumerate(records):
        events.append(((rec.arrival_s - origin) / o.speedup, _ARRIVAL, i, ""))
    heapq.heapify(events)
    wall0 = time.perf_counter()
    now = 0.0

    def start_step(rid: ReplicaId) -> None:
        duration = engines[rid].step(now)
        if duration > 0:
            busy[rid] = True
            heapq.heappush(events, (now + duration, _STEP_END, 0, rid))
        else:
            busy[rid] = False

    def release(h: RequestHandle) -> None:
        """A first copy's prefill is over: its waiting copies arrive now."""
        key = lead_of.pop(h, None)
        if key is None:
            return
        leads.pop(key, None)
        for i in held.pop(key, ()):
            heapq.heappush(events, (now, _ARRIVAL, i, ""))

    def collect(rid: ReplicaId) -> None:
        for h in engines[rid].take_updates():
            if h not in pending:
                continue
            if h.first_token_time is not None or h.finished:
                release(h)
            if h.first_token_time is not None:
                driver.prefilled(
                    pending[h][3], h.first_token_time
                )  # idempotent: the first byte, as in the proxy
            if not h.finished:
                continue
            index, arrival, replica, request = pending.pop(h)
            in_flight[replica] -= 1
            res = _result(index, arrival, h, replica)
            results.append(res)
            driver.finished(request, replica, res.error is None, res.end_s - arrival)

    while events:
        now, kind, index, rid_s = heapq.heappop(events)
        if kind == _STEP_END:
            rid = ReplicaId(rid_s)
            collect(rid)
            start_step(rid)
            continue
        if index in sent:
            continue  # a copy released by its first copy, then by its own deadline
        rec = records[index]
        arrival = (rec.arrival_s - origin) / o.speedup
        request = waiting.pop(index, None)
        released = request is not None
        if request is None:
            request = driver.resolve(
                route_request_for(rec, index, trace.block_tokens, o.model, sessions=o.sessions)
            )
        key = prompt_key(request) if o.same_prompt_wait_s > 0 else None
        lead = leads.get(key) if key is not None else None
        if lead is not None and not released and now < lead[1]:
            assert key is not None
            waiting[index] = request
            held.setdefault(key, []).append(index)
            heapq.heappush(events, (lead[1], _ARRIVAL, index, ""))
            continue
        sent.add(index)
        view = ClusterView(
            replicas=tuple(replace(s, load=_load(engines[s.id], now)) for s in states),
            now=now,
            in_flight=in_flight_view,
            prefill=driver.meter,
        )
        rid, priority = driver.dispatch(request, view)
        engine = engines[rid]
        hashes = rechunk(rec.block_hashes, rec.input_tokens)[: rec.input_tokens // bs]
        max_tokens = max(1, rec.output_tokens)
        if o.max_output_tokens is not None:
            max_tokens = min(max_tokens, o.max_output_tokens)
        sim_request = SimRequest(
            request_id=f"trace-{index}",
            prompt_tokens=max(1, rec.input_tokens),
            block_hashes=hashes,
            max_tokens=max_tokens,
            ignore_eos=True,
            priority=priority,
        )
        try:
            handle = engine.submit(sim_request, now)
        except RequestRejected:
            results.append(
                RequestResult(
                    index,
                    arrival,
                    now,
                    None,
                    prompt_tokens=rec.input_tokens,
                    error="rejected",
                    replica=rid,
                )
            )
            driver.finished(request, rid, False, 0.0)
            continue
        pending[handle] = (index, arrival, rid, request)
        if key is not None and (lead is None or now >= lead[1]):
            if lead is not None:
                lead_of.pop(lead[0], None)
            leads[key] = (handle, now + wait_bound(driver.meter, rid, o.same_prompt_wait_s))
            lead_of[handle] = key
        in_flight[rid] += 1
        if not busy[rid]:
            start_step(rid)

    wall = time.perf_counter() - wall0
    for h, (index, arrival, replica, _) in pending.items():
        results.append(_result(index, arrival, h, replica))  # engines stalled: unfinished
    results.sort(key=lambda r: r.index)
    end = max((r.end_s for r in results), default=0.0)
    report = ReplayReport.build(results, end, label="simulate", replicas=[str(r) for r in ids])
    return SimulationResult(
        report=report,
        options=o,
        profile=profile.name,
        simulated_s=end,
        wall_s=wall,
        preemptions=sum(e.stats.preemptions for e in engines.values()),
        unrouted=driver.unrouted,
    )


def _load(engine: EngineModel, now: float) -> EngineLoad:
    s = engine.stats
    return EngineLoad(
        waiting=float(engine.num_waiting),
        running=float(engine.num_running),
        kv_usage=engine.kv_usage,
        prefix_hit_rate=s.prefix_hits / s.prefix_queries if s.prefix_queries else None,
        kv_capacity_tokens=engine.profile.kv_capacity_tokens,
        scraped_at=now,
    )
