"""deploy/: Kubernetes manifests against the Kubernetes schemas, the compose file through
docker-compose, the Dockerfile's inputs, and every shipped gateway config through kvgate's
own validation."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import check_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"
OVERLAYS = ["keda", "hpa", "demo"]


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found on PATH (needed for `kubectl kustomize`)")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str, name: str = "kvgate") -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            continue  # CRDs: checked field by field below and in test_k8s_references.py
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_deployment_is_probed_bounded_and_covered(overlay: str) -> None:
    docs = kustomize(DEPLOY / "k8s/overlays" / overlay)
    deployment = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = by_kind(docs, kind)["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector and selector.items() <= labels.items(), kind
    # The mounted settings are a valid kvgate config, and the drain outlasts the probe.
    config = by_kind(
        docs, "ConfigMap", next(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap")
    )
    settings = yaml.safe_load(config["data"]["gateway.yaml"])
    probe = container["readinessProbe"]
    assert settings["server"]["drain_delay_s"] >= probe["periodSeconds"] * probe["failureThreshold"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings["server"]["drain_delay_s"] + settings["server"]["drain_timeout_s"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    assert env["KVGATE_CONFIG_FILE"] == f"{mount}/gateway.yaml"


def test_keda_scales_the_gateway_on_its_queue_and_in_flight_signals() -> None:
    docs = kustomize(DEPLOY / "k8s/overlays/keda")
    scaled = by_kind(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert (
        scaled["spec"]["scaleTargetRef"]["name"] == by_kind(docs, "Deployment")["metadata"]["name"]
    )
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert all(t["type"] == "prometheus" for t in scaled["spec"]["triggers"])
    assert any("kvgate_admission_queue_depth" in q for q in queries)
    assert any("kvgate_in_flight" in q for q in queries)
    assert all(float(t["metadata"]["threshold"]) > 0 for t in scaled["spec"]["triggers"])


def test_the_hpa_reads_what_the_adapter_rules_serve() -> None:
    docs = kustomize(DEPLOY / "k8s/overlays/hpa")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    wanted = {m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    rules = yaml.safe_load((DEPLOY / "k8s/overlays/hpa/adapter-rules.yaml").read_text())["rules"]
    served = set()
    for rule in rules["custom"] + rules["external"]:
        name = rule["name"]
        served.add(name.get("as") or name["matches"].strip("^$"))
    assert wanted == served


def compose_file() -> Path:
    return DEPLOY / "compose/docker-compose.yml"


def test_docker_compose_accepts_the_demo_stack() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not found on PATH (CI installs it; apt install docker-compose)")
    out = subprocess.run(
        [binary, "-f", str(compose_file()), "config"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"redis", "engine", "gateway-a", "gateway-b", "prometheus", "grafana"} <= set(services)
    assert services["engine"]["deploy"]["replicas"] == 4
    assert services["engine"]["command"][0] == "sim"  # the gateway's own image


def test_every_file_the_compose_stack_mounts_exists() -> None:
    services = yaml.safe_load(compose_file().read_text())["services"]
    mounts = [v.split(":")[0] for s in services.values() for v in s.get("volumes", [])]
    assert mounts
    for source in mounts:
        assert (compose_file().parent / source).exists(), source


@pytest.mark.parametrize(
    "config",
    ["deploy/docker/gateway.yaml", "deploy/compose/gateway.yaml", "deploy/k8s/base/gateway.yaml"],
)
def test_shipped_gateway_configs_are_valid(config: str) -> None:
    assert check_config(ROOT / config) == []


def dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker/Dockerfile").read_text().replace("\\\n", " ")
    return [(m[0].upper(), m[1].strip()) for m in re.findall(r"^(\w+)\s+(.*)$", text, re.MULTILINE)]


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the build context (last match wins)."""
    verdict = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            verdict = not negate
    return verdict


def test_every_path_the_dockerfile_copies_exists_in_the_build_context() -> None:
    copies = [args.split() for op, args in dockerfile() if op == "COPY" and "--from" not in args]
    assert copies
    for parts in copies:
        for source in parts[:-1]:
            assert (ROOT / source).exists(), source
            assert not ignored(source), f"{source} is excluded by .dockerignore"


def test_the_image_runs_unprivileged_with_a_healthcheck_and_a_config_path() -> None:
    instructions = dockerfile()
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = next(args for op, args in instructions if op == "HEALTHCHECK")
    assert "kvgate-healthcheck" in health
    env = " ".join(args for op, args in instructions if op == "ENV")
    assert (
        "KVGATE_CONFIG_FILE=/etc/kvgate/gateway.yaml" in env
        and "KVGATE_SERVER__HOST=0.0.0.0" in env
    )
    assert json.loads(next(args for op, args in instructions if op == "ENTRYPOINT")) == ["kvgate"]


def test_the_healthcheck_script_reports_a_live_and_a_dead_server() -> None:
    script = DEPLOY / "docker/healthcheck.py"
    dead = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={"KVGATE_HEALTHCHECK_URL": "http://127.0.0.1:9/health"},
        check=False,
    )
    assert dead.returncode == 1 and "127.0.0.1:9" in dead.stderr


def test_the_dashboard_json_is_generated_from_its_source() -> None:
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import dashboard
    finally:
        sys.path.pop(0)
    assert (DEPLOY / "grafana/kvgate.json").read_text() == dashboard.render()
