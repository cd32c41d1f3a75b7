from __future__ import annotations

from collections.abc import Mapping

import pytest

from gateway.pd import decision as d
from gateway.pd.config import ModelPDSettings
from gateway.types import (
    ClusterView,
    Endpoint,
    ReplicaId,
    ReplicaState,
    Role,
    RouteRequest,
    SessionKey,
)

DENSE = 320 * 1024  # bytes per token of a 70B-class GQA model in bf16


def _view(*roles: tuple[str, Role], healthy: bool = True) -> ClusterView:
    return ClusterView(
        replicas=tuple(
            ReplicaState(
                id=ReplicaId(rid),
                url=f"http://h:{i}",
                role=role,
                healthy=healthy,
                models=frozenset({"m"}),
            )
            for i, (rid, role) in enumerate(roles)
        )
    )


FULL = _view(("c0", Role.BOTH), ("c1", Role.BOTH), ("p0", Role.PREFILL), ("d0", Role.DECODE))


def _req(tokens: int, endpoint: Endpoint = Endpoint.CHAT) -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model="m",
        session_key=SessionKey("s"),
        prompt_tokens=tokens,
        endpoint=endpoint,
    )


def _cfg(**kw: object) -> ModelPDSettings:
    base: dict[str, object] = {
        "mode": "auto",
        "kv_bytes_per_token": DENSE,
        "link_gbps": 400,
        "link_latency_ms": 0,
        "min_uncached_tokens": 2048,
        "max_transfer_ms": 100,
    }
    base.update(kw)
    return ModelPDSettings.model_validate(base)


def _cached(table: Mapping[str, int]) -> d.CachedTokens:
    return lambda rid: table.get(rid, 0)


def test_not_configured_and_never() -> None:
    assert d.decide(None, _req(50_000), FULL).reason == d.NOT_CONFIGURED
    out = d.decide(_cfg(mode="never"), _req(50_000), FULL)
    assert (out.disaggregate, out.reason) == (False, d.MODE_NEVER)


def test_long_uncached_prompt_with_cheap_transfer_disaggregates() -> None:
    out = d.decide(_cfg(), _req(8_000), FULL, _cached({"c0": 1_000}))
    assert out.disaggregate and out.reason == d.PAYS
    assert out.uncached_tokens == 7_000
    assert out.best_colocated == "c0"
    assert out.kv_bytes == 8_000 * DENSE
    assert out.transfer_s == pytest.approx(8_000 * DENSE * 8 / 400e9)


def test_sticky_session_mostly_cached_stays_colocated() -> None:
    # 94% of a 100K context cached on c1: uncached part is below the threshold.
    out = d.decide(
        _cfg(max_transfer_ms=10_000, min_uncached_tokens=8_192),
        _req(100_000),
        FULL,
        _cached({"c0": 0, "c1": 94_000}),
    )
    assert not out.disaggregate and out.reason == d.MOSTLY_CACHED
    assert out.best_colocated == "c1" and out.uncached_tokens == 6_000
    # Just above the threshold it flips.
    out = d.decide(
        _cfg(max_transfer_ms=10_000, min_uncached_tokens=6_000),
        _req(100_000),
        FULL,
        _cached({"c1": 94_000}),
    )
    assert out.disaggregate


def test_cached_estimate_is_clamped_to_prompt() -> None:
    out = d.decide(_cfg(), _req(4_000), FULL, _cached({"c0": 10**9}))
    assert out.uncached_tokens == 0 and out.reason == d.MOSTLY_CACHED


def test_huge_kv_over_link_budget_stays_colocated() -> None:
    out = d.decide(_cfg(link_gbps=10), _req(30_000), FULL)
    assert out.transfer_s * 1000 > 100
    assert (out.disaggregate, out.reason) == (False, d.OVER_BUDGET)


def test_small_kv_model_passes_budget_that_dense_fails() -> None:
    dense = d.decide(_cfg(link_gbps=25), _req(30_000), FULL)
    small = d.decide(_cfg(link_gbps=25, kv_bytes_per_token=8 * 1024), _req(30_000), FULL)
    assert dense.reason == d.OVER_BUDGET
    assert small.reason == d.PAYS


