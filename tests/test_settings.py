from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from gateway.errors import ConfigError
from gateway.settings import KvgateSettings, check_config, load_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "gateway.example.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVGATE_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = load_settings()
    assert s.server.port == 8000 and s.replicas == ()
    assert s.session.header == "X-Session-Id"
    assert s.routing.policy == "lineage"
    assert s.sim.replicas == 4


def test_yaml_then_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "g.yaml"
    cfg.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nreplicas:\n  - url: http://a:1/\n")
    s = load_settings(cfg)
    assert s.server.port == 9000 and s.server.host == "0.0.0.0"
    assert (
        s.replicas[0].url == "http://a:1"
        and s.replicas[0].id.startswith("r-")
        and "a:1" not in s.replicas[0].id
    )
    monkeypatch.setenv("KVGATE_SERVER__PORT", "9100")
    monkeypatch.setenv("KVGATE_ROUTING__POLICY", "round_robin")
    s = load_settings(cfg)
    assert s.server.port == 9100 and s.server.host == "0.0.0.0"  # nested merge keeps host
    assert s.routing.policy == "round_robin"
    monkeypatch.setenv("KVGATE_REPLICAS", '[{"url": "http://b:2", "weight": 2}]')
    assert load_settings(cfg).replicas[0].weight == 2.0


def test_errors_name_their_dotted_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "server:\n  port: 99999\n  bogus: 1\nreplicas:\n  - url: ftp://x\n  - url: http://a:1\n"
        "    weight: 0\nhealth:\n  interval_s: -1\nrouting:\n  policy: nope\n"
    )
    problems = check_config(cfg)
    keys = [p.split(":", 1)[0] for p in problems]
    assert keys == [
        "server.port",
        "server.bogus",
        "replicas.0.url",
        "replicas.1.weight",
        "health.interval_s",
        "routing.policy",
    ]
    assert "unknown setting" in problems[1] and "known policies" in problems[-1]
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    assert "server.port" in info.value.message


