"""Settings sections that name each other: a name one section uses must exist in the
other, and the error says which entry and which section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.auth.principal import hash_key
from gateway.errors import ConfigError
from gateway.settings import load_settings, read_yaml

POOL: dict[str, Any] = {
    "name": "fast",
    "hardware": "H200",
    "origin": "imported",
    "price_per_card_hour": 4.0,
    "cards_per_replica": 1,
    "slots_per_replica": 4,
}
MODELS: list[dict[str, Any]] = [{"name": "m", "pools": ["fast"]}]


def _pools() -> dict[str, Any]:
    return {"pools": [POOL], "models": MODELS}


def test_a_replica_in_an_unknown_pool_is_refused() -> None:
    replicas = [
        {"id": "a", "url": "http://127.0.0.1:1", "pool": "fast"},
        {"id": "b", "url": "http://127.0.0.1:2", "pool": "slow"},
    ]
    with pytest.raises(ConfigError, match=r"replicas\[1\]\.pool 'slow'"):
        load_settings(replicas=replicas, pools=_pools())
    ok = load_settings(replicas=replicas[:1], pools=_pools())
    assert ok.replicas[0].pool == "fast"


def test_a_dns_target_in_an_unknown_pool_is_refused() -> None:
    dns = [{"name": "engines.local", "pool": "gone"}]
    with pytest.raises(ConfigError, match=r"discovery\.dns\[0\]\.pool 'gone'"):
        load_settings(discovery={"dns": dns}, pools=_pools())


def test_a_key_ceiling_must_name_an_admission_class() -> None:
    key = {"name": "alice", "key_sha256": hash_key("sk-a"), "max_priority": "platinum"}
    with pytest.raises(ConfigError, match="max_priority 'platinum' is not a class"):
        load_settings(auth={"keys": [key]})
    key["max_priority"] = "default"
    assert load_settings(auth={"keys": [key]}).auth.keys[0].max_priority == "default"


def test_redis_keys_need_the_redis_store() -> None:
    with pytest.raises(ConfigError, match=r"needs store\.backend: redis"):
        load_settings(auth={"redis_keys": True})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfeplain", "not UTF-8 text (byte 0xff at offset 0)"),
        (b"replicas: [unclosed", "not valid YAML"),
        (b"- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_read_yaml_says_what_is_wrong_with_the_file(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        read_yaml(path)
    assert message in caught.value.message


def test_read_yaml_of_an_empty_file_and_a_missing_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert read_yaml(empty) == {}
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_yaml(tmp_path / "absent.yaml")
