"""`kvgate serve` as a real process: what it prints, and how it stops (issue 19, items 8, 9)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.sim.server import SimEngine
from gateway.testing.process import free_port, kvgate_serve
from gateway.testing.servers import sim_engines

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _serve(*args: str, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    embedded = {"KVGATE_SIM__PROFILE": "instant", "KVGATE_SIM__REPLICAS": "2", **env}
    with kvgate_serve(*args, env=embedded, cwd=ROOT) as running:
        yield running


def test_serve_on_embedded_engines_says_where_it_listens() -> None:
    with _serve() as (proc, port):
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=10)[0].decode()
    assert f"http://127.0.0.1:{port}" in output, output
    assert f"kvgate: console at http://127.0.0.1:{port}/console" in output, output


async def _wait_ready(port: int, proc: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient(timeout=1) as http:
        for _ in range(300):
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(f"http://127.0.0.1:{port}/ready")).status_code == 200:
                    return
            assert proc.returncode is None, "kvgate serve exited"
            await asyncio.sleep(0.05)
    raise AssertionError("kvgate serve did not become ready")


@contextlib.asynccontextmanager
async def _serve_file(config: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "-c",
        str(config),
        "--port",
        str(port),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await _wait_ready(port, proc)
        yield proc, port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _config(path: Path, engines: list[SimEngine], **server: object) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "server": {"drain_timeout_s": 10, "drain_delay_s": 0.5, **server},
                "replicas": [{"id": f"e{e.index}", "url": e.url} for e in engines],
                "health": {"interval_s": 0.5},
                "scrape": {"enabled": False},
            }
        )
    )
    return path


STREAM = {
    "model": "kvgate-sim",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 300,
    "stream": True,
    "ignore_eos": True,
}


async def _stream_all(http: httpx.AsyncClient, url: str) -> tuple[str, list[str]]:
    async with http.stream("POST", url + "/v1/chat/completions", json=STREAM) as resp:
        return resp.headers["x-kvgate-replica"], [line async for line in resp.aiter_lines() if line]


async def test_sigterm_drains_streams_in_flight_then_exits(tmp_path: Path) -> None:
    async with (
        sim_engines(1, "tiny") as engines,
        _serve_file(_config(tmp_path / "c.yaml", engines)) as (proc, port),
    ):
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=20) as http:
            streaming = asyncio.create_task(_stream_all(http, url))
            await asyncio.sleep(0.2)  # the stream is under way (300 tokens take ~0.8 s)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(timeout=2) as fresh:
                ready = await fresh.get(url + "/ready")
            assert ready.status_code == 503 and ready.json()["draining"] is True
            _, lines = await streaming
            assert lines[-1] == "data: [DONE]" and len(lines) > 300
            await asyncio.wait_for(proc.wait(), 10)
            with pytest.raises(httpx.ConnectError):
                await http.get(url + "/health")


async def test_sighup_reloads_replicas_without_dropping_a_request(tmp_path: Path) -> None:
    async with sim_engines(2, "tiny") as engines:
        config = _config(tmp_path / "c.yaml", engines[:1])
        async with _serve_file(config) as (proc, port):
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=20) as http:
                streaming = asyncio.create_task(_stream_all(http, url))
                await asyncio.sleep(0.2)
                _config(config, engines[1:])
                proc.send_signal(signal.SIGHUP)
                replica, lines = await streaming
                assert replica == "e0" and lines[-1] == "data: [DONE]"
                body = {**STREAM, "stream": False, "max_tokens": 2}
                for _ in range(100):
                    resp = await http.post(url + "/v1/chat/completions", json=body)
                    assert resp.status_code == 200
                    if resp.headers["x-kvgate-replica"] == "e1":
                        break
                    await asyncio.sleep(0.05)
                assert resp.headers["x-kvgate-replica"] == "e1"
                assert proc.returncode is None  # SIGHUP did not stop it
