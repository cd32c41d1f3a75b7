"""The scraper against real HTTP servers on loopback serving literal expositions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.serving import RunningServer, start_server
from gateway.types import ClusterView, ReplicaId, ReplicaState

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


@dataclass
class Exposition:
    """What the fake replica serves; tests change it between scrapes."""

    text: str = VLLM
    status: int = 200
    delay_s: float = 0.0
    hits: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    peers: set[object] = field(default_factory=set)
    auth: list[str | None] = field(default_factory=list)

    def app(self) -> Starlette:
        async def metrics(request: Request) -> Response:
            self.hits += 1
            self.peers.add(request.client)
            self.auth.append(request.headers.get("authorization"))
            self.ready.set()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return PlainTextResponse(self.text, status_code=self.status)

        return Starlette(routes=[Route("/metrics", metrics)])


@dataclass
class HealthLog:
    ok: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def scrape_succeeded(self, replica: ReplicaId) -> None:
        self.ok.append(replica)

    def scrape_failed(self, replica: ReplicaId, reason: str) -> None:
        self.failed.append((replica, reason))


@pytest.fixture
async def served() -> AsyncIterator[tuple[Exposition, RunningServer]]:
    expo = Exposition()
    server = await start_server(expo.app())
    try:
        yield expo, server
    finally:
        await server.stop()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(registry).decode()
    ):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


async def test_background_loop_publishes_fresh_loads(
    served: tuple[Exposition, RunningServer],
) -> None:
    _, server = served
    target = ReplicaState(ReplicaId("a"), server.url)
    published: list[tuple[str, float]] = []
    registry = CollectorRegistry()
    scraper = MetricsScraper(
        ScrapeSettings(interval_s=0.05, stale_after_s=0.5),
        lambda: [target],
        registry=registry,
        on_load=lambda rid, load: published.append((rid, load.waiting)),
    )
    await scraper.start()
    try:
        for _ in range(100):
            if len(published) >= 3:
                break
            await asyncio.sleep(0.02)
        assert len(published) >= 3, "the loop keeps polling at the interval"
        load = scraper.loads[ReplicaId("a")]
        assert (load.waiting, load.running, load.kv_usage) == (3.0, 2.0, 0.25)
        assert published[0] == ("a", 3.0)
        assert sample(registry, "kvgate_scrape_waiting", replica="a") == 3.0
        assert sample(registry, "kvgate_scrape_kv_usage", replica="a") == 0.25
        age = sample(registry, "kvgate_scrape_age_seconds", replica="a")
        assert age is not None and 0 <= age < 0.5
        assert (sample(registry, "kvgate_scrapes_total", replica="a") or 0) >= 3
    finally:
        await scraper.stop()


async def test_failures_feed_health_and_keep_the_old_snapshot_until_stale(
    served: tuple[Exposition, RunningServer],
) -> None:
    expo, server = served
    health = HealthLog()
    registry = CollectorRegistry()
    settings = ScrapeSettings(interval_s=0.05, stale_after_s=0.3, timeout_s=0.2)
    target = ReplicaState(ReplicaId("a"), server.url)
    # No background targets: every scrape here is explicit, so counts are exact.
    scraper = MetricsScraper(settings, list, registry=registry, health=health)
    await scraper.start()
    try:
        good = await scraper.scrape_once(target)
        assert good is not None and health.ok
        expo.status = 500
        assert await scraper.scrape_once(target) is None
        expo.status, expo.text = 200, "# TYPE up gauge\nup 1\n"
        assert await scraper.scrape_once(target) is None
        expo.text, expo.delay_s = VLLM, 0.5
        assert await scraper.scrape_once(target) is None
        reasons = {reason for _, reason in health.failed}
        assert {"status_500", "parse", "timeout"} <= reasons
        assert sample(registry, "kvgate_scrape_errors_total", replica="a", reason="parse") == 1.0
        # The last good snapshot is kept, and a view judges it by age.
        kept = scraper.loads[ReplicaId("a")]
        assert kept is good
        replica = ReplicaState(ReplicaId("a"), server.url, load=kept)
        fresh = ClusterView(
            (replica,), now=kept.scraped_at + 0.1, stale_after=settings.stale_after_s
        )
        stale = ClusterView(
            (replica,), now=kept.scraped_at + 1.0, stale_after=settings.stale_after_s
        )
        assert fresh.load_of(replica) is kept and stale.load_of(replica) is None
    finally:
        await scraper.stop()


async def test_scrapes_reuse_one_connection_and_send_the_engine_key(
    served: tuple[Exposition, RunningServer],
) -> None:
    expo, server = served
    target = ReplicaState(ReplicaId("a"), server.url)
    scraper = MetricsScraper(ScrapeSettings(), list, headers=[(b"authorization", b"Bearer k")])
    await scraper.start()
    try:
        for status in (200, 500, 200, 200):
            expo.status = status
            await scraper.scrape_once(target)
    finally:
        await scraper.stop()
    # Bodies are read to the end, error statuses included, so the connection stays pooled.
    assert expo.hits == 4 and len(expo.peers) == 1
    assert expo.auth == ["Bearer k"] * 4


async def test_connection_refused_is_a_connect_failure() -> None:
    health = HealthLog()
    dead = ReplicaState(ReplicaId("gone"), "http://127.0.0.1:9")
    scraper = MetricsScraper(ScrapeSettings(timeout_s=0.5), lambda: [dead], health=health)
    await scraper.start()
    try:
        assert await scraper.scrape_once(dead) is None
        assert ("gone", "connect") in health.failed
    finally:
        await scraper.stop()


async def test_an_answer_cut_off_midway_is_an_error_not_a_connect_failure() -> None:
    """The engine was reached: only connect failures count toward ejection."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nvllm:num_requests")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    health = HealthLog()
    replica = ReplicaState(ReplicaId("cut"), f"http://127.0.0.1:{port}")
    scraper = MetricsScraper(ScrapeSettings(timeout_s=0.5), lambda: [replica], health=health)
    await scraper.start()
    try:
        assert await scraper.scrape_once(replica) is None
        assert health.failed == [("cut", "error")]
    finally:
        await scraper.stop()
        server.close()
        await server.wait_closed()


