"""`kvgate epp`: the gateway's brain as Envoy's ext_proc Endpoint Picker.

The same app as `kvgate serve` is built (every feature installed, the same lifespan), its
HTTP port keeps serving /metrics, /health, /ready and the admin routes, and the ext_proc
gRPC server runs beside it in the same event loop (gateway.epp.server).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    epp = sub.add_parser(
        "epp", help="serve Envoy's ext_proc as a Gateway API Inference Extension endpoint picker"
    )
    epp.add_argument(
        "-c",
        "--config",
        default=os.environ.get("KVGATE_CONFIG_FILE") or None,
        help="YAML settings file (the same as `kvgate serve`; the epp: section for gRPC)",
    )
    epp.add_argument("--host", help="override server.host (HTTP: metrics, health, admin)")
    epp.add_argument("--port", type=int, help="override server.port (HTTP)")
    epp.add_argument("--grpc-port", type=int, help="override epp.port (ext_proc, default 9002)")
    epp.set_defaults(handler=_epp)


def _epp(args: argparse.Namespace) -> int:
    from gateway.errors import ConfigError
    from gateway.settings import load_settings

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"kvgate: {exc.message}", file=sys.stderr)
        return 2
    server_over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    update: dict[str, Any] = {}
    if server_over:
        update["server"] = settings.server.model_copy(update=server_over)
    if args.grpc_port is not None:
        update["epp"] = settings.epp.model_copy(update={"port": args.grpc_port})
    if update:
        settings = settings.model_copy(update=update)
    if settings.server.workers > 1:
        print("kvgate: `kvgate epp` runs one process (server.workers is ignored)", file=sys.stderr)
    server = settings.server
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import uvicorn

    from gateway.app import build_app
    from gateway.epp.server import EppService
    from gateway.serving import DrainingServer

    app = build_app(settings)
    state = app.state.gateway
    if settings.epp.pool is not None:
        from gateway.epp.inferencepool import PoolWatcher

        # Before the EPP: readiness waits for the pool's first listing.
        state.services.append(PoolWatcher(state.cluster, settings.epp.pool))
    state.services.append(EppService(state, settings.epp))
    lifecycle = app.state.lifecycle

    def drain() -> None:
        lifecycle.draining = True

    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        # grpc.aio drives its completion queue from the asyncio loop it was started on;
        # the default loop is the one it is tested with.
        "loop": "asyncio",
        "http": server.protocol(),
        "log_level": server.log_level,
        "access_log": server.access_log,
        "timeout_graceful_shutdown": server.drain_timeout_s,
        "lifespan": "on",
        "server_header": False,
        "date_header": False,
    }
    server_ = DrainingServer(
        uvicorn.Config(app, **options), on_drain=drain, drain_delay_s=server.drain_delay_s
    )
    with contextlib.suppress(KeyboardInterrupt):
        server_.run()
    return 0 if server_.started else 3
