"""Request bodies for a trace's requests: message layouts, turn boundaries and sessions.

A trace has no text and often no turns or sessions (the Mooncake trace has neither), so
both are read from its prefix structure. Request R's *parent* is the earlier request
with the most full blocks that are a prefix of R's blocks, the latest of those (its
previous turn, in a conversation; another session sharing only the preamble has fewer).

R's text is an exact extension of its parent P's text, as a client re-sending its previous
prompt would make it. P's partial last block is hashed over fewer tokens, so R's block at
that position has another hash although, in the conversation, it held the same tokens and
more; R's text for that block (its *join*) is therefore P's text for it, character for
character, followed by the rest of R's own block text (from that length on), which keeps
R's block as long as its tokens. P's text for the block may itself be a join with P's
parent, and R's blocks before it are P's, joins of earlier turns included. Only when R is
shorter than P (a Mooncake request sharing P's full blocks, then a shorter tail) does R's
text stop early: it is then a prefix of P's. Everything depends on earlier requests only.

R's *segments* are its parent's segments plus the rest of R as one new segment, so the
new segment starts where P's text ends. A request with no parent starts with the longest
prefix it shares with any earlier request (a common system prompt) as its own segment.
Segment bounds are token positions in the prompt.

Layouts for chat requests:

* ``growing``: a short fixed system message and one user message with the whole prompt.
* ``turns``: one message per segment, the first as the system message, then user and
  assistant alternately, so a turn's message list is its parent's list plus new
  messages, byte for byte.

Completions get the prompt text whatever the layout. Sessions missing from the trace are
inferred from the same relation: a request inherits its parent's session.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Protocol, TypedDict

from gateway.trace.format import TraceRecord

Layout = Literal["growing", "turns"]
Role = Literal["system", "user", "assistant"]
LAYOUTS: tuple[Layout, ...] = ("growing", "turns")
SYSTEM_PROMPT = "You are a helpful agent."
SESSION_HEADERS = ("x-session-id", "x-smg-routing-key")
INFERRED_SESSION_PREFIX = "inferred-"
# Joined block texts kept (each at most one block long).
DEFAULT_JOIN_CACHE = 4096


class Message(TypedDict):
    role: Role
    content: str


class TextSource(Protocol):
    """Deterministic text for blocks and whole prompts (`replay.PromptBuilder`).

    A block's text is as long as its tokens make it, whatever the hash, and a shorter
    block of a hash is a prefix of a longer one.
    """

    def block_text(self, block_hash: int, tokens: int) -> str: ...

    def prompt(self, rec: TraceRecord, index: int) -> str: ...


@dataclass(frozen=True, slots=True)
class Link:
    """How one request relates to the earlier ones."""

    parent: int | None
    # Leading blocks shared with the full blocks of some earlier request.
    shared_blocks: int


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What to render for one request: segment ends (token positions), session, parent."""

    bounds: tuple[int, ...]
    session_id: str
    parent: int | None = None


def full_blocks(rec: TraceRecord, block_tokens: int) -> int:
    """Blocks of the prompt that are `block_tokens` long (all but a partial last one)."""
    n = len(rec.block_hashes)
    return n - 1 if n and rec.last_block_tokens < block_tokens else n


def prompt_tokens(rec: TraceRecord, block_tokens: int) -> int:
    """Tokens the blocks add up to (`input_tokens` in a valid trace)."""
    n = len(rec.block_hashes)
    return (n - 1) * block_tokens + rec.last_block_tokens if n else rec.input_tokens


