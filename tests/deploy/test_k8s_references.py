"""deploy/k8s: each overlay stands alone. Every Service, Secret and ConfigMap a manifest
names (in a pod spec, or as a host in a URL or DNS name of the gateway's settings or a
CRD) is an object of that overlay or is listed in deploy/README.md as the operator's; the
Prometheus Operator objects, which kubernetes-validate has no schema for, are checked by
shape."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import DEPLOY, OVERLAYS, by_kind, kustomize

README = DEPLOY / "README.md"
RULES = DEPLOY / "prometheus/kvgate-rules.yml"
Ref = tuple[str, str, str]  # (kind, namespace, name)
URL_HOST = re.compile(r"^[a-z][a-z0-9+.-]*://(?:[^@/]*@)?([A-Za-z0-9.-]+)")
IP = re.compile(r"^\d+(\.\d+){3}$")


def documented() -> dict[str, set[tuple[str, str]]]:
    """deploy/README.md's table: overlay -> {(kind, name)}, name as `namespace/name` when
    the object lives in another namespace."""
    text = README.read_text()
    section = text.split("### What each overlay expects you to provide", 1)[1]
    out: dict[str, set[tuple[str, str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("overlay", "") or set(cells[0]) <= {"-"}:
            continue
        for overlay in cells[0].split(","):
            out.setdefault(overlay.strip(), set()).add((cells[1], cells[2]))
    return out


def service_of_host(host: str, namespace: str) -> tuple[str, str] | None:
    """The (namespace, Service) a cluster DNS name points at; None for outside names."""
    if IP.match(host) or host in ("localhost",):
        return None
    labels = host.rstrip(".").split(".")
    while labels and labels[0].startswith("_"):  # SRV: _port._proto.service
        labels = labels[1:]
    if len(labels) == 1:
        return namespace, labels[0]
    if len(labels) == 2 or labels[2:] in (["svc"], ["svc", "cluster", "local"]):
        return labels[1], labels[0]
    return None


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def pod_refs(pod: dict[str, Any], namespace: str) -> Iterator[Ref]:
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            yield "ConfigMap", namespace, volume["configMap"]["name"]
        if "secret" in volume:
            yield "Secret", namespace, volume["secret"]["secretName"]
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                yield "ConfigMap", namespace, source["configMap"]["name"]
            if "secret" in source:
                yield "Secret", namespace, source["secret"]["name"]
    for secret in pod.get("imagePullSecrets", []):
        yield "Secret", namespace, secret["name"]
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            if "configMapKeyRef" in source:
                yield "ConfigMap", namespace, source["configMapKeyRef"]["name"]
            if "secretKeyRef" in source:
                yield "Secret", namespace, source["secretKeyRef"]["name"]
        for env_from in container.get("envFrom", []):
            if "configMapRef" in env_from:
                yield "ConfigMap", namespace, env_from["configMapRef"]["name"]
            if "secretRef" in env_from:
                yield "Secret", namespace, env_from["secretRef"]["name"]


def settings_hosts(settings: dict[str, Any]) -> Iterator[str]:
    """Hosts the gateway will dial: every URL in its settings and every DNS name it
    resolves for discovery."""
    for value in strings(settings):
        if match := URL_HOST.match(value):
            yield match[1]
    for entry in (settings.get("discovery") or {}).get("dns", []):
        yield entry["name"]


def references(docs: list[dict[str, Any]], namespace: str) -> set[Ref]:
    refs: set[Ref] = set()
    for doc in docs:
        ns = doc["metadata"].get("namespace", namespace)
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec") if doc["kind"] != "Pod" else spec
        if pod:
            refs.update(pod_refs(pod, ns))
        hosts: list[str] = []
        if doc["kind"] == "ConfigMap":
            for name, text in doc.get("data", {}).items():
                if name.endswith((".yaml", ".yml")):
                    hosts.extend(settings_hosts(yaml.safe_load(text) or {}))
        elif doc["kind"] not in ("PrometheusRule",):  # rule text has no hosts, only URLs in docs
            hosts.extend(m[1] for s in strings(spec) if (m := URL_HOST.match(s)))
        for host in hosts:
            if (target := service_of_host(host, ns)) is not None:
                refs.add(("Service", *target))
    return refs


def unresolved(
    docs: list[dict[str, Any]], namespace: str, provided: set[tuple[str, str]]
) -> set[Ref]:
    shipped = {
        (d["kind"], d["metadata"].get("namespace", namespace), d["metadata"]["name"]) for d in docs
    }
    listed = set()
    for kind, name in provided:
        ns, _, bare = name.rpartition("/")
        listed.add((kind, ns or namespace, bare))
    return references(docs, namespace) - shipped - listed


def namespace_of(docs: list[dict[str, Any]]) -> str:
    return next(d["metadata"]["namespace"] for d in docs if d["kind"] == "Deployment")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_secret_and_configmap_is_shipped_or_documented(overlay: str) -> None:
    docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
    namespace = namespace_of(docs)
    refs = references(docs, namespace)
    # The scan sees what it must: the settings' ConfigMap, the store, the engines.
    assert ("Service", namespace, "kvgate-redis") in refs
    assert ("Service", namespace, "vllm") in refs
    assert any(kind == "ConfigMap" for kind, _, _ in refs)
    missing = unresolved(docs, namespace, documented().get(overlay, set()))
    assert not missing, f"{overlay}: not shipped and not in deploy/README.md's table: {missing}"


def test_the_check_finds_what_the_bare_base_does_not_ship() -> None:
    docs = kustomize(DEPLOY / "k8s/base")
    for doc in docs:
        doc["metadata"].setdefault("namespace", "default")
    missing = unresolved(docs, "default", set())
    assert {("Service", "default", "kvgate-redis"), ("Service", "default", "vllm")} <= missing


def test_the_readme_lists_only_what_an_overlay_does_not_ship() -> None:
    listed = documented()
    assert set(listed) <= set(OVERLAYS) and listed, listed
    for overlay, provided in listed.items():
        docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
        namespace = namespace_of(docs)
        refs = references(docs, namespace)
        for kind, name in provided:
            ns, _, bare = name.rpartition("/")
            assert (kind, ns or namespace, bare) in refs, f"{overlay}: {kind} {name} is never named"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_store_ships_with_persistence_off(overlay: str) -> None:
    docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
    redis = by_kind(docs, "Deployment", "kvgate-redis")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert not redis.get("volumes")
    service = by_kind(docs, "Service", "kvgate-redis")["spec"]
    assert (
        service["selector"].items()
        <= by_kind(docs, "Deployment", "kvgate-redis")["spec"]["template"]["metadata"][
            "labels"
        ].items()
    )


@pytest.mark.parametrize("overlay", ["keda", "hpa"])
def test_the_prometheus_operator_scrapes_the_gateways_and_loads_the_rules(overlay: str) -> None:
    docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
    monitor = by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = by_kind(docs, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
    # The job label a ServiceMonitor gives is the Service's name: the one the rules watch.
    assert 'up{job="' + service["metadata"]["name"] + '"}' in RULES.read_text()

    rule = by_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert {"alert", "expr", "labels", "annotations"} <= set(r)
            assert r["labels"]["severity"] in ("warning", "critical")
