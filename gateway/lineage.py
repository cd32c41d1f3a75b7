"""Conversation lineage inferred from the prompt itself, whatever the message layout.

A request *continues* a conversation when its prompt extends that conversation's latest
prompt. Prompts are compared through their chained prefix hashes (gateway.keys): a short
run of opener hashes over the first bytes, then one hash per fixed-size block, each
covering everything before it. So "extends" means: every hash of the conversation's latest
prompt is a leading hash of this one. That holds for one growing user message, one
message per turn, tool calls and results, `/v1/completions` strings and token-id prompts
alike, because the gateway encodes each of them as one byte stream that only grows.

The rule, per request with hashes ``H``:

1. ``m`` = how many leading hashes of ``H`` the index holds (binary search: the index is
   prefix-closed, as it evicts deepest-first).
2. The owner of ``H[m-1]`` decides:

   * nobody (``m == 0``): a new lineage;
   * ``SHARED`` (a prefix held by two or more lineages: a system prompt, an agent
     preamble): a new lineage that branches off the shared part;
   * lineage ``L`` whose latest prompt had ``tip`` hashes: if ``m >= tip - slack`` the
     request covers L's latest prompt (but for at most ``slack`` trailing hashes: a
     client that re-renders the end of its last message) and continues L; otherwise it
     branches off L (a new conversation that opens like L, an edited or cut history),
     and the ``m`` hashes both hold become ``SHARED``.

   When ``m == tip`` the bytes past the last hash (under a block) decide: the request
   continues L if its bytes there start with L's, or if they are the start of L's (L's
   latest prompt cut short inside its last block: a regenerate after the end was edited,
   a trace's repeat of a request a few tokens shorter). It is then L's latest prompt.

So a prefix seen in many lineages never defines a conversation; the first part only one
lineage holds does. Examples (``|`` separates hashes):

* ``sys|u1`` then ``sys|u1|a1|u2``: the second continues the first.
* ``sys|u1`` and ``sys|v1`` (same preamble, another task): the second branches at ``sys``,
  which becomes shared; ``sys|v1|b1|v2`` then continues ``sys|v1``.
* ``sys|u1|a1|u2`` then ``sys|u1|x``: a branch (the history was edited after ``u1``).
* two conversations that open with the very same ``sys|hi``: one lineage until one of
  them moves on; the other then branches at ``sys|hi``.
* ``sys|report, summarise it`` then ``sys|report, summ`` (cut inside the last block):
  one lineage; ``sys|report, list its figures`` after them: a new one (it shares only
  ``sys|report``, which becomes shared).

A new chat lineage's session key is the request's own conversation key (gateway.keys:
its opening messages), which every gateway computes alike from the request alone, so
placements shared through the store find the conversation on any gateway; when another
lineage already has that key (two conversations that open alike), and for other
endpoints, it is ``l:<n>`` with a number of this index's own. Memory is bounded: at most
``capacity`` hashes (LRU, deepest-first within a prompt, as engines evict),
``max_lineages`` lineages (LRU), and ``TAIL_BYTES_PER_HASH x capacity`` bytes of tails
(each under a block; a lineage whose tail was dropped is continued on its hashes alone).
Everything here is synchronous and does no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.hashing import leading_match
from gateway.types import ReplicaState, SessionKey

SHARED = -1
MIN_BLOCKS = 4096
# Trailing tokens of a conversation's last prompt that its next turn may differ in and
# still continue it (for clients that re-render the end of their last message). Clients
# re-send their history as it was, so none by default: a slack lets a new conversation
# whose own part is shorter than it join the one it opens like.
DEFAULT_SLACK_TOKENS = 0
_MEMO_MAX = 8192
# Tail bytes kept per hash of capacity: a hash entry costs about 150 bytes, so tails add at
# most 40% to the index, and a conversation of tens of blocks keeps its tail.
TAIL_BYTES_PER_HASH = 64
DEFAULT_CAPACITY = 1 << 20
# Index size over the cluster's KV (session.lineage_capacity_factor): it outlives engines'
# caches so that a conversation back after an eviction still goes back where it was.
DEFAULT_CAPACITY_FACTOR = 4.0
DEFAULT_MAX_LINEAGES = 1 << 18


# (hashes counted, length): the prompt's bytes after that many hashes, at most `length`.
TailProbe = Callable[[int, int], bytes]


@dataclass(frozen=True, slots=True)
class LineageMatch:
    """What `LineageIndex.resolve` found for one prompt.

    `lineage` is the continued lineage, or None for a new one; `matched` is how many
    leading hashes the index already holds; `parent` the lineage a new one branches off.
    """

    lineage: int | None
    matched: int
    parent: int | None = None

    @property
    def continues(self) -> bool:
        return self.lineage is not None


def lineage_key(lineage: int) -> SessionKey:
    return SessionKey(f"l:{lineage:x}")


class LineageIndex:
    """Prefix hashes -> the one lineage holding them (or SHARED), and each lineage's tip."""

    __slots__ = (
        "_by_key",
        "_ends",
        "_keys",
        "_moves",
        "_next_id",
        "_owner",
        "_tail_bytes",
        "_tails",
        "_tips",
        "_touched",
        "capacity",
        "max_lineages",
        "slack",
    )

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        max_lineages: int = DEFAULT_MAX_LINEAGES,
        slack: int = 0,
    ) -> None:
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._tips: OrderedDict[int, int] = OrderedDict()  # lineage -> hashes of its tip
        # Entries moved to the LRU's end so far, and when each lineage's hashes last all
        # were: a continued lineage's earlier hashes are touched again only once a fair
        # part of the index has moved past them (`record`).
        self._moves = 0
        self._touched: dict[int, int] = {}
        self._keys: dict[int, SessionKey] = {}
        self._by_key: dict[SessionKey, int] = {}
        # The bytes of a lineage's latest prompt past its last hash (under a block; LRU),
        # and the lineages whose latest prompt ends at a given hash: two prompts that
        # differ only there (a shared preamble, then a short task) are told apart, and a
        # next turn is checked to repeat them.
        self._tails: dict[int, bytes] = {}
        self._tail_bytes = 0
        self._ends: dict[int, list[int]] = {}
        self._next_id = 0
        self.capacity = max(1, capacity)
        self.max_lineages = max(1, max_lineages)
        self.slack = max(0, slack)

    def __len__(self) -> int:
        return len(self._owner)

    @property
    def lineages(self) -> int:
        return len(self._tips)

    @property
    def tail_bytes(self) -> int:
        return self._tail_bytes

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._trim()

    def resolve(self, hashes: Sequence[int], probe: TailProbe | None = None) -> LineageMatch:
        """Which lineage `hashes` continues, if any. Read-only; O(log n).

        `probe(n, length)` gives up to `length` bytes of the prompt after its `n`-th hash
        (None: no bytes at hand, as for trace records; tails are then not compared).
        """
        owner = self._owner
        m = leading_match(hashes, owner)
        if m == 0:
            return LineageMatch(None, 0)
        if probe is not None:
            tails = self._tails
            for lineage in self._ends.get(hashes[m - 1], ()):
                if self._tips.get(lineage) != m:
                    continue
                tail = tails.get(lineage)
                # Its bytes repeat the tail and go on, or they stop inside it (cut short).
                if not tail or tail.startswith(probe(m, len(tail))):
                    return LineageMatch(lineage, m)
        holder = owner[hashes[m - 1]]
        if holder == SHARED:
            return LineageMatch(None, m)
        tip = self._tips.get(holder)
        if tip is None:  # its lineage was forgotten: what it left is anybody's
            return LineageMatch(None, m)
        if m >= tip - self.slack and not (
            probe is not None and m == tip and self._tails.get(holder)
        ):
            # (Ending exactly at a tip with bytes past it was decided above, by the bytes.)
            return LineageMatch(holder, m)
        return LineageMatch(None, m, parent=holder)

    def key_of(self, lineage: int) -> SessionKey | None:
        return self._keys.get(lineage)

    def key_in_use(self, key: SessionKey) -> bool:
        return key in self._by_key

    def record(
        self,
        match: LineageMatch,
        hashes: Sequence[int],
        key: SessionKey | None = None,
        tail: bytes = b"",
        new_id: int | None = None,
    ) -> int:
        """Enter a served prompt under the lineage `match` resolved; returns its lineage.

        Hashes are touched deepest-first so that the prompt's leading hashes are the most
        recent and eviction takes tails first. A continued lineage's earlier hashes (most
        of a long conversation's) are touched again only when an eighth of the capacity
        has moved to the LRU's end since they last were: until then they are nowhere
        near its front, and touching them every turn was a third of its CPU per turn.
        """
        if not hashes:
            return match.lineage if match.lineage is not None else SHARED
        lineage = match.lineage
        if lineage is None:
            lineage = new_id if new_id is not None else self.new_id()
        # A new lineage's hashes that another lineage holds too stop naming either one.
        # (All of them, not only the `matched` ones: requests resolved at the same time
        # may have entered the same preamble meanwhile.)
        shared = len(hashes) if match.lineage is None else 0
        owner = self._owner
        get, touch = owner.get, owner.move_to_end
        tips = self._tips
        # A continued lineage's first `matched` hashes are its own or SHARED already (its
        # earlier turns entered them): they are only touched, in one C loop, and not at
        # every turn.
        known = min(match.matched, len(hashes)) if match.lineage is not None else 0
        moves = self._moves
        fresh = (
            known
            and moves - self._touched.get(lineage, -self.capacity) < self.capacity >> 3
            # (Unless the index shrank or evicted them since routing.)
            and hashes[0] in owner
            and hashes[known - 1] in owner
        )
        for i in range(len(hashes) - 1, known - 1, -1):
            h = hashes[i]
            held = get(h)
            if held is None:
                owner[h] = lineage
                continue
            if held != lineage and held != SHARED:
                owner[h] = SHARED if i < shared and held in tips else lineage
            touch(h)
        if fresh:
            self._moves = moves + len(hashes) - known
        elif known:
            self._moves = moves + len(hashes)
            self._touched[lineage] = self._moves
            try:
                deque(map(touch, reversed(hashes[:known])), 0)
            except KeyError:  # some went (evicted since routing): the long way for them
                for i in range(known - 1, -1, -1):
                    h = hashes[i]
                    if h in owner:
                        touch(h)
                    else:
                        owner[h] = lineage
        if not known:
            self._moves += len(hashes)
            self._touched[lineage] = self._moves
        tip = tips.get(lineage, 0)
        new_tip = max(tip, len(hashes)) if match.lineage is not None else len(hashes)
        if tip:
            self._unend(lineage, tip, hashes)
        tips[lineage] = new_tip
        tips.move_to_end(lineage)
        if new_tip == len(hashes):
            self._ends.setdefault(hashes[-1], []).append(lineage)
            self._set_tail(lineage, tail)
        if key is not None and match.lineage is None:
            old = self._keys.get(lineage)
            if old is not None:
                self._by_key.pop(old, None)
            self._keys[lineage] = key
            self._by_key[key] = lineage
        self._trim()
        return lineage

    def _trim(self) -> None:
        owner = self._owner
        pop = owner.popitem
        for _ in range(len(owner) - self.capacity):
            pop(False)
        tips, keys, by_key = self._tips, self._keys, self._by_key
        for _ in range(len(tips) - self.max_lineages):
            lineage = tips.popitem(False)[0]
            self._touched.pop(lineage, None)
            key = keys.pop(lineage, None)
            if key is not None:
                by_key.pop(key, None)
            self._drop_tail(lineage)
        budget = TAIL_BYTES_PER_HASH * self.capacity
        tails = self._tails
        while self._tail_bytes > budget and tails:
            self._drop_tail(next(iter(tails)))
        ends = self._ends
        if len(ends) > 2 * len(tips) + 64:
            # Ends of forgotten lineages (or tips that moved on) are dropped in one sweep.
            for end in [e for e, ls in ends.items() if not any(x in tips for x in ls)]:
                del ends[end]

    def _set_tail(self, lineage: int, tail: bytes) -> None:
        self._drop_tail(lineage)
        if tail:
            self._tails[lineage] = tail  # most recent last
            self._tail_bytes += len(tail)

    def _drop_tail(self, lineage: int) -> None:
        old = self._tails.pop(lineage, None)
        if old is not None:
            self._tail_bytes -= len(old)

    def _unend(self, lineage: int, tip: int, hashes: Sequence[int]) -> None:
        """Forget where `lineage`'s previous tip ended (its hashes are a prefix of these)."""
        if tip <= len(hashes):
            ends = self._ends.get(hashes[tip - 1])
            if ends is not None and lineage in ends:
                ends.remove(lineage)
                if not ends:
                    del self._ends[hashes[tip - 1]]

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id


