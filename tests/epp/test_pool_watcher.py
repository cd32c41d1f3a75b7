"""`PoolWatcher` (gateway.epp.inferencepool) against a Kubernetes API on loopback: a small
Starlette app serving the InferencePool, the pod list and a pod watch, reached by the real
`kubernetes_asyncio` client through a kubeconfig. The cluster's members follow the pool's
pods through the listing, the watch's events, a watch that ends (a re-list) and an API
that fails (a retry)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.cluster import Cluster
from gateway.epp import inferencepool
from gateway.epp.config import InferencePoolRef
from gateway.epp.inferencepool import PoolWatcher
from gateway.serving import start_server

NAMESPACE = "ml"


def pod(name: str, ip: str, *, ready: bool = True, app: str = "vllm") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": app}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApi:
    """The three calls the watcher makes; the test feeds watch events through a queue."""

    def __init__(self) -> None:
        self.pool: dict[str, Any] | None = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": [{"number": 8000}],
            },
        }
        self.pods = [pod("a", "10.0.0.1")]
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.lists = 0
        self.misses = 0  # pool reads answered 404
        self.selectors: list[str] = []
        self.app = Starlette(
            routes=[
                Route(
                    "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                    self._pool,
                ),
                Route("/api/v1/namespaces/{ns}/pods", self._pods),
            ]
        )

    async def _pool(self, request: Request) -> Response:
        if self.pool is None or request.path_params["ns"] != NAMESPACE:
            self.misses += 1
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
            return Response(orjson.dumps(status), 404, media_type="application/json")
        return Response(orjson.dumps(self.pool), media_type="application/json")

    async def _pods(self, request: Request) -> Response:
        self.selectors.append(request.query_params.get("labelSelector", ""))
        if request.query_params.get("watch") in ("true", "True", "1"):
            return StreamingResponse(self._watch(), media_type="application/json")
        self.lists += 1
        listing = {
            "apiVersion": "v1",
            "kind": "PodList",
            "metadata": {"resourceVersion": str(self.lists)},
            "items": self.pods,
        }
        return Response(orjson.dumps(listing), media_type="application/json")

    async def _watch(self) -> AsyncIterator[bytes]:
        while True:
            event = await self.events.get()
            if event is None:
                return  # the API server ends the watch: the watcher lists again
            yield orjson.dumps(event) + b"\n"


async def members(cluster: Cluster, want: dict[str, str]) -> None:
    for _ in range(300):
        if {r: s.url for r, s in cluster.members.items()} == want:
            return
        await asyncio.sleep(0.01)
    got = {r: s.url for r, s in cluster.members.items()}
    raise AssertionError(f"members {got} never became {want}")


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(inferencepool, "RETRY_S", 0.05)
    return path


async def test_members_follow_the_listing_the_watch_and_a_relist(kubeconfig: Path) -> None:
    api = FakeApi()
    server = await start_server(api.app, "127.0.0.1", 0)
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    cluster = Cluster()
    watcher = PoolWatcher(cluster, InferencePoolRef(name="llama", namespace=NAMESPACE))
    try:
        await watcher.start()
        await members(cluster, {"a": "http://10.0.0.1:8000"})
        assert api.selectors[0] == "app=vllm"
        await api.events.put({"type": "ADDED", "object": pod("b", "10.0.0.2")})
        await members(cluster, {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.2:8000"})
        await api.events.put({"type": "MODIFIED", "object": pod("a", "10.0.0.1", ready=False)})
        await members(cluster, {"b": "http://10.0.0.2:8000"})
        await api.events.put({"type": "DELETED", "object": pod("b", "10.0.0.2")})
        await members(cluster, {})
        # The watch ends: the watcher reads the pool again and lists, seeing a new port.
        assert api.pool is not None
        api.pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
        api.pods = [pod("c", "fd00::3")]
        lists = api.lists
        await api.events.put(None)
        await members(
            cluster, {"c:8000": "http://[fd00::3]:8000", "c:8001": "http://[fd00::3]:8001"}
        )
        assert api.lists > lists
        # The API fails (the pool is gone): the members stay, the watcher retries.
        api.pool = None
        await api.events.put(None)
        for _ in range(200):
            if api.misses >= 3:
                break
            await asyncio.sleep(0.01)
        assert api.misses >= 3  # one failure, then a retry every RETRY_S
        assert set(cluster.members) == {"c:8000", "c:8001"}
        assert watcher._task is not None and not watcher._task.done()
    finally:
        await watcher.stop()
        await server.stop()
    assert watcher._task is not None and watcher._task.cancelled()


async def test_the_namespace_defaults_to_the_service_accounts_or_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = InferencePoolRef(name="llama")
    monkeypatch.setattr(inferencepool, "_NAMESPACE_FILE", tmp_path / "missing")
    assert PoolWatcher(Cluster(), ref).namespace == "default"
    mounted = tmp_path / "namespace"
    mounted.write_text("inference\n")
    monkeypatch.setattr(inferencepool, "_NAMESPACE_FILE", mounted)
    assert PoolWatcher(Cluster(), ref).namespace == "inference"
    assert PoolWatcher(Cluster(), InferencePoolRef(name="p", namespace="x")).namespace == "x"


def test_kvgate_epp_refuses_a_bad_config_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from gateway.epp import cli

    monkeypatch.delenv("KVGATE_CONFIG_FILE", raising=False)
    parser = argparse.ArgumentParser(prog="kvgate")
    cli.register(parser.add_subparsers(dest="command", required=True))
    config = tmp_path / "kvgate.yaml"
    config.write_text("epp:\n  chunk_bytes: 100\n  max_endpoints: 0\n")
    args = parser.parse_args(["epp", "-c", str(config), "--grpc-port", "9100"])
    assert args.grpc_port == 9100 and args.config == str(config)
    assert args.handler(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate: invalid configuration")
    assert "epp.chunk_bytes" in err and "epp.max_endpoints" in err
