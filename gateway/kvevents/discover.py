"""Event sources from the engines themselves, for replicas `kv_events.sources` leaves out.

vLLM 0.33 answers `GET /kv_event_sources` with its publisher config per DP rank
(`{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}}`); SGLang
0.5.23 describes its publisher under `/server_info`'s `kv_events` (`endpoint_host`,
`endpoint_port_base`, `replay_endpoint_port_base`, `topic`, `block_size`, `dp_size`). A
wildcard host (`*`, `0.0.0.0`, `::`) is the replica URL's host, as both engines say.

The gateway reads those descriptions itself (gateway.facts), at start and again whenever
a replica comes back into service; `EventDiscovery` listens and tells the intake which
streams each replica publishes now. A data-parallel engine publishes one stream per rank
(rank r on port + r, replay port + r): every rank is subscribed, each with its own
numbering and replay (gateway.kvevents.intake). An engine paging at another size than
`kv_events.block_size` is re-cut on intake (gateway.kvevents.rechunk).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway.facts.read import EngineFacts
from gateway.kvevents.intake import EventIntake, Source
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.kvevents")

_WILDCARDS = frozenset(("*", "0.0.0.0", "::", "[::]"))


def _host_of(url: str) -> str:
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _dial(endpoint: str | None, host: str) -> str | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint if endpoint and endpoint.startswith("ipc://") else None
    address, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return f"tcp://{host if address in _WILDCARDS else address}:{port}"


def from_vllm(replica: ReplicaId, url: str, body: Any) -> tuple[tuple[Source, ...], str]:
    """The sources (one per DP rank) in vLLM's `/kv_event_sources` answer, or () and why."""
    if not isinstance(body, Mapping) or not body:
        return (), "no KV event publisher (start vLLM with --kv-events-config)"
    host = _host_of(url)
    out: list[Source] = []
    for rank, config in sorted(body.items(), key=lambda kv: str(kv[0]).zfill(8)):
        if not str(rank).isdigit():
            return (), f"rank {rank!r} is not a number"
        if not isinstance(config, Mapping) or config.get("publisher") != "zmq":
            return (), f"rank {rank}: no zmq publisher"
        endpoint = _dial(config.get("endpoint"), host)
        if endpoint is None:
            return (), f"endpoint {config.get('endpoint')!r} is not reachable from here"
        replay = _dial(config.get("replay_endpoint"), host)
        topic = config.get("topic") or ""
        out.append(Source(replica, endpoint, replay, topic, int(rank)))
    return tuple(out), ""


def from_sglang(replica: ReplicaId, url: str, kv: Any) -> tuple[tuple[Source, ...], str]:
    """The sources (one per DP rank) in SGLang's `/server_info` `kv_events` descriptor, or
    () and why."""
    if not isinstance(kv, Mapping):
        return (), "no kv_events in /server_info (start SGLang with --kv-events-config)"
    ranks, base = kv.get("dp_size", 1), kv.get("endpoint_port_base")
    if not isinstance(ranks, int) or ranks < 1 or not isinstance(base, int):
        return (), f"unreadable kv_events {dict(kv)!r}"
    host = kv.get("endpoint_host")
    host = _host_of(url) if not isinstance(host, str) or host in _WILDCARDS else host
    replay = kv.get("replay_endpoint_port_base")
    topic = str(kv.get("topic") or "")
    return tuple(
        Source(
            replica,
            f"tcp://{host}:{base + r}",
            f"tcp://{host}:{replay + r}" if isinstance(replay, int) else None,
            topic,
            r,
        )
        for r in range(ranks)
    ), ""


def sources_of(replica: ReplicaId, url: str, facts: EngineFacts) -> tuple[tuple[Source, ...], str]:
    if facts.kind == "vllm":
        return from_vllm(replica, url, facts.kv_events)
    return from_sglang(replica, url, facts.kv_events)


class EventDiscovery:
    """Listens to the engine facts (gateway.facts) of the replicas `kv_events.sources`
    leaves out and keeps the intake following the streams each one describes."""

    def __init__(self, intake: EventIntake, replicas: Iterable[ReplicaId]) -> None:
        self.intake = intake
        self.replicas = frozenset(replicas)
        self.found: dict[ReplicaId, tuple[Source, ...]] = {}
        self._said: dict[ReplicaId, str] = {}

    def __call__(self, replica: ReplicaId, url: str, facts: EngineFacts) -> None:
        """A `FactsListener`: runs on the loop after each read of a replica's facts."""
        if replica not in self.replicas:
            return
        sources, why = sources_of(replica, url, facts)
        if sources == self.found.get(replica, ()):
            if not sources and self._said.get(replica) != why:
                self._said[replica] = why
                log.warning("replica %s: no KV event source: %s", replica, why)
            return
        if sources:
            self.found[replica] = sources
            self._said.pop(replica, None)
            log.info(
                "replica %s: KV events from %s",
                replica,
                ", ".join(s.endpoint for s in sources),
            )
        else:
            self.found.pop(replica, None)
            log.warning("replica %s: no KV event source any more: %s", replica, why)
        self.intake.replace(replica, sources)
