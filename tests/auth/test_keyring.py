"""Where keys come from and what a key grants: the ring's lookup by digest, a key's grants
narrowed by its tenant's, keys files (and their one-line errors), the Redis records, and a
keys file served by a real gateway."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from pydantic import ValidationError

from gateway.auth.config import Grants, KeySettings, Limits
from gateway.auth.principal import KeyRing, hash_key, principal_of
from gateway.auth.sources import decode_record, read_keys_file, static_keys
from gateway.errors import ConfigError
from gateway.settings import load_settings
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, replica_config, sim_engines

CLASSES = ["interactive", "default", "batch"]  # best first


def key(name: str, secret: str, **fields: object) -> KeySettings:
    return KeySettings.model_validate({"name": name, "key_sha256": hash_key(secret), **fields})


def test_a_key_is_found_by_its_secret_and_only_by_it() -> None:
    ring = KeyRing([key("a", "sk-a"), key("b", "sk-b")], {}, CLASSES)
    found = ring.lookup("sk-a")
    assert found is not None and found.name == "a"
    assert ring.lookup(b"sk-b") == ring.lookup("sk-b")
    assert ring.lookup("sk-A") is None and ring.lookup("") is None
    assert ring.lookup(hash_key("sk-a")) is None  # the digest itself is no key
    assert len(ring) == 2


def test_a_key_given_in_clear_is_hashed_and_a_disabled_key_is_known_but_refused() -> None:
    clear = KeySettings.model_validate({"name": "c", "key": "sk-clear"})
    ring = KeyRing([clear, key("off", "sk-off", disabled=True)], {}, CLASSES)
    found = ring.lookup("sk-clear")
    assert found is not None and found.name == "c"
    assert ring.lookup("sk-off") is None
    assert len(ring) == 2


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "x"},  # no secret
        {"name": "x", "key": "sk", "key_sha256": hash_key("sk")},  # two
        {"name": "x", "key_sha256": "not-hex"},
        {"name": "x", "key_sha256": hash_key("sk")[:-1]},
        {"name": "", "key": "sk"},
        {"name": "x", "key": "sk", "role": "admin"},  # unknown field
    ],
)
def test_a_malformed_key_is_refused_at_load(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        KeySettings.model_validate(fields)


def test_an_upper_case_digest_is_the_same_key() -> None:
    ring = KeyRing([KeySettings(name="u", key_sha256=hash_key("sk-u").upper())], {}, CLASSES)
    assert ring.lookup("sk-u") is not None


def test_a_keys_grants_are_narrowed_by_its_tenants() -> None:
    tenants = {
        "acme": Grants(
            max_priority="default",
            models=("m1", "m2"),
            pools=("cheap",),
            limits=Limits(requests_per_minute=100),
        )
    }
    own = principal_of(
        key("k1", "s1", tenant="acme", max_priority="interactive", models=["m1"]),
        tenants,
        CLASSES,
    )
    # The stricter ceiling of the two; the key's own model list; the tenant's pools.
    assert own.max_priority == "default"
    assert own.models == {"m1"} and own.pools == {"cheap"}
    assert own.tenant_limits.requests_per_minute == 100 and not own.key_limits.any
    assert own.limited
    stricter = principal_of(key("k2", "s2", tenant="acme", max_priority="batch"), tenants, CLASSES)
    assert stricter.max_priority == "batch" and stricter.models == {"m1", "m2"}
    # No tenant named: the key is its own tenant, with nothing granted beyond the key's.
    alone = principal_of(key("solo", "s3"), tenants, CLASSES)
    assert alone.tenant == "solo" and alone.max_priority is None and not alone.limited


def test_shared_keys_are_replaced_as_a_whole_and_a_static_key_wins() -> None:
    ring = KeyRing([key("static", "sk-1")], {}, CLASSES)
    ring.replace_shared([key("shadow", "sk-1"), key("shared", "sk-2")])
    first = ring.lookup("sk-1")
    assert first is not None and first.name == "static"
    assert ring.lookup("sk-2") is not None
    ring.replace_shared([key("later", "sk-3")])  # sk-2 was revoked in Redis
    assert ring.lookup("sk-2") is None and ring.lookup("sk-3") is not None
    assert ring.lookup("sk-1") is not None


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_keys_file_is_a_list_or_a_mapping_with_keys(tmp_path: Path, wrapped: bool) -> None:
    entries = [
        {"name": "f1", "key_sha256": hash_key("sk-f1"), "tenant": "t"},
        {"name": "f2", "key_sha256": hash_key("sk-f2"), "admin": True},
    ]
    path = tmp_path / "keys.yaml"
    path.write_bytes(orjson.dumps({"keys": entries} if wrapped else entries))  # JSON is YAML
    keys = read_keys_file(path)
    assert [k.name for k in keys] == ["f1", "f2"]
    assert keys[0].tenant == "t" and keys[1].admin


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (None, "No such file"),
        ("keys: [unclosed", "keys.yaml"),
        ("just a string", "expected a list of keys"),
        ("keys: {name: x}", "expected a list of keys"),
        ("- {name: x}", "key_sha256 or key"),
    ],
)
def test_a_broken_keys_file_is_one_config_error_naming_it(
    tmp_path: Path, text: str | None, words: str
) -> None:
    path = tmp_path / "keys.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_keys_file(path)
    assert str(path) in caught.value.message and words in caught.value.message


def test_static_keys_are_the_configs_then_the_files(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_bytes(orjson.dumps([{"name": "filed", "key_sha256": hash_key("sk-f")}]))
    settings = load_settings(
        auth={"keys": [{"name": "inline", "key_sha256": hash_key("sk-i")}], "keys_file": path}
    )
    assert [k.name for k in static_keys(settings.auth)] == ["inline", "filed"]


def test_a_redis_record_never_keeps_a_key_in_clear_and_a_broken_one_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    digest = hash_key("sk-r")
    record = decode_record(digest, orjson.dumps({"name": "r", "key": "sk-r", "admin": True}))
    assert record is not None and record.key is None and record.key_sha256 == digest
    assert record.admin
    with caplog.at_level(logging.WARNING, logger="kvgate.auth"):
        assert decode_record(digest, b"{not json") is None
        assert decode_record(digest, b"[1, 2]") is None
        assert decode_record(digest, orjson.dumps({"name": ""})) is None
    assert len(caplog.records) == 3
    assert all(digest[:8] in r.getMessage() for r in caplog.records)
    assert not any(digest in r.getMessage() for r in caplog.records)  # not the whole digest


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(1, "instant") as engines:
        yield engines


async def test_a_gateway_serves_the_keys_of_its_keys_file(
    engines: list[SimEngine], tmp_path: Path
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        f"keys:\n  - name: filed\n    key_sha256: {hash_key('sk-filed')}\n"
        f"  - name: revoked\n    key_sha256: {hash_key('sk-revoked')}\n    disabled: true\n"
    )
    body = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        gateway(
            engines,
            auth={"keys_file": str(path)},
            replicas=replica_config(engines, models=["kvgate-sim"]),
            models={"discover": False},
        ) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        served = await http.post(
            "/v1/chat/completions", json=body, headers={"x-api-key": "sk-filed"}
        )
        revoked = await http.post(
            "/v1/chat/completions", json=body, headers={"x-api-key": "sk-revoked"}
        )
        missing = await http.post("/v1/chat/completions", json=body)
    assert served.status_code == 200
    assert revoked.status_code == missing.status_code == 401