def link_requests(records: Sequence[TraceRecord], block_tokens: int) -> tuple[Link, ...]:
    """Each request's parent and shared prefix, in one pass over the blocks.

    O(total blocks) dictionary and set operations; relies on chained hashes only to find
    candidates, each checked by comparing the blocks themselves.
    """
    ends: dict[int, int] = {}  # last full block hash -> latest request ending its full blocks there
    seen: set[int] = set()
    counts: list[int] = []
    links: list[Link] = []
    for i, rec in enumerate(records):
        hashes = rec.block_hashes
        n_full = full_blocks(rec, block_tokens)
        head = hashes[:n_full]
        parent: int | None = None
        # The longest full-block prefix first (the previous turn, not a sibling session
        # sharing only the preamble); `ends` keeps the latest request of each length.
        candidates = [
            c
            for j, c in reversed(list(enumerate(map(ends.get, head))))
            if c is not None and counts[c] == j + 1
        ]
        for c in candidates:
            if records[c].block_hashes[: counts[c]] == hashes[: counts[c]]:
                parent = c
                break
        shared = 0
        if parent is not None:
            shared = counts[parent]
        else:
            for h in head:
                if h not in seen:
                    break
                shared += 1
        links.append(Link(parent, shared))
        counts.append(n_full)
        if n_full:
            ends[head[-1]] = i
            seen.update(head)
    return tuple(links)


def segment_bounds(
    records: Sequence[TraceRecord], block_tokens: int, links: Sequence[Link]
) -> tuple[tuple[int, ...], ...]:
    """Per request, the end token position of each segment (the last is its length).

    A request without hashes gets ``()``: one segment, the whole prompt.
    """
    out: list[tuple[int, ...]] = []
    for rec, link in zip(records, links):
        total = prompt_tokens(rec, block_tokens)
        if not rec.block_hashes:
            out.append(())
        elif link.parent is not None:
            out.append(tuple(b for b in out[link.parent] if b < total) + (total,))
        elif 0 < link.shared_blocks < len(rec.block_hashes):
            out.append((link.shared_blocks * block_tokens, total))
        else:
            out.append((total,))
    return tuple(out)


def infer_sessions(
    records: Sequence[TraceRecord], links: Sequence[Link], *, keep_known: bool = True
) -> tuple[str, ...]:
    """A session per request: its own (when `keep_known`), else its parent's, else new."""
    out: list[str] = []
    fresh = 0
    for rec, link in zip(records, links):
        if keep_known and rec.session_id:
            out.append(rec.session_id)
        elif link.parent is not None:
            out.append(out[link.parent])
        else:
            out.append(f"{INFERRED_SESSION_PREFIX}{fresh}")
            fresh += 1
    return tuple(out)


def plan_requests(records: Sequence[TraceRecord], block_tokens: int) -> tuple[RequestPlan, ...]:
    """Segments, sessions (the trace's own, else inferred) and parents of every request."""
    links = link_requests(records, block_tokens)
    bounds = segment_bounds(records, block_tokens, links)
    sessions = infer_sessions(records, links)
    return tuple(RequestPlan(b, s, k.parent) for b, s, k in zip(bounds, sessions, links))


def join_block(text: str, own: str) -> str:
    """A block that starts with `text` (the parent's) and goes on as `own`, as long as it."""
    return text + own[len(text) :] if len(text) <= len(own) else text[: len(own)]


