"""The InferencePool -> replicas translation (gateway.epp.inferencepool.pool_endpoints)."""

from __future__ import annotations

from typing import Any

from gateway.epp.inferencepool import pool_endpoints


def pool(ports: list[int], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {
            "selector": {"matchLabels": labels or {"app": "vllm"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "kvgate-epp", "port": {"number": 9002}},
        },
    }


def pod(
    name: str,
    ip: str | None,
    *,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels or {"app": "vllm"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T10:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_each_target_port_of_each_ready_selected_pod_is_one_replica() -> None:
    replicas = pool_endpoints(pool([8000, 8001]), [pod("b", "10.0.0.2"), pod("a", "10.0.0.1")])
    assert [(r.id, r.url) for r in replicas] == [
        ("a:8000", "http://10.0.0.1:8000"),
        ("a:8001", "http://10.0.0.1:8001"),
        ("b:8000", "http://10.0.0.2:8000"),
        ("b:8001", "http://10.0.0.2:8001"),
    ]


def test_one_port_keeps_the_pod_name_as_the_id_and_ipv6_is_bracketed() -> None:
    replicas = pool_endpoints(pool([8000]), [pod("a", "fd00::5")])
    assert [(r.id, r.url) for r in replicas] == [("a", "http://[fd00::5]:8000")]


def test_unready_unselected_pending_terminating_and_ipless_pods_are_left_out() -> None:
    pods = [
        pod("ok", "10.0.0.1"),
        pod("unready", "10.0.0.2", ready=False),
        pod("other", "10.0.0.3", labels={"app": "sglang"}),
        pod("pending", "10.0.0.4", phase="Pending"),
        pod("going", "10.0.0.5", deleting=True),
        pod("noip", None),
    ]
    assert [r.id for r in pool_endpoints(pool([8000]), pods)] == ["ok"]


def test_a_pool_without_ports_or_selector_has_no_replicas() -> None:
    assert pool_endpoints(pool([]), [pod("a", "10.0.0.1")]) == ()
    empty = pool([8000])
    empty["spec"]["selector"] = {}
    assert pool_endpoints(empty, [pod("a", "10.0.0.1")]) == ()


def test_every_selector_label_must_match() -> None:
    p = pool([8000], {"app": "vllm", "model": "llama"})
    pods = [
        pod("both", "10.0.0.1", labels={"app": "vllm", "model": "llama", "x": "y"}),
        pod("one", "10.0.0.2", labels={"app": "vllm"}),
    ]
    assert [r.id for r in pool_endpoints(p, pods)] == ["both"]
