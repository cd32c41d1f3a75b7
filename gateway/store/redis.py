"""RedisStore: shared state for several gateway instances, served from a local copy.

What is shared and how stale it can be (normal operation, `sync_interval_s` = T):

* session placements: a Redis string per session, TTL refreshed on use. A new placement or
  a move is written at once (not waiting for T) and pushed to the other instances over
  pub/sub, so they see it within about one round trip; TTL refreshes are batched every T,
  and each refresh returns Redis's value so a diverged local copy is corrected within T.
* Responses chains: a Redis string per answer that continues a chain, naming the chain's
  root; written at once like a new placement, expiring after the session TTL. A lookup
  the local copy cannot answer spends one GET bounded by `op_timeout_s`.
* ejections: a small hash, pushed over pub/sub when it changes and re-read every T.
  Health verdicts are not shared: nothing read another instance's, and while a hash of
  200 of them lived (a minute after any change) reading it every T cost about 1 ms of CPU.
* prefix placements: a stream trimmed to about `prefix_stream_max` entries, read every T.
  Each entry carries only the first `prefix_hashes_shared` block hashes of the prompt (8
  bytes each), so other instances learn where the leading part of a prefix lives (shared
  system prompts, tool definitions, forked agents), at most about T late; a longer match
  is found by the instance that placed it, and later turns follow the session placement.

While nothing is written here and a pull brings nothing new (ten syncs in a row), T
becomes one second: an idle fleet's pulls find nothing. The first write that would wait for
T (a TTL refresh, a prefix placement) wakes the sync, and a prefix placement written then
is announced over pub/sub so that the other instances, quiet too, pull it at once.

Request path: `lookup_session` answers from the local copy; on a local miss it spends one
round trip (GETEX) bounded by `op_timeout_s`. Every other verb only updates local state and
queues the write. When Redis is down, slow or restarting the store is *degraded*: requests
use local state only (no Redis call at all), a gauge and a log line say so, a background
task reconnects with exponential backoff (tenacity) and, once connected, resynchronises:
it pushes the local placements Redis lost and adopts the ones Redis kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from gateway.store.base import Ejection, PrefixPlacement, PrefixSink, StoreStatus
from gateway.store.config import StoreSettings
from gateway.store.connect import (
    RedisClient,
    drop_idle_connections,
    open_redis,
    parse_store_url,
)
from gateway.store.keys import StoreKeys
from gateway.store.memory import Clock, MemoryStore
from gateway.store.metrics import StoreMetrics
from gateway.store.redis_sync import SyncBatch, apply_event, encode_event, run_batch
from gateway.types import ReplicaId, SessionKey

log = logging.getLogger("kvgate.store")

_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
_PENDING_PREFIXES_MAX = 4096
# Consecutive request-path timeouts that mark the store degraded.
_SLOW_STRIKES = 3
# Recently published (replica, last shared block) pairs, to skip repeats.
_PUBLISHED_MEMORY = 8192
# After this many syncs in a row that wrote nothing and pulled nothing new, the store is
# quiet: it syncs once a second (at most), until a write or a pulled entry shows activity.
_QUIET_SYNCS = 10
_QUIET_SYNC_S = 1.0


class RedisStore:
    """`Store` replicated through Redis. Create one per app; `start()` in the lifespan."""

    backend = "redis"

    def __init__(
        self,
        settings: StoreSettings,
        *,
        registry: CollectorRegistry | None = None,
        instance_id: str | None = None,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.settings = settings
        self.local = MemoryStore(settings, clock=clock, wall=wall, instance_id=instance_id)
        self.instance_id = self.local.instance_id
        self.keys = StoreKeys(settings.key_prefix)
        self.metrics = StoreMetrics.create(registry)
        self._wall = wall
        self.target = parse_store_url(settings.url)
        self._redis: RedisClient = open_redis(
            self.target,
            socket_connect_timeout=settings.connect_timeout_s,
            socket_timeout=max(1.0, settings.connect_timeout_s * 2),
            # Retries belong to the reconnect loop; a request must never wait on one.
            retry=Retry(NoBackoff(), 0),
            # Named per instance, so `CLIENT LIST` shows which gateways share this Redis.
            client_name=f"kvgate-{self.instance_id}",
        )
        self.batch = SyncBatch()
        self.prefixes_out: deque[PrefixPlacement] = deque(maxlen=_PENDING_PREFIXES_MAX)
        self._published: OrderedDict[tuple[ReplicaId, int], None] = OrderedDict()
        self.stream_cursor = "0-0"
        self._degraded = True
        self._reason = "not connected yet"
        self._lookups: dict[SessionKey, asyncio.Future[ReplicaId | None]] = {}
        self._lookup_task: asyncio.Task[None] | None = None
        self._slow_strikes = 0
        self._first_connect = True
        self._wake = asyncio.Event()
        # Nothing written or pulled for _QUIET_SYNCS syncs: the sync runs at the quiet rate,
        # and the first write that would otherwise wait for the next sync wakes it.
        self._quiet = False
        # Requests waiting for the writes they queued to reach Redis (`flushed`).
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.metrics.degraded.set(1)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._supervise(), name="kvgate-store-sync")
        # A fresh instance starts warm when Redis answers quickly, and serves anyway if not.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.connect_timeout_s * 2):
                await self._connected.wait()
        if self._degraded:
            log.warning(
                "store starting degraded, serving routing state locally: redis at %s did not "
                "answer within %.1f s; reconnecting in the background",
                self.target.describe(),
                self.settings.connect_timeout_s * 2,
            )

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        waiters, self._flush_waiters = self._flush_waiters, []
        self._release_flush_waiters(waiters)
        if not self._degraded:
            with contextlib.suppress(*_FAILURES):
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    await run_batch(self, full=False)
        if self._lookup_task is not None and not self._lookup_task.done():
            self._lookup_task.cancel()
            await asyncio.wait({self._lookup_task}, timeout=1.0)
        if self._task is not None:
            # The loops also watch `_closing`: a cancellation swallowed inside a client
            # timeout must not leave the task running.
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.settings.connect_timeout_s * 4)
            self._task = None
        await self._redis.aclose()

    async def sync(self) -> None:
        if self._degraded:
            return
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s * 2):
                await run_batch(self, full=False)
        except _FAILURES as exc:
            self._mark_degraded("sync", exc)

    async def flushed(self) -> None:
        if self._degraded or self._closing:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(waiter)
        self._wake.set()
        # A flush already under way delays ours by one round trip: a few budgets, not one.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.op_timeout_s * 4):
                await asyncio.shield(waiter)

    def _release_flush_waiters(self, waiters: list[asyncio.Future[None]]) -> None:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def redis(self) -> RedisClient:
        return self._redis

    def status(self) -> StoreStatus:
        sessions = sum(1 for _ in self.local.local_sessions())
        return StoreStatus(self.backend, self._degraded, sessions, self._reason)

    # -- sessions -------------------------------------------------------------------------
    async def lookup_session(self, session: SessionKey) -> ReplicaId | None:
        replica = self.local.local_lookup(session)
        if replica is not None:
            self.batch.touched.add(session)
            self.metrics.request_lookups.labels("local").inc()
            return replica
        if self._degraded:
            self.metrics.request_lookups.labels("degraded").inc()
            return None
        self.metrics.request_lookups.labels("redis").inc()
        future = self._lookups.get(session)
        if future is None:
            future = self._lookups[session] = asyncio.get_running_loop().create_future()
            if self._lookup_task is None or self._lookup_task.done():
                self._lookup_task = asyncio.create_task(self._lookup_batch())
        try:
            async with asyncio.timeout(self.settings.op_timeout_s):
                # Shielded: a request giving up must not cancel the others' shared lookup.
                return await asyncio.shield(future)
        except TimeoutError:
            self._note_slow()
            return None

    async def _lookup_batch(self) -> None:
        """One pipeline for every lookup that missed locally since the last one started.

        Concurrent requests share one round trip (and one connection) instead of opening
        a connection each, which is what makes a burst of new sessions cheap.
        """
        while self._lookups:
            batch, self._lookups = self._lookups, {}
            pipe = self._redis.pipeline(transaction=False)
            ttl = self.ttl_ms()
            for session in batch:
                pipe.getex(self.keys.session(session), px=ttl)
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s * 2):
                    results = await pipe.execute()
            except _FAILURES as exc:
                for future in batch.values():
                    if not future.done():
                        future.set_result(None)
                if isinstance(exc, TimeoutError):
                    self._note_slow()
                else:
                    self._mark_degraded("lookup", exc)
                return
            self._slow_strikes = 0
            for (session, future), raw in zip(batch.items(), results):
                replica = None if raw is None else ReplicaId(raw.decode())
                if replica is not None and self.local.local_peek(session) is None:
                    self.local.local_assign(session, replica)
                if not future.done():
                    future.set_result(replica)

    def _note_slow(self) -> None:
        # One slow answer is noise on a busy host; a few in a row mean Redis is in trouble.
        self.metrics.errors.labels("lookup_timeout").inc()
        self._slow_strikes += 1
        if self._slow_strikes >= _SLOW_STRIKES:
            self._mark_degraded("lookup", TimeoutError("lookups keep timing out"))

    async def assign_session(self, session: SessionKey, replica: ReplicaId) -> None:
        previous = self.local.local_peek(session)
        self.local.local_assign(session, replica)
        if previous == replica:
            self.batch.touched.add(session)
            if self._quiet:
                self._wake.set()
            return
        # A first placement must not overwrite one another instance made meanwhile; a move
        # (bounded load, failover) is a decision and wins.
        self.batch.assigned[session] = (replica, previous is not None)
        self._wake.set()

    async def forget_replica(self, replica: ReplicaId) -> None:
        self.local.local_forget(replica)
        self.batch.forgotten.add(replica)
        self._wake.set()

    # -- Responses chains -----------------------------------------------------------------
    async def link_response(self, response: str, root: str) -> None:
        self.local.local_link(response, root)
        self.batch.linked[response] = root
        self._wake.set()

    async def response_root(self, response: str) -> str | None:
        root = self.local.local_root(response)
        if root is not None or self._degraded:
            return root
        try:
            async with asyncio.timeout(self.settings.op_timeout_s):
                raw = await self._redis.get(self.keys.response_root(response))
        except TimeoutError:
            self._note_slow()
            return None
        except _FAILURES as exc:
            self._mark_degraded("lookup", exc)
            return None
        if raw is None:
            return None
        root = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.local.local_link(response, root)
        return root

    # -- health and ejections -------------------------------------------------------------
    async def eject_replica(self, replica: ReplicaId, cooldown_s: float, reason: str = "") -> None:
        ejection = Ejection(replica, self._wall() + cooldown_s, reason)
        self.local.local_eject(ejection)
        self.batch.ejected[replica] = ejection
        self.batch.readmitted.discard(replica)
        self._wake.set()

    async def readmit_replica(self, replica: ReplicaId) -> None:
        self.local.local_readmit(replica)
        self.batch.ejected.pop(replica, None)
        self.batch.readmitted.add(replica)
        self._wake.set()

    def ejections(self) -> Mapping[ReplicaId, Ejection]:
        return self.local.ejections()

    # -- prefix placements ----------------------------------------------------------------
    def publish_prefix(self, placement: PrefixPlacement) -> None:
        # Only the leading blocks are shared: they keep the index prefix-closed (what
        # `PrefixIndex` needs) and they repeat across the turns of a conversation, so later
        # turns dedupe to nothing; deeper turns follow the session placement instead.
        hashes = placement.prefix_hashes[: self.settings.prefix_hashes_shared]
        if not hashes:
            return
        mark = (placement.replica, hashes[-1])
        if mark in self._published:
            self._published.move_to_end(mark)
            return
        self._published[mark] = None
        if len(self._published) > _PUBLISHED_MEMORY:
            self._published.popitem(last=False)
        self.prefixes_out.append(replace(placement, prefix_hashes=hashes, at=self._wall()))
        if self._quiet:
            self._wake.set()

    def subscribe_prefixes(self, sink: PrefixSink) -> None:
        self.local.subscribe_prefixes(sink)

    # -- background -----------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Syncing at the quiet rate: nothing written or pulled for a while."""
        return self._quiet

    def pull_soon(self) -> None:
        """Another instance wrote what a pull brings: at the quiet rate, sync now."""
        if self._quiet:
            self._wake.set()

    def ttl_ms(self) -> int:
        return max(1, round(self.settings.session_ttl_s * 1000))

    def _mark_degraded(self, op: str, exc: BaseException) -> None:
        self.metrics.errors.labels(op).inc()
        if self._degraded:
            return
        self._degraded = True
        self._reason = f"{op}: {type(exc).__name__}: {exc}"
        waiters, self._flush_waiters = self._flush_waiters, []
        self._release_flush_waiters(waiters)
        self._connected.clear()
        self.metrics.degraded.set(1)
        log.warning(
            "store degraded, serving routing state locally: redis %s failed (%s)",
            op,
            self._reason,
        )
        self._wake.set()

    async def _supervise(self) -> None:
        while not self._closing:
            try:
                await self._reconnect()
            except _FAILURES:
                return  # only when closing: the retry loop stops then
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._listen())
                    group.create_task(self._sync_loop())
            except* _FAILURES as failures:
                self._mark_degraded("connection", failures.exceptions[0])

    async def _reconnect(self) -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(_FAILURES),
            wait=wait_exponential_jitter(initial=0.05, max=self.settings.reconnect_max_s),
            stop=lambda _state: self._closing,
            reraise=True,
        ):
            with attempt:
                async with asyncio.timeout(self.settings.connect_timeout_s * 2):
                    if not self._first_connect:
                        # Idle pooled connections may predate a Redis restart: each would
                        # fail once on first use and flap the store back to degraded.
                        await drop_idle_connections(self._redis)
                    await self._redis.ping()
                    started = time.perf_counter()
                    await run_batch(self, full=True)
        self.metrics.resyncs.inc()
        was = self._reason
        self._degraded = False
        self._slow_strikes = 0
        self._reason = ""
        self.metrics.degraded.set(0)
        self._connected.set()
        first = self._first_connect
        self._first_connect = False
        # A recovery is as worth seeing as the outage was; the first connect is routine.
        log.log(
            logging.INFO if first else logging.WARNING,
            "store connected to redis and resynchronised in %.1f ms (was: %s)",
            (time.perf_counter() - started) * 1000,
            was,
        )

    async def _sync_loop(self) -> None:
        interval = self.settings.sync_interval_s
        quiet_wait = max(interval, _QUIET_SYNC_S)
        idle_syncs = 0
        while not self._closing:
            # An idle fleet's pulls find nothing; ten a second were a gateway's largest store
            # cost while idle. Other instances' placements, moves and ejections still arrive
            # at once over pub/sub; only their prefix placements wait for a pull.
            self._quiet = idle_syncs >= _QUIET_SYNCS
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), quiet_wait if self._quiet else interval)
            self._wake.clear()
            if self._closing:
                return
            if self._degraded:
                raise ConnectionError(self._reason or "degraded")
            started = time.perf_counter()
            wrote = self.batch.pending() or bool(self.prefixes_out)
            cursor = self.stream_cursor
            # Whoever waits now has its writes in the batch run_batch takes next.
            waiters, self._flush_waiters = self._flush_waiters, []
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s * 2):
                    await run_batch(self, full=False)
            finally:
                self._release_flush_waiters(waiters)
            idle_syncs = 0 if wrote or self.stream_cursor != cursor else idle_syncs + 1
            self.metrics.sync_seconds.observe(time.perf_counter() - started)

    async def _listen(self) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.events())
            while not self._closing:
                message: dict[str, Any] | None = await pubsub.get_message(timeout=0.25)
                if message is not None and message.get("type") == "message":
                    apply_event(self, orjson.loads(message["data"]))
                if self._degraded:
                    raise ConnectionError(self._reason or "degraded")
        finally:
            with contextlib.suppress(*_FAILURES, RuntimeError):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8 on

    def encode_event(self, kind: str, **fields: Any) -> bytes:
        return encode_event(self.instance_id, kind, **fields)