def test_always_still_needs_pd_replicas_and_a_full_block() -> None:
    no_pd = _view(("c0", Role.BOTH), ("p0", Role.PREFILL))
    assert d.decide(_cfg(mode="always"), _req(9_000), no_pd).reason == d.NO_PD_REPLICAS
    assert d.decide(_cfg(mode="always"), _req(4), FULL).reason == d.SHORT_PROMPT
    out = d.decide(_cfg(mode="always"), _req(100), FULL, _cached({"c0": 100}))
    assert out.disaggregate and out.reason == d.MODE_ALWAYS


def test_unhealthy_or_other_model_pd_replicas_do_not_count() -> None:
    view = ClusterView(
        replicas=(
            ReplicaState(id=ReplicaId("c0"), url="http://h:1", role=Role.BOTH),
            ReplicaState(id=ReplicaId("p0"), url="http://h:2", role=Role.PREFILL, healthy=False),
            ReplicaState(id=ReplicaId("d0"), url="http://h:3", role=Role.DECODE),
            ReplicaState(
                id=ReplicaId("p1"), url="http://h:4", role=Role.PREFILL, models=frozenset({"other"})
            ),
        )
    )
    assert d.decide(_cfg(), _req(9_000), view).reason == d.NO_PD_REPLICAS


def test_busy_prefill_replicas_keep_auto_colocated() -> None:
    busy = ClusterView(replicas=FULL.replicas, in_flight={ReplicaId("p0"): 2})
    out = d.decide(_cfg(), _req(8_000), busy)
    assert (out.disaggregate, out.reason) == (False, d.PREFILL_BUSY)
    assert d.decide(_cfg(max_prefill_queue=3), _req(8_000), busy).reason == d.PAYS
    # One free prefill replica is enough; `always` does not look.
    two = _view(("c0", Role.BOTH), ("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE))
    one_free = ClusterView(replicas=two.replicas, in_flight={ReplicaId("p0"): 5})
    assert d.decide(_cfg(), _req(8_000), one_free).reason == d.PAYS
    assert d.decide(_cfg(mode="always"), _req(8_000), busy).reason == d.MODE_ALWAYS


def test_no_colocated_replica_means_split_in_auto() -> None:
    view = _view(("p0", Role.PREFILL), ("d0", Role.DECODE))
    out = d.decide(_cfg(min_uncached_tokens=10**6), _req(100), view)
    assert out.disaggregate and out.reason == d.NO_COLOCATED


def test_unsupported_requests() -> None:
    assert d.decide(_cfg(), _req(9_000), FULL, blocker="n").reason == d.UNSUPPORTED
    assert d.decide(_cfg(), _req(9_000, Endpoint.EMBEDDINGS), FULL).reason == d.UNSUPPORTED


def test_prompt_size_falls_back_to_prefix_blocks() -> None:
    req = RouteRequest(
        request_id="r",
        model="m",
        session_key=SessionKey("s"),
        prefix_hashes=tuple(range(300)),
        block_tokens=16,
    )
    assert d.prompt_tokens_of(req) == 4_800
    assert d.decide(_cfg(), req, FULL).reason == d.PAYS


@pytest.mark.parametrize(
    ("body", "endpoint", "blocked"),
    [
        ({"n": 2}, Endpoint.CHAT, "n"),
        ({"n": 1}, Endpoint.CHAT, None),
        ({"best_of": 3}, Endpoint.COMPLETIONS, "best_of"),
        ({"kv_transfer_params": {"x": 1}}, Endpoint.CHAT, "kv_transfer_params"),
        ({"bootstrap_room": 5}, Endpoint.CHAT, "bootstrap_room"),
        ({}, Endpoint.EMBEDDINGS, "embeddings"),
        ({"stream": True, "max_tokens": 5}, Endpoint.COMPLETIONS, None),
    ],
)
def test_body_blocker(body: dict[str, object], endpoint: Endpoint, blocked: str | None) -> None:
    assert d.body_blocker(body, endpoint) == blocked


def test_every_reason_is_listed_once() -> None:
    assert len(set(d.REASONS)) == len(d.REASONS)
