"""A real `kvgate serve -c FILE` process for the front-door tests (asyncio: the simulated
engines it fronts run in the test's own event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.testing.process import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def kvgate_serve(config: dict[str, Any], directory: Path, *args: str) -> AsyncIterator[str]:
    """`kvgate serve` on `config` (written to `directory`) until /ready; yields its URL."""
    path = directory / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "-c",
        str(path),
        "--port",
        str(port),
        *args,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(url + "/ready")).status_code == 200:
                        break
                assert proc.returncode is None, "kvgate serve exited"
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("kvgate serve did not become ready")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
