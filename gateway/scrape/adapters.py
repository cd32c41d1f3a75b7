"""Engine dialects: turn one parsed `/metrics` exposition into an `EngineReading`.

Parsing is prometheus-client's; this module only knows which series mean what for vLLM
(current and pre-0.9 names), SGLang and TGI. A missing series stays `None` (unknown),
never zero.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import GatewayError
from gateway.scrape.config import EngineKind

Labels = Mapping[str, str]
Series = Sequence[tuple[Labels, float]]
SampleIndex = Mapping[str, Series]


class MetricsFormatError(GatewayError):
    """A replica's `/metrics` could not be parsed or speaks no known dialect."""

    code = "metrics_unreadable"


@dataclass(frozen=True, slots=True)
class CounterState:
    """Prefix-cache counters from the previous scrape, to turn totals into a recent rate."""

    hits: float
    queries: float
    rate: float | None = None


@dataclass(frozen=True, slots=True)
class EngineReading:
    kind: EngineKind
    waiting: float
    running: float
    kv_usage: float | None
    prefix_hit_rate: float | None
    kv_capacity_tokens: int | None
    counters: CounterState | None = None


def index_samples(text: str) -> SampleIndex:
    """Sample name -> [(labels, value)], with `_created` series dropped."""
    out: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                # Every series read here is a count, a total or a fraction: a NaN, an
                # infinity or a negative one is a broken engine, read as absent.
                if sample.name.endswith("_created") or not 0.0 <= value < math.inf:
                    continue
                out[sample.name].append((sample.labels, value))
    except ValueError as exc:
        raise MetricsFormatError(f"unparseable metrics exposition: {exc}") from exc
    return MappingProxyType(dict(out))


def _sum(index: SampleIndex, *names: str) -> float | None:
    """Sum of the first present name's series (vLLM: one series per DP `engine` rank)."""
    for name in names:
        series = index.get(name)
        if series:
            return sum(v for _, v in series)
    return None


def _mean(index: SampleIndex, *names: str) -> float | None:
    # A usage *fraction* must be averaged over DP ranks, not summed.
    for name in names:
        series = index.get(name)
        if series:
            return sum(v for _, v in series) / len(series)
    return None


def _per_dp_rank(
    index: SampleIndex, name: str, reduce: Callable[[list[float]], float]
) -> float | None:
    """SGLang repeats scheduler gauges on every TP rank: take one value per DP rank."""
    series = index.get(name)
    if not series:
        return None
    by_rank: dict[str, float] = {}
    for labels, value in series:
        rank = labels.get("dp_rank", "")
        by_rank[rank] = max(by_rank.get(rank, value), value)
    return reduce(list(by_rank.values()))


def _hit_rate(
    hits: float | None, queries: float | None, previous: CounterState | None
) -> tuple[float | None, CounterState | None]:
    if hits is None or queries is None:
        return None, None
    if previous is None:
        rate = hits / queries if queries > 0 else None
        return rate, CounterState(hits, queries, rate)
    d_hits, d_queries = hits - previous.hits, queries - previous.queries
    if d_queries < 0 or d_hits < 0:
        # Counters went backwards: the engine restarted, so its totals are the delta.
        d_hits, d_queries = hits, queries
    rate = d_hits / d_queries if d_queries > 0 else previous.rate
    return rate, CounterState(hits, queries, rate)


def _vllm_capacity(index: SampleIndex) -> int | None:
    series = index.get("vllm:cache_config_info")
    if not series:
        return None
    total = 0
    for labels, _ in series:
        try:
            # vLLM 0.33 labels the group-aware capacity: on hybrid models (sliding-window or
            # Mamba groups beside full attention) blocks times block size overstates it.
            sized = labels.get("kv_cache_size_tokens", "None")
            if sized not in ("None", ""):
                total += int(sized)
                continue
            total += int(labels["num_gpu_blocks"]) * int(labels.get("block_size", "16"))
        except (KeyError, ValueError):
            # `num_gpu_blocks` is "None" until the engine profiled memory.
            return None
    return total or None


