"""`PrefixWarmer`: moves a placed session to the pool the weights now give it, prefix first.

Stickiness keeps a session where its KV prefix lives, so when the weights shift (the peak
is over, the cheap pool has room again) the sessions placed during the peak keep running
on the expensive pool until they end. Moving one plainly costs a cold prefill of its whole
history on the new pool, which is exactly the latency the weights were meant to protect.

Instead, after a turn of such a session succeeds, the same prompt is sent, with at most one
generated token, to an idle replica of the pool the weights give the session (the inner
policy ranks them). That replica's prefix cache then holds the conversation, and only
after the warm-up succeeded is the session recorded there: its next turn arrives to a warm
cache (only the newest turn is uncached). The warm-up runs between turns, while the user
reads the answer, on a replica that had nothing else to do.

Costs and bounds: the warm-up holds an in-flight slot like any request (routing sees it),
is charged to the target pool's busy time but adds no served tokens, runs only for prompts
up to `max_prompt_tokens`, at most `max_concurrent` at once and one per replica, and a
session moves at most once per `min_interval_s`. A long prompt is warmed in slices
(`slice_tokens`, gateway.pools.slices), each sent only while the replica has no live
request, so a live turn never waits behind more than one slice. When no replica of the
target pool is idle as the turn ends, the session waits up to `retry_s` for one (at most
`max_waiting` sessions wait, each holding its last body). A failed or abandoned warm-up
leaves the session where it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.forward import open_leg
from gateway.hooks import RequestOutcome
from gateway.pools.config import WarmMoveSettings
from gateway.pools.selector import PoolSelector
from gateway.pools.slices import prefix_bodies
from gateway.state import GatewayState
from gateway.types import ENDPOINT_PATHS, Endpoint, ReplicaId, RouteRequest

log = logging.getLogger("kvgate.pools")

# Endpoints whose prompt fills a prefix cache (RequestOutcome.endpoint is the value).
_PATHS = {e.value: ENDPOINT_PATHS[e] for e in (Endpoint.CHAT, Endpoint.COMPLETIONS)}
# Generation-only fields: they cannot change the prompt's KV, and some would conflict with a
# one-token answer (min_tokens, n, best_of) or cost engine work for nothing (grammars).
_GENERATION_ONLY = frozenset(
    {
        "stream",
        "stream_options",
        "n",
        "best_of",
        "min_tokens",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "response_format",
        "tool_choice",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "max_completion_tokens",
    }
)
# Client headers a warm-up does not carry: it has its own body, and its own request id.
_NOT_CARRIED = frozenset({b"content-type", b"content-encoding", b"x-request-id"})
_SESSIONS_REMEMBERED = 65536
_POLL_S = 0.2  # how often sessions waiting for an idle replica look again
_IDLE_POLL_S = 0.01  # between slices, how often a busy target is looked at again

# (from pool, to pool, result) -> count; result is ok, failed or timeout.
WarmCounts = Counter[tuple[str, str, str]]


def warm_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request to prefill `body`'s prompt: same prompt, one generated token, no stream."""
    warm = {k: v for k, v in body.items() if k not in _GENERATION_ONLY}
    warm["max_tokens"] = 1
    warm["stream"] = False
    return warm


