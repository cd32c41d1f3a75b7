"""`TokenStage`: tokenizes prompts in workers (threads, or processes: gateway.kvevents.workers)
as their requests are sent, and teaches the `PromptBridge` their token blocks (a dispatch
observer, and an `OutcomeObserver` for the prompts it dropped then; never waited for on the
request path).

At dispatch, not at the end: the engine stores a prompt's blocks during its prefill, and
a request that shares them can arrive long before the first one finished decoding (the
next turn of a conversation, another session with the same preamble); by then the bridge
should know the prompt.

Bounded: at most `max_pending` prompts wait; more are dropped (counted) and retried when
their request ends. A prompt the bridge already knows to its last block, or that is queued,
is not tokenized again, so a conversation costs one tokenization per turn and none for a
repeated prompt; with the renderer's token cache (gateway.kvevents.incremental) a turn
tokenizes only what it added to the previous one. A job that runs longer than
`timeout_s` is counted as slow and its result discarded, so a pathological prompt cannot
feed the bridge stale answers; a prompt whose job taught nothing (slow, unsupported,
failed) is remembered for a while and not tried again.

Before routing (`before_route`, the proxy's `pre_route` hook, with `route_budget_s` > 0): a
prompt the bridge knows less than half of (a conversation this process has not seen, sent
before by another gateway or client; the first prompt of its kind) is submitted then, and the
decision waits for it at most `route_budget_s`, on the event loop without blocking it. What
finishes in time routes on the engines' events; what does not is answered by the
approximate index, and the job still teaches the bridge when it ends (the dispatch
observer finds it queued and does not submit it again). A full queue, or no replica whose
events could answer, means no wait. For a waiting decision the prompt's opening is encoded
first (by the job's thread, or beside a worker process's job in a thread here): if no synced
replica holds its first token block, none holds any of the prompt, and the decision goes at
once (outcome `cold`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gateway.hashing import CHARS_PER_TOKEN, hash_key
from gateway.hooks import RequestOutcome
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.learn import opening_key
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.render import Renderer
from gateway.kvevents.tokcache import TokenCache
from gateway.kvevents.tokenkeys import in_namespace, namespace
from gateway.kvevents.workers import JobResult, ProcessJobs, run_job
from gateway.types import Endpoint, ReplicaId, RouteRequest

log = logging.getLogger("kvgate.kvevents")


# A prompt the bridge knows at least half of, or all but NEAR_BLOCKS prompt blocks of, is
# routed at once: the rest is what this turn adds (a message, a tool's output), new text
# that no replica holds, so tokenizing it first would delay the decision and change nothing.
# Less than that known (or none of it, however short) means that most of the prompt was
# sent by someone else, or is the first of its kind.
NEAR_BLOCKS = 2
# How long a worker that answered a decision early waits for it to be made (it is on the
# event loop within a millisecond or so) before tokenizing the rest of the prompt.
_RESUME_WAIT_S = 0.005
_FRUITLESS = 1024  # prompts whose job taught nothing, remembered so as not to retry them


def salt_namespace(body: Mapping[str, Any], adapter: str | None = None) -> int | None:
    """A `cache_salt` and a LoRA adapter put the prompt's blocks in their own namespace at
    the engine (both engines hash them in): its keys must match only blocks stored under
    the same salt and adapter (gateway.kvevents.tokenkeys.block_namespace), never the base
    model's."""
    salt = body.get("cache_salt")
    if salt == "":
        salt = None
    if salt is None and adapter is None:
        return None
    return namespace(adapter, salt if isinstance(salt, str) or salt is None else repr(salt))


