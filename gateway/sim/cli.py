"""`kvgate sim`: serve N simulated engines from one process on consecutive ports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

from gateway.sim.cluster import SimCluster
from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.profiles import PROFILES, HardwareProfile, get_profile
from gateway.sim.server import ENGINE_KEEP_ALIVE_S
from gateway.sim.tokenizer import FileTokenizer
from gateway.types import Role


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `sim` subcommand to a `kvgate` argparse subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="run simulated vLLM/SGLang engines",
        description="Serve simulated engines with vLLM's HTTP surface on consecutive ports.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="number of engines (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address the engines listen on")
    parser.add_argument("--port", type=int, default=8100, help="port of the first engine")
    parser.add_argument(
        "--profile", default="h200-sparse", choices=sorted(PROFILES), help="hardware profile"
    )
    parser.add_argument("--model", default="kvgate-sim", help="served model name")
    parser.add_argument(
        "--flavor",
        default="vllm",
        choices=["vllm", "sglang", "vllm-0.33", "sglang-0.5.23"],
        help="metric names to expose, and which priorities run first (sglang: higher); "
        "sglang-0.5.23 also serves /metrics only with --enable-metrics, as that release",
    )
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="with --flavor sglang-0.5.23: serve /metrics (SGLang's flag, off by default)",
    )
    parser.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with --flavor sglang*: run lower priority values first (SGLang's flag; its "
        "default runs larger ones first), and say so under /server_info",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME",
        help="LoRA adapter names served beside the model (vLLM's --lora-modules): listed "
        "in /v1/models with the model as parent, answered as the model is",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=ENGINE_KEEP_ALIVE_S,
        metavar="SECONDS",
        help="close a connection idle this long (default 5, vLLM's and SGLang's)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run simulated time this many times faster than real time",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the output text and the fault dice"
    )
    parser.add_argument(
        "--role",
        action="append",
        choices=[r.value for r in Role],
        help="role per replica, repeat in replica order (last one repeats)",
    )
    parser.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="honour the request 'priority' field (else non-zero is a 400)",
    )
    parser.add_argument(
        "--tokenizer-file",
        default=None,
        metavar="PATH",
        help="a tokenizer.json to count tokens with (needs the 'tokenizers' "
        "package; default: about 4 characters a token)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="like vLLM's --api-key: /v1 requests need 'Authorization: Bearer KEY' (401 otherwise)",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=30.0,
        help="seconds a decode engine waits for an SGLang bootstrap room",
    )
    engine = parser.add_argument_group("engine arguments (override the profile's)")
    for flag, kind in _ENGINE_ARGS.items():
        engine.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=kind,
            default=None,
            help=f"vLLM's --{flag.replace('_', '-')} (default: the profile's)",
        )
    faults = parser.add_argument_group("fault injection (also: POST /admin/faults)")
    faults.add_argument(
        "--fault-slow",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="extra delay before each response",
    )
    faults.add_argument(
        "--fault-error",
        type=int,
        default=None,
        metavar="STATUS",
        help="answer with this HTTP status",
    )
    faults.add_argument(
        "--fault-error-rate", type=float, default=1.0, help="share of requests --fault-error hits"
    )
    faults.add_argument(
        "--fault-stall",
        type=int,
        default=None,
        metavar="TOKENS",
        help="streams stop (hang) after this many tokens",
    )
    faults.add_argument(
        "--fault-refuse-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close the listening socket (connections refused), re-open after this long",
    )
    faults.add_argument("--fault-unhealthy", action="store_true", help="GET /health answers 503")
    faults.add_argument(
        "--fault-replica",
        type=int,
        action="append",
        default=None,
        help="replica index the faults apply to (repeatable; default all)",
    )


_ENGINE_ARGS: dict[str, type] = {
    "num_gpu_blocks": int,
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "gpu_memory_utilization": float,
}


def profile_from_args(args: argparse.Namespace) -> HardwareProfile:
    """The named profile with the engine arguments given on the command line."""
    changes = {k: getattr(args, k) for k in _ENGINE_ARGS if getattr(args, k, None) is not None}
    for key, value in changes.items():
        if value <= 0 or (key == "gpu_memory_utilization" and value > 1):
            raise ValueError(f"--{key.replace('_', '-')} is out of range: {value}")
    profile = get_profile(args.profile)
    return profile.scaled(**changes) if changes else profile


def fault_config(args: argparse.Namespace) -> FaultConfig:
    if args.fault_refuse_for is not None:
        refuse: dict[str, Any] = {"refuse": True, "refuse_for": args.fault_refuse_for}
    else:
        refuse = {}
    config = FaultConfig(
        slow=args.fault_slow,
        error=args.fault_error,
        error_rate=args.fault_error_rate,
        stall=args.fault_stall,
        unhealthy=args.fault_unhealthy,
        **refuse,
    )
    return config if config.active else NO_FAULTS


def cluster_from_args(args: argparse.Namespace) -> SimCluster:
    return SimCluster(
        args.replicas,
        profile_from_args(args),
        model=args.model,
        flavor="sglang" if args.flavor.startswith("sglang") else "vllm",
        seed=args.seed,
        metrics_enabled=args.flavor != "sglang-0.5.23" or args.enable_metrics,
        low_priority_first=args.schedule_low_priority_values_first,
        lora_modules=args.lora_modules,
        time_scale=args.time_scale,
        roles=args.role,
        priority_scheduling=args.priority_scheduling,
        host=args.host,
        base_port=args.port,
        faults=fault_config(args),
        fault_replicas=args.fault_replica,
        bootstrap_timeout_s=args.bootstrap_timeout,
        tokenizer=FileTokenizer(args.tokenizer_file) if args.tokenizer_file else None,
        api_key=args.api_key,
        keep_alive_s=args.timeout_keep_alive,
    )


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with cluster_from_args(args) as cluster:
        for engine in cluster.engines:
            print(
                f"engine {engine.index} ({engine.role.value}, {engine.profile.name}, "
                f"{engine.flavor}) at {engine.url}",
                flush=True,
            )
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    try:
        asyncio.run(serve(args))
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
