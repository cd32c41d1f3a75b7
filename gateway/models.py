"""`GET /v1/models`: the union of what the healthy replicas serve, cached briefly.

The same fetch feeds `Cluster.set_models`, which is how an unknown model gets a 404 from
the gateway instead of a detour to a replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.cluster import Cluster
from gateway.errors import GatewayError
from gateway.types import ReplicaId
from gateway.upstream import Timeouts, UpstreamClient

log = logging.getLogger("kvgate.models")


class ModelsCache:
    def __init__(
        self,
        cluster: Cluster,
        client: UpstreamClient,
        ttl_s: float,
        timeout_s: float,
        *,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.headers = headers  # the engines' API key, if they need one
        self.ttl_s = ttl_s
        self._timeouts = Timeouts(timeout_s, timeout_s, timeout_s)
        self._body: bytes | None = None
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()
        # What the last refresh found: every model id, and the LoRA adapters among them
        # (cards with a `parent`, as vLLM lists its `--lora-modules`), for keying a
        # request's prompt in its adapter's namespace (gateway.kvevents.adapters).
        self.served: frozenset[str] = frozenset()
        self.adapters: frozenset[str] = frozenset()

    async def _fetch_one(self, replica: ReplicaId) -> list[dict[str, Any]] | None:
        if replica not in self.cluster.members:
            return None
        url = self.cluster.url_of(replica) + "/v1/models"
        try:
            resp = await self.client.send("GET", url, self.headers, None, timeouts=self._timeouts)
            try:
                raw = await resp.read()
            finally:
                await resp.aclose()
        except GatewayError:
            return None
        if resp.status != 200:
            return None
        try:
            data = orjson.loads(raw).get("data")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        self.cluster.set_models(replica, (c["id"] for c in cards))
        return cards

    async def refresh(self) -> bytes:
        replicas = [r for r in self.cluster.members if self.cluster.is_healthy(r)]
        results = await asyncio.gather(*(self._fetch_one(r) for r in replicas))
        merged: dict[str, dict[str, Any]] = {}
        for cards in results:
            for card in cards or ():
                merged.setdefault(card["id"], card)
        self._body = orjson.dumps({"object": "list", "data": list(merged.values())})
        self.served = frozenset(merged)
        self.adapters = frozenset(m for m, card in merged.items() if card.get("parent"))
        self._fetched_at = self.cluster.clock()
        return self._body

    async def run(self, interval_s: float) -> None:
        """Lifespan task: re-discover models (replicas restart with other models, or were
        unreachable at start-up)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Exception:  # keep discovering after a bad round
                log.exception("model discovery round failed")

    async def body(self) -> bytes:
        if self._body is not None and self.cluster.clock() - self._fetched_at < self.ttl_s:
            return self._body
        async with self._lock:
            if self._body is not None and self.cluster.clock() - self._fetched_at < self.ttl_s:
                return self._body
            return await self.refresh()

    async def card(self, model_id: str) -> bytes | None:
        """One model's card (`GET /v1/models/{id}`), None when no replica serves it."""
        listing = orjson.loads(await self.body())
        for card in listing.get("data", ()):
            if card.get("id") == model_id:
                return orjson.dumps(card)
        return None
