"""Event sources from the engines themselves, for replicas `kv_events.sources` leaves out.

vLLM 0.33 answers `GET /kv_event_sources` with its publisher config per DP rank
(`{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}}`); SGLang
0.5.23 describes its publisher under `/server_info`'s `kv_events` (`endpoint_host`,
`endpoint_port_base`, `replay_endpoint_port_base`, `topic`, `block_size`, `dp_size`). A
wildcard host (`*`, `0.0.0.0`, `::`) is the replica URL's host, as both engines say.

A data-parallel engine (more than one rank) publishes one stream per rank and balances
requests over them without asking kvgate; one index per replica cannot say which rank
holds what, so such a replica is left to the approximate index (with a warning) rather
than keyed on rank 0 alone. So is an engine keyed at another block size than kvgate's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.kvevents.intake import EventIntake, Source
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.kvevents")

_WILDCARDS = frozenset(("*", "0.0.0.0", "::", "[::]"))
RETRY_S = 10.0


def _host_of(url: str) -> str:
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _dial(endpoint: str | None, host: str) -> str | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint if endpoint and endpoint.startswith("ipc://") else None
    address, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return f"tcp://{host if address in _WILDCARDS else address}:{port}"


def from_vllm(replica: ReplicaId, url: str, body: Any) -> tuple[Source | None, str]:
    """A source from vLLM's `/kv_event_sources` answer, or None and why not."""
    if not isinstance(body, Mapping) or not body:
        return None, "no KV event publisher (start vLLM with --kv-events-config)"
    if len(body) > 1:
        return None, f"{len(body)} data-parallel ranks publish apart"
    config = next(iter(body.values()))
    if not isinstance(config, Mapping) or config.get("publisher") != "zmq":
        return None, "no zmq publisher"
    host = _host_of(url)
    endpoint = _dial(config.get("endpoint"), host)
    if endpoint is None:
        return None, f"endpoint {config.get('endpoint')!r} is not reachable from here"
    topic = config.get("topic") or ""
    return Source(replica, endpoint, _dial(config.get("replay_endpoint"), host), topic), ""


def from_sglang(
    replica: ReplicaId, url: str, info: Any, block_size: int
) -> tuple[Source | None, str]:
    """A source from SGLang's `/server_info` `kv_events` descriptor, or None and why not."""
    kv = info.get("kv_events") if isinstance(info, Mapping) else None
    if not isinstance(kv, Mapping):
        return None, "no kv_events in /server_info (start SGLang with --kv-events-config)"
    if kv.get("dp_size", 1) != 1:
        return None, f"{kv.get('dp_size')} data-parallel ranks publish apart"
    if kv.get("block_size") != block_size:
        return None, (
            f"events at block size {kv.get('block_size')}, kv_events.block_size is "
            f"{block_size} (start SGLang with --page-size {block_size})"
        )
    host = kv.get("endpoint_host")
    host = _host_of(url) if not isinstance(host, str) or host in _WILDCARDS else host
    endpoint = f"tcp://{host}:{kv.get('endpoint_port_base')}"
    replay = kv.get("replay_endpoint_port_base")
    replay_endpoint = f"tcp://{host}:{replay}" if isinstance(replay, int) else None
    return Source(replica, endpoint, replay_endpoint, str(kv.get("topic") or "")), ""


async def discover(
    client: httpx.AsyncClient, replica: ReplicaId, url: str, block_size: int
) -> tuple[Source | None, str]:
    base = url.rstrip("/")
    response = await client.get(base + "/kv_event_sources")
    if response.status_code == 200:
        return from_vllm(replica, url, response.json())
    response = await client.get(base + "/server_info")
    if response.status_code == 200:
        return from_sglang(replica, url, response.json(), block_size)
    return None, "neither /kv_event_sources nor /server_info answered"


class EventDiscovery:
    """A `Service`: asks each listed replica for its publisher until it answers, and hands
    what it finds to the intake."""

    def __init__(
        self,
        intake: EventIntake,
        replicas: Mapping[ReplicaId, str],
        block_size: int,
        *,
        headers: Mapping[str, str] | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.intake = intake
        self.replicas = dict(replicas)
        self.block_size = block_size
        self.headers = dict(headers or {})
        self.retry_s = retry_s
        self.found: dict[ReplicaId, Source] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.replicas and self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-kv-discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        said: dict[ReplicaId, str] = {}
        async with httpx.AsyncClient(timeout=5.0, headers=self.headers) as client:
            while len(self.found) < len(self.replicas):
                for replica, url in self.replicas.items():
                    if replica in self.found:
                        continue
                    try:
                        source, why = await discover(client, replica, url, self.block_size)
                    except (httpx.HTTPError, ValueError) as exc:
                        source, why = None, f"unreachable ({type(exc).__name__})"
                    if source is not None:
                        self.found[replica] = source
                        self.intake.add(source)
                        log.info("replica %s: KV events from %s", replica, source.endpoint)
                    elif said.get(replica) != why:
                        said[replica] = why
                        log.warning("replica %s: no KV event source: %s", replica, why)
                await asyncio.sleep(self.retry_s)
