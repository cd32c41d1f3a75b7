"""`kvgate plan`: size a deployment (memory per card, KV, fixes, PD, and from a trace)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.plan.cards import Card, get_card, load_cards
from gateway.plan.fit import Target
from gateway.plan.memory import Budget, EngineSettings, budget
from gateway.plan.shapes import DTYPE_BYTES, KV_DTYPES, ModelShape

_POOL_KEYS = {
    "card",
    "tp",
    "price",
    "label",
    "weights",
    "kv_dtype",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
}


def register(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="size a deployment: memory per card, KV tokens, fixes, PD hand-off, from a trace",
        description="Memory budget per card (weights, activations, CUDA graphs, KV), the KV"
        " tokens and concurrency that fit, the settings that would fit a target, whether a"
        " PD hand-off pays, and with --trace the replicas and cost per pool.",
    )
    p.add_argument("model", nargs="?", help="a built-in model name or a path to a config.json")
    p.add_argument("--card", default="h100", help="card type (default h100)")
    p.add_argument("--cards-file", help="YAML adding or overriding card types")
    p.add_argument("--list-cards", action="store_true", help="print the card table and exit")
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        dest="tp",
        help="tensor-parallel cards per replica",
    )
    p.add_argument(
        "--weights",
        "--quantization",
        dest="weights",
        choices=sorted(DTYPE_BYTES),
        help="weight dtype (default: the model's)",
    )
    p.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        default="bf16",
        choices=KV_DTYPES,
        help="KV cache element type",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of card memory vLLM takes"
    )
    p.add_argument(
        "--max-model-len", type=int, help="engine's max_model_len (default: the model's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine's batch cap")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="engine's tokens per step"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        dest="expert_parallel",
        help="MoE experts split over the cards instead of sharded",
    )
    measured = p.add_argument_group("measured figures per card (vLLM's start-up log), GiB")
    measured.add_argument("--weights-gib", type=float, help="model weights loaded")
    measured.add_argument("--activation-gib", type=float, help="peak activation memory")
    measured.add_argument("--cuda-graph-gib", type=float, help="CUDA graph capture")
    target = p.add_argument_group("target")
    target.add_argument("--context", type=int, help="tokens per sequence to fit")
    target.add_argument("--concurrency", type=int, default=1, help="sequences at once")
    pd = p.add_argument_group("prefill/decode hand-off")
    pd.add_argument(
        "--prompt",
        type=int,
        action="append",
        default=[],
        help="prompt length to judge a hand-off for (repeatable)",
    )
    pd.add_argument("--link", default="100gbe", help="10gbe, 100gbe, 400g-ib, nvlink or Gbit/s")
    pd.add_argument("--cached", type=int, default=0, help="prompt tokens already cached")
    pd.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV bytes a prompt token moves, for a compressed KV format"
        " (default: the model's at --kv-dtype)",
    )
    pd.add_argument(
        "--prefill-interference",
        type=float,
        default=1.0,
        help="share of a colocated prefill's time that stalls decoding: 1 for dense attention,"
        " near 0 where sparse attention or a compressed KV leaves decode unaffected (then a"
        " split saves ~nothing)",
    )
    tr = p.add_argument_group("from a trace (runs kvgate simulate)")
    tr.add_argument("--trace", help="kvgate, Mooncake (JSONL) or Azure (CSV) trace")
    tr.add_argument("--ttft", type=float, default=2.0, help="target TTFT, seconds")
    tr.add_argument(
        "--percentile",
        default="p90",
        choices=("p50", "p90", "p99", "mean"),
        help="TTFT statistic held to --ttft",
    )
    tr.add_argument("--price", type=float, help="price per card-hour of --card")
    tr.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="POOL",
        help="another pool, e.g. card=ascend-910b,tp=8,price=1.2 (repeatable)",
    )
    tr.add_argument("--max-replicas", type=int, default=64, help="largest fleet to try")
    tr.add_argument("--policy", default=None, help="routing policy (default: the gateway's)")
    tr.add_argument("--speedup", type=float, default=1.0, help="arrival-time compression")
    tr.add_argument("--start", type=int, default=0, help="first request index to use")
    tr.add_argument("--limit", type=int, help="number of requests to use")
    p.add_argument("--plot", help="write a PNG (memory bar per card; TTFT/cost vs replicas)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=run)
    return p


def _fail(message: str) -> int:
    print(f"kvgate plan: {message}", file=sys.stderr)
    return 2


def settings_from(args: argparse.Namespace, **over: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "tp": args.tp,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cuda_graphs": not args.enforce_eager,
        "kv_dtype": args.kv_dtype,
        "weight_dtype": args.weights,
        "block_size": args.block_size,
        "expert_parallel": args.expert_parallel,
        "weights_gib": args.weights_gib,
        "activation_gib": args.activation_gib,
        "cuda_graph_gib": args.cuda_graph_gib,
    }
    values.update(over)
    return EngineSettings(**values)


def parse_pool(spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _POOL_KEYS:
            keys = ", ".join(sorted(_POOL_KEYS))
            raise ValueError(f"pool {spec!r}: use key=value with keys {keys}")
        out[key] = value.strip()
    if "card" not in out:
        raise ValueError(f"pool {spec!r} names no card=")
    return out


def _pool_budget(
    model: ModelShape, cards: Any, args: argparse.Namespace, spec: dict[str, str]
) -> tuple[str, Budget, float | None]:
    card: Card = get_card(spec["card"], cards)
    over: dict[str, Any] = {}
    if "tp" in spec:
        over["tp"] = int(spec["tp"])
        if args.weights_gib is not None:
            over["weights_gib"] = args.weights_gib * args.tp / over["tp"]
    for key, cast in (
        ("weights", str),
        ("kv_dtype", str),
        ("gpu_memory_utilization", float),
        ("max_num_batched_tokens", int),
        ("max_num_seqs", int),
    ):
        if key in spec:
            over["weight_dtype" if key == "weights" else key] = cast(spec[key])
    b = budget(model, card, settings_from(args, **over))
    price = float(spec["price"]) if "price" in spec else card.price_per_hour
    return spec.get("label", f"{card.name}-tp{b.settings.tp}"), b, price


def run(args: argparse.Namespace) -> int:
    from gateway.plan.handoff import link_gbps
    from gateway.plan.hfconfig import resolve_model
    from gateway.plan.report import as_dict, make_plan, render

    try:
        cards = load_cards(args.cards_file)
        if args.list_cards:
            return _list_cards(cards, args.json)
        if not args.model:
            raise ValueError("name a model (a built-in name or a config.json path)")
        model = resolve_model(args.model)
        b = budget(model, get_card(args.card, cards), settings_from(args))
        target = Target(args.context, args.concurrency) if args.context else None
        if target is not None and (target.context < 1 or target.concurrency < 1):
            raise ValueError("--context and --concurrency must be positive")
        report = make_plan(
            b,
            target=target,
            prompts=args.prompt,
            link_gbps=link_gbps(args.link),
            cached_tokens=args.cached,
            kv_bytes_per_token=args.kv_bytes_per_token,
            interference=args.prefill_interference,
        )
        out: dict[str, Any] = {"plan": as_dict(report)}
        text = render(report)
        budgets = [b]
        trace_plans: list[Any] = []
        if args.trace:
            pools = [("", b, args.price)] + [
                _pool_budget(model, cards, args, parse_pool(s)) for s in args.compare
            ]
            text_t, trace_plans, out["trace"] = _trace(args, pools)
            text += "\n\n" + text_t
            budgets += [pb for _, pb, _ in pools[1:]]
        if args.plot:
            from gateway.plan.plots import write_plot

            write_plot(args.plot, budgets, trace_plans)
            print(f"wrote {args.plot}", file=sys.stderr)
    except (GatewayError, OSError, ValueError) as exc:
        return _fail(exc.message if isinstance(exc, GatewayError) else str(exc))
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() if args.json else text)
    ok = report.ok and all(p.needed is not None for p in trace_plans)
    return 0 if ok else 1


def _trace(
    args: argparse.Namespace, pools: list[tuple[str, Budget, float | None]]
) -> tuple[str, list[Any], dict[str, Any]]:
    from gateway.plan.fromtrace import Pool, SimSettings, TraceShape, plan_pools
    from gateway.plan.fromtrace import render as render_trace
    from gateway.policy import DEFAULT_POLICY
    from gateway.trace.format import read_trace

    trace = read_trace(args.trace).window(args.start, args.limit)
    if not trace.records:
        raise ValueError(f"{args.trace}: no requests in the chosen window")
    built = [
        Pool(label or f"{pb.card.name}-tp{pb.settings.tp}", pb, price) for label, pb, price in pools
    ]
    sim = SimSettings(
        policy=args.policy or DEFAULT_POLICY, speedup=args.speedup, max_replicas=args.max_replicas
    )
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    plans = plan_pools(
        trace, built, args.ttft, percentile=args.percentile, sim=sim, progress=progress
    )
    shape = TraceShape.of(trace)
    data = {
        "shape": {
            "requests": shape.requests,
            "duration_s": shape.duration_s,
            "input_p50": shape.input_p50,
            "output_p50": shape.output_p50,
            "input_output_ratio": shape.ratio,
        },
        "pools": [p.as_dict() for p in plans],
    }
    return render_trace(shape, plans, str(args.trace)), plans, data


def _list_cards(cards: Any, as_json: bool) -> int:
    if as_json:
        print(
            orjson.dumps(
                {n: c.model_dump() for n, c in cards.items()}, option=orjson.OPT_INDENT_2
            ).decode()
        )
        return 0
    print(
        f"{'card':13} {'GiB':>6} {'TB/s':>5} {'bf16 TF':>8} {'fp8':>11} {'fp4':>11}"
        f" {'link GB/s':>9}  interconnect"
    )
    for name, c in sorted(cards.items()):
        print(
            f"{name:13} {c.memory_gib:>6g} {c.bandwidth_tbs:>5g} {c.bf16_tflops:>8g}"
            f" {c.fp8:>11} {c.fp4:>11} {c.interconnect_gbs:>9g}  {c.interconnect}"
        )
    return 0