class Conversations:
    """The gateway's lineage index, sized from the replicas' KV capacity.

    `key_for` names a prompt's conversation before routing; `record` enters the prompt
    once it was served. The index holds `capacity_factor` x the cluster's KV capacity in
    hash blocks (at least `min_blocks`, at most `max_blocks`), re-read when the cluster's
    membership or scraped capacities change.
    """

    __slots__ = ("_block_tokens", "_factor", "_max", "_memo", "_seen", "index")

    def __init__(
        self,
        block_tokens: int,
        capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
        max_blocks: int = DEFAULT_CAPACITY,
        max_lineages: int = DEFAULT_MAX_LINEAGES,
        slack_tokens: int = DEFAULT_SLACK_TOKENS,
    ) -> None:
        self._block_tokens = max(1, block_tokens)
        self._factor = capacity_factor
        self._max = max_blocks
        self._seen: object = None
        slack = -(-slack_tokens // self._block_tokens)
        # Resolutions of requests not recorded yet, by identity of their hash tuple: the
        # prompt is recorded under the lineage routing went by. Ordered so that dropping
        # the oldest is O(1): requests that fail are never recorded, and a plain dict
        # emptied from its front makes each `next(iter(...))` walk the holes it left.
        self._memo: OrderedDict[int, tuple[Sequence[int], LineageMatch, int]] = OrderedDict()
        self.index = LineageIndex(max_blocks, max_lineages, slack)

    def key_for(
        self, hashes: Sequence[int], own: SessionKey | None, probe: TailProbe | None = None
    ) -> SessionKey | None:
        """The session key of the prompt `hashes`. `own` is the request's conversation
        key when it names a conversation by its opening messages (chat), else None."""
        if not hashes:
            return None
        index = self.index
        match = index.resolve(hashes, probe)
        memo = self._memo
        if len(memo) >= _MEMO_MAX:
            memo.popitem(False)
        if match.lineage is not None:
            memo[id(hashes)] = (hashes, match, match.lineage)
            return index.key_of(match.lineage) or lineage_key(match.lineage)
        lineage = index.new_id()
        memo[id(hashes)] = (hashes, match, lineage)
        if own is not None and not index.key_in_use(own):
            return own
        return lineage_key(lineage)

    def record(self, hashes: Sequence[int], key: SessionKey, tail: bytes = b"") -> None:
        """`hashes` (keyed `key` by `key_for`) was served; `tail` is its bytes past the
        last hash."""
        if hashes:
            index = self.index
            memo = self._memo.pop(id(hashes), None)
            if memo is not None and memo[0] is hashes:
                index.record(memo[1], hashes, key, tail, memo[2])  # what routing went by
            else:
                index.record(index.resolve(hashes), hashes, key, tail)

    def fit(self, replicas: Sequence[ReplicaState]) -> None:
        """Resize to the replicas' KV capacity; O(1) when `replicas` is the last tuple."""
        if replicas is self._seen:
            return
        self._seen = replicas
        tokens = 0
        for r in replicas:
            scraped = r.load.kv_capacity_tokens if r.load is not None else None
            tokens += scraped or r.kv_capacity_tokens or 0
        if tokens:
            blocks = int(self._factor * tokens / self._block_tokens)
            self.index.resize(min(self._max, max(MIN_BLOCKS, blocks)))
