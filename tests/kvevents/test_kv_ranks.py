"""A data-parallel engine publishes one stream per rank (rank r on port + r, replay port +
r): the intake follows every rank of a replica, each with its own numbering and replay,
and the replica is credited with what its best rank holds. The frames are vLLM 0.33.0's
own (recorded for rank 0 and rank 1)."""

from __future__ import annotations

from array import array
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.facts.read import from_vllm as facts_of
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.discover import EventDiscovery
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.intake import EventIntake, stream_id
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.testing.views import make_request
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import VLLM, scenario
from tests.kvevents.test_kv_engine_replay import FixturePublisher, until

R = ReplicaId("e0")
R1 = stream_id(R, 1)
KEYS = chain_keys(list(range(100, 148)), 16, root_seed())


def config(pub: FixturePublisher) -> dict[str, Any]:
    """A rank's entry in vLLM's `/kv_event_sources` (as recorded), at this publisher."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "topic": "",
    }


async def test_every_rank_is_followed_and_the_replica_holds_what_its_best_rank_holds() -> None:
    # Rank 0 stored and then cleared its blocks; rank 1 holds three blocks (tokens 100..147).
    pubs = [
        FixturePublisher(scenario(VLLM, "plain")),
        FixturePublisher(scenario(VLLM, "plain_dp_rank1")),
    ]
    for pub in pubs:
        pub.start()
        pub.publish_all()
    registry = CollectorRegistry()
    index = EventIndex()
    feed = EventFeed(index, KVEventMetrics(registry), warmup_s=3600)
    intake = EventIntake((), feed, dynamic=True, replay_timeout_s=1.0, block_size=16)
    discovery = EventDiscovery(intake, [R])
    bridge = PromptBridge()
    evidence = EventEvidence(index, feed, bridge, {"GPU": 1.0}, block_size=16)
    bridge.learn([7], array("Q", KEYS), [3])
    await intake.start()
    try:
        discovery(
            R, "http://127.0.0.1:1", facts_of({"0": config(pubs[0]), "1": config(pubs[1])}, None)
        )
        await until(
            lambda: feed.state(R) is SyncState.SYNCED and feed.state(R1) is SyncState.SYNCED
        )
        # Each rank was asked for its own history, on its own replay endpoint.
        assert [pub.replays for pub in pubs] == [1, 1]
        assert [registry.get_sample_value(
            "kvgate_kv_events_batches_total", {"replica": s}
        ) for s in (R, R1)] == [4, 2]  # fmt: skip
        r0, r1 = index.blocks(R), index.blocks(R1)
        assert r0 is not None and not r0.media and r1 is not None and len(r1.media) == 3
        assert evidence.cached_tokens(make_request(request_id="a", prefix_hashes=(7,))) == {R: 48}
        # Read again after a restart with one rank: rank 1's stream is dropped with its index.
        discovery(R, "http://127.0.0.1:1", facts_of({"0": config(pubs[0])}, None))
        await until(lambda: feed.state(R1) is SyncState.DOWN)
        r1 = index.blocks(R1)
        assert r1 is not None and not r1.media
        assert evidence.cached_tokens(make_request(request_id="b", prefix_hashes=(7,))) == {R: 0}
    finally:
        await intake.stop()
        for pub in pubs:
            pub.stop()
