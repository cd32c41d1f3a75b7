"""Seeded synthetic traces of agent-shaped traffic (`kvgate trace generate`).

An agent session starts with its kind's preamble (system prompt and tool specs, shared by
every session of that kind) and a task; each later turn appends the previous assistant
output and a tool result to the context and sends it all again. Sessions start as a
Poisson process and wait a think time between turns, so many are interleaved. The
defaults aim at what practitioners measured on real agent traffic: context P50 about
108K tokens, per-request input:output median about 256, over 97% of requests above 16K
tokens and about 94% of input tokens reusable from earlier requests.

Block hashes are chained over (segment id, offset, length) pieces, so an appended turn
keeps every full block of the previous one and the preamble's full blocks are shared by
kind. The same options and seed give the same trace.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

import xxhash

from gateway.trace.format import MOONCAKE_BLOCK_TOKENS, Trace, TraceHeader, TraceRecord
from gateway.trace.tokenize import APPROX_TOKENIZER_NAME

GENERATED_SOURCE = "generate-agent"
_MAX_OUTPUT_TOKENS = 8_192
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class AgentTraceOptions:
    """What `generate_agent_trace` builds; token counts are before `context_scale`."""

    seed: int = 1
    sessions: int = 64
    # Session starts are Poisson over `duration_s`, or at `rate_per_s` when that is set.
    duration_s: float = 600.0
    rate_per_s: float | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    # Multiplies every token count (preambles, turns, outputs, the context cap).
    context_scale: float = 1.0
    kinds: int = 4
    preamble_tokens: tuple[int, int] = (10_000, 30_000)
    turns: tuple[int, int] = (20, 45)
    # Medians of log-normal lengths: the first user message, each turn's tool result or
    # user text, and each assistant output.
    task_tokens: int = 1_500
    tool_tokens: int = 3_800
    output_tokens: int = 400
    # A session ends early rather than send a context above this (a 256K-context model).
    max_context_tokens: int = 256_000
    # Gap between two turns' arrivals: output_tokens / decode_tokens_per_s + a think time
    # (log-normal, this median).
    think_s: float = 6.0
    decode_tokens_per_s: float = 60.0

    def validate(self) -> None:
        if self.sessions < 0 or self.kinds <= 0 or self.block_tokens <= 0:
            raise ValueError("sessions must be >= 0, kinds and block_tokens > 0")
        if self.context_scale <= 0 or self.duration_s <= 0:
            raise ValueError("context_scale and duration_s must be positive")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        if not 0 < self.preamble_tokens[0] <= self.preamble_tokens[1]:
            raise ValueError("preamble_tokens must be 0 < low <= high")
        if not 1 <= self.turns[0] <= self.turns[1]:
            raise ValueError("turns must be 1 <= low <= high")
        if min(self.task_tokens, self.tool_tokens, self.output_tokens) <= 0:
            raise ValueError("task, tool and output token medians must be positive")
        if self.think_s < 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("think_s must be >= 0 and decode_tokens_per_s > 0")


class _Context:
    """A prompt as chained block hashes, grown by appending segments."""

    __slots__ = ("block_tokens", "full", "pending", "pending_tokens", "tokens")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.full: list[int] = []
        self.pending: list[int] = []  # (segment, offset, length) triples, flattened
        self.pending_tokens = 0
        self.tokens = 0

    def copy(self) -> _Context:
        other = _Context(self.block_tokens)
        other.full = list(self.full)
        other.pending = list(self.pending)
        other.pending_tokens = self.pending_tokens
        other.tokens = self.tokens
        return other

    def _hash(self) -> int:
        parent = self.full[-1] if self.full else 0
        data = struct.pack(f"<QQ{len(self.pending)}Q", parent, self.pending_tokens, *self.pending)
        return xxhash.xxh3_64_intdigest(data)

    def append(self, segment: int, tokens: int) -> None:
        offset = 0
        while offset < tokens:
            take = min(tokens - offset, self.block_tokens - self.pending_tokens)
            self.pending += (segment, offset, take)
            self.pending_tokens += take
            offset += take
            if self.pending_tokens == self.block_tokens:
                self.full.append(self._hash())
                self.pending, self.pending_tokens = [], 0
        self.tokens += tokens

    def record(self, arrival_s: float, output_tokens: int, session: str) -> TraceRecord:
        if self.pending_tokens:
            hashes = (*self.full, self._hash())
            last = self.pending_tokens
        else:
            hashes, last = tuple(self.full), self.block_tokens
        # Rounded as the writer rounds, so a written trace reads back equal.
        return TraceRecord(round(arrival_s, 6), self.tokens, output_tokens, hashes, last, session)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _scaled(tokens: float, scale: float) -> int:
    return max(1, round(tokens * scale))


def _session_records(
    rng: random.Random, opts: AgentTraceOptions, preamble: _Context, start_s: float, sid: str
) -> list[TraceRecord]:
    scale = opts.context_scale
    cap = _scaled(opts.max_context_tokens, scale)
    ctx = preamble.copy()
    ctx.append(rng.getrandbits(64), _scaled(_lognormal(rng, opts.task_tokens, 0.6), scale))
    turns = rng.randint(*opts.turns)
    out: list[TraceRecord] = []
    t = start_s
    for turn in range(turns):
        if turn:
            tool = _scaled(_lognormal(rng, opts.tool_tokens, 0.9), scale)
            if ctx.tokens + tool > cap:
                break
            ctx.append(rng.getrandbits(64), tool)
        output = _scaled(min(_MAX_OUTPUT_TOKENS, _lognormal(rng, opts.output_tokens, 0.7)), scale)
        out.append(ctx.record(t, output, sid))
        # The assistant's output is the start of the next turn's new text.
        ctx.append(rng.getrandbits(64), output)
        gap = output / scale / opts.decode_tokens_per_s + _lognormal(rng, opts.think_s, 0.8)
        t += gap
    return out


def generate_agent_trace(opts: AgentTraceOptions) -> Trace:
    """A kvgate trace of interleaved agent sessions, arrivals re-based to the first one."""
    opts.validate()
    rng = random.Random(opts.seed)
    low, high = opts.preamble_tokens
    preambles: list[_Context] = []
    for kind in range(opts.kinds):
        # Stratified, so the kinds span the range whatever the seed.
        tokens = low + (high - low) * (kind + rng.random()) / opts.kinds
        ctx = _Context(opts.block_tokens)
        ctx.append(rng.getrandbits(64), _scaled(tokens, opts.context_scale))
        preambles.append(ctx)
    # A few kinds carry most sessions (Zipf-like popularity).
    weights = [1.0 / (k + 1) for k in range(opts.kinds)]
    rate = opts.rate_per_s or opts.sessions / opts.duration_s
    records: list[TraceRecord] = []
    start = 0.0
    for n in range(opts.sessions):
        if n:
            start += rng.expovariate(rate)
        kind = rng.choices(range(opts.kinds), weights)[0]
        sid = xxhash.xxh3_64_hexdigest(struct.pack("<QQ", opts.seed & _U64, n))
        records += _session_records(rng, opts, preambles[kind], start, sid)
    records.sort(key=lambda r: r.arrival_s)
    header = TraceHeader(
        block_tokens=opts.block_tokens, tokenizer=APPROX_TOKENIZER_NAME, source=GENERATED_SOURCE
    )
    return Trace(header, tuple(records))
