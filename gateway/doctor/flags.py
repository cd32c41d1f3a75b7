"""Engine flags kvgate needs and the engines leave off by default: each finding names the
exact flag (vLLM 0.33, SGLang 0.5.23; see docs/conformance.md for where each comes from).

Pure: from an engine's snapshot (its `/metrics` and, for SGLang, `/server_info` args).
"""

from __future__ import annotations

from gateway.doctor.findings import Finding, Hints
from gateway.doctor.probe import EngineSnapshot
from gateway.scrape.config import EngineKind

METRICS_OFF = "start SGLang with --enable-metrics: without /metrics kvgate sees no load"


def metrics_missing(url: str, snap: EngineSnapshot) -> Finding | None:
    """`/metrics` answered 404: SGLang serves it only with --enable-metrics (off by
    default); kvgate then has no queue or KV usage for this replica."""
    if snap.error is None or "answered 404" not in snap.error:
        return None
    return Finding(
        "metrics_off",
        "severe",
        url,
        "the engine serves no /metrics",
        (f"GET {url}/metrics: {snap.error}",),
        METRICS_OFF + " (vLLM serves it unless started with --disable-log-stats)",
    )


def flag_findings(url: str, snap: EngineSnapshot, hints: Hints) -> list[Finding]:
    out: list[Finding] = []
    args = snap.server_args
    sglang = snap.kind is EngineKind.SGLANG
    if sglang and args.get("enable_metrics") is False:
        out.append(
            Finding(
                "metrics_off",
                "severe",
                url,
                "the engine reports metrics off",
                ("server_info enable_metrics=false",),
                METRICS_OFF,
            )
        )
    if sglang and args.get("enable_cache_report") is False:
        out.append(
            Finding(
                "cached_tokens_off",
                "warning",
                url,
                "cached prompt tokens are not reported",
                ("server_info enable_cache_report=false",),
                "start SGLang with --enable-cache-report (vLLM: "
                "--enable-prompt-tokens-details); otherwise "
                "kvgate_cached_prompt_tokens_total stays empty",
            )
        )
    size = args.get("page_size") if sglang else snap.block_size
    if hints.kv_block_size and isinstance(size, int) and size != hints.kv_block_size:
        flag = "--page-size" if sglang else "--block-size"
        out.append(
            Finding(
                "event_block_size",
                "severe",
                url,
                "KV events come at another block size than kvgate's",
                (f"engine block size {size}, kv_events.block_size {hints.kv_block_size}",),
                f"start the engine with {flag} {hints.kv_block_size}, or set "
                f"kv_events.block_size: {size}; until then kvgate re-cuts its events on "
                "intake (an entry per engine page: more memory and intake work)",
            )
        )
    if hints.priority_scheduling and sglang:
        first_low = args.get("schedule_low_priority_values_first")
        if first_low is False:
            out.append(
                Finding(
                    "priority_higher_first",
                    "severe",
                    url,
                    "the engine runs larger priority values first",
                    ("server_info schedule_low_priority_values_first=false",),
                    "set admission priority_order: higher_first (or engine: sglang), or "
                    "start SGLang with --schedule-low-priority-values-first",
                )
            )
        elif first_low is None:
            out.append(
                Finding(
                    "priority_direction_unknown",
                    "warning",
                    url,
                    "the engine's priority direction is unknown",
                    ("server_info has no schedule_low_priority_values_first",),
                    "set admission priority_order explicitly; SGLang runs larger values "
                    "first unless started with --schedule-low-priority-values-first",
                )
            )
    return out
