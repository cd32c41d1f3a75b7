"""A real redis-server for the store tests, started once per session on a free port."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port() -> int:
    """A free port below the kernel's ephemeral range, for servers that are restarted.

    While a killed server is down, clients keep reconnecting to its port; if that port is an
    ephemeral one, a client socket can take it (even connect to itself) and the restarted
    server then finds it busy. Ports below the range are never handed out to clients.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@dataclass
class RedisServer:
    """One redis-server process that tests may kill and restart on the same port."""

    binary: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    # A replica saves what it syncs to its directory: never the working tree.
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvgate-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.workdir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
                # DEBUG SLEEP simulates a slow Redis in one test.
                "--enable-debug-command",
                "local",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        pytest.skip(
            "redis-server binary not found on PATH (CI installs it; apt install redis-server)"
        )
    server = RedisServer(binary, server_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server for tests that kill and restart it."""
    binary = redis_binary()
    if binary is None:
        pytest.skip(
            "redis-server binary not found on PATH (CI installs it; apt install redis-server)"
        )
    server = RedisServer(binary, server_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture
def key_prefix() -> str:
    """Each test gets its own namespace on the shared server."""
    return f"t{uuid.uuid4().hex[:10]}"
