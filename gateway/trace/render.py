"""Request bodies for a trace's requests: message layouts, turn boundaries and sessions.

A trace has no text and often no turns or sessions (the Mooncake trace has neither), so
both are read from its prefix structure. Request R's *parent* is the latest earlier
request whose full blocks are a prefix of R's blocks (its previous turn, in a
conversation). R's *segments* are its parent's segments, cut back to the parent's full
blocks, plus R's remaining blocks as one new segment: a parent's partial last block is
hashed over fewer tokens, so its text is not part of what R shares. A request with no
parent starts with the longest prefix it shares with any earlier request (a common system
prompt) as its own segment. Segment bounds are block indices, so a segment's text is the
same in every request that holds it.

Layouts for chat requests:

* ``growing``: a short fixed system message and one user message with the whole prompt.
* ``turns``: one message per segment, the first as the system message, then user and
  assistant alternately, so a turn's message list is its parent's list (cut back to the
  parent's full blocks) plus new messages, byte for byte.

Completions get the prompt text whatever the layout. Sessions missing from the trace are
inferred from the same relation: a request inherits its parent's session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict

from gateway.trace.format import TraceRecord

Layout = Literal["growing", "turns"]
Role = Literal["system", "user", "assistant"]
LAYOUTS: tuple[Layout, ...] = ("growing", "turns")
SYSTEM_PROMPT = "You are a helpful agent."
SESSION_HEADERS = ("x-session-id", "x-smg-routing-key")
INFERRED_SESSION_PREFIX = "inferred-"


class Message(TypedDict):
    role: Role
    content: str


class TextSource(Protocol):
    """Deterministic text for blocks and whole prompts (`replay.PromptBuilder`)."""

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
    """What to render for one request: segment end bounds (block indices) and session."""

    bounds: tuple[int, ...]
    session_id: str


def full_blocks(rec: TraceRecord, block_tokens: int) -> int:
    """Blocks of the prompt that are `block_tokens` long (all but a partial last one)."""
    n = len(rec.block_hashes)
    return n - 1 if n and rec.last_block_tokens < block_tokens else n


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
        candidates = sorted(
            (c for j, c in enumerate(map(ends.get, head)) if c is not None and counts[c] == j + 1),
            reverse=True,
        )
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
    """Per request, the end block index of each segment (the last is len(block_hashes))."""
    out: list[tuple[int, ...]] = []
    for rec, link in zip(records, links):
        n = len(rec.block_hashes)
        if link.parent is not None:
            cut = full_blocks(records[link.parent], block_tokens)
            inherited = tuple(b for b in out[link.parent] if b < cut) + (cut,)
            out.append(inherited + (n,) if n > cut else inherited)
        elif 0 < link.shared_blocks < n:
            out.append((link.shared_blocks, n))
        else:
            out.append((n,) if n else ())
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
    """Segments and sessions (the trace's own, else inferred) of every request."""
    links = link_requests(records, block_tokens)
    bounds = segment_bounds(records, block_tokens, links)
    sessions = infer_sessions(records, links)
    return tuple(RequestPlan(b, s) for b, s in zip(bounds, sessions))


def segment_texts(
    source: TextSource,
    rec: TraceRecord,
    index: int,
    bounds: Sequence[int],
    block_tokens: int,
) -> list[str]:
    """The text of each segment; empty `bounds` means one segment, the whole prompt."""
    hashes = rec.block_hashes
    if not hashes or not bounds:
        return [source.prompt(rec, index)]
    lengths = rec.block_lengths(block_tokens)
    texts: list[str] = []
    start = 0
    for end in bounds:
        texts.append("".join(source.block_text(hashes[k], lengths[k]) for k in range(start, end)))
        start = end
    return texts


def _role(position: int) -> Role:
    if position == 0:
        return "system"
    return "user" if position % 2 else "assistant"


def growing_messages(text: str) -> list[Message]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]


def turn_messages(texts: Sequence[str]) -> list[Message]:
    return [{"role": _role(k), "content": t} for k, t in enumerate(texts)]


def render_content(
    source: TextSource,
    rec: TraceRecord,
    index: int,
    *,
    chat: bool,
    layout: Layout = "growing",
    block_tokens: int,
    bounds: Sequence[int] = (),
) -> str | list[Message]:
    """The completions prompt (a string), or the chat messages of one request.

    `bounds` (a `RequestPlan`'s) matters for the ``turns`` layout only. The cost is that
    of building the prompt text once.
    """
    if not chat:
        return source.prompt(rec, index)
    if layout == "growing":
        return growing_messages(source.prompt(rec, index))
    if layout == "turns":
        return turn_messages(segment_texts(source, rec, index, bounds, block_tokens))
    raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")


def session_headers(session_id: str | None) -> dict[str, str]:
    """The session id as gateways and routers read it (kvgate, SGLang's router)."""
    return {name: session_id for name in SESSION_HEADERS} if session_id else {}
