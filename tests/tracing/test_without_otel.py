"""The gateway imports, starts and propagates without OpenTelemetry installed; asking for
spans then fails start-up with the install command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter where every `opentelemetry` import fails, as when the extra
# is not installed.
SCRIPT = """
import asyncio, sys

class NoOtel:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoOtel())

import httpx
from gateway.errors import ConfigError
from gateway.app import build_app
from gateway.settings import load_settings
from gateway.testing.servers import gateway, sim_engines

async def main():
    async with sim_engines(1, "instant") as engines:
        async with gateway(engines, models={"discover": False}) as gw:
            async with httpx.AsyncClient() as http:
                r = await http.post(gw.url + "/v1/chat/completions", json={
                    "model": "kvgate-sim", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
        assert engines[0].trace_contexts[-1][1].startswith("00-")
    try:
        build_app(load_settings(tracing={"enabled": True}))
    except ConfigError as exc:
        print("refused:", exc.message)
    assert not any(m.startswith("opentelemetry") for m in sys.modules)
    print("served without opentelemetry")

asyncio.run(main())
"""


def test_the_gateway_runs_without_the_otel_extra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "served without opentelemetry" in result.stdout
    assert "refused: tracing.enabled needs OpenTelemetry: pip install 'kvgate[otel]'" in (
        result.stdout
    )
