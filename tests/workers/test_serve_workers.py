"""`kvgate serve --workers 2` as a real process: one /metrics for both workers (issue 21).

The gateway runs with TMPDIR pointing into the test's directory, so the test can see the
private metrics directory the supervisor creates (and that it is gone after exit), and
read each worker's own counter file to know that both workers served requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import sim_engines
from tests.store.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "kvgate-sim"
N = 48


def families(text: str) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value, family.type))
    return out


def total(text: str, name: str) -> float:
    return sum(v for _, v, _ in families(text).get(name, []))


@contextlib.asynccontextmanager
async def serve_workers(
    engines: list[SimEngine], tmp: Path, workers: int = 2
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    port = free_port()
    config = tmp / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "replicas": [
                    {"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines
                ],
                "models": {"discover": False},
                "server": {"log_level": "warning", "drain_timeout_s": 5},
                "health": {"interval_s": 0.5},
            }
        )
    )
    tmpdir = tmp / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir))
    log = (tmp / "serve.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "gateway.cli", "serve", "-c", str(config), "--port", str(port)),
        *("--workers", str(workers)),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(600):
                assert proc.returncode is None, (tmp / "serve.log").read_text()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(url + "/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("not ready: " + (tmp / "serve.log").read_text())
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


async def scrape(url: str) -> str:
    # A new connection each time, so successive scrapes may reach either worker.
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(url + "/metrics")
    assert response.status_code == 200
    return response.text


def served_by(private: Path) -> dict[str, float]:
    """Requests counted per worker pid, read off each worker's own counter file."""
    out: dict[str, float] = {}
    for path in private.glob("counter_*.db"):
        pid = path.stem.rpartition("_")[2]
        for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
            if key.startswith('["kvgate_requests"'):
                out[pid] = out.get(pid, 0.0) + value
    return out


def fresh_connections() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)


async def wait_for(url: str, name: str, expected: float, timeout: float = 8.0) -> str:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = await scrape(url)
        if total(text, name) == expected:
            return text
        assert asyncio.get_running_loop().time() < deadline, (name, total(text, name), expected)
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_two_workers_answer_one_consistent_metrics(tmp_path: Path) -> None:
    async with sim_engines(2, "instant") as engines, serve_workers(engines, tmp_path) as (url, _):
        [private] = list((tmp_path / "tmp").glob("kvgate-metrics-*"))
        async with fresh_connections() as http:
            client = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="k", max_retries=0, http_client=http
            )

            async def one(i: int) -> None:
                messages = [{"role": "user", "content": f"question {i}"}]
                if i % 2:
                    stream = await client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=4,
                        stream=True,  # type: ignore[arg-type]
                    )
                    assert "".join(
                        [c.choices[0].delta.content or "" async for c in stream if c.choices]
                    )
                else:
                    answer = await client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=4,  # type: ignore[arg-type]
                    )
                    assert answer.choices[0].message.content

            # Which worker accepts a connection is the kernel's choice, and one may take a
            # whole batch: send batches of 8 until both have served (N at the least).
            sent = 0
            while sent < N or (len(served_by(private)) < 2 and sent < 10 * N):
                await asyncio.gather(*(one(i) for i in range(sent, sent + 8)))
                sent += 8

        # Both workers served some: each one's own counter file holds its share.
        per_worker = served_by(private)
        assert len(per_worker) == 2 and all(per_worker.values()), per_worker
        assert sum(per_worker.values()) == sent

        for _ in range(6):
            text = await scrape(url)
            assert total(text, "kvgate_requests_total") == sent
            assert total(text, "kvgate_time_to_first_token_seconds_count") == sent // 2
            assert total(text, "kvgate_e2e_request_latency_seconds_count") == sent
            fams = families(text)
            assert sum(v for _, v, _ in fams["kvgate_workers"]) == 2
            # Merged gauges: one series per replica, no worker label.
            healthy = {labels["replica"]: v for labels, v, _ in fams["kvgate_replica_healthy"]}
            assert healthy == {"e0": 1.0, "e1": 1.0}
            assert all("worker" not in labels for labels, _, _ in fams["kvgate_in_flight"])
            assert all("pid" not in labels for labels, _, _ in fams["kvgate_requests_total"])


@pytest.mark.slow
async def test_in_flight_is_the_sum_over_workers_and_the_directory_goes_at_exit(
    tmp_path: Path,
) -> None:
    held = 6
    # Slow enough that every stream is still decoding while the test looks.
    slow = PROFILES["tiny"].scaled(decode_base_s=0.02, num_gpu_blocks=4096)
    engines = [SimEngine(slow, index=i) for i in range(2)]
    for engine in engines:
        await engine.start()
    try:
        await _hold_streams(engines, tmp_path, held)
    finally:
        for engine in engines:
            await engine.stop()


async def _hold_streams(engines: list[SimEngine], tmp_path: Path, held: int) -> None:
    async with serve_workers(engines, tmp_path) as (url, proc):
        [private] = list((tmp_path / "tmp").glob("kvgate-metrics-*"))
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for i in range(held):
                http = await stack.enter_async_context(fresh_connections())
                response = await stack.enter_async_context(
                    http.stream(
                        "POST",
                        url + "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": f"long {i}"}],
                            "max_tokens": 500,
                            "stream": True,
                        },
                    )
                )
                assert response.status_code == 200
                chunks = response.aiter_raw()
                assert await anext(chunks)
                streams.append(chunks)
            await wait_for(url, "kvgate_in_flight", held)
            pids = {p.stem.rpartition("_")[2] for p in private.glob("kvgate_live_*.json")}
            assert len(pids) == 2
        # Every stream closed: the sum over both workers falls back to zero.
        await wait_for(url, "kvgate_in_flight", 0)
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 15)
        assert not private.exists()
