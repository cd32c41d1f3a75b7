from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from gateway.cluster import Cluster
from gateway.health import HealthMonitor
from gateway.metrics import GatewayMetrics
from gateway.settings import HealthSettings
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_series_and_per_app_registry() -> None:
    cluster = Cluster([ReplicaState(ReplicaId("a"), "http://a")])
    m = GatewayMetrics(cluster)
    other = GatewayMetrics(cluster)
    assert m.registry is not other.registry
    m.request_done("chat", "a", 200, True, 0.2, 0.05)
    m.request_done("chat", "a", 200, True, 0.3, 0.05)
    m.error("invalid_json")
    m.retry("upstream_connect_error")
    m.decision("consistent_hash", "ring")
    m.disconnect("mid_stream")
    m.upstream_failure("a", "upstream_timeout")
    cluster.acquire(ReplicaId("a"))
    s = samples(m)
    assert (
        s[("kvgate_requests_total", (("endpoint", "chat"), ("replica", "a"), ("status", "200")))]
        == 2
    )
    assert (
        s[("kvgate_request_duration_seconds_count", (("endpoint", "chat"), ("stream", "true")))]
        == 2
    )
    assert s[("kvgate_ttfb_seconds_count", (("endpoint", "chat"), ("stream", "true")))] == 2
    assert s[("kvgate_errors_total", (("code", "invalid_json"),))] == 1
    assert s[("kvgate_retries_total", (("reason", "upstream_connect_error"),))] == 1
    assert (
        s[("kvgate_routing_decisions_total", (("policy", "consistent_hash"), ("reason", "ring")))]
        == 1
    )
    assert s[("kvgate_client_disconnects_total", (("phase", "mid_stream"),))] == 1
    assert s[("kvgate_in_flight", (("replica", "a"),))] == 1
    assert s[("kvgate_replica_healthy", (("replica", "a"),))] == 1
    assert (
        "kvgate_requests_total",
        (("endpoint", "chat"), ("replica", "a"), ("status", "200")),
    ) not in samples(other)


def test_features_can_register_their_own_series() -> None:
    m = GatewayMetrics(Cluster())
    c = Counter("kvgate_feature_things", "x", registry=m.registry)
    c.inc()
    assert samples(m)[("kvgate_feature_things_total", ())] == 1


def test_reference_table_matches_the_registry() -> None:
    import re

    import gateway.metrics as module

    documented = {
        (name, kind, tuple(sorted(label.strip() for label in labels.split(","))))
        for name, kind, labels in re.findall(
            r"^\| (kvgate_\w+) \| (\w+) \| ([^|]*) \|$", module.__doc__ or "", re.MULTILINE
        )
    }
    cluster = Cluster([ReplicaState(ReplicaId("a"), "http://a")])
    m = GatewayMetrics(cluster)
    health = HealthMonitor(cluster, make_client("h1", Timeouts(1, 1, 1)), HealthSettings())
    health.ejections[(ReplicaId("a"), "probe")] += 1
    m.watch_health(health)
    m.request_done("chat", "a", 200, False, 0.1, 0.1)
    m.error("x")
    m.retry("x")
    m.decision("p", "r")
    m.disconnect("mid_stream")
    m.upstream_failure("a", "k")
    m.served("m", "a", "", 0.2, 10, 5, 3)
    m.charge("a", "", 0.01)
    m.cache_forecast("a", "lineage", 1024, 2048, 512)
    timer = m.stream_timer("m", "a", 0.0)
    for _ in range(3):
        timer.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    timer.finish(3)
    actual = set()
    for family in text_string_to_metric_families(m.render().decode()):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps; scrapers ignore them
        labels = set()
        for s in family.samples:
            labels |= {k for k in s.labels if k != "le"}
        actual.add(
            (
                family.name if family.type != "counter" else family.name + "_total",
                family.type,
                tuple(sorted(labels)),
            )
        )
    assert documented == actual
