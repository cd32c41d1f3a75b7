"""`kvgate trace stats`: a trace's shape, its prefix-cache potential and what it costs.

Hit rates are token-weighted: for each request, the tokens of its leading blocks already
in the cache count as hits (the scan stops at the first miss, since a KV prefix is only
reusable up to its first difference). Caches are either infinite or LRU of a size in
tokens. The cluster figures route every request with the real routing policy (pure, no
HTTP, no timing: the cluster view shows idle replicas; `kvgate simulate` adds load).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.trace.format import Trace
from gateway.trace.report import Percentiles
from gateway.trace.routing import PolicyDriver, make_replicas, route_request_for
from gateway.trace.tierstats import TierSummary, tier_summary
from gateway.types import ClusterView, EngineLoad

LONG_CONTEXT_TOKENS = 16 * 1024
_SUFFIXES = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_tokens(text: str) -> int | None:
    """'1M' -> 1_000_000, '250k' -> 250_000, 'inf' -> None (infinite)."""
    t = text.strip().lower()
    if t in {"inf", "infinite", "none"}:
        return None
    mult = _SUFFIXES.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in _SUFFIXES else t
    try:
        value = int(float(number) * mult)
    except ValueError as exc:
        raise ValueError(f"not a token count: {text!r} (examples: 500k, 2M, inf)") from exc
    if value <= 0:
        raise ValueError(f"cache size must be positive: {text!r}")
    return value


class PrefixCache:
    """A block cache, infinite or LRU by block count."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def access(self, hashes: Sequence[int], lengths: Sequence[int]) -> int:
        """Tokens of the leading cached blocks; then all blocks become most recent."""
        blocks = self._blocks
        hit = 0
        for h, n in zip(hashes, lengths):
            if h not in blocks:
                break
            hit += n
        # Touch tail first so that a prefix is always more recent than its extensions: LRU
        # then evicts leaves before the roots other requests share (as vLLM does).
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)
        return hit


