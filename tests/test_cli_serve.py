"""`kvgate serve` as a real process: what it prints, and how it stops (issue 19, items 8, 9)."""

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

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serve(*args: str, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = _free_port()
    environ = {**os.environ, "KVGATE_SIM__PROFILE": "instant", "KVGATE_SIM__REPLICAS": "2",
               "KVGATE_SERVER__PORT": str(port), **env}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT,
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "kvgate serve did not become ready"
            time.sleep(0.05)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_serve_on_embedded_engines_says_where_it_listens() -> None:
    with _serve() as (proc, port):
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=10)[0].decode()
    assert f"http://127.0.0.1:{port}" in output, output
