"""Gateway processes for the multi-instance tests: `python -m gateway.cli serve` each."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.store.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def gateway_config(
    replica_urls: Sequence[str],
    redis_url: str,
    key_prefix: str,
    **store: Any,
) -> dict[str, Any]:
    return {
        "replicas": [
            {"id": f"e{i}", "url": url, "models": ["kvgate-sim"]}
            for i, url in enumerate(replica_urls)
        ],
        "models": {"discover": False},
        "server": {"log_level": "warning"},
        "health": {"interval_s": 0.2, "timeout_s": 2.0, "failure_threshold": 1, "cooldown_s": 1.0},
        "retries": {"max_attempts": 4},
        "timeouts": {"connect_s": 1.0},
        "routing": {"policies": {"consistent_hash": {"load_factor": None}}},
        "store": {
            "backend": "redis",
            "url": redis_url,
            "key_prefix": key_prefix,
            "sync_interval_s": 0.05,
            # Generous: this host is shared by many busy processes; latency is benchmarked.
            "op_timeout_s": 0.5,
            "sticky_load_factor": None,
            **store,
        },
    }


class GatewayProcess:
    def __init__(self, config: dict[str, Any], workdir: Path, name: str, workers: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.workers = workers
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 30.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env = {k: v for k, v in env.items() if not k.startswith("KVGATE_")}
        args = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(self.config_path)]
        args += ["--port", str(self.port), "--workers", str(self.workers)]
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *args, cwd=REPO, env=env, stdout=log, stderr=log
            )
        deadline = asyncio.get_running_loop().time() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-3000:]}")
                try:
                    if (await client.get(self.url + "/ready", timeout=1.0)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"gateway not ready: {self.log_path.read_text()[-3000:]}")
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()

    async def metric(self, name: str) -> float:
        async with httpx.AsyncClient() as client:
            text = (await client.get(self.url + "/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise KeyError(name)

    def log(self) -> str:
        return self.log_path.read_text()


async def stop_all(gateways: Sequence[GatewayProcess]) -> None:
    await asyncio.gather(*(g.stop() for g in gateways))
