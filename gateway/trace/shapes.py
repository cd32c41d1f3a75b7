"""Seeded traces of the traffic shapes that co-locate (`kvgate trace generate --shape`).

Three shapes besides the linear agent sessions of gateway.trace.generate, each with short
chats under a few shared system prompts mixed in:

* ``forks``: main agents (a 10-30K-token preamble shared per agent kind, tens of turns)
  that now and then fork 1-4 subagents at the same instant. A subagent's first prompt is
  the parent's whole history plus its own task; it runs a few turns; the parent resumes
  once the last of them is done, with their results appended to its history. Subagents
  are sessions of their own (``<parent>/<n>``), as Claude Code's are.
* ``samples``: conversations whose every turn is sent ``n`` times at once (2-8: ``n > 1``
  or best-of-N sent as separate requests, RL rollouts); the conversation goes on from one
  of them. The ``n`` requests of a turn share the session id and the prompt.
* ``rag``: sessions that open with a shared system prompt and 2-4 documents retrieved from
  a corpus (Zipf popularity, most popular first, so popular documents open many
  sessions alike), then a question, and go on for a few turns.

Lengths are log-normal around the stated medians; block hashes are chained as in
gateway.trace.generate, so a prompt that extends another keeps all of its full blocks. The
same options give the same trace.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import xxhash

from gateway.trace.format import MOONCAKE_BLOCK_TOKENS, Trace, TraceHeader, TraceRecord
from gateway.trace.generate import _Context, _lognormal, _scaled
from gateway.trace.tokenize import APPROX_TOKENIZER_NAME

SHAPES = ("forks", "samples", "rag")
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ShapeOptions:
    """What `generate_shape` builds; token counts are before `context_scale`."""

    shape: str = "forks"
    seed: int = 1
    # Main sessions (agents, sampled conversations, RAG sessions) starting Poisson over
    # `duration_s`, and as many short chats again times `chat_share`.
    sessions: int = 48
    duration_s: float = 300.0
    chat_share: float = 1.0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    context_scale: float = 1.0
    kinds: int = 4
    preamble_tokens: tuple[int, int] = (10_000, 30_000)
    turns: tuple[int, int] = (15, 30)
    tool_tokens: int = 3_000
    output_tokens: int = 400
    think_s: float = 4.0
    decode_tokens_per_s: float = 60.0
    # forks: chance that a main-agent turn (after the third) forks, subagents per fork,
    # and each subagent's turns.
    fork_chance: float = 0.15
    fork_children: tuple[int, int] = (1, 4)
    child_turns: tuple[int, int] = (2, 5)
    # samples: requests per turn.
    samples: tuple[int, int] = (2, 8)
    # rag: documents in the corpus, per session, and their length median.
    documents: int = 40
    retrieved: tuple[int, int] = (2, 4)
    document_tokens: int = 4_000
    # chats: shared system prompts, their length, and turns per chat.
    chat_prompts: int = 3
    chat_prompt_tokens: int = 1_500
    chat_turns: tuple[int, int] = (2, 8)

    def validate(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}")
        if self.sessions < 0 or self.kinds <= 0 or self.block_tokens <= 0:
            raise ValueError("sessions must be >= 0, kinds and block_tokens > 0")
        if self.context_scale <= 0 or self.duration_s <= 0 or self.chat_share < 0:
            raise ValueError("context_scale and duration_s must be positive, chat_share >= 0")
        for name in ("preamble_tokens", "turns", "fork_children", "child_turns", "samples"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high")
        if not 0 <= self.fork_chance <= 1:
            raise ValueError("fork_chance must be in [0, 1]")
        if self.documents < self.retrieved[1] or self.retrieved[0] < 1:
            raise ValueError("documents must be at least the most retrieved per session")


class _Maker:
    """Shared state of one trace: the rng, the options, the records."""

    def __init__(self, opts: ShapeOptions) -> None:
        self.o = opts
        self.rng = random.Random(opts.seed)
        self.records: list[TraceRecord] = []

    def tokens(self, median: float, sigma: float = 0.6) -> int:
        return _scaled(_lognormal(self.rng, median, sigma), self.o.context_scale)

    def output(self) -> int:
        return min(self.tokens(self.o.output_tokens, 0.7), _scaled(8_192, self.o.context_scale))

    def gap(self, output: int) -> float:
        o = self.o
        return output / o.context_scale / o.decode_tokens_per_s + _lognormal(
            self.rng, o.think_s, 0.8
        )

    def context(self, tokens: int) -> _Context:
        ctx = _Context(self.o.block_tokens)
        ctx.append(self.rng.getrandbits(64), tokens)
        return ctx

    def sid(self, n: int) -> str:
        return xxhash.xxh3_64_hexdigest(struct.pack("<QQ", self.o.seed & _U64, n))

    def run(self, ctx: _Context, t: float, turns: int, sid: str, copies: int = 1) -> float:
        """`turns` turns of one conversation from `t`; returns when its last answer is in."""
        for turn in range(turns):
            if turn:
                ctx.append(self.rng.getrandbits(64), self.tokens(self.o.tool_tokens, 0.9))
            output = self.output()
            for _ in range(copies):
                self.records.append(ctx.record(t, output, sid))
            ctx.append(self.rng.getrandbits(64), output)
            t += self.gap(output)
        return t

    def starts(self, count: int) -> list[float]:
        rate = count / self.o.duration_s if count else 1.0
        out, t = [], 0.0
        for n in range(count):
            if n:
                t += self.rng.expovariate(rate)
            out.append(t)
        return out


def _agent(m: _Maker, ctx: _Context, t: float, sid: str) -> None:
    """A main agent: turns, with forks whose subagents the parent waits for."""
    o = m.o
    turns = m.rng.randint(*o.turns)
    forks = 0
    for turn in range(turns):
        if turn:
            ctx.append(m.rng.getrandbits(64), m.tokens(o.tool_tokens, 0.9))
        output = m.output()
        m.records.append(ctx.record(t, output, sid))
        ctx.append(m.rng.getrandbits(64), output)
        t += m.gap(output)
        if turn >= 3 and turn < turns - 1 and m.rng.random() < o.fork_chance:
            # The subagents start together from the parent's whole history.
            done = t
            results = []
            for c in range(m.rng.randint(*o.fork_children)):
                child = ctx.copy()
                child.append(m.rng.getrandbits(64), m.tokens(800))
                cid = f"{sid}/{forks}.{c}"
                done = max(done, m.run(child, t, m.rng.randint(*o.child_turns), cid))
                results.append(m.tokens(1_000))
            for size in results:
                ctx.append(m.rng.getrandbits(64), size)
            forks += 1
            t = done


def _chats(m: _Maker, count: int, base: int) -> None:
    o = m.o
    prompts = [m.context(m.tokens(o.chat_prompt_tokens, 0.3)) for _ in range(o.chat_prompts)]
    for n, start in enumerate(m.starts(count)):
        ctx = m.rng.choice(prompts).copy()
        ctx.append(m.rng.getrandbits(64), m.tokens(200))
        turns = m.rng.randint(*o.chat_turns)
        t = start
        for turn in range(turns):
            if turn:
                ctx.append(m.rng.getrandbits(64), m.tokens(150))
            output = min(m.output(), m.tokens(300))
            m.records.append(ctx.record(t, output, m.sid(base + n)))
            ctx.append(m.rng.getrandbits(64), output)
            t += m.gap(output)


def generate_shape(opts: ShapeOptions) -> Trace:
    """A kvgate trace of the shape `opts.shape`, arrivals re-based to the first one."""
    opts.validate()
    m = _Maker(opts)
    low, high = opts.preamble_tokens
    # Stratified over the range, so the kinds span it whatever the seed.
    kinds = [
        m.context(
            _scaled(low + (high - low) * (k + m.rng.random()) / opts.kinds, opts.context_scale)
        )
        for k in range(opts.kinds)
    ]
    weights = [1.0 / (k + 1) for k in range(opts.kinds)]
    docs = [m.tokens(opts.document_tokens, 0.5) for _ in range(opts.documents)]
    doc_ids = [m.rng.getrandbits(64) for _ in range(opts.documents)]
    doc_weights = [1.0 / (d + 1) for d in range(opts.documents)]
    for n, start in enumerate(m.starts(opts.sessions)):
        sid = m.sid(n)
        if opts.shape == "forks":
            ctx = m.rng.choices(kinds, weights)[0].copy()
            ctx.append(m.rng.getrandbits(64), m.tokens(1_500))
            _agent(m, ctx, start, sid)
        elif opts.shape == "samples":
            ctx = m.rng.choices(kinds, weights)[0].copy()
            ctx.append(m.rng.getrandbits(64), m.tokens(1_500))
            copies = m.rng.randint(*opts.samples)
            m.run(ctx, start, m.rng.randint(*opts.chat_turns), sid, copies)
        else:
            ctx = kinds[0].copy()
            picked: set[int] = set()
            want = m.rng.randint(*opts.retrieved)
            while len(picked) < want:
                picked.add(m.rng.choices(range(opts.documents), doc_weights)[0])
            for d in sorted(picked):  # most popular first: popular openings are shared
                ctx.append(doc_ids[d], docs[d])
            ctx.append(m.rng.getrandbits(64), m.tokens(150))
            m.run(ctx, start, m.rng.randint(*opts.chat_turns), sid)
    _chats(m, round(opts.sessions * opts.chat_share), opts.sessions)
    m.records.sort(key=lambda r: r.arrival_s)
    origin = m.records[0].arrival_s if m.records else 0.0
    records = tuple(
        TraceRecord(
            round(r.arrival_s - origin, 6),
            r.input_tokens,
            r.output_tokens,
            r.block_hashes,
            r.last_block_tokens,
            r.session_id,
        )
        for r in m.records
    )
    header = TraceHeader(
        block_tokens=opts.block_tokens,
        tokenizer=APPROX_TOKENIZER_NAME,
        source=f"generate-{opts.shape}",
    )
    return Trace(header, records)