class TokenStage:
    def __init__(
        self,
        renderer: Renderer,
        bridge: PromptBridge,
        *,
        block_size: int = 16,
        workers: int = 1,
        max_pending: int = 64,
        timeout_s: float = 1.0,
        metrics: KVEventMetrics | None = None,
        cache: TokenCache | None = None,
        route_budget_s: float = 0.0,
        synced: Callable[[], bool] | None = None,
        processes: ProcessJobs | None = None,
        opening_held: Callable[[int], bool] | None = None,
        opens_cold: Callable[[str], None] | None = None,
        adapter_of: Callable[[Mapping[str, Any]], str | None] | None = None,
    ) -> None:
        # Jobs run in `processes` when given (each worker holds its own renderer and
        # cache: `renderer` then only says which endpoints it renders), else in threads.
        self.processes = processes
        self.renderer = renderer
        self.cache = cache  # the renderer's, read for the metrics
        self.bridge = bridge
        self.block_size = block_size
        self.workers = workers
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.route_budget_s = route_budget_s
        self._synced = synced  # whether any replica's events are complete (else: no wait)
        # Whether any synced replica holds a token block (by key), and what to tell the
        # evidence of a request whose first block none holds: a decision waiting for its
        # prompt is released as soon as its opening is known.
        self._opening_held = opening_held
        self._opens_cold = opens_cold
        # The LoRA adapter a request body names, if any (gateway.kvevents.adapters).
        self._adapter_of = adapter_of
        self.endpoints = renderer.endpoints & {Endpoint.CHAT, Endpoint.COMPLETIONS}
        self.pending = 0
        self._queued: set[int] = set()  # last prompt hash of each job waiting or running
        # Queued jobs of salted or adapter prompts: their keys go into that namespace.
        self._ns: dict[int, int] = {}
        self._fruitless: OrderedDict[int, None] = OrderedDict()
        # Routing decisions waiting for a job, by its last prompt hash: (request id, the
        # future that ends the wait with its outcome).
        self._waiters: dict[int, list[tuple[str, asyncio.Future[str]]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        # With worker processes, openings are encoded in a thread of this process (the
        # renderer built here for the settings check); a process answers the whole prompt.
        self._openings: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Routing decisions waiting for the stage now."""
        return sum(len(w) for w in self._waiters.values())

    @property
    def _running(self) -> bool:
        return self._pool is not None or (self.processes is not None and self.processes.running)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.processes is not None:
            await self.processes.start()
            if self._opening_held is not None:
                self._openings = ThreadPoolExecutor(1, thread_name_prefix="kvgate-opening")
        else:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvgate-tokenize")

    async def stop(self) -> None:
        for pool in (self._pool, self._openings):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._openings = None
        if self.processes is not None:
            await self.processes.stop()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.tokenize.labels(outcome).inc()

    def dispatched(
        self, request: RouteRequest, replica: ReplicaId, body: Mapping[str, Any]
    ) -> None:
        """The dispatch observer: hand the prompt to a worker (never blocks)."""
        self._submit(request, body, count_known=True)

    def __call__(self, outcome: RequestOutcome) -> None:
        """The outcome observer: a prompt dropped at dispatch gets another chance."""
        if outcome.ok and outcome.request is not None and outcome.body is not None:
            self._submit(outcome.request, outcome.body, count_known=False)

    def before_route(
        self, request: RouteRequest, body: Mapping[str, Any]
    ) -> Awaitable[None] | None:
        """The proxy's `pre_route` hook: None (route now), or a wait of at most the budget
        for the prompt's tokenization."""
        hashes = request.prefix_hashes
        if not self._running or not hashes or not body or request.endpoint not in self.endpoints:
            return None
        last = hashes[-1]
        known = self.bridge.known_blocks(hashes)
        if (known and len(hashes) - known <= max(NEAR_BLOCKS, len(hashes) // 2)) or (
            last in self._fruitless
        ):
            self._route_count("known")
            return None
        if self._synced is not None and not self._synced():
            self._route_count("unsynced")
            return None
        if last not in self._queued:
            if self.pending >= self.max_pending:
                self._route_count("queue_full")
                return None
            self._start(request, body, last, probe=True)
        # Queued already (the same prompt sent by another request): wait for that job.
        return self._wait(last, request.request_id)

    async def _wait(self, last: int, request_id: str) -> None:
        assert self._loop is not None
        entry = (request_id, self._loop.create_future())
        self._waiters.setdefault(last, []).append(entry)
        t0 = time.perf_counter()
        outcome = "cancelled"
        try:
            async with asyncio.timeout(self.route_budget_s):
                outcome = await entry[1]
        except TimeoutError:
            outcome = "over_budget"
        finally:
            waiting = self._waiters.get(last)
            if waiting is not None and entry in waiting:
                waiting.remove(entry)
                if not waiting:
                    del self._waiters[last]
            self._route_count(outcome)
            if self.metrics is not None:
                self.metrics.route_wait_seconds.observe(time.perf_counter() - t0)

    def _route_count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.route_waits.labels(outcome).inc()

    def _submit(self, request: RouteRequest, body: Mapping[str, Any], *, count_known: bool) -> None:
        hashes = request.prefix_hashes
        if not self._running or not hashes or not body or request.endpoint not in self.endpoints:
            return
        last = hashes[-1]
        if last in self._queued or self.bridge.knows(last) or last in self._fruitless:
            if count_known:
                self._count("known")
            return
        if self.pending >= self.max_pending:
            self._count("dropped")
            return
        self._start(request, body, last)

    def _start(
        self, request: RouteRequest, body: Mapping[str, Any], last: int, *, probe: bool = False
    ) -> None:
        bytes_per_block = request.block_tokens * CHARS_PER_TOKEN
        hashes = request.prefix_hashes
        self.pending += 1
        self._queued.add(last)
        adapter = self._adapter_of(body) if self._adapter_of is not None else None
        ns = salt_namespace(body, adapter)
        if ns is not None:
            self._ns[last] = ns
        if self.processes is not None:
            # One conversation, one worker: its earlier turn is in that worker's cache.
            key = hash_key(request.session_key)
            job = self.processes.submit(key, body, request.endpoint, hashes, bytes_per_block)
            job.add_done_callback(lambda f: self._apply(f, last))  # on the loop already
            if probe and self._openings is not None:
                # Nothing heavy follows in that thread: it need not wait for the decision.
                self._openings.submit(self._probe, body, request.endpoint, last, False)
            return
        assert self._pool is not None
        opening = last if probe and self._opening_held is not None else None
        future = self._pool.submit(
            self._job, body, request.endpoint, hashes, bytes_per_block, opening
        )
        future.add_done_callback(lambda f: self._done(f, last))

    def _job(
        self,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        hashes: Sequence[int],
        block_bytes: int,
        opening: int | None = None,
    ) -> JobResult:
        if opening is not None:
            self._probe(body, endpoint, opening, True)
        return run_job(
            self.renderer, self.cache, body, endpoint, hashes, block_bytes, self.block_size
        )

    def _probe(
        self, body: Mapping[str, Any], endpoint: Endpoint, last: int, then_job: bool
    ) -> None:
        """A thread: the prompt's first token block, from its opening alone (a small part
        of the whole job), handed to the loop to answer the waiting decisions early.
        `then_job`: this thread goes on with the whole prompt (it waits for them first)."""
        try:
            ids = self.renderer.opening(body, endpoint, self.block_size)
        except Exception:  # noqa: BLE001 - the whole job meets it again and reports it
            return
        key = None if ids is None else opening_key(ids, self.block_size)
        loop = self._loop
        if key is None or loop is None or loop.is_closed():
            return
        resumed = threading.Event()
        try:
            loop.call_soon_threadsafe(self._opened, last, key, resumed)
        except RuntimeError:  # the loop closed meanwhile
            return
        if then_job:
            # Let the released decisions run before this thread takes the GIL for the
            # whole prompt: the loop would otherwise wait for it (up to the 5 ms switch
            # interval).
            resumed.wait(_RESUME_WAIT_S)

    def _opened(self, last: int, key: int, resumed: threading.Event) -> None:
        """Loop: no synced replica holds the prompt's first block, so its events hold none
        of it, and the rest of its tokens would change nothing: route now."""
        ns = self._ns.get(last)
        if ns is not None:
            key = in_namespace((key,), ns)[0]
        try:
            if last not in self._waiters or self._opening_held is None or self._opening_held(key):
                return
            for request_id, waiter in self._waiters.pop(last):
                if not waiter.done():
                    if self._opens_cold is not None:
                        self._opens_cold(request_id)
                    waiter.set_result("cold")
        finally:
            # After the woken decisions' next step (the ready queue runs in order).
            asyncio.get_running_loop().call_soon(resumed.set)

    def _done(self, future: Future[JobResult], last: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._apply, future, last)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _apply(self, future: Future[JobResult] | asyncio.Future[JobResult], last: int) -> None:
        self.pending -= 1
        self._queued.discard(last)
        ns = self._ns.pop(last, None)
        try:
            if not future.cancelled():
                outcome = self._learn(future, ns)
                self._count(outcome)
                if outcome != "done":
                    self._fruitless[last] = None
                    if len(self._fruitless) > _FRUITLESS:
                        self._fruitless.popitem(last=False)
        finally:
            # After the bridge learnt: the decisions waiting for it route on what it knows.
            for _, waiter in self._waiters.pop(last, ()):
                if not waiter.done():
                    waiter.set_result("in_time")

    def _learn(
        self, future: Future[JobResult] | asyncio.Future[JobResult], ns: int | None = None
    ) -> str:
        exc = future.exception()
        if exc is not None:
            log.warning("tokenizer stage failed on a prompt: %r", exc)
            return "error"
        learnt, seconds, reuse, reused, cache_stats = future.result()
        if self.metrics is not None:
            self.metrics.tokenize_seconds.observe(seconds)
            if reuse:
                self.metrics.token_cache(reuse, reused, cache_stats)
        if learnt is None:
            return "unsupported"
        if seconds > self.timeout_s:
            return "slow"
        hashes, keys, counts = learnt
        if ns is not None:
            keys = array("Q", in_namespace(keys, ns))
        self.bridge.learn(hashes, keys, counts)
        if self.metrics is not None:
            self.metrics.bridge_entries.set(len(self.bridge))
        return "done"
