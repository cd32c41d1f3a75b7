"""`kvgate trace capture|stats|replay|convert|generate` and `kvgate simulate`.

`register(subparsers)` adds the commands to the main parser; each sets `handler`, a callable
taking the parsed namespace and returning an exit code. Heavy modules are imported by the
handlers, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.policy import DEFAULT_POLICY
from gateway.trace.format import DEFAULT_BLOCK_TOKENS


def _tokens_list(text: str) -> list[int]:
    from gateway.trace.stats import parse_tokens

    sizes: list[int] = []
    for part in text.split(","):
        if part.strip():
            size = parse_tokens(part)
            if size is None:
                continue  # the infinite cache is always reported
            sizes.append(size)
    return sizes


def _add_capture(sub: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="turn a JSONL file of OpenAI requests (+responses) into a private trace",
        description="Each input line is a request body, or {request, response?, timestamp?,"
        " session_id?, headers?}. Only salted block hashes and lengths are written.",
    )
    p.add_argument("input", type=Path, help="JSONL of OpenAI requests")
    p.add_argument("-o", "--output", type=Path, required=True, help="trace file to write")
    p.add_argument(
        "--salt-file",
        type=Path,
        help="secret salt (created if missing, mode 0600);"
        " default $KVGATE_TRACE_SALT, else a random salt for this run only",
    )
    p.add_argument(
        "--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="tokens per hashed block"
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer.json (needs 'tokenizers'); default: ~4 characters per token",
    )
    p.set_defaults(handler=cmd_capture)


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="shape, prefix-cache potential and cost of a trace")
    p.add_argument("trace", type=Path, help="kvgate, Mooncake (JSONL) or Azure (CSV) trace")
    p.add_argument("--lru", default="", help="LRU cache sizes in tokens, e.g. 1M,4M")
    p.add_argument("--replicas", type=int, default=0, help="also route over N replicas")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help=f"routing policy for --replicas (repeatable; default {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--no-session-ids",
        action="store_true",
        help="route as for clients that send no session id (lineage keys them)",
    )
    p.add_argument(
        "--price-per-card-hour", type=float, help="card price, for a cost per million tokens"
    )
    p.add_argument("--throughput", type=float, help="measured total tokens/s of --cards cards")
    p.add_argument("--cards", type=int, default=1, help="cards that measured --throughput")
    p.add_argument("--plots", type=Path, help="write PNG plots here (needs kvgate[plots])")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=cmd_stats)


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert between kvgate and Mooncake trace formats")
    p.add_argument("input", type=Path, help="trace to read (kvgate, Mooncake or Azure CSV)")
    p.add_argument("-o", "--output", type=Path, required=True, help="trace file to write")
    p.add_argument("--to", choices=("kvgate", "mooncake"), required=True, help="output format")
    p.set_defaults(handler=cmd_convert)


def _add_window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--start", type=int, default=0, help="first request index to use")
    p.add_argument("--limit", type=int, help="number of requests to use")


def _add_replay(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible endpoint")
    p.add_argument("trace", type=Path, help="trace to replay")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="kvgate-sim", help="model name sent in each request")
    p.add_argument("--speedup", type=float, default=1.0, help="arrival-time compression")
    p.add_argument("--concurrency", type=int, help="ignore arrivals; keep N requests in flight")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions",
    )
    p.add_argument("--api-key", default=None, help="bearer key sent with each request")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for endpoints that reject unknown fields)",
    )
    p.add_argument("--max-output-tokens", type=int, help="cap each request's max_tokens")
    p.add_argument(
        "--layout",
        choices=("growing", "turns"),
        default="growing",
        help="chat messages: one user message with the whole prompt (growing), or one"
        " message per turn read from the trace's prefixes (turns)",
    )
    p.add_argument(
        "--no-session-header",
        action="store_true",
        help="send no session (default: x-session-id and x-smg-routing-key, inferred from"
        " the prefixes when the trace has none)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_window(p)
    p.set_defaults(handler=cmd_replay)


def _add_generate(sub: Any) -> None:
    from gateway.trace.generate import AgentTraceOptions

    d = AgentTraceOptions()
    p = sub.add_parser(
        "generate",
        help="write a seeded synthetic trace of agent-shaped traffic",
        description="Interleaved agent sessions: a preamble shared per agent kind, tens of"
        " turns that each append tool output and the previous answer, Poisson session"
        " starts and think time between turns. Other shapes (--shape, chats mixed in):"
        " forks (agents forking 1-4 subagents at once from their whole history, resuming"
        " with their results), samples (each turn sent 2-8 times at once) and rag"
        " (sessions opening with documents shared across sessions).",
    )
    p.add_argument("-o", "--out", type=Path, required=True, help="kvgate trace file to write")
    p.add_argument(
        "--shape",
        choices=("agent", "forks", "samples", "rag"),
        default="agent",
        help="traffic shape (gateway/trace/shapes.py; default agent)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="same seed, same trace")
    p.add_argument("--sessions", type=int, default=d.sessions, help="agent sessions to write")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--duration",
        type=float,
        default=d.duration_s,
        help="seconds over which sessions start (Poisson)",
    )
    when.add_argument("--rate", type=float, help="session starts per second")
    p.add_argument(
        "--block-tokens", type=int, default=d.block_tokens, help="tokens per hashed block"
    )
    p.add_argument(
        "--context-scale",
        type=float,
        default=d.context_scale,
        help="multiply every token count (e.g. 0.05 for small, fast traces)",
    )
    p.add_argument("--kinds", type=int, default=d.kinds, help="agent kinds (shared preambles)")
    p.add_argument("--think", type=float, default=d.think_s, help="median think time, seconds")
    p.set_defaults(handler=cmd_generate)


def _add_simulate(sub: Any) -> None:
    p = sub.add_parser("simulate", help="offline discrete-event simulation of a trace on N engines")
    p.add_argument("trace", type=Path, help="trace to simulate")
    p.add_argument("--replicas", type=int, default=4, help="simulated engines")
    p.add_argument("--policy", default=DEFAULT_POLICY, help="routing policy by name")
    p.add_argument("--policy-config", default="{}", help="JSON config for the policy")
    p.add_argument(
        "--no-session-ids",
        action="store_true",
        help="route as for clients that send no session id (lineage keys them)",
    )
    p.add_argument("--profile", default=None, help="simulated hardware profile name")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        metavar="N",
        help="KV blocks per engine instead of the profile's (finite KV, as `kvgate sim` runs)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="arrival-time compression")
    p.add_argument("--max-output-tokens", type=int, help="cap each request's output tokens")
    p.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines run vLLM's priority scheduling and get the gateway's `priority` "
        "(shortest uncached prefill first, the `engine_priority:` defaults)",
    )
    p.add_argument(
        "--same-prompt-wait-s",
        type=float,
        default=None,
        metavar="S",
        help="copies of a prompt in prefill wait for its first token, at most this long "
        "(routing.same_prompt_wait_s; default 10, 0 sends them at once)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_window(p)
    p.set_defaults(handler=cmd_simulate)


def register(subparsers: Any) -> None:
    """Add `trace ...` and `simulate` to the main parser's subparsers."""
    trace = subparsers.add_parser("trace", help="capture, inspect and replay workload traces")
    sub = trace.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")
    _add_capture(sub)
    _add_stats(sub)
    _add_replay(sub)
    _add_convert(sub)
    _add_generate(sub)
    _add_simulate(subparsers)