def hit_rate(trace: Trace, capacity_tokens: int | None = None) -> float:
    """Token-weighted prefix hit rate of one cache over the whole trace."""
    bt = trace.block_tokens
    cache = PrefixCache(None if capacity_tokens is None else max(1, capacity_tokens // bt))
    hits = total = 0
    for rec in trace.records:
        total += rec.input_tokens
        hits += cache.access(rec.block_hashes, rec.block_lengths(bt))
    return hits / total if total else 0.0


@dataclass(frozen=True, slots=True)
class ClusterHitRate:
    policy: str
    replicas: int
    capacity_tokens: int | None  # per replica
    hit_rate: float
    request_share: tuple[float, ...]


def cluster_hit_rate(
    trace: Trace,
    replicas: int,
    policy: str,
    capacity_tokens: int | None = None,
    policy_config: Mapping[str, Any] | None = None,
    sessions: bool = True,
) -> ClusterHitRate:
    """Hit rate with one cache per replica, requests routed by `policy`. `sessions=False`
    routes as for clients that send no session id (the lineage rule keys them)."""
    bt = trace.block_tokens
    states = make_replicas(replicas)
    driver = PolicyDriver(policy, states, policy_config, block_tokens=bt)
    cap = None if capacity_tokens is None else max(1, capacity_tokens // bt)
    caches = {r.id: PrefixCache(cap) for r in states}
    counts = {r.id: 0 for r in states}
    hits = total = 0
    for i, rec in enumerate(trace.records):
        now = rec.arrival_s
        # Idle replicas, freshly scraped: no timing here, so no load to show. (A cache's
        # fill is not KV usage: cached-but-free blocks are not "in use" on an engine.)
        loaded = tuple(replace(r, load=_idle(now)) for r in states)
        view = ClusterView(replicas=loaded, now=now)
        request = driver.resolve(route_request_for(rec, i, bt, sessions=sessions))
        replica = driver.choose(request, view)
        driver.prefilled(request)  # no timing here: every prefill is over at once
        total += rec.input_tokens
        hits += caches[replica].access(rec.block_hashes, rec.block_lengths(bt))
        counts[replica] += 1
    n = len(trace.records) or 1
    share = tuple(counts[r.id] / n for r in states)
    return ClusterHitRate(policy, replicas, capacity_tokens, hits / total if total else 0.0, share)


def _idle(now: float) -> EngineLoad:
    return EngineLoad(waiting=0.0, running=0.0, kv_usage=0.0, scraped_at=now)


@dataclass(frozen=True, slots=True)
class Cost:
    price_per_card_hour: float
    cards: int
    throughput_tokens_s: float
    per_million_total: float
    per_million_output: float


@dataclass(frozen=True, slots=True)
class CacheForecast:
    """Predicted against achieved prefix-cache hits of the requests a live capture saw
    with all three numbers (gateway.forecast), as shares of their input tokens."""

    requests: int
    input_tokens: int
    predicted: int
    best: int
    achieved: int
    mean_abs_error: float  # mean |achieved - predicted| per request, in tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "predicted_tokens": self.predicted,
            "best_tokens": self.best,
            "achieved_tokens": self.achieved,
            "mean_abs_error_tokens": self.mean_abs_error,
        }


def cache_forecast(trace: Trace) -> CacheForecast | None:
    rows = [
        (r.input_tokens, r.predicted_cached, r.best_cached, r.achieved_cached)
        for r in trace.records
        if r.predicted_cached is not None
        and r.best_cached is not None
        and r.achieved_cached is not None
    ]
    if not rows:
        return None
    return CacheForecast(
        requests=len(rows),
        input_tokens=sum(r[0] for r in rows),
        predicted=sum(r[1] for r in rows),
        best=sum(r[2] for r in rows),
        achieved=sum(r[3] for r in rows),
        mean_abs_error=sum(abs(r[3] - r[1]) for r in rows) / len(rows),
    )


@dataclass(frozen=True, slots=True)
class TraceStats:
    source: str
    block_tokens: int
    requests: int
    duration_s: float
    rate_per_s: float
    input_tokens: Percentiles
    output_tokens: Percentiles
    ratio_median: float
    long_share: float
    total_input: int
    total_output: int
    has_prefixes: bool
    hit_rate_infinite: float | None
    hit_rate_lru: dict[int, float] = field(default_factory=dict)
    cluster: tuple[ClusterHitRate, ...] = ()
    cost: Cost | None = None
    forecast: CacheForecast | None = None
    tiers: TierSummary | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "block_tokens": self.block_tokens,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "rate_per_s": self.rate_per_s,
            "input_tokens": self.input_tokens.as_dict(),
            "output_tokens": self.output_tokens.as_dict(),
            "input_output_ratio_median": self.ratio_median,
            "share_over_16k": self.long_share,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "hit_rate_infinite": self.hit_rate_infinite,
            "hit_rate_lru": {str(k): v for k, v in self.hit_rate_lru.items()},
            "cluster": [
                {
                    "policy": c.policy,
                    "replicas": c.replicas,
                    "capacity_tokens": c.capacity_tokens,
                    "hit_rate": c.hit_rate,
                    "request_share": list(c.request_share),
                }
                for c in self.cluster
            ],
            "cache_forecast": None if self.forecast is None else self.forecast.as_dict(),
            "tiers": None if self.tiers is None else self.tiers.as_dict(),
            "cost": None
            if self.cost is None
            else {
                "price_per_card_hour": self.cost.price_per_card_hour,
                "cards": self.cost.cards,
                "throughput_tokens_s": self.cost.throughput_tokens_s,
                "per_million_total": self.cost.per_million_total,
                "per_million_output": self.cost.per_million_output,
            },
        }


def compute_cost(
    total_tokens: int,
    output_tokens: int,
    price_per_card_hour: float,
    throughput_tokens_s: float,
    cards: int = 1,
) -> Cost:
    """Cost per million tokens of this trace's mix, at a measured total-token throughput
    (of all `cards` together)."""
    if price_per_card_hour < 0 or throughput_tokens_s <= 0 or cards <= 0:
        raise ValueError("price must be >= 0, throughput and cards > 0")
    per_m_total = price_per_card_hour * cards / (throughput_tokens_s * 3600.0) * 1e6
    out_share = output_tokens / total_tokens if total_tokens else 0.0
    per_m_out = per_m_total / out_share if out_share else math.inf
    return Cost(price_per_card_hour, cards, throughput_tokens_s, per_m_total, per_m_out)


def compute_stats(
    trace: Trace,
    *,
    source: str = "",
    lru_tokens: Sequence[int] = (),
    replicas: int = 0,
    policies: Sequence[str] = (),
    sessions: bool = True,
    price_per_card_hour: float | None = None,
    throughput_tokens_s: float | None = None,
    cards: int = 1,
) -> TraceStats:
    recs = trace.records
    n = len(recs)
    inputs = [float(r.input_tokens) for r in recs]
    outputs = [float(r.output_tokens) for r in recs]
    duration = recs[-1].arrival_s - recs[0].arrival_s if n > 1 else 0.0
    ratios = [r.input_tokens / r.output_tokens for r in recs if r.output_tokens > 0]
    total_in, total_out = int(sum(inputs)), int(sum(outputs))
    has_prefixes = any(r.block_hashes for r in recs)
    lru: dict[int, float] = {}
    cluster: list[ClusterHitRate] = []
    if has_prefixes:
        lru = {size: hit_rate(trace, size) for size in lru_tokens}
        if replicas > 0:
            for policy in policies:
                for size in (None, *lru_tokens):
                    cluster.append(
                        cluster_hit_rate(trace, replicas, policy, size, sessions=sessions)
                    )
    cost = None
    if price_per_card_hour is not None and throughput_tokens_s is not None:
        cost = compute_cost(
            total_in + total_out, total_out, price_per_card_hour, throughput_tokens_s, cards
        )
    return TraceStats(
        source=source or trace.header.source,
        block_tokens=trace.block_tokens,
        requests=n,
        duration_s=duration,
        rate_per_s=n / duration if duration > 0 else math.nan,
        input_tokens=Percentiles.of(inputs),
        output_tokens=Percentiles.of(outputs),
        ratio_median=statistics.median(ratios) if ratios else math.nan,
        long_share=sum(1 for x in inputs if x > LONG_CONTEXT_TOKENS) / n if n else 0.0,
        total_input=total_in,
        total_output=total_out,
        has_prefixes=has_prefixes,
        hit_rate_infinite=hit_rate(trace) if has_prefixes else None,
        hit_rate_lru=lru,
        cluster=tuple(cluster),
        cost=cost,
        forecast=cache_forecast(trace),
        tiers=tier_summary(recs),
    )


def _size(tokens: int | None) -> str:
    if tokens is None:
        return "infinite"
    for suffix, mult in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= mult:
            return f"{tokens / mult:g}{suffix}"
    return str(tokens)


def render_stats(s: TraceStats) -> str:
    def pct(p: Percentiles) -> str:
        return f"P50 {p.p50:,.0f}  P90 {p.p90:,.0f}  P99 {p.p99:,.0f}  mean {p.mean:,.1f}"

    total = s.total_input + s.total_output
    lines = [
        f"trace            {s.source}"
        + (f" ({s.block_tokens} tokens/block)" if s.has_prefixes else " (no prefix hashes)"),
        f"requests         {s.requests:,}",
        f"duration         {s.duration_s:,.1f} s",
        f"rate             {s.rate_per_s:.3f} req/s",
        f"input tokens     {pct(s.input_tokens)}",
        f"output tokens    {pct(s.output_tokens)}",
        f"input:output     median per-request ratio r = {s.ratio_median:,.1f}",
        f"over 16K tokens  {s.long_share:.1%} of requests (input > {LONG_CONTEXT_TOKENS:,})",
        (
            f"tokens           total {total:,} = input {s.total_input:,}"
            f" + output {s.total_output:,}"
            f" (output {s.total_output / total if total else 0:.2%} of total)"
        ),
    ]
    if not s.has_prefixes:
        lines.append("prefix hit rate  n/a (trace has no prefix hashes)")
    else:
        lines.append(f"prefix hit rate  one cache, infinite: {s.hit_rate_infinite:.1%}")
        for size, rate in s.hit_rate_lru.items():
            lines.append(f"                 one cache, LRU {_size(size)} tokens: {rate:.1%}")
        for c in s.cluster:
            share = " ".join(f"{x:.0%}" for x in c.request_share)
            lines.append(
                f"                 {c.replicas} replicas, {c.policy}, {_size(c.capacity_tokens)}"
                f" per replica: {c.hit_rate:.1%}  (requests: {share})"
            )
    f = s.forecast
    if f is not None:
        inputs = f.input_tokens or 1
        lines.append(
            f"cache forecast   {f.requests:,} requests as routed:"
            f" predicted {f.predicted / inputs:.1%}, best replica {f.best / inputs:.1%},"
            f" engine reported {f.achieved / inputs:.1%} of their input;"
            f" mean |reported - predicted| {f.mean_abs_error:,.0f} tokens"
        )
    if s.tiers is not None:
        lines.extend(s.tiers.render())
    if s.cost is not None:
        cost = s.cost
        lines.append(
            f"cost             ${cost.per_million_total:,.4f} per M total tokens,"
            f" ${cost.per_million_output:,.2f} per M output tokens ({cost.cards} card(s) at"
            f" ${cost.price_per_card_hour:g}/h, {cost.throughput_tokens_s:,.0f} tok/s)"
        )
    return "\n".join(lines)
