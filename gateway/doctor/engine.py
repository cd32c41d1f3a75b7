"""One engine's diagnoses: pure functions from its snapshots to findings, each with its
arithmetic (KV starvation, preemptions, queues, the prefill budget, frozen counters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.doctor.findings import (
    KV_FULL,
    MNBT_CAP,
    MNBT_SHARE,
    STARVED_SEQUENCES,
    VLLM_DEFAULT_MAX_NUM_SEQS,
    Finding,
    Hints,
)
from gateway.doctor.flags import flag_findings, metrics_missing
from gateway.doctor.probe import EngineSnapshot
from gateway.plan.memory import Budget


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What is known about one engine's configuration, and where each value came from."""

    capacity: int | None
    max_model_len: int | None
    max_num_seqs: int
    seqs_source: str
    mnbt: int | None
    mnbt_source: str
    block_size: int

    @classmethod
    def of(cls, snap: EngineSnapshot, hints: Hints) -> EngineFacts:
        args = snap.server_args
        seqs, seqs_source = VLLM_DEFAULT_MAX_NUM_SEQS, "vLLM default; pass --max-num-seqs"
        if hints.max_num_seqs:
            seqs, seqs_source = hints.max_num_seqs, "--max-num-seqs"
        elif isinstance(args.get("max_running_requests"), int):
            seqs, seqs_source = args["max_running_requests"], "server_info"
        mnbt, mnbt_source = None, ""
        if hints.max_num_batched_tokens:
            mnbt, mnbt_source = hints.max_num_batched_tokens, "--max-num-batched-tokens"
        elif isinstance(args.get("chunked_prefill_size"), int):
            mnbt, mnbt_source = args["chunked_prefill_size"], "server_info chunked_prefill_size"
        return cls(
            snap.kv_capacity_tokens,
            hints.max_model_len or snap.max_model_len,
            seqs,
            seqs_source,
            mnbt,
            mnbt_source,
            snap.block_size or 16,
        )


def _pow2_at_most(value: float, floor: int) -> int:
    if value < floor:
        return floor
    return int(2 ** math.floor(math.log2(value)))


def _delta(samples: Sequence[EngineSnapshot], key: str) -> float | None:
    first, last = samples[0].counters.get(key), samples[-1].counters.get(key)
    if first is None or last is None:
        return None
    return last - first if last >= first else last  # an engine restart resets counters


def _waiting(samples: Sequence[EngineSnapshot]) -> list[float]:
    return [s.reading.waiting for s in samples if s.reading is not None]


def _series(values: Sequence[float]) -> str:
    return " -> ".join(f"{v:.0f}" for v in values)


def _max_usage(samples: Sequence[EngineSnapshot]) -> float:
    return max((s.reading.kv_usage or 0.0) for s in samples if s.reading is not None)


def check_engine(url: str, samples: Sequence[EngineSnapshot], hints: Hints) -> list[Finding]:
    last = samples[-1]
    missing = metrics_missing(url, last)
    if missing is not None:
        return [missing]
    if last.error is not None or last.reading is None:
        return [
            Finding(
                "unreachable",
                "severe",
                url,
                "engine did not answer",
                (f"GET {url}/metrics: {last.error}",),
                "check the engine process and its --port; nothing else can be read",
            )
        ]
    ok = [s for s in samples if s.reading is not None]
    facts = EngineFacts.of(last, hints)
    out = _unhealthy(url, last)
    out += _kv_starved(url, facts, last)
    out += _preempting(url, ok, facts)
    out += _queue_growing(url, ok, facts)
    out += _queue_first_come(url, ok, hints)
    out += _mnbt_too_big(url, facts, hints.budget)
    out += _frozen(url, ok)
    out += flag_findings(url, last, hints)
    return out


def _unhealthy(url: str, snap: EngineSnapshot) -> list[Finding]:
    if snap.health_status is None or snap.health_status == 200:
        return []
    return [
        Finding(
            "engine_unhealthy",
            "severe",
            url,
            "the engine says it is unhealthy",
            (
                f"GET {url}/health: {snap.health_status}",
                "while /metrics answers: the API server is up, the engine behind it is not",
            ),
            "read the engine's log (a dead engine core, out of memory) and restart it; a"
            " gateway in front takes it out on its probes until /health answers 200",
        )
    ]


