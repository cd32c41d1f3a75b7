"""The JSON of each admin endpoint, built from the live objects at request time.

Current values (health, in-flight, queue, the sessions table) are read live; rates come
from the sampler's last two samples, so they are at most one sample interval old.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from gateway.console.counters import by_label
from gateway.console.forecast import cache_forecast
from gateway.console.runtime import ConsoleRuntime

HOTTEST = 10


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def fleet(rt: ConsoleRuntime) -> dict[str, Any]:
    rates = rt.sampler.rates
    measuring = rt.watch.measuring
    rows = rt.fleet.rows()
    for row in rows:
        rid = row["id"]
        q = rt.measurements.ttft(rid) if measuring else None
        # A replica without a sample of its own served nothing in the interval.
        row["requests_per_s"] = _round(rates.get(f"requests:{rid}", 0.0)) if rates else None
        row["tokens_per_s"] = (
            _round(rates.get(f"tokens:{rid}", 0.0)) if measuring and rates else None
        )
        row["ttft_p50_s"], row["ttft_p99_s"] = (q[0], q[1]) if q else (None, None)
        row["errors_per_s"] = _round(rates.get(f"failed:{rid}", 0.0)) if rates else None
        row["error_share"] = _round(rt.sampler.error_shares.get(rid), 4)
        row["ring_share"] = round(row["ring_share"], 4)
    return {
        "now": time.time(),
        "measuring": measuring,
        "replicas": rows,
        "healthy": sum(1 for r in rows if r["healthy"]),
        "in_flight": sum(r["in_flight"] for r in rows),
        "events": rt.fleet.events.recent(),
        "sample_interval_s": rt.sampler.interval_s,
    }


def sessions(rt: ConsoleRuntime) -> dict[str, Any]:
    m = rt.measurements
    window = rt.settings.live_session_s
    live = list(m.sessions.live(m.now(), window))
    spread = Counter(str(s.replica) for _, s in live)
    hottest = sorted(live, key=lambda kv: (kv[1].tokens, kv[1].requests), reverse=True)[:HOTTEST]
    now = m.now()
    lineage = rt.state.lineage
    decisions = by_label(rt.sampler.series.get("kvgate_routing_decisions_total", {}), "reason")
    return {
        "measuring": rt.watch.measuring,
        "measuring_since": rt.watch.since,
        "live": len(live),
        "live_window_s": window,
        "tracked": len(m.sessions),
        "spread": {rid: spread.get(rid, 0) for rid in rt.state.cluster.members} | dict(spread),
        "hottest": [
            {
                "key": str(key)[:48],
                "source": s.source,
                "replica": s.replica,
                "requests": s.requests,
                "tokens": s.tokens,
                "moves": s.moves,
                "idle_s": round(now - s.last_seen, 1),
                "age_s": round(now - s.first_seen, 1),
            }
            for key, s in hottest
        ],
        "moves": dict(m.sessions.moves),
        "recent_moves": [
            {
                "at": mv.at,
                "key": str(mv.key)[:48],
                "from": mv.source,
                "to": mv.target,
                "reason": mv.reason,
            }
            for mv in reversed(m.sessions.recent_moves)
        ],
        "routing_decisions": {k: int(v) for k, v in sorted(decisions.items())},
        "lineage": None
        if lineage is None
        else {
            "blocks": len(lineage.index),
            "capacity_blocks": lineage.index.capacity,
            "conversations": lineage.index.lineages,
        },
    }


def _cost(rt: ConsoleRuntime) -> dict[str, Any] | None:
    runtime = rt.state.extras.get("pools")
    if runtime is None:
        return None
    snap = runtime.controller.snapshot
    per_pool = {}
    for name, pc in runtime.ledger.summary().items():
        per_pool[name] = {
            "requests": pc.requests,
            "total_tokens": pc.total_tokens,
            "output_tokens": pc.completion_tokens,
            "cached_tokens": pc.cached_tokens,
            "tokens_per_s": round(pc.throughput_tps, 3),
            "cost": {b: round(v, 6) for b, v in pc.cost.items()},
            "per_1k_total": {b: pc.per_1k_total(b) for b in pc.cost},
            "per_1k_output": {b: pc.per_1k_output(b) for b in pc.cost},
        }
    return {
        "weights": dict(snap.weights),
        "last_change": {
            "code": snap.code,
            "reason": snap.reason,
            "at": snap.changed_at,
            "version": snap.version,
        },
        "status": snap.status,
        "pools": per_pool,
    }


def traffic(rt: ConsoleRuntime) -> dict[str, Any]:
    rates = rt.sampler.rates
    measuring = rt.watch.measuring
    totals = rt.measurements.totals() if measuring else None
    prompt, output = rates.get("tokens:prompt"), rates.get("tokens:completion")
    cached = rates.get("tokens:cached")
    return {
        "measuring": measuring,
        "measuring_since": rt.watch.since,
        "requests_per_s": _round(rates.get("requests")),
        "errors_per_s": _round(rates.get("errors")),
        "tokens_per_s": _round(prompt + output)
        if prompt is not None and output is not None
        else None,
        "output_tokens_per_s": _round(output),
        "cached_share": _round(cached / prompt if prompt and cached is not None else None, 4),
        "totals": None if totals is None else {k: int(v) for k, v in totals.items()},
        "cached_share_total": _round(totals["cached"] / totals["prompt"], 4)
        if totals and totals["prompt"]
        else None,
        "money": _cost(rt),
        "cache_forecast": cache_forecast(rt.state.metrics.registry),
    }


def admission(rt: ConsoleRuntime) -> dict[str, Any]:
    gate = rt.state.extras.get("admission")
    if gate is None:
        return {"enabled": False, "classes": []}
    series = rt.sampler.series
    depth = by_label(series.get("kvgate_admission_queue_depth", {}), "priority_class")
    count = series.get("kvgate_admission_wait_seconds_count", {})
    total = series.get("kvgate_admission_wait_seconds_sum", {})
    waits = by_label(count, "priority_class")
    wait_sum = by_label(total, "priority_class")
    rejected = by_label(
        series.get("kvgate_admission_rejected_total", {}), "priority_class", "reason"
    )
    classes = []
    for c in gate.settings.classes:
        n = waits.get(c.name, 0.0)
        classes.append(
            {
                "name": c.name,
                "queued": int(depth.get(c.name, 0)),
                "waits": int(n),
                "mean_wait_s": _round(wait_sum.get(c.name, 0.0) / n) if n else None,
                "rejected": {
                    reason: int(rejected.get(f"{c.name}/{reason}", 0))
                    for reason in ("queue_full", "timeout")
                },
            }
        )
    return {
        "enabled": True,
        "queued": len(gate.room),
        "max_queue": gate.settings.max_queue,
        "max_wait_s": gate.settings.max_wait_s,
        "rejected_per_s": _round(rt.sampler.rates.get("rejected")),
        "rejected_total": sum(sum(c["rejected"].values()) for c in classes),
        "classes": classes,
    }


def pd(rt: ConsoleRuntime) -> dict[str, Any]:
    enabled = rt.state.settings.pd.enabled
    series = rt.sampler.series
    rates = rt.sampler.rates
    decisions = by_label(series.get("kvgate_pd_decisions_total", {}), "decision", "reason")
    handoffs = by_label(series.get("kvgate_pd_handoffs_total", {}), "protocol", "outcome")
    return {
        "enabled": enabled,
        "decisions": [
            {
                "decision": name.split("/", 1)[0],
                "reason": name.split("/", 1)[1],
                "count": int(v),
                "per_s": _round(rates.get(f"pd:{name}")),
            }
            for name, v in sorted(decisions.items())
        ],
        "handoffs": [
            {"protocol": name.split("/", 1)[0], "outcome": name.split("/", 1)[1], "count": int(v)}
            for name, v in sorted(handoffs.items())
        ],
    }