async def test_membership_changes_start_and_stop_pollers(
    served: tuple[Exposition, RunningServer],
) -> None:
    expo, server = served
    targets = [ReplicaState(ReplicaId("a"), server.url)]
    registry = CollectorRegistry()
    scraper = MetricsScraper(
        ScrapeSettings(interval_s=0.05, stale_after_s=0.5), lambda: list(targets), registry=registry
    )
    await scraper.start()
    try:
        await asyncio.wait_for(expo.ready.wait(), 2)
        targets.append(ReplicaState(ReplicaId("b"), server.url))
        for _ in range(100):
            if ReplicaId("b") in scraper.loads:
                break
            await asyncio.sleep(0.02)
        assert set(scraper.loads) == {"a", "b"}
        targets.pop(0)
        for _ in range(100):
            if ReplicaId("a") not in scraper.loads:
                break
            await asyncio.sleep(0.02)
        assert set(scraper.loads) == {"b"}
        assert sample(registry, "kvgate_scrape_waiting", replica="a") is None
    finally:
        await scraper.stop()


def test_settings_reject_a_stale_limit_below_the_interval() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        ScrapeSettings(interval_s=1.0, stale_after_s=0.5)
    assert ScrapeSettings().interval_s < 1.0
    assert ScrapeSettings(engines={"a": "sglang"}).engine_for("a").value == "sglang"


async def test_loop_publishes_in_batches(served: tuple[Exposition, RunningServer]) -> None:
    _, server = served
    published: list[str] = []
    target = ReplicaState(ReplicaId("a"), server.url)
    scraper = MetricsScraper(ScrapeSettings(), list, on_load=lambda rid, _: published.append(rid))
    await scraper.start()
    try:
        assert await scraper.scrape_once(target, publish=False) is not None
        assert published == [] and ReplicaId("a") in scraper.loads
        scraper.flush()
        scraper.flush()
        assert published == ["a"]
    finally:
        await scraper.stop()


async def test_malformed_expositions_are_parse_failures_without_a_traceback(
    served: tuple[Exposition, RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    expo, server = served
    health = HealthLog()
    scraper = MetricsScraper(
        ScrapeSettings(timeout_s=0.5), list, registry=CollectorRegistry(), health=health
    )
    target = ReplicaState(ReplicaId("a"), server.url)
    await scraper.start()
    try:
        for text in (
            "\x00\xff garbage {{{\n",
            "vllm:num_requests_running{engine=0 3\n",
            "sglang:num_running_reqs 1\nsglang:num_queue_reqs 1\nsglang:max_total_num_tokens NaN\n",
            "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n",
        ):
            expo.text = text
            await scraper.scrape_once(target)
    finally:
        await scraper.stop()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert [reason for _, reason in health.failed] == ["parse", "parse", "parse"]


async def test_the_same_answer_again_is_not_parsed_again(
    served: tuple[Exposition, RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.scrape.scraper as scraper_module

    parsed: list[str] = []
    real = scraper_module.read_engine_series

    def counting(text: str, *args: object) -> object:
        parsed.append(text)
        return real(text, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(scraper_module, "read_engine_series", counting)
    expo, server = served
    target = ReplicaState(ReplicaId("a"), server.url)
    scraper = MetricsScraper(ScrapeSettings(select_series=False), list)
    await scraper.start()

    async def read() -> tuple[float, float, float | None, float | None]:
        load = await scraper.scrape_once(target)
        assert load is not None
        return load.waiting, load.running, load.kv_usage, load.prefix_hit_rate

    counters = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
    )
    expo.text = VLLM + counters
    try:
        first = await read()
        assert await read() == first and len(parsed) == 1  # a quiet engine: same bytes
        expo.text = VLLM.replace('model_name="m"} 2.0', 'model_name="m"} 5.0') + counters
        changed = await read()
        assert changed[1] == 5 and len(parsed) == 2
        assert await read() == changed and len(parsed) == 2
        scraper._counters.pop(target.id)  # the prefix-cache rate starts afresh: parse
        assert await read() == changed and len(parsed) == 3
    finally:
        await scraper.stop()