def _kv_starved(url: str, f: EngineFacts, snap: EngineSnapshot) -> list[Finding]:
    if not f.capacity or not f.max_model_len:
        return []
    full = f.capacity // f.max_model_len
    if full >= STARVED_SEQUENCES:
        return []
    blocks = f"{snap.num_gpu_blocks:,} blocks x {f.block_size}" if snap.num_gpu_blocks else "KV"
    fit_len = f.capacity // STARVED_SEQUENCES // f.block_size * f.block_size
    evidence = (
        f"KV capacity {blocks} = {f.capacity:,} tokens",
        (
            f"max_model_len {f.max_model_len:,}: {f.capacity:,} // {f.max_model_len:,} = {full}"
            " full-length sequence(s) fit at once"
        ),
        (
            f"max_num_seqs {f.max_num_seqs} ({f.seqs_source}) x max_model_len would need"
            f" {f.max_num_seqs * f.max_model_len:,} tokens"
            f" ({f.capacity / (f.max_num_seqs * f.max_model_len):.1%} of that is there)"
        ),
    )
    return [
        Finding(
            "kv_starved",
            "severe" if full < 1 else "warning",
            url,
            "KV cache too small for the configured max_model_len",
            evidence,
            f"give KV more memory (a smaller max_num_batched_tokens, a higher"
            f" gpu_memory_utilization, kv_cache_dtype fp8, more tensor parallelism), or set"
            f" max_model_len <= {fit_len:,} so {STARVED_SEQUENCES} full-length sequences fit",
        )
    ]


def _preempting(url: str, samples: Sequence[EngineSnapshot], f: EngineFacts) -> list[Finding]:
    delta = _delta(samples, "preemptions")
    total = samples[-1].counters.get("preemptions", 0.0)
    if not total:
        return []
    usage = _max_usage(samples)
    running = max(s.reading.running for s in samples if s.reading is not None)
    window = samples[-1].at - samples[0].at
    now = delta is not None and delta > 0 and len(samples) > 1
    evidence = [
        f"preemptions: {total:,.0f} since start"
        + (f", {delta:,.0f} in the last {window:.1f} s" if len(samples) > 1 else ""),
        f"KV usage peaked at {usage:.0%} with {running:.0f} requests running",
    ]
    per_seq = f.capacity / running if f.capacity and running else None
    if per_seq is not None:
        evidence.append(
            f"{f.capacity:,} KV tokens / {running:.0f} running ="
            f" {per_seq:,.0f} tokens per running request"
        )
    severe = now and usage >= KV_FULL
    target = max(1, int(running * 0.75)) if running else 1
    return [
        Finding(
            "preemptions",
            "severe" if severe else "warning",
            url,
            "requests are preempted (KV full: their KV is dropped and recomputed)"
            if severe
            else "requests were preempted earlier",
            tuple(evidence),
            f"cap the batch at what KV holds: max_num_seqs ~{target} (now {f.max_num_seqs},"
            f" {f.seqs_source}), or give KV more memory",
        )
    ]


def _queue_growing(url: str, samples: Sequence[EngineSnapshot], f: EngineFacts) -> list[Finding]:
    if len(samples) < 2:
        return []
    waits = _waiting(samples)
    usage = _max_usage(samples)  # usage swings as sequences finish: full at any sample counts
    if waits[-1] <= waits[0] or waits[-1] < 1 or usage < KV_FULL:
        return []
    running = samples[-1].reading.running if samples[-1].reading is not None else 0.0
    window = samples[-1].at - samples[0].at
    return [
        Finding(
            "queue_growing_kv_full",
            "warning",
            url,
            "waiting queue grows while the KV cache is full",
            (
                f"waiting {_series(waits)} over {window:.1f} s",
                (
                    f"KV usage up to {usage:.0%}, {running:.0f} running of max_num_seqs {f.max_num_seqs}"
                    f" ({f.seqs_source}): KV, not max_num_seqs, limits the batch"
                ),
            ),
            "more KV per replica (see kv_starved / max_num_batched_tokens) or more replicas;"
            " lowering max_num_seqs will not help while KV is the limit",
        )
    ]