def test_duplicate_ids_unreadable_and_non_mapping(tmp_path: Path) -> None:
    dup = tmp_path / "dup.yaml"
    dup.write_text("replicas:\n  - {url: 'http://a:1', id: x}\n  - {url: 'http://b:1', id: x}\n")
    assert any("used twice" in p for p in check_config(dup))
    assert "cannot read" in check_config(tmp_path / "missing.yaml")[0]
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    assert "mapping" in check_config(lst)[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("server: [\n")
    assert "not valid YAML" in check_config(broken)[0]


def test_policy_config_errors_are_reported(tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text("routing:\n  policies:\n    consistent_hash:\n      vnodes: 0\n")
    problems = check_config(cfg)
    assert len(problems) == 1 and problems[0].startswith("routing.policies.consistent_hash")


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        inner = getattr(ann, "__args__", (ann,))
        sub = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None and name != "policies":
            keys |= _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def _yaml_keys(data: Any, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, dict) and k != "policies":
                keys |= _yaml_keys(v, f"{prefix}{k}.")
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                keys |= _yaml_keys(v[0], f"{prefix}{k}.")
            else:
                keys.add(f"{prefix}{k}")
    return keys


def test_example_yaml_is_valid_and_documents_every_core_setting() -> None:
    assert check_config(EXAMPLE) == []
    documented = _yaml_keys(yaml.safe_load(EXAMPLE.read_text()))
    core = {
        "server",
        "replicas",
        "sim",
        "routing",
        "session",
        "health",
        "retries",
        "timeouts",
        "limits",
        "models",
        "upstream",
    }
    expected = {k for k in _leaf_keys(KvgateSettings) if k.split(".")[0] in core}
    missing = expected - documented
    assert not missing, f"settings missing from gateway.example.yaml: {sorted(missing)}"


def test_priority_order_follows_the_engine_kind_unless_set() -> None:
    settings = load_settings(
        replicas=[
            {"url": "http://a:1"},
            {"url": "http://b:1", "engine": "sglang"},
            {"url": "http://c:1", "engine": "sglang", "priority_order": "lower_first"},
            {"url": "http://d:1", "engine": "vllm", "priority_order": "higher_first"},
        ]
    )
    assert [r.runs_higher_first() for r in settings.replicas] == [False, True, False, True]
    with pytest.raises(ConfigError, match="priority_order"):
        load_settings(replicas=[{"url": "http://a:1", "priority_order": "first"}])


def test_an_environment_value_that_is_not_json_names_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_REPLICAS", "[{url: http://a:1")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.message.startswith("environment: KVGATE_REPLICAS: not valid JSON")


def test_an_environment_value_out_of_range_names_its_dotted_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("server:\n  port: 9000\n")
    monkeypatch.setenv("KVGATE_RETRIES__MAX_ATTEMPTS", "99")
    problems = check_config(cfg)
    assert len(problems) == 1
    assert problems[0].startswith("retries.max_attempts: ") and "(got '99')" in problems[0]


def test_a_long_bad_value_is_shown_cut_short(tmp_path: Path) -> None:
    cfg = tmp_path / "long.yaml"
    cfg.write_text(f"server:\n  log_level: {'x' * 500}\n")
    (problem,) = check_config(cfg)
    assert problem.startswith("server.log_level: ")
    shown = problem.partition("(got ")[2]
    assert shown.startswith("'xxx") and len(shown) <= 81  # the value, then ')'


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://a:1/v1?x=1", "query"),
        ("http://a:1/#top", "query"),
        ("http://a:1?", "query"),
        ("a:1", "http(s) URL"),
        ("http://:1", "http(s) URL"),
    ],
)
def test_a_replica_url_requests_cannot_be_appended_to_is_refused(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(replicas=[{"url": url}])
    (line,) = info.value.message.splitlines()[1:]
    assert line.strip().startswith("replicas.0.url: ") and why in line


def test_a_replica_id_is_opaque_stable_and_ignores_a_trailing_slash() -> None:
    first = load_settings(replicas=[{"url": "http://10.0.0.5:8000/"}]).replicas[0]
    again = load_settings(replicas=[{"url": "http://10.0.0.5:8000"}]).replicas[0]
    other = load_settings(replicas=[{"url": "http://10.0.0.6:8000"}]).replicas[0]
    assert first.url == "http://10.0.0.5:8000"
    assert first.id == again.id != other.id
    assert first.id.startswith("r-") and "10.0.0.5" not in first.id
    named = load_settings(replicas=[{"url": "http://10.0.0.5:8000", "id": "gpu-a"}])
    assert named.replicas[0].id == "gpu-a"


def test_two_urls_given_the_same_id_are_refused_naming_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(replicas=[{"url": "http://a:1", "id": "x"}, {"url": "http://b:1", "id": "x"}])
    assert "replica id 'x' is used twice" in info.value.message


@pytest.mark.parametrize(
    ("key", "passed", "keys_on", "expected"),
    [
        (None, None, False, True),  # nothing set: the client may hold the engines' key
        (None, None, True, False),  # the gateway's keys are not the engines'
        ("sk-engine", None, False, False),
        ("sk-engine", True, True, True),
        (None, False, False, False),
    ],
)
def test_the_client_authorization_goes_to_engines_only_when_it_may(
    key: str | None, passed: bool | None, keys_on: bool, expected: bool
) -> None:
    upstream = load_settings(
        upstream={"engine_api_key": key, "pass_client_authorization": passed}
    ).upstream
    assert upstream.passes_client_authorization(keys_on) is expected
    assert upstream.auth_headers() == (
        ((b"authorization", b"Bearer " + key.encode()),) if key else ()
    )


def test_the_engine_key_is_never_shown_in_an_error_or_a_dump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_UPSTREAM__ENGINE_API_KEY", "sk-very-secret")
    settings = load_settings()
    assert "sk-very-secret" not in repr(settings)
    assert "sk-very-secret" not in settings.model_dump_json()
    with pytest.raises(ConfigError) as info:
        load_settings(upstream={"max_connections": 0})
    assert "sk-very-secret" not in info.value.message
