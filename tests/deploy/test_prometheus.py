"""A real Prometheus scrapes a real gateway under load; every dashboard and alert expression
must return data (issue 21's proof: no misspelt metric name survives)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import yaml

from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from tests.discovery.dns_server import Zone, dns_server
from tests.store.conftest import RedisServer, free_port, redis_binary, server_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/kvgate-rules.yml"
DASHBOARD = ROOT / "deploy/grafana/kvgate.json"
MODEL = "kvgate-sim"
RATE_WINDOW = "20s"  # stands in for Grafana's $__rate_interval at a 1 s scrape interval

# Series the relay does not record yet (each must then be absent: a dashboard panel on a
# series nothing records would pass unnoticed). The stream timer's are wired now.
PENDING_RELAY_WIRING: set[str] = set()

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def dashboard_panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return [p for p in panels if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]


def feature_bound(panel: dict[str, Any]) -> bool:
    """A panel whose description names the feature it needs (deploy/grafana NEEDS)."""
    return str(panel.get("description", "")).startswith("Needs ")


def concrete(expr: str, instance: str = ".*") -> str:
    """A dashboard expression as Grafana sends it: the job variable at the scrape job,
    the instance at the gateway, every namespace (a test has no namespace label)."""
    return (
        expr.replace("$__rate_interval", RATE_WINDOW)
        .replace("$job", "kvgate")
        .replace("$namespace", ".*")
        .replace("$instance", instance)
    )


def rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r["alert"], r["expr"]) for g in groups for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bkvgate_\w+", expr))


@contextlib.contextmanager
def prometheus(target: str, tmp: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary not found on PATH (CI installs it; apt install prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    # The child keeps its own copy of the log's descriptor; ours closes once it started.
    with (tmp / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def loaded_gateway(engines: list[SimEngine], redis_url: str) -> AsyncIterator[RunningGateway]:
    """Four engines in two pools, all found in DNS; Redis store, admission, PD on."""
    zone = Zone()
    for pool, members in (("h200", engines[:2]), ("domestic", engines[2:])):
        zone.srv[f"_{pool}._tcp.kvgate.test"] = [
            (f"e{e.index}.kvgate.test", urlsplit(e.url).port or 0) for e in members
        ]
    for e in engines:
        zone.a[f"e{e.index}.kvgate.test"] = ["127.0.0.1"]
    pool = {"cards_per_replica": 1, "slots_per_replica": 8}
    with dns_server(zone) as ns:
        async with gateway(
            engines,
            replicas=[],
            discovery={
                "nameservers": [ns],
                "dns": [
                    {"name": f"_{p}._tcp.kvgate.test", "pool": p} for p in ("h200", "domestic")
                ],
            },
            pools={
                "pools": [
                    {"name": "h200", "price_per_card_hour": 4.0, **pool},
                    {"name": "domestic", "price_per_card_hour": 1.0, **pool},
                ],
                "models": [{"name": MODEL}],
            },
            store={"backend": "redis", "url": redis_url},
            admission={"enabled": True, "saturation": {"max_inflight": 1}},
            pd={"models": {MODEL: {"mode": "auto", "kv_bytes_per_token": 65536}}},
            health={"interval_s": 0.5},
        ) as gw:
            yield gw


async def drive(gw: RunningGateway | str, seconds: float, *, bad_model: bool = True) -> None:
    url = gw if isinstance(gw, str) else gw.url
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
        deadline = time.monotonic() + seconds

        async def worker(n: int) -> None:
            turn = 0
            while time.monotonic() < deadline:
                turn += 1
                messages = [
                    {"role": "user", "content": f"conversation {n % 3} " * 60 + f"turn {turn}"}
                ]
                with contextlib.suppress(openai.APIError):
                    if turn % 3:
                        stream = await client.chat.completions.create(
                            model=MODEL,
                            messages=messages,
                            max_tokens=12,
                            stream=True,
                            extra_headers={"X-Session-Id": f"w{n}"},
                        )
                        async for _ in stream:
                            pass
                    else:
                        await client.completions.create(
                            model=MODEL, prompt=str(messages), max_tokens=6
                        )
                if bad_model and n == 0 and turn % 5 == 0:
                    with contextlib.suppress(openai.NotFoundError):
                        await client.chat.completions.create(
                            model="no-such-model", messages=messages
                        )

        await asyncio.gather(*(worker(n) for n in range(8)))


async def query(http: httpx.AsyncClient, expr: str) -> list[Any]:
    response = await http.get("/api/v1/query", params={"query": expr})
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_every_dashboard_and_alert_expression_returns_data(tmp_path: Path) -> None:
    binary = redis_binary()
    if binary is None:
        pytest.skip(
            "redis-server binary not found on PATH (CI installs it; apt install redis-server)"
        )
    redis = RedisServer(binary, server_port())
    redis.start()
    try:
        async with sim_engines(4, "tiny") as engines:
            # One engine answers some requests 503 (retried elsewhere), one some 500 (relayed).
            await engines[1].set_faults(FaultConfig(error=503, error_rate=0.3))
            await engines[3].set_faults(FaultConfig(error=500, error_rate=0.2))
            async with loaded_gateway(engines, redis.url) as gw:
                with prometheus(urlsplit(gw.url).netloc, tmp_path) as prom:
                    await drive(gw, seconds=10)
                    await asyncio.sleep(2.5)  # the last scrapes
                    async with httpx.AsyncClient(base_url=prom, timeout=10) as http:
                        await check_all(http)
    finally:
        redis.kill()


async def check_all(http: httpx.AsyncClient) -> None:
    empty, wired = [], []
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    for title, expr in exprs:
        data = await query(http, concrete(expr))
        pending = any(
            name.removesuffix("_bucket") in PENDING_RELAY_WIRING for name in metric_names(expr)
        )
        if pending and data:
            wired.append(title)
        elif not pending and not data:
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard expressions without data:\n" + "\n".join(empty)
    assert not wired, f"the relay records {wired} now: empty PENDING_RELAY_WIRING"

    rules = (await http.get("/api/v1/rules")).json()["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError")) for g in rules for r in g["rules"]}
    names = [name for name, _ in rule_exprs()]
    assert sorted(health) == sorted(names)
    assert all(h == "ok" for h, _ in health.values()), health
    missing = set()
    for _, expr in rule_exprs() + exprs:
        for name in metric_names(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base not in PENDING_RELAY_WIRING and not await query(
                http, f'group({{__name__="{name}"}})'
            ):
                missing.add(name)
    assert not missing, f"metrics no gateway exported: {sorted(missing)}"
    # KEDA's triggers query the same Prometheus (without the namespace label a test lacks).
    scaled = yaml.safe_load((ROOT / "deploy/k8s/overlays/keda/scaledobject.yaml").read_text())
    for trigger in scaled["spec"]["triggers"]:
        expr = re.sub(r"\{namespace=\"[^\"]*\"\}", "", trigger["metadata"]["query"])
        assert await query(http, expr), expr
    # The rules are evaluated over real data: at least the fleet-wide ones produce a value.
    exprs_by_alert = dict(rule_exprs())
    assert await query(http, exprs_by_alert["KvgateHigh5xxRate"].split(">")[0])
    # The gateway is up, so the gateway-down alert's comparison holds a series at 1.
    up = await query(http, exprs_by_alert["KvgateGatewayDown"].split("==")[0])
    assert [float(s["value"][1]) for s in up] == [1.0]


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found on PATH (CI installs prometheus)")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_fire_the_gateway_down_and_absent_alerts() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found on PATH (CI installs prometheus)")
    cases = RULES.with_name("kvgate-rules.test.yml")
    result = subprocess.run(
        [promtool, "test", "rules", str(cases)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = cases.read_text()
    assert "alertname: KvgateGatewayDown" in text and "alertname: KvgateGatewayAbsent" in text


@contextlib.contextmanager
def plain_serve() -> Iterator[str]:
    """`kvgate serve` with no config at all: its embedded simulated engines."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "kvgate serve never ready"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_every_panel_answers_on_a_plain_serve_unless_it_names_its_feature(
    tmp_path: Path,
) -> None:
    """Issue 46: a healthy fleet (no faults, no bad requests) behind a plain `kvgate serve`
    reads a value, if only a zero, on every panel that does not say what it needs."""
    with plain_serve() as url, prometheus(urlsplit(url).netloc, tmp_path) as prom:
        await drive(url, seconds=8, bad_model=False)
        await asyncio.sleep(2.5)  # the last scrapes
        panels = dashboard_panels()
        bound = [p["title"] for p in panels if feature_bound(p)]
        general = [p for p in panels if not feature_bound(p)]
        assert len(general) >= 15 and bound, bound
        empty = []
        async with httpx.AsyncClient(base_url=prom, timeout=10) as http:
            for panel in general:
                for target in panel["targets"]:
                    expr = concrete(target["expr"], instance=urlsplit(url).netloc)
                    if not await query(http, expr):
                        empty.append(f"{panel['title']}: {expr}")
            # The filters are real: another instance's view is empty.
            other = concrete(general[0]["targets"][0]["expr"], instance="elsewhere:1")
            assert not await query(http, other)
            # What feature-bound panels need is really off here, so their zeroes or gaps
            # are the feature's absence (not a misspelt series the declaration hides).
            for panel in panels:
                if feature_bound(panel):
                    for target in panel["targets"]:
                        assert not await query(http, concrete(target["expr"])), panel["title"]
    assert not empty, "panels with no data on a plain kvgate serve:\n" + "\n".join(empty)