class PrefixWarmer:
    def __init__(
        self,
        settings: WarmMoveSettings,
        selector: PoolSelector,
        state: GatewayState,
        charge: Callable[[ReplicaId, float, float], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._selector = selector
        self._state = state
        self._charge = charge  # (replica, started_at wall clock, seconds busy)
        self._clock = clock
        self._auth = state.settings.upstream.auth_headers()
        self._not_carried = _NOT_CARRIED | {b"authorization"} if self._auth else _NOT_CARRIED
        self._tasks: set[asyncio.Task[None]] = set()
        self._targets: set[ReplicaId] = set()
        self._sessions_warming: set[str] = set()
        self._moved_at: OrderedDict[str, float] = OrderedDict()
        # Sessions whose target pool had no idle replica yet: key -> (outcome, give up at).
        self._waiting: OrderedDict[str, tuple[RequestOutcome, float]] = OrderedDict()
        self._poller: asyncio.Task[None] | None = None
        self.counts: WarmCounts = Counter()
        # Why sessions the weights send elsewhere were not warmed when their turn ended.
        self.skipped: Counter[str] = Counter()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def consider(self, outcome: RequestOutcome) -> None:
        """Outcome observer: start a warm-up when this session should follow the weights,
        or wait (`retry_s`) for a replica of the target pool to become idle."""
        request, body, replica = outcome.request, outcome.body, outcome.replica
        if (
            request is None
            or body is None
            or replica is None
            or not outcome.ok
            or outcome.disconnected
            or outcome.endpoint not in _PATHS
        ):
            return
        key = request.session_key
        self._waiting.pop(key, None)  # a newer turn supersedes what was waiting
        if key in self._sessions_warming:
            return
        move = self._selector.warm_move(request, replica, self._state.cluster.view())
        if move is None:
            return  # the weights keep the session where it is
        if request.prompt_tokens > self._settings.max_prompt_tokens:
            self.skipped["too_long"] += 1
            return
        if self._pricier_needs_pressure(replica, move[0]):
            self.skipped["pricier_pool_without_pressure"] += 1
            return
        moved = self._moved_at.get(key)
        if moved is not None and self._clock() - moved < self._settings.min_interval_s:
            self.skipped["moved_recently"] += 1
            return
        started = self._try(outcome, move)
        if started is None:
            self.skipped["no_idle_replica_yet"] += 1
        if started is None and self._settings.retry_s > 0:
            self._waiting[key] = (outcome, self._clock() + self._settings.retry_s)
            while len(self._waiting) > self._settings.max_waiting:
                self._waiting.popitem(last=False)
            if self._poller is None or self._poller.done():
                self._poller = asyncio.get_running_loop().create_task(self._poll())

    def _try(
        self, outcome: RequestOutcome, move: tuple[str, ReplicaId | None] | None = None
    ) -> bool | None:
        """Start the warm-up if there is somewhere to warm. True: started; False: nothing
        to do (the weights keep the session where it is); None: no idle replica yet.
        `move`: the selector's answer when the caller has just asked it."""
        request, body, replica = outcome.request, outcome.body, outcome.replica
        assert request is not None and body is not None and replica is not None
        if len(self._tasks) >= self._settings.max_concurrent:
            return None
        if move is None:  # a retry: ask again (the caller already vetted a move it passes)
            move = self._selector.warm_move(request, replica, self._state.cluster.view())
            if move is not None and self._pricier_needs_pressure(replica, move[0]):
                return False
        if move is None:
            return False
        target = move[1]
        if target is None or target in self._targets:
            return None
        source = self._selector.pool_of(replica) or ""
        self._targets.add(target)
        self._sessions_warming.add(request.session_key)
        task = asyncio.get_running_loop().create_task(
            self._warm(
                request,
                _PATHS[outcome.endpoint],
                warm_body(body),
                source,
                target,
                outcome.headers or (),
            )
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _pricier_needs_pressure(self, replica: ReplicaId, pool: str) -> bool:
        return self._settings.pricier_only_under_pressure and (
            self._selector.move_buys_latency_only(replica, pool)
        )

    async def _poll(self) -> None:
        """Retry waiting sessions, oldest first, until each starts, expires or is moot."""
        while self._waiting:
            await asyncio.sleep(_POLL_S)
            now = self._clock()
            for key, (outcome, give_up_at) in list(self._waiting.items()):
                if now >= give_up_at:
                    del self._waiting[key]
                    continue
                try:
                    started = self._try(outcome)
                except Exception:  # a bug must not stop the other sessions' retries
                    log.exception("warm move of %s failed to start", key)
                    started = False
                if started is not None:
                    del self._waiting[key]

    async def _warm(
        self,
        request: RouteRequest,
        path: str,
        body: dict[str, Any],
        source: str,
        target: ReplicaId,
        client_headers: Sequence[tuple[bytes, bytes]],
    ) -> None:
        state = self._state
        result = "failed"
        started_at = time.time()
        # The headers the triggering turn was forwarded with: an engine that checks an API
        # key gets the client's, or the gateway's own (upstream.engine_api_key) when set.
        headers = [h for h in client_headers if h[0] not in self._not_carried]
        headers += self._auth
        headers += [
            (b"content-type", b"application/json"),
            (b"x-request-id", f"{request.request_id}-warm".encode()),
        ]
        busy = 0.0
        ok = False
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                pieces = prefix_bodies(body, request.prompt_tokens, self._settings.slice_tokens)
                for i, piece in enumerate(pieces):
                    if i:
                        # Only idle time: a live request on the replica goes first.
                        while state.cluster.in_flight.get(target, 0) > 0:
                            await asyncio.sleep(_IDLE_POLL_S)
                    t = time.perf_counter()
                    leg = await open_leg(
                        state.cluster,
                        state.client,
                        state.health,
                        target,
                        path,
                        headers,
                        orjson.dumps(piece),
                    )
                    try:
                        await leg.response.read()
                        ok = leg.response.status == 200
                    finally:
                        await leg.aclose()
                        busy += time.perf_counter() - t
                    if not ok:
                        break
            if ok:
                result = "ok"
                self._record_move(request, target)
                if state.placements is not None:
                    await state.placements.record(request.session_key, target)
        except TimeoutError:
            result = "timeout"
        except GatewayError as exc:
            log.debug("warm-up of %s on %s failed: %s", request.session_key, target, exc.message)
        finally:
            self._targets.discard(target)
            self._sessions_warming.discard(request.session_key)
            self._charge(target, started_at, busy)
            to = self._selector.pool_of(target) or ""
            self.counts[(source, to, result)] += 1

    def _record_move(self, request: RouteRequest, target: ReplicaId) -> None:
        # `placed` makes the target's pool the session's home and tells the pool's inner
        # policy (a prefix index learns the prefix now lives on `target`).
        self._selector.placed(request, target)
        key = request.session_key
        self._moved_at[key] = self._clock()
        self._moved_at.move_to_end(key)
        while len(self._moved_at) > _SESSIONS_REMEMBERED:
            self._moved_at.popitem(last=False)

    async def stop(self) -> None:
        self._waiting.clear()
        tasks = list(self._tasks)
        if self._poller is not None:
            tasks.append(self._poller)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