def _fail(exc: Exception) -> int:
    message = exc.message if isinstance(exc, GatewayError) else str(exc)
    print(f"kvgate: {message}", file=sys.stderr)
    return 2


def cmd_capture(args: argparse.Namespace) -> int:
    from gateway.trace.capture import Capturer, capture_openai_jsonl, load_salt
    from gateway.trace.tokenize import load_tokenizer

    try:
        if args.salt_file is None and not os.environ.get("KVGATE_TRACE_SALT"):
            print(
                "kvgate: no --salt-file or KVGATE_TRACE_SALT: using a random salt for this"
                " run only (hashes will not match other captures)",
                file=sys.stderr,
            )
        capturer = Capturer(
            load_salt(args.salt_file), load_tokenizer(args.tokenizer), args.block_tokens
        )
        with open(args.input, "rb") as src, open(args.output, "wb") as dst:
            n = capture_openai_jsonl(src, dst, capturer, str(args.input))
    except (GatewayError, OSError) as exc:
        return _fail(exc)
    print(
        f"captured {n} requests into {args.output} (salt id {capturer.header.salt_id})",
        file=sys.stderr,
    )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from gateway.trace.format import read_trace
    from gateway.trace.stats import compute_stats, render_stats

    try:
        trace = read_trace(args.trace)
        stats = compute_stats(
            trace,
            source=args.trace.name,
            lru_tokens=_tokens_list(args.lru),
            replicas=args.replicas,
            policies=args.policy or [DEFAULT_POLICY],
            sessions=not args.no_session_ids,
            price_per_card_hour=args.price_per_card_hour,
            throughput_tokens_s=args.throughput,
            cards=args.cards,
        )
        if args.plots is not None:
            from gateway.trace.plots import write_plots

            for path in write_plots(trace, args.plots):
                print(f"wrote {path}", file=sys.stderr)
    except (GatewayError, OSError, ValueError) as exc:
        return _fail(exc)
    if args.json:
        print(orjson.dumps(stats.as_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_stats(stats))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from gateway.trace.format import read_trace, write_mooncake, write_trace

    try:
        trace = read_trace(args.input)
        if args.to == "mooncake":
            write_mooncake(args.output, trace)
        else:
            write_trace(args.output, trace)
    except (GatewayError, OSError) as exc:
        return _fail(exc)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from gateway.trace.format import read_trace
    from gateway.trace.replay import replay

    try:
        trace = read_trace(args.trace).window(args.start, args.limit)
        report = asyncio.run(
            replay(
                trace,
                args.url,
                speedup=args.speedup,
                concurrency=args.concurrency,
                model=args.model,
                endpoint=args.endpoint,
                api_key=args.api_key,
                timeout_s=args.timeout,
                ignore_eos=not args.no_ignore_eos,
                max_output_tokens=args.max_output_tokens,
                progress=None if args.quiet else sys.stderr,
                layout=args.layout,
                session_header=not args.no_session_header,
            )
        )
    except (GatewayError, OSError, ValueError) as exc:
        return _fail(exc)
    print(
        orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2).decode()
        if args.json
        else report.render()
    )
    return 1 if report.requests and report.ok == 0 else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from gateway.trace.format import write_trace
    from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
    from gateway.trace.shapes import ShapeOptions, generate_shape

    try:
        if args.shape != "agent":
            shape = ShapeOptions(
                shape=args.shape,
                seed=args.seed,
                sessions=args.sessions,
                duration_s=args.duration if args.rate is None else args.sessions / args.rate,
                block_tokens=args.block_tokens,
                context_scale=args.context_scale,
                kinds=args.kinds,
                think_s=args.think,
            )
            trace = generate_shape(shape)
            write_trace(args.out, trace)
            print(
                f"wrote {len(trace.records)} requests of"
                f" {len({r.session_id for r in trace.records})} sessions to {args.out}",
                file=sys.stderr,
            )
            return 0
        options = AgentTraceOptions(
            seed=args.seed,
            sessions=args.sessions,
            duration_s=args.duration,
            rate_per_s=args.rate,
            block_tokens=args.block_tokens,
            context_scale=args.context_scale,
            kinds=args.kinds,
            think_s=args.think,
        )
        trace = generate_agent_trace(options)
        write_trace(args.out, trace)
    except (OSError, ValueError) as exc:
        return _fail(exc)
    sessions = len({r.session_id for r in trace.records})
    print(
        f"wrote {len(trace.records)} requests of {sessions} sessions to {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from gateway.admission.config import EnginePrioritySettings
    from gateway.sim.profiles import HardwareProfile, get_profile
    from gateway.trace.format import read_trace
    from gateway.trace.simulate import DEFAULT_PROFILE, SimulationOptions, simulate

    try:
        config = orjson.loads(args.policy_config)
        if not isinstance(config, dict):
            raise ValueError("--policy-config must be a JSON object")
        trace = read_trace(args.trace).window(args.start, args.limit)
        profile: str | HardwareProfile | None = args.profile
        if args.kv_blocks is not None:
            if args.kv_blocks <= 0:
                raise ValueError("--kv-blocks must be positive")
            profile = get_profile(args.profile or DEFAULT_PROFILE).scaled(
                num_gpu_blocks=args.kv_blocks
            )
        options = SimulationOptions(
            replicas=args.replicas,
            policy=args.policy,
            policy_config=config,
            profile=profile,
            speedup=args.speedup,
            max_output_tokens=args.max_output_tokens,
            sessions=not args.no_session_ids,
            engine_priority=EnginePrioritySettings() if args.engine_priority else None,
        )
        if args.same_prompt_wait_s is not None:
            if args.same_prompt_wait_s < 0:
                raise ValueError("--same-prompt-wait-s must be at least 0")
            options = replace(options, same_prompt_wait_s=args.same_prompt_wait_s)
        result = simulate(trace, options)
    except (GatewayError, OSError, ValueError, orjson.JSONDecodeError) as exc:
        return _fail(exc)
    if args.json:
        print(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(result.render())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (`python -m gateway.trace.cli ...`), same commands as `kvgate`."""
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