def _queue_first_come(url: str, samples: Sequence[EngineSnapshot], hints: Hints) -> list[Finding]:
    """Requests wait with KV to spare: compute (prefill) is the queue's limit, and in a
    first-come queue a turn whose history is cached waits behind every new long context."""
    if len(samples) < 2 or hints.priority_scheduling:
        return []
    args = samples[-1].server_args
    if args.get("enable_priority_scheduling") is True:
        return []
    waits = _waiting(samples)
    queued = sum(1 for w in waits if w >= 1)
    usage = _max_usage(samples)
    if queued * 2 < len(waits) or usage >= KV_FULL:
        return []
    if "enable_priority_scheduling" in args:
        how = "server_info: enable_priority_scheduling false (first come)"
    else:
        how = (
            "vLLM does not report its scheduling policy: first come unless started with "
            "--scheduling-policy priority (then pass --priority-scheduling)"
        )
    return [
        Finding(
            "queue_first_come",
            "warning",
            url,
            "requests queue for compute, not memory, in arrival order",
            (
                (
                    f"waiting {_series(waits)}: queued in {queued} "
                    f"of {len(waits)} reads, KV usage at most {usage:.0%}"
                ),
                how,
            ),
            "start the engine with --scheduling-policy priority (SGLang: "
            "--enable-priority-scheduling) and flag the replica `priority_scheduling: true`: "
            "kvgate then sends the shortest uncached prefill first (engine_priority, "
            "docs/admission.md); more replicas if the queue keeps growing",
        )
    ]


def _mnbt_too_big(url: str, f: EngineFacts, b: Budget | None) -> list[Finding]:
    if not f.mnbt or not f.capacity or f.mnbt <= MNBT_SHARE * f.capacity:
        return []
    rec = min(f.mnbt // 2, MNBT_CAP, _pow2_at_most(f.capacity / 4, f.block_size))
    evidence = [
        (
            f"max_num_batched_tokens {f.mnbt:,} ({f.mnbt_source}) vs KV capacity"
            f" {f.capacity:,} tokens: one step may schedule {f.mnbt / f.capacity:.0%} of"
            " everything the KV holds"
        )
    ]
    if b is not None:
        from gateway.plan.memory import activation_bytes

        s = b.settings
        now = activation_bytes(b.model, f.mnbt, s.max_num_seqs, s.tp, s.expert_parallel)
        then = activation_bytes(b.model, rec, s.max_num_seqs, s.tp, s.expert_parallel)
        freed = (now - then) / 2**30
        gained = int((now - then) // b.kv_bytes_per_token) if b.kv_bytes_per_token else 0
        evidence.append(
            f"activations for {f.mnbt:,} tokens ~{now / 2**30:.2f} GiB, for"
            f" {rec:,} ~{then / 2**30:.2f} GiB: {freed:.2f} GiB ="
            f" {gained:,} more KV tokens at {b.kv_bytes_per_token:,.0f} B/token"
        )
    return [
        Finding(
            "max_num_batched_tokens_high",
            "warning",
            url,
            "max_num_batched_tokens far above what the KV budget allows",
            tuple(evidence),
            f"set max_num_batched_tokens {rec:,}: the activation peak vLLM profiles shrinks"
            " and its memory goes to KV (chunked prefill keeps long prompts working)",
        )
    ]


def _frozen(url: str, samples: Sequence[EngineSnapshot]) -> list[Finding]:
    if len(samples) < 2:
        return []
    busy = all(s.reading is not None and s.reading.running > 0 for s in samples)
    moved = [_delta(samples, k) for k in ("prompt_tokens", "generation_tokens")]
    if not busy or any(m is None or m > 0 for m in moved):
        return []
    window = samples[-1].at - samples[0].at
    return [
        Finding(
            "stale_metrics",
            "warning",
            url,
            "metrics do not move while requests run",
            (
                (
                    f"{samples[-1].reading.running if samples[-1].reading else 0:.0f} running, but the"
                    f" prompt and generation token counters did not change in {window:.1f} s"
                ),
            ),
            "the engine is hung or /metrics is served from a cache: check the engine's log",
        )
    ]
