"""`EngineModel`: a continuous-batching engine as a pure step function.

No asyncio, no clock, no I/O: the driver passes `now`, calls `step(now)`, and waits the
returned duration (really in `EngineRunner`, virtually in the offline simulator) before the
next call. Token timestamps are stamped at the *end* of the step that produced them.

Scheduling follows vLLM V1: running requests first (each gets the tokens it still needs,
a decode gets one), then waiting ones while `max_num_seqs` and the
`max_num_batched_tokens` budget allow (long prompts are prefilled in chunks, each chunk at
most `long_prefill_token_threshold` tokens when that is set). When a
running request cannot get a block, the newest running request (lowest priority under
priority scheduling) is preempted: its blocks are freed and it is recomputed later; when
the request is its own victim, no further running request is scheduled in that pass.
Waiting requests are not admitted in a pass that preempted, and wait while blocks run out.
Priority scheduling orders only the waiting queue (and the choice of victim): running
requests keep the step budget whatever their priority.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import xxhash

from gateway.kvevents.wire import Event
from gateway.sim.kvcache import KVCache
from gateway.sim.profiles import HardwareProfile
from gateway.sim.tokenizer import ApproxTokenizer, Tokenizer, chain_block_hashes

# How long a prefill leg keeps KV for a decode engine that never comes to fetch it.
DEFAULT_KV_HOLD_TIMEOUT_S = 120.0


class RequestRejected(ValueError):
    """The request can never run here (too long for the model or the KV cache)."""


class State(str, Enum):
    WAITING = "waiting"
    WAITING_REMOTE_KV = "waiting_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the engine needs to know about a request (no text).

    `block_hashes` are the chained hashes of the prompt's whole blocks. `remote_kv`: a
    decode leg whose prompt KV arrives from a prefill engine. `hold_kv`: a prefill leg
    that keeps its blocks after finishing until `release_held` (or a timeout).
    """

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    max_tokens: int | None = None
    priority: int = 0
    ignore_eos: bool = False
    output_seed: int = 0
    remote_kv: bool = False
    hold_kv: bool = False
    # The prompt's token ids, when the engine publishes KV events (they carry them).
    token_ids: Sequence[int] = ()


