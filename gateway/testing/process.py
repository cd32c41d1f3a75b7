"""`kvgate serve` as a real process on a free loopback port, for tests that need what only a
process shows (its command line, its output, signals, the embedded default engines)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def kvgate_serve(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Run `kvgate serve ARGS --port P` until `/ready` answers 200; yield the process (its
    output piped, stderr folded in) and P. On exit it gets SIGINT, then SIGKILL after
    `STOP_TIMEOUT_S`. `env` is added to this process's environment."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", *args, "--port", str(port)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"kvgate serve exited with {proc.returncode}:\n{out}")
            if time.monotonic() > deadline:
                raise AssertionError("kvgate serve did not become ready")
            time.sleep(0.05)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
