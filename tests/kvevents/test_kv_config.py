"""The kv_events settings (gateway.kvevents.config): each bad value refused with a message
that names it, and the defaults a config that says nothing gets."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.kvevents.config import EventSource, KVEventsSettings, TokenizerKind, TokenizerSettings


def source(replica: str = "r0", **extra: Any) -> dict[str, Any]:
    return {"replica": replica, "endpoint": "tcp://127.0.0.1:5557", **extra}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            source(endpoint="http://127.0.0.1:5557"),
            "'http://127.0.0.1:5557' is not a tcp:// or ipc://",
        ),
        (source(replay_endpoint="127.0.0.1:5558"), "'127.0.0.1:5558' is not a tcp:// or ipc://"),
        (source(engine="tgi"), "engine"),
        (source(surprise=1), "Extra inputs are not permitted"),
    ],
)
def test_a_bad_event_source_is_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EventSource.model_validate(raw)


def test_tcp_and_ipc_endpoints_are_both_zmq() -> None:
    s = EventSource.model_validate(
        source(endpoint="ipc:///tmp/kv.sock", replay_endpoint="tcp://10.0.0.5:5558")
    )
    assert s.endpoint == "ipc:///tmp/kv.sock" and s.topic == ""


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kind": "hf"}, "needs tokenizer.path"),
        ({"kind": "sim", "workers": 0}, "greater than or equal to 1"),
        ({"kind": "sim", "workers": 17}, "less than or equal to 16"),
        ({"kind": "sim", "timeout_s": 0}, "greater than 0"),
        ({"kind": "sim", "route_budget_ms": 1001}, "less than or equal to 1000"),
        ({"kind": "sim", "executor": "fiber"}, "executor"),
        ({"kind": "sentencepiece"}, "kind"),
    ],
)
def test_a_bad_tokenizer_is_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TokenizerSettings.model_validate(raw)


def test_the_tokenizer_defaults_to_none_with_a_cache() -> None:
    t = TokenizerSettings()
    assert t.kind is TokenizerKind.NONE
    assert t.cache_entries > 0 and t.cache_bytes > 0 and t.workers == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"sources": [source("a"), source("b"), source("a")]}, r"replica\(s\) \['a'\]"),
        ({"medium_weights": {"GPU": 1.0, "CPU": -0.5}}, "must not be negative"),
        ({"max_blocks_per_replica": 0}, "greater than or equal to 1"),
        ({"replay_timeout_s": 0}, "greater than 0"),
        ({"intake": "fork"}, "intake"),
    ],
)
def test_bad_kv_events_settings_are_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KVEventsSettings.model_validate(raw)


def test_one_source_per_replica_and_nested_sections_validate() -> None:
    s = KVEventsSettings.model_validate(
        {"enabled": True, "sources": [source("a"), source("b")], "tokenizer": {"kind": "sim"}}
    )
    assert [x.replica for x in s.sources] == ["a", "b"]
    assert s.tokenizer.kind is TokenizerKind.SIM
    assert s.medium_weights["CPU"] < s.medium_weights.get("GPU", 1.0)
