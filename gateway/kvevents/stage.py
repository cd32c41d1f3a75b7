"""`TokenStage`: tokenizes prompts in worker threads as their requests are sent, and teaches
the `PromptBridge` their token blocks (a dispatch observer, and an `OutcomeObserver` for
the prompts it dropped then; never waited for on the request path).

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
feed the bridge stale answers. The routing decision never waits for any of this: a
prompt not learnt yet is answered by the approximate index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gateway.hashing import CHARS_PER_TOKEN
from gateway.hooks import RequestOutcome
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.render import Rendered, Renderer
from gateway.kvevents.tokcache import TokenCache
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.types import Endpoint, ReplicaId, RouteRequest

log = logging.getLogger("kvgate.kvevents")

Learnt = tuple[tuple[int, ...], "array[int]", list[int]]
# (what was learnt, seconds, the token cache's answer, tokens it gave)
_JobResult = tuple[Learnt | None, float, str, int]


def learn_prompt(
    renderer: Renderer,
    body: Mapping[str, Any],
    endpoint: Endpoint,
    prompt_hashes: Sequence[int],
    prompt_block_bytes: int,
    block_size: int,
) -> Learnt | None:
    """(prompt hashes, token-block keys, keys known at each prompt block): threadable."""
    rendered = renderer.render(body, endpoint)
    if rendered is None:
        return None
    return learn_rendered(rendered, prompt_hashes, prompt_block_bytes, block_size)


def learn_rendered(
    rendered: Rendered, prompt_hashes: Sequence[int], prompt_block_bytes: int, block_size: int
) -> Learnt:
    ids = rendered.token_ids
    if rendered.keys is not None:
        keys = array("Q", rendered.keys)
    else:
        keys = array("Q", chain_keys(ids, block_size, root_seed()))
    counts = [
        rendered.stable_tokens((j + 1) * prompt_block_bytes) // block_size
        for j in range(len(prompt_hashes))
    ]
    return tuple(prompt_hashes), keys, counts


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
    ) -> None:
        self.renderer = renderer
        self.cache = cache  # the renderer's, read for the metrics
        self.bridge = bridge
        self.block_size = block_size
        self.workers = workers
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.pending = 0
        self._queued: set[int] = set()  # last prompt hash of each job waiting or running
        self._pool: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvgate-tokenize")

    async def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

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

    def _submit(self, request: RouteRequest, body: Mapping[str, Any], *, count_known: bool) -> None:
        pool = self._pool
        hashes = request.prefix_hashes
        if pool is None or not hashes or not body:
            return
        if request.endpoint not in (Endpoint.CHAT, Endpoint.COMPLETIONS):
            return
        last = hashes[-1]
        if last in self._queued or self.bridge.knows(last):
            if count_known:
                self._count("known")
            return
        if self.pending >= self.max_pending:
            self._count("dropped")
            return
        self.pending += 1
        self._queued.add(last)
        bytes_per_block = request.block_tokens * CHARS_PER_TOKEN
        future = pool.submit(self._job, body, request.endpoint, hashes, bytes_per_block)
        future.add_done_callback(lambda f: self._done(f, last))

    def _job(
        self, body: Mapping[str, Any], endpoint: Endpoint, hashes: Sequence[int], block_bytes: int
    ) -> _JobResult:
        t0 = time.perf_counter()
        rendered = self.renderer.render(body, endpoint)
        if rendered is None:
            return None, time.perf_counter() - t0, "", 0
        learnt = learn_rendered(rendered, hashes, block_bytes, self.block_size)
        return learnt, time.perf_counter() - t0, rendered.reuse, rendered.reused

    def _done(self, future: Future[_JobResult], last: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._apply, future, last)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _apply(self, future: Future[_JobResult], last: int) -> None:
        self.pending -= 1
        self._queued.discard(last)
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            log.warning("tokenizer stage failed on a prompt: %r", exc)
            self._count("error")
            return
        learnt, seconds, reuse, reused = future.result()
        if self.metrics is not None:
            self.metrics.tokenize_seconds.observe(seconds)
            if reuse:
                self.metrics.token_cache(reuse, reused, self.cache)
        if learnt is None:
            self._count("unsupported")
            return
        if seconds > self.timeout_s:
            self._count("slow")
            return
        hashes, keys, counts = learnt
        self.bridge.learn(hashes, keys, counts)
        self._count("done")
        if self.metrics is not None:
            self.metrics.bridge_entries.set(len(self.bridge))
