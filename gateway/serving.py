"""Run an ASGI app on a real uvicorn server inside the *current* event loop.

Tests, the simulated cluster and `kvgate serve`'s embedded engines all need several servers
in one process on loopback. `uvicorn.run` owns the loop and the signal handlers, so it cannot
do that; `start_server` binds the socket itself (port 0 gives a free port, known before the
first request), runs `Server.serve` as a task, and returns once the lifespan has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import Any, Self

import uvicorn

from gateway.protocol import guarded_protocol
from gateway.settings import DEFAULT_KEEP_ALIVE_S

_log = logging.getLogger("kvgate")

# Long enough for a streamed answer to finish, short enough that a stalled stream (the sim's
# fault injection keeps one open on purpose) cannot hang a test's teardown.
DEFAULT_GRACEFUL_SHUTDOWN_S = 2


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever owns the process.

    Several of these run at once; if each swapped SIGINT/SIGTERM handlers on start and
    restored them on exit, stopping them out of order would leave a dead server's handler
    installed.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DrainingServer(uvicorn.Server):
    """`kvgate serve`'s server: SIGTERM/SIGINT drain, SIGHUP reload.

    On the first SIGTERM or SIGINT `on_drain` runs at once (the gateway's `/ready` turns
    503), the listener stays open `drain_delay_s` more (so a load balancer sees the 503 and
    stops sending), then uvicorn's graceful shutdown stops accepting and waits for requests
    and streams in flight, at most `timeout_graceful_shutdown` seconds. A second signal
    skips the delay. SIGHUP runs `on_reload` in the loop; requests are not disturbed.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        on_drain: Callable[[], None] = lambda: None,
        drain_delay_s: float = 0.0,
        on_reload: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        self._drain_delay_s = drain_delay_s
        self._on_reload = on_reload
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reloads: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            hup = getattr(signal, "SIGHUP", None)
            if (
                hup is None
                or self._on_reload is None
                or threading.current_thread() is not threading.main_thread()
            ):
                yield
                return
            previous = signal.signal(hup, self._hang_up)
            try:
                yield
            finally:
                signal.signal(hup, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self._draining or not self._drain_delay_s or loop is None:
            if not self._draining:
                self._draining = True
                self._on_drain()
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._on_drain()
        _log.info("draining: /ready answers 503; stopping to accept in %.1f s", self._drain_delay_s)
        stop = super().handle_exit
        loop.call_soon_threadsafe(loop.call_later, self._drain_delay_s, stop, sig, frame)

    def _hang_up(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_reload)

    def _start_reload(self) -> None:
        assert self._on_reload is not None
        task = asyncio.ensure_future(self._on_reload())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on accepted sockets
    # whose proto says TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # Re-binding the same port (refuse-fault recovery, restarts in tests) must not wait
        # for TIME_WAIT connections to expire.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        # uvicorn exits the process when the lifespan startup fails; inside a task that
        # would escape the event loop and kill the whole process.
        raise RuntimeError(f"uvicorn exited with status {exc.code}") from None


class RunningServer:
    """Handle on a started server: its address, and how to stop it."""

    def __init__(
        self, server: uvicorn.Server, task: asyncio.Task[None], host: str, port: int
    ) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port
        self._paused_sockets: list[socket.socket] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def listening(self) -> bool:
        return any(s.is_serving() for s in getattr(self._server, "servers", []))

    @property
    def stopped(self) -> bool:
        return self._task.done()

    def pause_listening(self) -> None:
        """Close the listening socket so new connections are refused (ECONNREFUSED).

        Idle keep-alive connections are closed too, otherwise a client's connection pool
        would keep reaching a replica that is supposed to be unreachable; responses in
        progress finish normally.
        """
        for srv in getattr(self._server, "servers", []):
            srv.close()
        for conn in list(self._server.server_state.connections):
            conn.shutdown()

    async def resume_listening(self) -> None:
        """Listen again on the same port after `pause_listening`."""
        if self.listening or self.stopped:
            return
        server = self._server
        config = server.config
        loop = asyncio.get_running_loop()
        sock = _bind(self.host, self.port)

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            proto: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=server.server_state,
                app_state=server.lifespan.state,
                _loop=_loop,
            )
            return proto

        srv = await loop.create_server(create_protocol, sock=sock, backlog=config.backlog)
        server.servers.append(srv)

    async def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (lifespan shutdown included); forced after `timeout` seconds."""
        if self._task.done():
            # A forced stop cancelled the task: awaiting it again would raise CancelledError
            # into the caller (a second `stop()`, `async with`'s exit) as if it were cancelled.
            if not self._task.cancelled():
                await self._task
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self._server.force_exit = True
            self._close_connections()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # uvicorn asks the connections open when its shutdown begins to close; one accepted
        # just then (its connection_made ran after that ask) is only waited for, and outlived
        # the server: a stopped engine kept answering probes on a client's pooled connection.
        # A process that exits closes every socket; so does a stopped server.
        self._close_connections()

    def _close_connections(self) -> None:
        for conn in list(self._server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_server(
    app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_kwargs: Any
) -> RunningServer:
    """Serve `app` on `host:port` in the running loop; return when it accepts connections.

    Defaults: lifespan "on" (startup errors surface here instead of being ignored), access
    log off, log level "warning", graceful shutdown bounded by DEFAULT_GRACEFUL_SHUTDOWN_S,
    idle connections kept DEFAULT_KEEP_ALIVE_S, httptools with request deadlines and
    trailers dropped (gateway.protocol).
    Any `uvicorn.Config` keyword overrides them. Raises RuntimeError if start-up fails.
    """
    options: dict[str, Any] = {
        "lifespan": "on",
        "http": guarded_protocol(),
        "access_log": False,
        "log_level": "warning",
        "timeout_graceful_shutdown": DEFAULT_GRACEFUL_SHUTDOWN_S,
        "timeout_keep_alive": DEFAULT_KEEP_ALIVE_S,
    }
    options.update(uvicorn_kwargs)
    sock = _bind(host, port)
    bound_port = int(sock.getsockname()[1])
    config = uvicorn.Config(app, host=host, port=bound_port, **options)
    server = _EmbeddedServer(config)
    task = asyncio.get_running_loop().create_task(
        _serve(server, sock), name=f"uvicorn:{host}:{bound_port}"
    )
    while not server.started:
        if task.done():
            sock.close()
            exc = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"server on {host}:{bound_port} failed to start") from exc
        await asyncio.sleep(0.005)
    return RunningServer(server, task, host, bound_port)
