"""Replicas from an InferencePool (inference.networking.k8s.io/v1) through the Kubernetes API.

`pool_endpoints(pool, pods)` is the translation (pure): every ready pod the pool's
`spec.selector.matchLabels` selects is one replica per `spec.targetPorts` entry, at
`http://podIP:port` (a data-parallel engine exposes its ranks as ports). `PoolWatcher`
keeps the cluster's members to it with `kubernetes_asyncio`: it reads the pool, lists the
pods it selects, then follows a watch of those pods; every `resync_s` (or when the watch
ends) it starts over, which is also when a changed selector or port list is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gateway.cluster import Cluster
from gateway.epp.config import InferencePoolRef
from gateway.types import ReplicaId, ReplicaState

log = logging.getLogger("kvgate.epp")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RETRY_S = 2.0


def _ready(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def selector_of(pool: Mapping[str, Any]) -> dict[str, str]:
    labels = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def pool_endpoints(
    pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]
) -> tuple[ReplicaState, ...]:
    """The replicas `pool` stands for among `pods` (dicts as the API serves them)."""
    spec = pool.get("spec") or {}
    ports = [int(p["number"]) for p in spec.get("targetPorts") or () if "number" in p]
    selector = selector_of(pool)
    if not ports or not selector:
        return ()
    out: list[ReplicaState] = []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()) or not _ready(pod):
            continue
        name = pod["metadata"]["name"]
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            replica = ReplicaId(name if len(ports) == 1 else f"{name}:{port}")
            out.append(ReplicaState(id=replica, url=f"http://{host}:{port}"))
    return tuple(out)


def default_namespace() -> str:
    with contextlib.suppress(OSError):
        return _NAMESPACE_FILE.read_text().strip() or "default"
    return "default"


class PoolWatcher:
    """An app `Service`: the InferencePool's pods are the cluster's members."""

    def __init__(self, cluster: Cluster, ref: InferencePoolRef) -> None:
        self.cluster = cluster
        self.ref = ref
        self.namespace = ref.namespace or default_namespace()
        self._task: asyncio.Task[None] | None = None
        self._api: Any = None

    async def start(self) -> None:
        from kubernetes_asyncio import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config()
        self._api = client.ApiClient()
        self._task = asyncio.create_task(self._run(), name="kvgate-inferencepool")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._api is not None:
            await self._api.close()

    def _apply(self, pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> None:
        replicas = pool_endpoints(pool, pods)
        if replicas != tuple(self.cluster.members.values()):
            self.cluster.set_members(replicas)
            log.info("InferencePool %s: %d endpoint(s)", self.ref.name, len(replicas))

    async def _run(self) -> None:
        while True:
            try:
                await self._sync_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("InferencePool %s/%s: watch failed", self.namespace, self.ref.name)
                await asyncio.sleep(RETRY_S)

    async def _sync_and_watch(self) -> None:
        from kubernetes_asyncio import client, watch

        custom = client.CustomObjectsApi(self._api)
        core = client.CoreV1Api(self._api)
        pool = await custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.ref.name
        )
        selector = ",".join(f"{k}={v}" for k, v in sorted(selector_of(pool).items()))
        listed = await core.list_namespaced_pod(self.namespace, label_selector=selector)
        serialize = self._api.sanitize_for_serialization
        pods = {p.metadata.name: serialize(p) for p in listed.items}
        self._apply(pool, pods.values())
        stream = watch.Watch()
        async with stream:
            async for event in stream.stream(
                core.list_namespaced_pod,
                self.namespace,
                label_selector=selector,
                resource_version=listed.metadata.resource_version,
                timeout_seconds=int(self.ref.resync_s),
            ):
                pod = serialize(event["object"])
                name = pod["metadata"]["name"]
                if event["type"] == "DELETED":
                    pods.pop(name, None)
                else:
                    pods[name] = pod
                self._apply(pool, pods.values())
