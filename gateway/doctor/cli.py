"""`kvgate doctor URL...`: read running engines (and the gateway), print findings.

Exit status: 0 no severe finding, 1 at least one severe finding, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx
import orjson

from gateway.doctor.checks import Diagnosis, diagnose
from gateway.doctor.findings import STALE_AFTER_S, Hints
from gateway.doctor.probe import EngineSnapshot, GatewaySnapshot, probe_engine, probe_gateway
from gateway.errors import GatewayError


def register(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="diagnose running engines: KV starved, preemptions, queues, hot replicas, stale",
        description="Reads each engine's /metrics, /v1/models and (SGLang) /server_info a few"
        " times, and the gateway's /metrics with --gateway, and explains what starves KV.",
    )
    p.add_argument("urls", nargs="*", help="engine base URLs, e.g. http://10.0.0.5:8000")
    p.add_argument("--gateway", help="the gateway's base URL (its view of each replica)")
    p.add_argument("--samples", type=int, default=3, help="reads per engine")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP read")
    p.add_argument("--api-key", help="sent as a bearer token to the engines")
    cfg = p.add_argument_group("engine arguments /metrics does not show")
    cfg.add_argument("--max-num-seqs", type=int, help="the engines' --max-num-seqs")
    cfg.add_argument(
        "--max-num-batched-tokens", type=int, help="the engines' --max-num-batched-tokens"
    )
    cfg.add_argument("--max-model-len", type=int, help="overrides /v1/models")
    cfg.add_argument("--expected-hit-rate", type=float, help="e.g. from kvgate plan --trace")
    cfg.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="the engines run --scheduling-policy priority (vLLM does not report it)",
    )
    cfg.add_argument(
        "--stale-after",
        type=float,
        default=STALE_AFTER_S,
        help="seconds after which a gateway's view of a replica counts as stale",
    )
    cfg.add_argument(
        "--kv-block-size",
        type=int,
        help="kvgate's kv_events.block_size: flags engines that publish at another size",
    )
    plan = p.add_argument_group("what the engines run (activation arithmetic, optional)")
    plan.add_argument("--model", help="built-in model name or config.json path")
    plan.add_argument("--card", help="card type, with --model")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--weights", help="weight dtype (default: the model's)")
    plan.add_argument("--kv-dtype", default="bf16", help="KV cache dtype")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(handler=run)
    return p


async def collect(
    urls: list[str],
    gateway: str | None,
    *,
    samples: int,
    interval: float,
    timeout: float,
    api_key: str | None = None,
) -> tuple[dict[str, list[EngineSnapshot]], GatewaySnapshot | None]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    series: dict[str, list[EngineSnapshot]] = {u: [] for u in urls}
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        for i in range(samples):
            if i:
                await asyncio.sleep(interval)
            snaps = await asyncio.gather(*(probe_engine(client, u) for u in urls))
            for url, snap in zip(urls, snaps, strict=True):
                series[url].append(snap)
    view = None
    if gateway:
        async with httpx.AsyncClient(timeout=timeout) as client:
            view = await probe_gateway(client, gateway)
    return series, view


def _hints(args: argparse.Namespace) -> Hints:
    budget = None
    if args.model:
        from gateway.plan.cards import get_card
        from gateway.plan.hfconfig import resolve_model
        from gateway.plan.memory import EngineSettings
        from gateway.plan.memory import budget as plan_budget

        if not args.card:
            raise ValueError("--model needs --card")
        settings = EngineSettings(
            tp=args.tp,
            weight_dtype=args.weights,
            kv_dtype=args.kv_dtype,
            max_num_seqs=args.max_num_seqs or 256,
            max_num_batched_tokens=args.max_num_batched_tokens or 8192,
            max_model_len=args.max_model_len,
        )
        budget = plan_budget(resolve_model(args.model), get_card(args.card), settings)
    if args.expected_hit_rate is not None and not 0 <= args.expected_hit_rate <= 1:
        raise ValueError("--expected-hit-rate is a fraction in [0, 1]")
    return Hints(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        expected_hit_rate=args.expected_hit_rate,
        priority_scheduling=args.priority_scheduling,
        stale_after_s=args.stale_after,
        kv_block_size=args.kv_block_size,
        budget=budget,
    )


def run(args: argparse.Namespace) -> int:
    try:
        if not args.urls and not args.gateway:
            raise ValueError("name at least one engine URL (or --gateway)")
        if args.samples < 1 or args.interval < 0:
            raise ValueError("--samples must be >= 1 and --interval >= 0")
        hints = _hints(args)
        series, gateway = asyncio.run(
            collect(
                args.urls,
                args.gateway,
                samples=args.samples,
                interval=args.interval,
                timeout=args.timeout,
                api_key=args.api_key,
            )
        )
    except (GatewayError, ValueError) as exc:
        message = exc.message if isinstance(exc, GatewayError) else str(exc)
        print(f"kvgate doctor: {message}", file=sys.stderr)
        return 2
    result = diagnose(series, gateway, hints)
    print(
        orjson.dumps(as_dict(result), option=orjson.OPT_INDENT_2).decode()
        if args.json
        else render(result)
    )
    return 1 if result.severe else 0


def _engine_row(url: str, s: EngineSnapshot) -> str:
    r = s.reading
    if r is None:
        return f"{url:32} {s.error}"
    usage = f"{r.kv_usage:.0%}" if r.kv_usage is not None else "-"
    hit = f"{r.prefix_hit_rate:.0%}" if r.prefix_hit_rate is not None else "-"
    cap = f"{r.kv_capacity_tokens:,}" if r.kv_capacity_tokens else "-"
    mml = f"{s.max_model_len:,}" if s.max_model_len else "-"
    pre = f"{s.counters['preemptions']:,.0f}" if "preemptions" in s.counters else "-"
    return (
        f"{url:32} {r.kind.value:6} {r.running:>7.0f} {r.waiting:>7.0f} {usage:>6}"
        f" {cap:>11} {mml:>9} {hit:>6} {pre:>8}"
    )


def render(d: Diagnosis) -> str:
    lines = [
        (
            f"{'engine':32} {'kind':6} {'running':>7} {'waiting':>7} {'KV':>6} {'KV tokens':>11}"
            f" {'max len':>9} {'hit':>6} {'preempt':>8}"
        )
    ]
    lines += [_engine_row(u, s) for u, s in d.engines.items()]
    lines.append("")
    if not d.findings:
        lines.append("no findings")
    for f in d.findings:
        lines.append(f"[{f.severity.upper()}] {f.code} @ {f.replica}: {f.title}")
        lines += [f"    {e}" for e in f.evidence]
        lines.append(f"    fix: {f.suggestion}")
    return "\n".join(lines)


def as_dict(d: Diagnosis) -> dict[str, Any]:
    engines = {}
    for url, s in d.engines.items():
        r = s.reading
        engines[url] = {
            "error": s.error,
            "kind": r.kind.value if r else None,
            "running": r.running if r else None,
            "waiting": r.waiting if r else None,
            "kv_usage": r.kv_usage if r else None,
            "kv_capacity_tokens": r.kv_capacity_tokens if r else None,
            "prefix_hit_rate": r.prefix_hit_rate if r else None,
            "num_gpu_blocks": s.num_gpu_blocks,
            "block_size": s.block_size,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "max_model_len": s.max_model_len,
            "counters": dict(s.counters),
        }
    return {"engines": engines, "findings": [f.as_dict() for f in d.findings], "severe": d.severe}
