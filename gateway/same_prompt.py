"""Requests that repeat a prompt still in prefill wait for it (issue 45: bursts co-locate).

`n > 1` or best-of-N sent as separate requests, RL rollouts and retried clients send the
same prompt several times at once, in one conversation. The router sends them to one
replica (they are one conversation), but an engine caches a prompt's blocks only as it
computes them: copies admitted together each compute the whole uncached part, sharing the
replica's prefill budget, so every copy's first token comes late and the engine does the
work n times (on the `samples` shape, kvgate's placement alone would have hit 95% of the
prompt tokens; the engines hit 91%).

So the first copy goes at once and the others wait, before the routing decision, until its
first token is back (its prefill is over and its blocks are cached), then route as usual:
to the same replica, where the prompt is now cached. The wait is bounded by the time the
first copy's prefill should take on its replica (the prefill queued there over the
replica's measured speed, `SLACK` times, plus `SLACK_S`) and by `routing.same_prompt_wait_s`,
so a non-streamed first copy (whose first byte is its whole answer) or a slow replica holds
the others no longer than the prefill they would have waited behind anyway. A copy whose
client leaves stops waiting; a first copy that fails or ends lets the others go.

"The same prompt" is the same endpoint, conversation (session key), prompt length and last
prefix block hash: the prefix hashes chain every block before it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.prefill_meter import PrefillMeter
from gateway.types import ReplicaId, RouteRequest

if TYPE_CHECKING:
    from gateway.hooks import PreRoute
    from gateway.state import GatewayState

DEFAULT_SAME_PROMPT_WAIT_S = 10.0
SLACK = 1.5  # the first copy's expected prefill, times this ...
SLACK_S = 0.25  # ... plus this: a first token a little late still beats n prefills
MAX_LEADS = 10_000  # prompts in prefill tracked at once (the oldest forgotten first)

PromptKey = tuple[str, str, int, int]


def prompt_key(request: RouteRequest) -> PromptKey | None:
    """What makes two requests copies of one prompt (None: no prompt hashes to compare)."""
    hashes = request.prefix_hashes
    if not hashes:
        return None
    return (request.endpoint, request.session_key, request.prompt_tokens, hashes[-1])


def wait_bound(meter: PrefillMeter, replica: ReplicaId, max_wait_s: float) -> float:
    """Seconds the copies may wait for a first copy just sent to `replica` (the meter has
    counted it): its expected prefill there, with slack, and at most `max_wait_s`."""
    speed = meter.speed(replica)
    expected = meter.queued_tokens(replica) / speed if speed else max_wait_s
    return min(max_wait_s, SLACK * expected + SLACK_S)


@dataclass(slots=True)
class _Lead:
    request_id: str
    deadline: float  # clock time after which the others stop waiting for it
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class SamePromptMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.waits = Counter(
            "kvgate_same_prompt_waits",
            "Requests that waited for a copy of their prompt in prefill: prefilled (its first "
            "token came), over_budget (its expected prefill time passed), cancelled",
            ["outcome"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "kvgate_same_prompt_wait_seconds",
            "Time a request waited for a copy of its prompt in prefill",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )


class SamePromptHold:
    """`before_route` is the pre-route hook; `dispatched` a dispatch observer; `prefilled`
    a prefill observer (first byte, or the end without one; idempotent)."""

    __slots__ = ("_clock", "_leads", "_meter", "_metrics", "_of_request", "max_wait_s")

    def __init__(
        self,
        meter: PrefillMeter,
        max_wait_s: float,
        metrics: SamePromptMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._meter = meter
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._clock = clock
        self._leads: OrderedDict[PromptKey, _Lead] = OrderedDict()
        self._of_request: dict[str, PromptKey] = {}

    def before_route(
        self, request: RouteRequest, body: Mapping[str, Any]
    ) -> Awaitable[None] | None:
        key = prompt_key(request)
        if key is None:
            return None
        lead = self._leads.get(key)
        if lead is None or lead.request_id == request.request_id:
            return None
        left = lead.deadline - self._clock()
        if left <= 0:
            return None
        return self._wait(lead, left)

    async def _wait(self, lead: _Lead, left: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lead.waiters.append(future)
        t0 = self._clock()
        outcome = "cancelled"
        try:
            async with asyncio.timeout(left):
                await future
            outcome = "prefilled"
        except TimeoutError:
            outcome = "over_budget"
        finally:
            if future in lead.waiters:
                lead.waiters.remove(future)
            if self._metrics is not None:
                self._metrics.waits.labels(outcome).inc()
                self._metrics.wait_seconds.observe(self._clock() - t0)

    def dispatched(
        self, request: RouteRequest, replica: ReplicaId, body: Mapping[str, Any]
    ) -> None:
        """The first copy of a prompt not in prefill yet leads; a retry keeps its lead."""
        key = prompt_key(request)
        if key is None:
            return
        lead = self._leads.get(key)
        now = self._clock()
        if lead is not None and lead.request_id != request.request_id:
            if now < lead.deadline:
                return  # another copy leads (this one waited, or was sent past its budget)
            # That copy's prefill should be over and no first byte said so: this one leads.
            del self._leads[key]
            self._release(lead)
            lead = None
        # The meter heard of this request first: its queue includes the request.
        deadline = now + wait_bound(self._meter, replica, self.max_wait_s)
        if lead is None:
            self._leads[key] = _Lead(request.request_id, deadline)
            self._of_request[request.request_id] = key
            if len(self._leads) > MAX_LEADS:
                _, oldest = self._leads.popitem(last=False)
                self._release(oldest)
        else:
            lead.deadline = deadline

    def prefilled(self, request: RouteRequest) -> None:
        key = self._of_request.pop(request.request_id, None)
        if key is None:
            return
        lead = self._leads.pop(key, None)
        if lead is not None:
            self._release(lead)

    def _release(self, lead: _Lead) -> None:
        self._of_request.pop(lead.request_id, None)
        for future in lead.waiters:
            if not future.done():
                future.set_result(None)

    @property
    def leads(self) -> int:
        """Prompts in prefill that others may wait for (for tests and the console)."""
        return len(self._leads)


def chain(first: PreRoute, then: PreRoute | None) -> PreRoute:
    """One pre-route hook from two: `first`'s wait, then `then`'s (both bounded)."""
    if then is None:
        return first

    def both(request: RouteRequest, body: Mapping[str, Any]) -> Awaitable[None] | None:
        ready = first(request, body)
        if ready is None:
            return then(request, body)
        return _in_turn(ready, then, request, body)

    return both


async def _in_turn(
    ready: Awaitable[None], then: PreRoute, request: RouteRequest, body: Mapping[str, Any]
) -> None:
    await ready
    after = then(request, body)
    if after is not None:
        await after


def install(state: GatewayState) -> None:
    wait_s = state.settings.routing.same_prompt_wait_s
    if wait_s <= 0:
        return
    hold = SamePromptHold(state.cluster.prefill, wait_s, SamePromptMetrics(state.metrics.registry))
    state.pre_route = chain(hold.before_route, state.pre_route)
    state.dispatch_observers.append(hold.dispatched)
    state.prefill_observers.append(hold.prefilled)
    state.extras["same_prompt"] = hold