def test_every_kvgate_selector_on_the_dashboard_carries_the_three_filters() -> None:
    names = [v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]]
    assert {"job", "namespace", "instance"} <= set(names)
    for title, expr in dashboard_exprs():
        selectors = re.findall(r"\bkvgate_\w+(\{[^}]*\})?", expr)
        assert selectors, title
        for selector in selectors:
            for label in ("job", "namespace", "instance"):
                assert f'{label}=~"${label}"' in selector, (title, expr)


async def test_the_compose_demo_config_fills_the_pool_pd_and_cost_panels(tmp_path: Path) -> None:
    """deploy/compose/gateway.yaml as shipped (only the addresses swapped for local ones:
    the engines' DNS name, the Redis URL) gives data on every panel, pools and PD too."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server binary not found on PATH (CI installs it)")
    config = yaml.safe_load((ROOT / "deploy/compose/gateway.yaml").read_text())
    redis = RedisServer(binary, server_port())
    redis.start()
    try:
        async with sim_engines(2, "tiny") as engines:
            zone = Zone()
            zone.srv["_engine._tcp.kvgate.test"] = [
                (f"e{e.index}.kvgate.test", urlsplit(e.url).port or 0) for e in engines
            ]
            for e in engines:
                zone.a[f"e{e.index}.kvgate.test"] = ["127.0.0.1"]
            with dns_server(zone) as ns:
                (entry,) = config["discovery"]["dns"]
                entry = {k: v for k, v in entry.items() if k != "port"}
                entry.update(name="_engine._tcp.kvgate.test", record="srv")
                config["discovery"].update(dns=[entry], nameservers=[ns])
                config["store"]["url"] = redis.url
                config.pop("server", None)
                async with gateway(engines, replicas=[], **config) as gw:
                    with prometheus(urlsplit(gw.url).netloc, tmp_path) as prom:
                        await drive(gw, seconds=8, bad_model=False)
                        await asyncio.sleep(2.5)
                        async with httpx.AsyncClient(base_url=prom, timeout=10) as http:
                            empty = [
                                panel["title"]
                                for panel in dashboard_panels()
                                for target in panel["targets"]
                                if not await query(http, concrete(target["expr"]))
                            ]
    finally:
        redis.kill()
    # The wait histogram fills only when a request queued, which load may or may not cause.
    assert set(empty) <= {"Wait p99"}, empty
