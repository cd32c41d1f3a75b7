"""The helpers as a third-party policy author uses them: engines and a gateway on loopback
with the policy by `module:Class`, the official client in front; the engines are stopped
even when the test body fails; a `kvgate serve` that cannot start says why; the view
builder's staleness and prefixes."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from gateway.testing.process import free_port, kvgate_serve
from gateway.testing.servers import gateway, replica_config, sim_engines
from gateway.testing.views import ViewBuilder, make_request
from tests.sample_third_party_policy import Reverse


async def test_a_policy_by_import_string_routes_real_requests_through_the_helpers() -> None:
    async with (
        sim_engines(3, "instant") as engines,
        gateway(
            engines,
            routing={"policy": "tests.sample_third_party_policy:Reverse", "filters": []},
        ) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        assert [r["id"] for r in replica_config(engines)] == ["e0", "e1", "e2"]
        for i in range(3):
            await client.completions.create(model="kvgate-sim", prompt=f"p{i}", max_tokens=2)
        # Reverse ranks by id descending: every request went to e2.
        assert [len(e.request_log) for e in engines] == [0, 0, 3]
        router = gw.state.router
        assert any(isinstance(p, Reverse) for p in getattr(router, "parts", lambda: ())())


async def test_engines_are_stopped_when_the_test_body_fails() -> None:
    urls: list[str] = []
    with pytest.raises(RuntimeError, match="body failed"):
        async with sim_engines(2, "instant") as engines:
            urls = [e.url for e in engines]
            raise RuntimeError("body failed")
    async with httpx.AsyncClient() as client:
        for url in urls:
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/health")


def test_a_serve_that_cannot_start_raises_with_its_output(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        "replicas:\n  - {id: a, url: 'http://127.0.0.1:9'}\nrouting:\n  policy: no_such_policy\n"
    )
    with (
        pytest.raises(AssertionError, match="kvgate serve exited with") as caught,
        kvgate_serve("--config", str(config)),
    ):
        pass
    assert "unknown routing policy 'no_such_policy'" in str(caught.value)


def test_free_ports_are_free() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds it


def test_view_builder_staleness_prefixes_and_extra_load_fields() -> None:
    view = (
        ViewBuilder(now=50.0)
        .replicas(2, prefix="gpu-")
        .load("gpu-0", waiting=1, age=3.0, kv_usage=0.5)
        .load("gpu-1", running=2, age=1.0)
        .stale_after(5.0)
        .inflight({"gpu-0": 2}, **{"gpu-1": 1})
        .build()
    )
    assert [r.id for r in view.replicas] == ["gpu-0", "gpu-1"]
    old = view.load_of(view.by_id["gpu-0"])
    assert old is not None and old.kv_usage == 0.5  # 3 s old, fresh under 5 s
    assert (view.inflight("gpu-0"), view.inflight("gpu-1")) == (2, 1)
    strict = ViewBuilder(now=50.0).replicas(1).load("r0", age=3.0).stale_after(2.0).build()
    assert strict.load_of(strict.replicas[0]) is None
    assert make_request().session_key == "session-1" and make_request().model == "m"
