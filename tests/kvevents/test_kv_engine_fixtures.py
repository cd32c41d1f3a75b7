"""What the recorded fixtures say the engines put on the wire (the facts the intake is
built on): if a re-recording changes one of these, the intake must change with it."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from tests.kvevents.engine_fixtures import ENGINES, SGLANG, VLLM, all_scenarios, load, scenario

END = (-1).to_bytes(8, "big", signed=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_fixtures_name_their_engine_version(engine: str) -> None:
    rec = load(engine, "events.json")["recorded"]
    assert f"{rec['engine']}-{rec['version']}" == engine
    assert rec["wheel"].startswith(f"{rec['engine']}-{rec['version']}-")
    assert len(rec["sha256"]) == 64


@pytest.mark.parametrize("sc", all_scenarios(), ids=lambda s: f"{s.engine}:{s.name}")
def test_live_is_three_frames_and_replay_four_with_the_topic(sc) -> None:  # type: ignore[no-untyped-def]
    for i, frames in enumerate(sc.live):
        assert len(frames) == 3
        assert frames[0] == sc.topic.encode()
        assert int.from_bytes(frames[1], "big") == i
    *batches, end = sc.replay_from_0
    assert end == [b"", b"", END, b""]
    assert [f[2:] for f in batches] == [f[1:] for f in sc.live]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == sc.topic.encode() for f in batches)
    assert sc.replay_from_last[:-1] == batches[-1:]


@pytest.mark.parametrize("engine", ENGINES)
def test_batches_are_positional_with_map_events_and_the_rank_last(engine: str) -> None:
    for name, rank in (
        (("plain", 0), ("plain_dp_rank1", 1))
        if engine == VLLM
        else (
            ("page16", 0),
            ("page16_dp_rank1", 1),
        )
    ):
        sc = scenario(engine, name)
        ts, events, dp_rank = msgspec.msgpack.decode(sc.live[0][2])
        assert isinstance(ts, float) and dp_rank == rank
        assert all(isinstance(e, dict) and "type" in e for e in events)
        # Rank r publishes on the base port + r.
        port = int(sc.raw["endpoint"].rsplit(":", 1)[1])
        assert sc.raw["endpoint_for_rank"].endswith(f":{port + rank}")


def test_sglang_eagle_publishes_token_pairs_one_per_page() -> None:
    sc = scenario(SGLANG, "eagle_bigram_page1")
    (event,) = msgspec.msgpack.decode(sc.live[0][2])[1]
    pairs = event["token_ids"]
    assert event["block_size"] == 1 and len(pairs) == len(event["block_hashes"])
    assert all(len(p) == 2 and p[1] == q[0] for p, q in itertools.pairwise(pairs))


def test_namespaces_and_tiers_as_each_engine_spells_them() -> None:
    salted = msgspec.msgpack.decode(scenario(SGLANG, "salted").live[0][2])[1][0]
    assert salted["cache_salt"] == "tenant-a"
    lora = msgspec.msgpack.decode(scenario(SGLANG, "lora").live[0][2])[1][0]
    assert lora["lora_name"] == "sql-adapter" and lora["lora_id"] is None
    media = {
        e.get("medium")
        for f in scenario(SGLANG, "page16").live
        for e in msgspec.msgpack.decode(f[2])[1]
    }
    assert {"GPU", "CPU_PINNED", "EXTERNAL"} <= media
    v = [msgspec.msgpack.decode(f[2])[1][0] for f in scenario(VLLM, "tiers").live]
    assert [e["medium"] for e in v[:3]] == ["GPU", "CPU", "STORAGE"]
    hybrid = msgspec.msgpack.decode(scenario(VLLM, "hybrid").live[0][2])[1]
    assert [(e["group_idx"], e["kv_cache_spec_kind"]) for e in hybrid] == [
        (0, "sliding_window"),
        (1, "full_attention"),
    ]
