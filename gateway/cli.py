"""`kvgate`: serve, check-config, and the subcommands feature packages register.

Each module in `FEATURE_CLIS` exposes `register(subparsers)` and sets a `handler` default
on its parsers: `handler(args) -> int` exit status. They are imported only when the
parser is built, so `import gateway.cli` stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gateway.errors import ConfigError

FEATURE_CLIS: tuple[str, ...] = (
    "gateway.sim.cli",
    "gateway.trace.cli",
    "gateway.plan.cli",
    "gateway.doctor.cli",
    "gateway.auth.cli",
    "gateway.epp.cli",
    "gateway.tiers.cli",
)

Handler = Callable[[argparse.Namespace], int]


def _serve(args: argparse.Namespace) -> int:
    from gateway.settings import CONFIG_FILE_ENV, load_settings

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"kvgate: {exc.message}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers))
        if v is not None
    }
    if overrides:
        settings = settings.model_copy(
            update={"server": settings.server.model_copy(update=overrides)}
        )
    server = settings.server
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import uvicorn

    from gateway.allocator import tune_allocator

    tune_allocator()  # before any worker starts: they inherit it through the environment
    if settings.console.enabled:
        from gateway.console.config import console_url

        url = console_url(server.host, server.port, settings.console.path)
        print(f"kvgate: console at {url}", file=sys.stderr, flush=True)
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "loop": "uvloop",
        "http": server.protocol(),
        "log_level": server.log_level,
        "access_log": server.access_log,
        # Off unless asked for: uvicorn's header rewrite runs on every request otherwise.
        "proxy_headers": server.proxy_headers,
        "forwarded_allow_ips": server.forwarded_allow_ips,
        "timeout_keep_alive": server.keep_alive_s,
        # SIGTERM: stop accepting, let requests and streams in flight finish this long.
        "timeout_graceful_shutdown": server.drain_timeout_s,
        "lifespan": "on",
        # The engines' own Date/Server headers are relayed; do not add a second pair.
        "server_header": False,
        "date_header": False,
    }
    if server.workers > 1:
        if not settings.has_replicas:
            print(
                "kvgate: --workers > 1 needs configured replicas (each worker would start its "
                "own simulated engines); run `kvgate sim` and list its URLs under replicas:",
                file=sys.stderr,
            )
            return 2
        if settings.store.backend == "memory":
            logging.getLogger("kvgate").warning(
                "%d workers with store.backend=memory: each worker keeps its own session "
                "placements, so a conversation may change replica between workers; set "
                "store.backend: redis to share them",
                server.workers,
            )
        if args.config:
            os.environ[CONFIG_FILE_ENV] = os.path.abspath(args.config)
        from gateway.workers.directory import metrics_directory

        # Before the workers spawn: they inherit the directory, so /metrics is all of them.
        with metrics_directory():
            uvicorn.run("gateway.app:app_from_env", factory=True, workers=server.workers, **options)
        return 0
    from gateway.app import build_app
    from gateway.collector import tune_collector
    from gateway.serving import DrainingServer

    app = build_app(settings)
    lifecycle = app.state.lifecycle
    tune_collector()

    def drain() -> None:
        lifecycle.draining = True

    server_ = DrainingServer(
        uvicorn.Config(app, **options),
        on_drain=drain,
        drain_delay_s=server.drain_delay_s,
        on_reload=lambda: _reload(app.state.gateway, args.config),
    )
    with contextlib.suppress(KeyboardInterrupt):
        server_.run()
    # As uvicorn.run: a start-up that failed (the lifespan raised) is an error exit.
    return 0 if server_.started else 3


async def _reload(state: Any, path: str | None) -> None:
    """SIGHUP: read the replica list from the config file again (gateway.app.reload_replicas)."""
    from gateway.app import reload_replicas
    from gateway.settings import load_settings

    log = logging.getLogger("kvgate")
    if path is None:
        log.warning("SIGHUP: no config file (-c) to reload replicas from")
        return
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        log.error("SIGHUP: not reloaded, keeping the current replicas: %s", exc.message)
        return
    try:
        await reload_replicas(state, settings)
    except Exception:  # the outermost boundary of a reload: the gateway keeps serving
        log.exception("SIGHUP: reloading the replicas failed")


def _check_config(args: argparse.Namespace) -> int:
    from gateway.settings import check_config

    problems = check_config(args.file)
    if not problems:
        print(f"{args.file}: OK")
        return 0
    print(f"{args.file}: {len(problems)} problem(s)", file=sys.stderr)
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    return 1


def _version() -> str:
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware LLM gateway")
    parser.add_argument("--version", action="version", version=f"kvgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway (simulated engines if no replicas)")
    serve.add_argument(
        "-c",
        "--config",
        default=os.environ.get("KVGATE_CONFIG_FILE") or None,
        help="YAML settings file (see gateway.example.yaml; default: $KVGATE_CONFIG_FILE)",
    )
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument("--workers", type=int, help="override server.workers")
    serve.set_defaults(handler=_serve)

    check = sub.add_parser("check-config", help="validate a settings file, explaining every error")
    check.add_argument("file", help="YAML settings file to check")
    check.set_defaults(handler=_check_config)

    for module_name in FEATURE_CLIS:
        importlib.import_module(module_name).register(sub)
    _show_defaults(parser)
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to an option's help, unless the default is None or a flag's
    False (nothing worth saying) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """The formatter on every parser and subparser, however deep a feature registered it."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"subcommand {args.command!r} registered no handler")
    result = handler(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