def read_vllm(index: SampleIndex, previous: CounterState | None) -> EngineReading | None:
    waiting = _sum(index, "vllm:num_requests_waiting")
    running = _sum(index, "vllm:num_requests_running")
    if waiting is None or running is None:
        return None
    rate, counters = _hit_rate(
        _sum(index, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        _sum(index, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        previous,
    )
    return EngineReading(
        kind=EngineKind.VLLM,
        waiting=waiting,
        running=running,
        kv_usage=_mean(index, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_hit_rate=rate,
        kv_capacity_tokens=_vllm_capacity(index),
        counters=counters,
    )


def read_sglang(index: SampleIndex, previous: CounterState | None) -> EngineReading | None:
    waiting = _per_dp_rank(index, "sglang:num_queue_reqs", sum)
    running = _per_dp_rank(index, "sglang:num_running_reqs", sum)
    if waiting is None or running is None:
        return None
    usage = _per_dp_rank(index, "sglang:token_usage", lambda v: sum(v) / len(v))
    hit = _per_dp_rank(index, "sglang:cache_hit_rate", lambda v: sum(v) / len(v))
    capacity = _per_dp_rank(index, "sglang:max_total_num_tokens", sum)
    return EngineReading(
        kind=EngineKind.SGLANG,
        waiting=waiting,
        running=running,
        kv_usage=usage,
        prefix_hit_rate=hit,
        kv_capacity_tokens=int(capacity) if capacity and capacity < _MAX_CAPACITY_TOKENS else None,
    )


def read_tgi(index: SampleIndex, previous: CounterState | None) -> EngineReading | None:
    waiting = _sum(index, "tgi_queue_size")
    running = _sum(index, "tgi_batch_current_size")
    if waiting is None or running is None:
        return None
    # TGI exposes neither KV usage nor a prefix-cache signal.
    return EngineReading(EngineKind.TGI, waiting, running, None, None, None)


Reader = Callable[[SampleIndex, CounterState | None], EngineReading | None]

READERS: Mapping[EngineKind, Reader] = MappingProxyType(
    {EngineKind.VLLM: read_vllm, EngineKind.SGLANG: read_sglang, EngineKind.TGI: read_tgi}
)
_PREFIXES: tuple[tuple[str, EngineKind], ...] = (
    ("vllm:", EngineKind.VLLM),
    ("sglang:", EngineKind.SGLANG),
    ("tgi_", EngineKind.TGI),
)


# Every sample name a reader looks at. Engines expose dozens of families (histograms with
# many buckets among them); parsing only these lines keeps a scrape cheap.
_READ_SAMPLES = frozenset(
    {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:max_total_num_tokens",
        "tgi_queue_size",
        "tgi_batch_current_size",
    }
)
# One alternation over the read names, anchored at a line start and ended by what may
# follow a sample name: the C regex engine skips every other line (histogram buckets and
# all) without a Python-level loop, which is most of a scrape's cost.
# (Anchored on a newline rather than `^` in multiline mode, which is several times slower:
# the engine then tries every position instead of scanning for the literal.)
_READ_LINE = re.compile(
    r"\n(" + "|".join(re.escape(n) for n in sorted(_READ_SAMPLES, key=len, reverse=True)) + r")"
    r"(?=[{ \t])([^\n]*)"
)
_SAMPLE_REST = re.compile(
    r'(?:\{((?:[^"}]|"(?:[^"\\\n]|\\.)*")*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*'
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"')
# What may stand between two labels; anything else is a malformed label set.
_LABEL_GAP = re.compile(r"[ \t,]*")
_NO_LABELS: Labels = MappingProxyType({})


def _labels(text: str, line: str) -> Labels:
    pairs = _LABEL.findall(text)
    # One C-level findall; the leftovers between the pairs must be separators only.
    if _LABEL_GAP.fullmatch(_LABEL.sub("", text)) is None:
        raise MetricsFormatError(f"unparseable metrics exposition: labels of {line!r}")
    out: dict[str, str] = {}
    for name, value in pairs:
        if "\\" in value:
            value = value.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n")
            value = value.replace("\x00", "\\")
        out[name] = value
    return out


def select_read_samples(text: str) -> tuple[SampleIndex, EngineKind | None]:
    """The samples the readers use, and the dialect the whole exposition shows (the first
    of vLLM, SGLang, TGI whose prefix any series name carries).

    Only the lines of the read series are parsed, by a small parser of the text format's
    sample line (what prometheus-client parses, minus what these series never carry);
    a malformed line of a read series is an unparseable exposition, as it was with the
    full parser. Every other line is skipped unread.
    """
    out: dict[str, list[tuple[Labels, float]]] = {}
    text = "\n" + text  # every line, the first one too, follows a newline
    for m in _READ_LINE.finditer(text):
        name, rest = m.group(1), m.group(2)
        sample = _SAMPLE_REST.fullmatch(rest.rstrip("\r"))
        if sample is None:
            raise MetricsFormatError(f"unparseable metrics exposition: {m.group(0)[1:]!r}")
        raw_labels, raw_value = sample.group(1), sample.group(2)
        try:
            value = float(raw_value)
        except ValueError as exc:
            raise MetricsFormatError(f"unparseable metrics exposition: {exc}") from exc
        # Every series read here is a count, a total or a fraction: a NaN, an infinity or
        # a negative one is a broken engine, read as absent.
        if not 0.0 <= value < math.inf:
            continue
        labels = _labels(raw_labels, m.group(0)[1:]) if raw_labels else _NO_LABELS
        out.setdefault(name, []).append((labels, value))
    kind = next((k for prefix, k in _PREFIXES if "\n" + prefix in text), None)
    return MappingProxyType(out), kind


def read_engine(
    text: str, kind: EngineKind = EngineKind.AUTO, previous: CounterState | None = None
) -> EngineReading:
    """Parse an exposition and read it in `kind`'s dialect (detected when `auto`)."""
    return read_engine_series(text, kind, previous)[0]


def read_engine_series(
    text: str, kind: EngineKind = EngineKind.AUTO, previous: CounterState | None = None
) -> tuple[EngineReading, frozenset[str]]:
    """`read_engine`, and the names of the read samples the exposition had (what a
    selective scrape of the same engine must bring back, gateway.scrape.select)."""
    index, detected = select_read_samples(text)
    resolved = detected if kind is EngineKind.AUTO else kind
    if resolved is None:
        raise MetricsFormatError("no vLLM, SGLang or TGI metrics found")
    reading = READERS[resolved](index, previous)
    if reading is None:
        raise MetricsFormatError(f"{resolved.value} queue/running gauges are missing")
    return _bounded(reading), frozenset(index)


def read_samples_of(kind: EngineKind) -> frozenset[str]:
    """The sample names `kind`'s reader looks at (all dialects' for `auto`)."""
    prefix = next((p for p, k in _PREFIXES if k is kind), "")
    return frozenset(n for n in _READ_SAMPLES if n.startswith(prefix))


_MAX_CAPACITY_TOKENS = 1 << 40  # far past any engine's KV; a larger figure is a broken one


def _bounded(r: EngineReading) -> EngineReading:
    """Fractions kept in [0, 1] and a capacity no engine can have dropped, so one engine's
    broken exposition cannot skew routing or crash the scraper."""

    def fraction(v: float | None) -> float | None:
        return None if v is None else min(1.0, v)

    capacity = r.kv_capacity_tokens
    if capacity is not None and capacity > _MAX_CAPACITY_TOKENS:
        capacity = None
    return replace(
        r,
        kv_usage=fraction(r.kv_usage),
        prefix_hit_rate=fraction(r.prefix_hit_rate),
        kv_capacity_tokens=capacity,
    )