class Renderer:
    """Prompt texts and chat messages of a trace's requests (see the module docstring).

    Rendering a request costs about building its text once plus a walk up its parent
    chain. Join texts are kept per request in a bounded LRU (safe across threads); an
    evicted one is rebuilt from the parent chain.
    """

    def __init__(
        self,
        source: TextSource,
        records: Sequence[TraceRecord],
        block_tokens: int,
        plans: Sequence[RequestPlan] | None = None,
        *,
        cache_size: int = DEFAULT_JOIN_CACHE,
    ) -> None:
        self.source = source
        self.records = records
        self.block_tokens = block_tokens
        self.plans = tuple(plans) if plans is not None else plan_requests(records, block_tokens)
        if len(self.plans) != len(records):
            raise ValueError("one plan per record")
        self._full = [full_blocks(r, block_tokens) for r in records]
        # Block index where each request joins its parent's partial last block, or None.
        self._joins: list[int | None] = []
        for rec, plan in zip(records, self.plans):
            p = plan.parent
            k = self._full[p] if p is not None else -1
            partial = p is not None and k < len(records[p].block_hashes)
            self._joins.append(k if partial and k < len(rec.block_hashes) else None)
        self._cache: OrderedDict[int, str] = OrderedDict()
        self._cache_size = max(1, cache_size)
        self._lock = threading.Lock()

    def _get(self, i: int) -> str | None:
        with self._lock:
            text = self._cache.get(i)
            if text is not None:
                self._cache.move_to_end(i)
            return text

    def _put(self, i: int, text: str) -> None:
        with self._lock:
            self._cache[i] = text
            self._cache.move_to_end(i)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _own_block(self, i: int, k: int) -> str:
        rec = self.records[i]
        n = self.block_tokens if k < len(rec.block_hashes) - 1 else rec.last_block_tokens
        return self.source.block_text(rec.block_hashes[k], n)

    def _joined(self, i: int) -> str:
        """Request `i`'s text for its join block (`_joins[i]` must be set)."""
        cached = self._get(i)
        if cached is not None:
            return cached
        # Up the chain while the parent's last block is itself a join not in the cache.
        stack = [i]
        while True:
            p = self.plans[stack[-1]].parent
            assert p is not None
            last = len(self.records[p].block_hashes) - 1
            if self._joins[p] != last:
                text = self._own_block(p, last)
                break
            cached = self._get(p)
            if cached is not None:
                text = cached
                break
            stack.append(p)
        for j in reversed(stack):
            k = self._joins[j]
            assert k is not None
            text = join_block(text, self._own_block(j, k))
            self._put(j, text)
        return text

    def block_texts(self, index: int) -> list[str]:
        """The text of each block of request `index`, joins included."""
        rec = self.records[index]
        lengths = rec.block_lengths(self.block_tokens)
        texts = [self.source.block_text(h, n) for h, n in zip(rec.block_hashes, lengths)]
        k = self._joins[index]
        if k is not None:
            texts[k] = self._joined(index)
        # Joins of earlier turns on what became their full blocks (held by every later turn).
        j = self.plans[index].parent
        while j is not None:
            k = self._joins[j]
            if k is not None and k < self._full[j]:
                texts[k] = self._joined(j)
            j = self.plans[j].parent
        return texts

    def text(self, index: int) -> str:
        """The whole prompt of request `index`."""
        rec = self.records[index]
        if not rec.block_hashes:
            return self.source.prompt(rec, index)
        return "".join(self.block_texts(index))

    def segments(self, index: int) -> list[str]:
        """The text of each segment (one, the whole prompt, without bounds)."""
        rec = self.records[index]
        bounds = self.plans[index].bounds
        if not rec.block_hashes or not bounds:
            return [self.text(index)]
        texts = self.block_texts(index)
        starts = [0]
        for t in texts:
            starts.append(starts[-1] + len(t))
        cuts = [0]
        for b in bounds[:-1]:
            k, off = divmod(b, self.block_tokens)
            inside = len(self.source.block_text(rec.block_hashes[k], off)) if off else 0
            cuts.append(starts[k] + inside)
        cuts.append(starts[-1])
        whole = "".join(texts)
        return [whole[a:b] for a, b in pairwise(cuts)]

    def content(self, index: int, *, chat: bool, layout: Layout = "growing") -> str | list[Message]:
        """The completions prompt (a string), or the chat messages of one request."""
        if not chat:
            return self.text(index)
        if layout == "growing":
            return growing_messages(self.text(index))
        if layout == "turns":
            return turn_messages(self.segments(index))
        raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")


def _role(position: int) -> Role:
    if position == 0:
        return "system"
    return "user" if position % 2 else "assistant"


def growing_messages(text: str) -> list[Message]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]


def turn_messages(texts: Sequence[str]) -> list[Message]:
    return [{"role": _role(k), "content": t} for k, t in enumerate(texts)]


def session_headers(session_id: str | None) -> dict[str, str]:
    """The session id as gateways and routers read it (kvgate, SGLang's router)."""
    return {name: session_id for name in SESSION_HEADERS} if session_id else {}