@dataclass(eq=False, slots=True)
class RequestHandle:
    """A request's life inside the engine; the driver reads it, only the engine writes it."""

    request: SimRequest
    arrival: float
    target_tokens: int
    length_capped: bool
    seq: int
    state: State = State.WAITING
    num_computed: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    first_scheduled: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    remote_ready_at: float | None = None
    transfer_bytes: int = 0
    held_blocks: tuple[int, ...] = ()
    owner: str = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.request.prompt_tokens + self.output_tokens

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters (token counters count tokens, as vLLM's do)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    kv_tx_bytes: int = 0
    kv_rx_bytes: int = 0
    steps: int = 0
    busy_time: float = 0.0


Observer = Callable[[RequestHandle], None]


class EngineModel:
    """See the module docstring. Public surface:

    submit(request, now) -> RequestHandle      submit_text(request_id, text, now, ...)
    step(now) -> float (0.0: nothing to do)     abort(handle_or_id, now) -> bool
    release_held(request_id) -> (tokens, block ids) | None
    take_updates() -> list[RequestHandle]      num_running / num_waiting / kv_usage / stats
    """

    def __init__(
        self,
        profile: HardwareProfile,
        *,
        priority_scheduling: bool = False,
        higher_priority_first: bool = False,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        on_finished: Observer | None = None,
        kv_hold_timeout_s: float = DEFAULT_KV_HOLD_TIMEOUT_S,
    ) -> None:
        self.profile = profile
        self.priority_scheduling = priority_scheduling
        # vLLM runs lower values first; SGLang, by default, higher ones.
        self._sign = -1 if higher_priority_first else 1
        self.seed = seed
        self.tokenizer: Tokenizer = tokenizer or ApproxTokenizer()
        self.kv = KVCache(profile.num_gpu_blocks, profile.block_size)
        self.stats = EngineStats()
        self.on_finished = on_finished
        self.kv_hold_timeout_s = kv_hold_timeout_s
        self._seq = itertools.count()
        self._fcfs: deque[RequestHandle] = deque()
        self._heap: list[tuple[int, int, RequestHandle]] = []
        self._running: list[RequestHandle] = []
        self._transferring: list[RequestHandle] = []
        self._by_id: dict[str, RequestHandle] = {}
        self._held: dict[str, tuple[RequestHandle, float]] = {}
        self._updates: list[RequestHandle] = []
        self._num_waiting = 0

    # ---- observation ----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + len(self._transferring)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._num_waiting or self._transferring)

    def get(self, request_id: str) -> RequestHandle | None:
        return self._by_id.get(request_id)

    def take_updates(self) -> list[RequestHandle]:
        """Handles that produced tokens, finished or were preempted since the last call."""
        updates, self._updates = self._updates, []
        return updates

    # ---- submission -------------------------------------------------------------------
    def prompt_from_text(
        self, text: str, cache_salt: str | None = None
    ) -> tuple[int, tuple[int, ...]]:
        tok = self.tokenizer.encode(text, self.profile.block_size)
        return tok.num_tokens, chain_block_hashes(tok.block_payloads, cache_salt)

    def token_ids(self, text: str) -> Sequence[int]:
        """The prompt's token ids when KV events are on (they carry them), else ()."""
        return self.tokenizer.ids(text) if self.kv.events is not None else ()

    def take_kv_events(self) -> list[Event]:
        events = self.kv.events
        if not events:
            return []
        self.kv.events = []
        return events

    def submit_text(
        self, request_id: str, text: str, now: float, *, cache_salt: str | None = None, **kw: object
    ) -> RequestHandle:
        tokens, hashes = self.prompt_from_text(text, cache_salt)
        kw.setdefault("token_ids", self.token_ids(text))
        seed = xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass"))
        return self.submit(
            SimRequest(request_id, tokens, hashes, output_seed=seed, **kw),  # type: ignore[arg-type]
            now,
        )

    def submit(self, request: SimRequest, now: float) -> RequestHandle:
        p = self.profile
        if request.prompt_tokens < 1:
            raise RequestRejected("The prompt is empty.")
        max_len = min(p.max_model_len, p.kv_capacity_tokens)
        if request.prompt_tokens + 1 > max_len or (
            request.max_tokens is not None and request.prompt_tokens + request.max_tokens > max_len
        ):
            asked = request.prompt_tokens + (request.max_tokens or 0)
            raise RequestRejected(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {asked} tokens ({request.prompt_tokens} in the messages, "
                f"{request.max_tokens or 0} in the completion). Please reduce the length."
            )
        budget = max_len - request.prompt_tokens
        cap = budget if request.max_tokens is None else min(request.max_tokens, budget)
        if request.ignore_eos:
            target, capped = cap, True
        else:
            lo, hi = p.natural_output_tokens
            natural = lo + xxhash.xxh64_intdigest(
                request.output_seed.to_bytes(8, "little"), seed=self.seed
            ) % (hi - lo + 1)
            target, capped = (cap, True) if natural >= cap else (natural, False)
        handle = RequestHandle(
            request=request,
            arrival=now,
            target_tokens=max(1, target),
            length_capped=capped,
            seq=next(self._seq),
        )
        handle.owner = f"{handle.seq}"
        self._by_id[request.request_id] = handle
        self._enqueue(handle, front=False)
        return handle

    # ---- abort / PD ---------------------------------------------------------------------
    def abort(self, target: RequestHandle | str, now: float) -> bool:
        handle = self._by_id.get(target) if isinstance(target, str) else target
        if handle is None or handle.finished:
            return False
        if handle.state is State.RUNNING:
            self._running.remove(handle)
        elif handle.state is State.WAITING_REMOTE_KV:
            self._transferring.remove(handle)
        else:
            self._dequeue(handle)
        self._finish(handle, "abort", now)
        return True

    def release_held(self, request_id: str) -> tuple[int, tuple[int, ...]] | None:
        """A decode engine fetched a prefill leg's KV: free it; (tokens, block ids) or None."""
        entry = self._held.pop(request_id, None)
        if entry is None:
            return None
        handle, _ = entry
        self.kv.free(handle.owner)
        tokens = handle.prompt_tokens
        self.stats.kv_tx_bytes += tokens * self.profile.kv_bytes_per_token
        return tokens, handle.held_blocks

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    # ---- the step -----------------------------------------------------------------------
    def step(self, now: float) -> float:
        """Schedule and run one batch starting at `now`; return its duration (0.0: idle).

        When only KV transfers are pending, returns the time until the first completes.
        """
        self._expire_held(now)
        self._finish_transfers(now)
        bs = self.profile.block_size
        while True:
            scheduled, preempted = self._schedule(now)
            # A pass that preempted and scheduled nothing runs no batch; the engine's next
            # pass follows at once (the freed blocks are there now).
            if scheduled or not preempted:
                break

        if not scheduled:
            if self._transferring:
                ready = min(h.remote_ready_at or now for h in self._transferring)
                return max(ready - now, 1e-6)
            return 0.0

        prefill_tokens = 0
        n_decode = 0
        attended = 0
        for r, n in scheduled.items():
            if n == 1 and r.output_tokens > 0 and r.num_computed == r.num_tokens - 1:
                n_decode += 1
                attended += self.profile.attended(r.num_tokens)
            else:
                prefill_tokens += n
        # Never 0.0 when work ran: 0.0 means "idle" to the drivers.
        duration = max(self.profile.step_time(prefill_tokens, n_decode, attended), 1e-9)
        done = now + duration
        self.stats.steps += 1
        self.stats.busy_time += duration

        for r, n in scheduled.items():
            r.num_computed += n
            self.kv.cache_full_blocks(
                r.owner, r.request.block_hashes, r.num_computed // bs, r.request.token_ids
            )
            if r.num_computed >= r.num_tokens:
                self._emit_token(r, done)
        return duration

    # ---- internals ----------------------------------------------------------------------
    def _schedule(self, now: float) -> tuple[dict[RequestHandle, int], bool]:
        """One scheduling pass as vLLM V1's: running requests first, in order, then waiting
        ones unless something was preempted. Returns tokens per request and whether a
        request was preempted."""
        budget = self.profile.max_num_batched_tokens
        scheduled: dict[RequestHandle, int] = {}
        preempted = False

        for r in list(self._running):
            if budget <= 0:
                break
            if r.state is not State.RUNNING:
                continue  # preempted earlier in this step
            n = min(self._capped(r.num_tokens - r.num_computed), budget)
            while not self.kv.allocate(r.owner, r.num_computed + n):
                victim = self._pick_victim()
                self._preempt(victim, now)
                preempted = True
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is r:
                    break
            if r.state is not State.RUNNING:
                # It was its own victim: vLLM schedules no further running request this step
                # (under priority scheduling, better ones after it in the list wait too).
                break
            scheduled[r] = n
            budget -= n

        while not preempted and budget > 0 and len(self._running) < self.profile.max_num_seqs:
            w = self._peek_waiting()
            if w is None or not self._admit(w, budget, now):
                break
            if w.state is State.WAITING_REMOTE_KV:
                continue
            n = min(self._capped(w.num_tokens - w.num_computed), budget)
            scheduled[w] = n
            budget -= n
        return scheduled, preempted

    def _capped(self, new_tokens: int) -> int:
        """Tokens one request may compute this step, before the shared budget (as vLLM)."""
        cap = self.profile.long_prefill_token_threshold
        return cap if 0 < cap < new_tokens else new_tokens

    def _admit(self, r: RequestHandle, budget: int, now: float) -> bool:
        """Give a waiting request its blocks and move it to running (or to a KV transfer)."""
        if self.kv.blocks_of(r.owner):
            # Back from a KV transfer: blocks are already held.
            n = min(self._capped(r.num_tokens - r.num_computed), budget)
            if not self.kv.allocate(r.owner, r.num_computed + n):
                return False
            self._dequeue(r)
            self._to_running(r, now)
            return True
        bs = self.profile.block_size
        hit = self.kv.match_prefix(r.request.block_hashes, r.num_tokens - 1)
        cached = len(hit) * bs
        if r.request.remote_kv and r.num_preemptions == 0 and r.output_tokens == 0:
            # Everything but the last prompt token comes over the link; cached blocks do not.
            remote = max(0, r.num_tokens - 1 - cached)
            if not self.kv.allocate(r.owner, r.num_tokens, hit):
                return False
            self._dequeue(r)
            self._count_prefix_query(r, cached)
            # vLLM reports locally cached + externally loaded tokens as cached.
            r.cached_tokens = cached + remote
            nbytes = remote * self.profile.kv_bytes_per_token
            r.transfer_bytes = nbytes
            self.stats.kv_rx_bytes += nbytes
            r.num_computed = cached + remote
            r.remote_ready_at = now + self.profile.transfer_time(remote)
            r.state = State.WAITING_REMOTE_KV
            if r.first_scheduled is None:
                r.first_scheduled = now
            self._transferring.append(r)
            return True
        n = min(self._capped(r.num_tokens - cached), budget)
        if not self.kv.allocate(r.owner, cached + n, hit):
            return False
        self._dequeue(r)
        self._count_prefix_query(r, cached)
        r.num_computed = cached
        self._to_running(r, now)
        return True

    def _count_prefix_query(self, r: RequestHandle, cached: int) -> None:
        self.stats.prefix_queries += r.num_tokens
        self.stats.prefix_hits += cached
        if r.cached_tokens is None:
            r.cached_tokens = cached

    def _to_running(self, r: RequestHandle, now: float) -> None:
        r.state = State.RUNNING
        if r.first_scheduled is None:
            r.first_scheduled = now
        self._running.append(r)

    def _finish_transfers(self, now: float) -> None:
        if not self._transferring:
            return
        still: list[RequestHandle] = []
        for r in self._transferring:
            if r.remote_ready_at is not None and r.remote_ready_at <= now:
                r.state = State.WAITING
                self._enqueue(r, front=True)
            else:
                still.append(r)
        self._transferring = still

    def _expire_held(self, now: float) -> None:
        if not self._held:
            return
        for request_id, (handle, expires) in list(self._held.items()):
            if expires <= now:
                del self._held[request_id]
                self.kv.free(handle.owner)

    def _emit_token(self, r: RequestHandle, t: float) -> None:
        r.output_tokens += 1
        self.stats.generation_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = t
            self.stats.prompt_tokens += r.prompt_tokens
        r.token_times.append(t)
        if r.output_tokens >= r.target_tokens:
            self._running.remove(r)
            self._finish(r, "length" if r.length_capped else "stop", t)
        else:
            self._updates.append(r)

    def _finish(self, r: RequestHandle, reason: str, t: float) -> None:
        r.state = State.FINISHED
        r.finish_reason = reason
        r.finish_time = t
        if r.request.hold_kv and reason != "abort" and self.kv.blocks_of(r.owner):
            r.held_blocks = tuple(self.kv.blocks_of(r.owner))
            self._held[r.request_id] = (r, t + self.kv_hold_timeout_s)
        else:
            self.kv.free(r.owner)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if self._by_id.get(r.request_id) is r:
            del self._by_id[r.request_id]
        self._updates.append(r)
        if self.on_finished is not None:
            self.on_finished(r)

    def _pick_victim(self) -> RequestHandle:
        if self.priority_scheduling:
            sign = self._sign
            return max(self._running, key=lambda h: (sign * h.request.priority, h.arrival, h.seq))
        return self._running[-1]

    def _preempt(self, r: RequestHandle, now: float) -> None:
        self._running.remove(r)
        self.kv.free(r.owner)
        r.num_computed = 0
        r.num_preemptions += 1
        r.state = State.WAITING
        self.stats.preemptions += 1
        self._enqueue(r, front=True)
        self._updates.append(r)

    def _enqueue(self, r: RequestHandle, *, front: bool) -> None:
        self._num_waiting += 1
        if self.priority_scheduling:
            heapq.heappush(self._heap, (self._sign * r.request.priority, r.seq, r))
        elif front:
            self._fcfs.appendleft(r)
        else:
            self._fcfs.append(r)

    def _dequeue(self, r: RequestHandle) -> None:
        self._num_waiting -= 1
        if self.priority_scheduling:
            # Lazy deletion: _peek_waiting drops entries whose request is no longer waiting.
            return
        if self._fcfs and self._fcfs[0] is r:
            self._fcfs.popleft()
        else:
            self._fcfs.remove(r)

    def _peek_waiting(self) -> RequestHandle | None:
        if not self.priority_scheduling:
            return self._fcfs[0] if self._fcfs else None
        while self._heap:
            r = self._heap[0][2]
            if r.state is State.WAITING:
                return r
            heapq.heappop(self._heap)
        return None

    def run_to_completion(self, handle: RequestHandle, now: float) -> None:
        """Step until `handle` finishes (the `instant` profile: durations are ignored)."""
        while not handle.finished:
            if self._running == [handle] and not self._num_waiting and handle.output_tokens:
                self._decode_alone(handle, now)
            elif self.step(now) == 0.0 and not handle.finished:
                raise RuntimeError("engine idle before the request finished")

    def _decode_alone(self, r: RequestHandle, now: float) -> None:
        """All remaining decode steps of a lone request at once (same blocks, same counts)."""
        remaining = r.target_tokens - r.output_tokens
        if not self.kv.allocate(r.owner, r.num_tokens + remaining - 1):
            self.step(now)
            return
        self.stats.steps += remaining
        for _ in range(remaining):
            r.num_computed = r.num_tokens
            self._emit_token(r, now)

    def iter_running(self) -> Iterator[RequestHandle]:
        return iter(list(self._running))
