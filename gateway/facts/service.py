"""`EngineFactsService`: reads each replica's own description (gateway.facts.read) in a
background task, never on the request path: at start until it answers, and again when
the replica comes back into service after being out of it (the health monitor's
`on_change`), since an engine that restarted may have restarted with other flags.

Listeners (the KV event discovery, gateway.kvevents.discover) hear every read, on the
event loop, with the replica's URL; readers (admission's priority direction, the
scraper's capacity when the engine serves no metrics) look facts up by replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import httpx

from gateway.facts.read import EngineFacts, from_server_info, from_vllm
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.facts")

RETRY_S = 10.0
FactsListener = Callable[[ReplicaId, str, EngineFacts], None]


async def _json(client: httpx.AsyncClient, url: str) -> Any | None:
    response = await client.get(url)
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


async def read_facts(client: httpx.AsyncClient, url: str) -> EngineFacts | None:
    """One replica's facts, or None when it describes itself neither way (yet)."""
    base = url.rstrip("/")
    sources = await _json(client, base + "/kv_event_sources")
    if sources is not None:
        return from_vllm(sources, await _json(client, base + "/v1/models"))
    return from_server_info(await _json(client, base + "/server_info"))


class EngineFactsService:
    """A `Service`. `replicas()` gives the current members (id -> base URL)."""

    def __init__(
        self,
        replicas: Callable[[], Mapping[ReplicaId, str]],
        *,
        headers: Mapping[str, str] | None = None,
        retry_s: float = RETRY_S,
        timeout_s: float = 5.0,
    ) -> None:
        self._replicas = replicas
        self.headers = dict(headers or {})
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._facts: dict[ReplicaId, EngineFacts] = {}
        self.facts: Mapping[ReplicaId, EngineFacts] = MappingProxyType(self._facts)
        self.listeners: list[FactsListener] = []
        self.reads = 0  # answered reads (tests and the console)
        self._due: set[ReplicaId] = set()  # to be read again (re-admitted)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def get(self, replica: ReplicaId) -> EngineFacts | None:
        return self._facts.get(replica)

    def runs_higher_first(self, replica: ReplicaId) -> bool | None:
        facts = self._facts.get(replica)
        return None if facts is None else facts.runs_higher_first

    def capacity(self, replica: ReplicaId) -> int | None:
        facts = self._facts.get(replica)
        return None if facts is None else facts.capacity_tokens

    def readmitted(self, replica: ReplicaId) -> None:
        """Read the replica again (it was out of service: maybe restarted). Until then its
        old facts stand: the engine was most likely restarted as it was."""
        self._due.add(replica)
        self._wake.set()

    def wake(self) -> None:
        """Members changed: read the new ones now."""
        self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="kvgate-engine-facts")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        said: dict[ReplicaId, str] = {}
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            while True:
                self._wake.clear()
                members = dict(self._replicas())
                for gone in [r for r in self._facts if r not in members]:
                    del self._facts[gone]
                self._due &= members.keys()
                wanted = [r for r in members if r not in self._facts or r in self._due]
                for replica in wanted:
                    url = members[replica]
                    self._due.discard(replica)
                    try:
                        facts = await read_facts(client, url)
                    except httpx.HTTPError as exc:
                        facts, why = None, f"unreachable ({type(exc).__name__})"
                    else:
                        why = "neither /kv_event_sources nor /server_info answered"
                    if facts is None:
                        if replica in self._facts:
                            self._due.add(replica)  # keep the old facts, try again
                        if said.get(replica) != why:
                            said[replica] = why
                            log.info("replica %s: engine facts unknown: %s", replica, why)
                        continue
                    said.pop(replica, None)
                    self._learnt(replica, url, facts)
                missing = any(r not in self._facts for r in members) or self._due
                try:
                    async with asyncio.timeout(self.retry_s if missing else None):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    def _learnt(self, replica: ReplicaId, url: str, facts: EngineFacts) -> None:
        before = self._facts.get(replica)
        self._facts[replica] = facts
        self.reads += 1
        if before != facts:
            log.info(
                "replica %s: %s engine, priority %s first, page size %s, metrics %s",
                replica,
                facts.kind,
                {True: "higher", False: "lower", None: "(unknown)"}[facts.runs_higher_first],
                facts.page_size or "(unknown)",
                {True: "on", False: "off", None: "(unknown)"}[facts.metrics_enabled],
            )
        for listener in self.listeners:
            try:
                listener(replica, url, facts)
            except Exception:  # one listener's bug must not stop the others or the reads
                log.exception("engine facts listener failed for replica %s", replica)
