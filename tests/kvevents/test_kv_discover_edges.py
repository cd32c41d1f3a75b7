"""What the engines may describe that kvgate cannot follow, and the discovery's answer
to a replica whose description changes (pure: no sockets are opened)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.facts.read import EngineFacts
from gateway.kvevents.discover import EventDiscovery, from_sglang, from_vllm, sources_of
from gateway.kvevents.intake import EventIntake, Source
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import VLLM, load

R = ReplicaId("e0")
ZMQ = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"x": ZMQ}, "rank 'x' is not a number"),
        ({"0": {**ZMQ, "publisher": "null"}}, "rank 0: no zmq publisher"),
        ({"0": "zmq"}, "rank 0: no zmq publisher"),
        ({"0": {**ZMQ, "endpoint": "inproc://kv"}}, "endpoint 'inproc://kv' is not reachable"),
        ({"0": {**ZMQ, "endpoint": None}}, "endpoint None is not reachable"),
        ([ZMQ], "no KV event publisher"),
    ],
)
def test_vllm_descriptions_that_cannot_be_followed_say_why(body: Any, why: str) -> None:
    sources, said = from_vllm(R, "http://h:8000", body)
    assert sources == () and said.startswith(why)


def test_vllm_endpoints_keep_named_hosts_and_ipc_and_bracket_ipv6_replicas() -> None:
    body = {
        "0": {**ZMQ, "endpoint": "tcp://10.1.2.3:5557", "replay_endpoint": None, "topic": "kv"},
        "1": {**ZMQ, "endpoint": "ipc:///run/kv-1", "replay_endpoint": "ipc:///run/kv-1r"},
        "10": {**ZMQ, "endpoint": "tcp://[::]:5567", "replay_endpoint": "tcp://0.0.0.0:5568"},
    }
    sources, why = from_vllm(R, "http://[fd00::5]:8000", body)
    assert why == ""
    # Ranks in numeric order, not as strings ("10" after "1", not before "2").
    assert [s.rank for s in sources] == [0, 1, 10]
    assert [(s.endpoint, s.replay_endpoint, s.topic) for s in sources] == [
        ("tcp://10.1.2.3:5557", None, "kv"),
        ("ipc:///run/kv-1", "ipc:///run/kv-1r", ""),
        ("tcp://[fd00::5]:5567", "tcp://[fd00::5]:5568", ""),
    ]


@pytest.mark.parametrize(
    "kv",
    [
        {"endpoint_port_base": "5557"},
        {"endpoint_port_base": 5557, "dp_size": 0},
        {"endpoint_port_base": 5557, "dp_size": "2"},
        {"dp_size": 1},
    ],
)
def test_unreadable_sglang_descriptors_are_refused(kv: dict[str, Any]) -> None:
    sources, why = from_sglang(R, "http://h", kv)
    assert sources == () and why.startswith("unreadable kv_events")


def test_sglang_named_host_and_no_replay_endpoint() -> None:
    kv = {"endpoint_host": "kv.internal", "endpoint_port_base": 7000, "topic": 5}
    (source,), _ = from_sglang(R, "http://h", kv)
    assert source == Source(R, "tcp://kv.internal:7000", None, "5", 0)
    # A wildcard or a non-string host is the replica's own host.
    (source,), _ = from_sglang(R, "http://10.9.8.7:30000", {**kv, "endpoint_host": 0})
    assert source.endpoint == "tcp://10.9.8.7:7000"


class Discovery:
    def __init__(self) -> None:
        self.intake = EventIntake((), _Nowhere(), dynamic=True)
        self.discovery = EventDiscovery(self.intake, [R])

    def told(self) -> list[tuple[ReplicaId, tuple[Source, ...]]]:
        out = []
        while not self.intake._added.empty():
            replica, sources, _only_add = self.intake._added.get()
            out.append((replica, sources))
        return out


class _Nowhere:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the intake was not started: nothing reaches the sink ({name})")


def _vllm(body: Any) -> EngineFacts:
    return EngineFacts("vllm", kv_events=body)


def test_discovery_follows_changes_and_ignores_listed_replicas(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvgate.kvevents")
    d = Discovery()
    body = load(VLLM, "http.json")["kv_event_sources"]
    d.discovery(ReplicaId("listed"), "http://h", _vllm(body))  # in kv_events.sources
    assert d.told() == []
    d.discovery(R, "http://h", _vllm(body))
    ((replica, sources),) = d.told()
    assert replica == R and len(sources) == 2 and d.discovery.found[R] == sources
    d.discovery(R, "http://h", _vllm(body))  # read again, unchanged: nothing to do
    assert d.told() == []
    # Restarted without a publisher: the streams are dropped, said once.
    for _ in range(3):
        d.discovery(R, "http://h", _vllm({}))
    assert d.told() == [(R, ())] and R not in d.discovery.found
    gone = [r for r in caplog.records if "no KV event source" in r.getMessage()]
    assert len(gone) == 2  # "any more", then once more with the reason; not per read


def test_an_engine_never_described_is_warned_about_once_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Discovery()
    for kv in (None, None, {"dp_size": "x"}, {"dp_size": "x"}):
        d.discovery(R, "http://h", EngineFacts("sglang", kv_events=kv))
    assert d.told() == []
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "--kv-events-config" in said[0] and "unreadable" in said[1]
    assert sources_of(R, "http://h", EngineFacts("sglang"))[0] == ()
