"""The background task that keeps one fresh `EngineLoad` per replica.

One asyncio task per replica, so a slow or dead replica never delays the others' scrapes.
A supervisor task reconciles the task set with the current replica list every interval.
Snapshots are immutable; a reader gets a read-only mapping and never a lock.

A quiet replica (nothing running or waiting at its last scrape, nothing in flight from this
gateway) is read every `idle_interval_s` instead: at four scrapes a second, an idle fleet's
GETs are nearly all of a gateway's idle CPU. Its load says it stays fresh that much longer
(`EngineLoad.grace_s`), and the gateway's next request to it (`wake`) scrapes it at once
and restores the busy rate, so routing under traffic sees what it saw before. Another
gateway of the store that begins using it has its holder read it at once (the wake sets of
gateway.scrape.shared); load that clients of no kvgate put on it shows within
`idle_interval_s`.

Scrapes go out on an `h1` client that proxied requests do not use (so a scrape never
queues behind them): a general-purpose client costs several times more CPU per GET, and
with four scrapes a second per replica that cost grows with the cluster. A gateway hands
the scraper its health probes' client when that is an `h1` one (gateway.scrape.install):
the engines close a connection idle for 5 s, and the quiet probes (every 4 s) keep one
open that the quiet reads reuse. Reads ask for only the series read (gateway.scrape.select),
and an answer the same as the last one is not parsed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Protocol

import xxhash
from prometheus_client import CollectorRegistry

from gateway.errors import GatewayError, UpstreamConnectError, UpstreamError, UpstreamTimeout
from gateway.scrape.adapters import (
    CounterState,
    EngineReading,
    MetricsFormatError,
    read_engine_series,
)
from gateway.scrape.config import EngineKind, ScrapeSettings
from gateway.scrape.metrics import ScrapeMetrics
from gateway.scrape.select import SeriesSelection
from gateway.scrape.shared import ScrapeShare
from gateway.types import EngineLoad, ReplicaId
from gateway.upstream import Timeouts, UpstreamClient, make_client

log = logging.getLogger(__name__)


class ScrapeTarget(Protocol):
    """Anything with a replica id and a base URL (e.g. `ReplicaState`)."""

    @property
    def id(self) -> ReplicaId: ...

    @property
    def url(self) -> str: ...


class ScrapeHealthSink(Protocol):
    """Where scrape outcomes go so that a replica whose /metrics fails counts as unwell."""

    def scrape_succeeded(self, replica: ReplicaId) -> None: ...

    def scrape_failed(self, replica: ReplicaId, reason: str) -> None: ...


LoadListener = Callable[[ReplicaId, EngineLoad], None]

# Statuses that mean "this engine serves no metrics" (not "the engine is unwell").
METRICS_ABSENT = frozenset({404})

# Scraped loads reach the listener within a quarter of an interval.
FLUSHES_PER_INTERVAL = 4


def _text(payload: bytes) -> str:
    return payload.decode("utf-8", "replace")


def _query_may_be_at_fault(status: int) -> bool:
    """A selective read's answer that a whole read may not share: a 200 (that may lack
    series), a 3xx or a 4xx (a server with no such path, that redirects it, or that refuses
    the query). A 5xx is the engine's state, and a whole read would only repeat it."""
    return status == 200 or 300 <= status < 500


class MetricsScraper:
    """Polls every target's `/metrics` every `interval_s` and publishes `EngineLoad`s."""

    def __init__(
        self,
        settings: ScrapeSettings,
        targets: Callable[[], Sequence[ScrapeTarget]],
        *,
        client: UpstreamClient | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        registry: CollectorRegistry | None = None,
        on_load: LoadListener | None = None,
        health: ScrapeHealthSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: ScrapeShare | None = None,
        in_flight: Mapping[ReplicaId, int] | None = None,
    ) -> None:
        self.settings = settings
        # Gateways sharing a store: this one scrapes only the engines it holds a lease on.
        self.share = share
        self._known: set[ReplicaId] = set()
        self._targets = targets
        self._client = client
        self._headers = tuple(headers)  # the engines' API key
        self._owns_client = client is None
        self._on_load = on_load
        self._health = health
        self._clock = clock
        self._loads: dict[ReplicaId, EngineLoad] = {}
        self._loads_view: Mapping[ReplicaId, EngineLoad] = MappingProxyType(self._loads)
        # The dialect each replica's last readable /metrics was read in (detected or set).
        self._kinds: dict[ReplicaId, EngineKind] = {}
        self.kinds: Mapping[ReplicaId, EngineKind] = MappingProxyType(self._kinds)
        self._counters: dict[ReplicaId, CounterState | None] = {}
        # Whole expositions or only the read series, per replica.
        self.selection = SeriesSelection(settings.select_series)
        # The last answer read per replica (its digest) and what it read as (`_read`).
        self._last_read: dict[ReplicaId, tuple[int, EngineKind, EngineReading, frozenset[str]]] = {}
        self._pending: dict[ReplicaId, EngineLoad] = {}
        self._missing: set[ReplicaId] = set()  # warned once each; gauge while missing
        # The KV capacity an engine states elsewhere (SGLang's /server_info
        # max_total_num_tokens, gateway.facts), for a replica whose metrics are off.
        self.capacity_of: Callable[[ReplicaId], int | None] | None = None
        self._tasks: dict[ReplicaId, asyncio.Task[None]] = {}
        # This gateway's requests in flight per replica (`Cluster.in_flight`): a replica
        # with any is never quiet. The poll loops of quiet replicas wait on these events.
        self._in_flight = in_flight
        self._quiet: dict[ReplicaId, asyncio.Event] = {}
        # The shared round waits on this between rounds; a request after a quiet spell sets it.
        self._share_wakeup = asyncio.Event()
        self._busy_at = -math.inf  # this gateway's last request to any replica began
        self._supervisor: asyncio.Task[None] | None = None
        self._sharer: asyncio.Task[None] | None = None
        self.metrics = (
            ScrapeMetrics(
                registry,
                lambda: self._loads_view,
                clock,
                lambda: self._missing,
                settings.stale_after_s,
            )
            if registry
            else None
        )

    @property
    def loads(self) -> Mapping[ReplicaId, EngineLoad]:
        """Read-only mapping of the latest snapshot per replica (each one immutable)."""
        return self._loads_view

    async def start(self) -> None:
        if self._supervisor is not None:
            return
        if self._client is None:
            # The bound is scrape_once's own timeout; the client's limits stay behind it, so
            # a slow connect reads as a timeout (not as an unreachable replica), as before.
            t = 2 * self.settings.timeout_s
            # One connection per replica is all the poll loops use.
            self._client = make_client("h1", Timeouts(t, t, t), max_connections=4)
        if self.share is not None:
            # The first round says which engines are this gateway's before any is scraped
            # (bounded: a slow store only means scraping every engine for a while).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.timeout_s):
                    await self._share_round()
            self._sharer = asyncio.create_task(self._share_loop(), name="kvgate-scrape-share")
        self._reconcile()
        self._supervisor = asyncio.create_task(self._supervise(), name="kvgate-scrape")

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in (self._supervisor, self._sharer):
            if task is not None:
                tasks.append(task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._supervisor = self._sharer = None
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def scrape_once(self, target: ScrapeTarget, *, publish: bool = True) -> EngineLoad | None:
        """Fetch, parse and publish one replica's load; None (and a health report) on failure.

        With `publish=False` the load waits for the next batched flush (the poll loops).
        """
        if self._client is None:
            raise RuntimeError("scraper not started")
        whole_url = target.url.rstrip("/") + self.settings.path
        url, selective = self.selection.url(target.id, whole_url)
        kind = self.settings.engine_for(target.id)
        previous = self._counters.get(target.id)
        started = self._clock()
        try:
            # One limit for the whole scrape: per-read limits would let a trickling reply run on.
            async with asyncio.timeout(self.settings.timeout_s):
                status, payload = await self._get(url)
                reading: EngineReading | None = None
                selected: frozenset[str] = frozenset()
                if selective and _query_may_be_at_fault(status):
                    # Short of what the whole exposition had (gateway.scrape.select), or
                    # refused: read it whole now, and let the selection learn from the two.
                    if status == 200:
                        with contextlib.suppress(MetricsFormatError):
                            reading, selected = self._read(target.id, payload, kind, previous)
                    else:
                        self.selection.refused(target.id)
                        selective = False
                    if reading is None or not self.selection.complete(target.id, selected):
                        reading = None
                        status, payload = await self._get(whole_url)
            if status in METRICS_ABSENT:
                self._failed(target.id, f"status_{status}")
                return self._own_counts(target.id, publish)
            if status != 200:
                self._failed(target.id, f"status_{status}")
                return None
            if reading is None:
                reading, series = self._read(target.id, payload, kind, previous)
                if selective:
                    self.selection.fell_short(target.id, reading.kind, selected, series)
                else:
                    self.selection.read_whole(target.id, reading.kind, series)
        except MetricsFormatError as exc:  # a GatewayError too: caught first
            log.debug("replica %s metrics unreadable: %s", target.id, exc.message)
            self._failed(target.id, "parse")
            return None
        except (TimeoutError, UpstreamTimeout):
            self._failed(target.id, "timeout")
            return None
        except UpstreamConnectError:
            self._failed(target.id, "connect")
            return None
        except GatewayError:
            # Cut off mid-answer, over-long, malformed: the engine was reached, so it is no
            # connect failure (those alone count toward ejection, as for proxied requests).
            self._failed(target.id, "error")
            return None
        now = self._clock()
        quiet = self._is_quiet(target.id, reading.waiting, reading.running)
        load = EngineLoad(
            waiting=reading.waiting,
            running=reading.running,
            kv_usage=reading.kv_usage,
            prefix_hit_rate=reading.prefix_hit_rate,
            kv_capacity_tokens=reading.kv_capacity_tokens,
            scraped_at=now,
            grace_s=self.settings.quiet_grace_s if quiet else 0.0,
        )
        if target.id in self._missing:
            self._missing.discard(target.id)
            log.info("replica %s exposes its engine load again", target.id)
        self._counters[target.id] = reading.counters
        self._kinds[target.id] = reading.kind
        self._loads[target.id] = load
        if self.metrics is not None:
            self.metrics.scrapes.labels(target.id).inc()
            self.metrics.duration.observe(now - started)
        if self._health is not None:
            self._health.scrape_succeeded(target.id)
        self._pending[target.id] = load
        if self.share is not None:
            self.share.offer(target.id, load, reading.kind)
        if publish:
            self.flush()
        return load

    def _read(
        self,
        replica: ReplicaId,
        payload: bytes,
        kind: EngineKind,
        previous: CounterState | None,
    ) -> tuple[EngineReading, frozenset[str]]:
        """`read_engine_series`, or the last reading again when the answer is the same bytes
        as last time and read from the same counters: a quiet engine's selected series do
        not change between reads, and parsing them again gave the same reading."""
        digest = xxhash.xxh3_64_intdigest(payload)
        last = self._last_read.get(replica)
        if last is not None:
            last_digest, last_kind, reading, series = last
            if last_digest == digest and last_kind is kind and previous is reading.counters:
                return reading, series
        reading, series = read_engine_series(_text(payload), kind, previous)
        self._last_read[replica] = (digest, kind, reading, series)
        return reading, series

    async def _get(self, url: str) -> tuple[int, bytes]:
        assert self._client is not None
        response = await self._client.send("GET", url, self._headers)
        try:
            return response.status, await response.read()  # drained: the connection is reused
        except UpstreamConnectError as exc:
            # Dropped after the status line: the engine was reached (see `scrape_once`).
            raise UpstreamError(exc.message) from exc
        finally:
            await response.aclose()

    def _own_counts(self, replica: ReplicaId, publish: bool) -> EngineLoad:
        """The engine serves no `/metrics`: publish an empty load marked `engine=False`, so
        routing and admission judge the replica by the gateway's own in-flight and token
        counts instead of holding it to one request at a time (unknown load)."""
        if replica not in self._missing:
            self._missing.add(replica)
            log.warning(
                "replica %s exposes no engine load (/metrics answered 404; SGLang needs "
                "--enable-metrics): its load is judged by this gateway's own in-flight and "
                "prompt-token counts; bound them with admission.saturation.max_inflight or "
                "max_prompt_tokens",
                replica,
            )
        capacity = self.capacity_of(replica) if self.capacity_of is not None else None
        load = EngineLoad(
            waiting=0.0,
            running=0.0,
            kv_capacity_tokens=capacity,
            scraped_at=self._clock(),
            engine=False,
        )
        self._loads[replica] = load
        self._pending[replica] = load
        if self.share is not None:
            self.share.offer(replica, load, None)
        if publish:
            self.flush()
        return load

    def flush(self) -> None:
        """Hand the loads scraped since the last flush to the listener, in one burst.

        Each publish invalidates the cluster's view; publishing in bursts bounds the view
        rebuilds per second by the flush rate instead of by the number of replicas.
        """
        pending, self._pending = self._pending, {}
        if self._on_load is not None:
            for replica, load in pending.items():
                self._on_load(replica, load)

    def _failed(self, replica: ReplicaId, reason: str) -> None:
        # The old snapshot is kept: it turns stale (unknown = saturated) on its own, at the
        # busy limit: the grace of a quiet load covers a read put off, not one that failed.
        load = self._loads.get(replica)
        if load is not None and load.grace_s:
            self._loads[replica] = self._pending[replica] = replace(load, grace_s=0.0)
        if self.metrics is not None:
            self.metrics.errors.labels(replica, reason).inc()
        if self._health is not None:
            self._health.scrape_failed(replica, reason)

    def _reconcile(self) -> None:
        current = {t.id: t for t in self._targets()}
        share = self.share
        scraped = current if share is None else {r: t for r, t in current.items() if share.owns(r)}
        for replica in list(self._tasks):
            if replica not in scraped:
                self._tasks.pop(replica).cancel()
                # Another gateway scrapes it now; a later lease starts the rate afresh.
                self._counters.pop(replica, None)
        for replica in self._known - current.keys():
            self._loads.pop(replica, None)
            self._pending.pop(replica, None)
            self._counters.pop(replica, None)
            self._kinds.pop(replica, None)
            self._missing.discard(replica)
            self.selection.forget(replica)
            self._last_read.pop(replica, None)
            if share is not None:
                share.forget(replica)
            if self.metrics is not None:
                self.metrics.forget(replica)
        self._known = set(current)
        for replica, target in scraped.items():
            if replica not in self._tasks:
                self._tasks[replica] = asyncio.create_task(
                    self._poll(target), name=f"kvgate-scrape-{replica}"
                )

    async def _share_round(self) -> None:
        share = self.share
        if share is None:
            return
        before = share.owned
        taken = await share.round(sorted(self._known | {t.id for t in self._targets()}))
        for replica in share.woken:  # other gateways began sending these requests
            event = self._quiet.get(replica)
            if event is not None:
                event.set()
        for replica, (load, kind) in taken.items():
            if share.owns(replica):
                continue  # claimed in this round: its own scrape follows
            self._loads[replica] = load
            self._pending[replica] = load
            if kind is not None:
                self._kinds[replica] = kind
            if load.engine:
                self._missing.discard(replica)
            else:
                self._missing.add(replica)
        if share.owned != before:
            self._reconcile()

    async def _share_loop(self) -> None:
        while True:
            self._share_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.share_period()):
                    await self._share_wakeup.wait()
            try:
                await self._share_round()
            except Exception:  # outermost boundary of this task: keep sharing, but say so
                log.exception("shared scrape round failed unexpectedly")
            # redis-py may turn a cancellation that lands inside a pipeline into a connection
            # error, which the round takes as a store failure: the task stays marked as
            # cancelling, and the next `asyncio.timeout` above would swallow its own expiry as
            # that cancel's and loop on, so `stop` would wait for it forever.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError

    def share_period(self) -> float:
        """Seconds to the next shared round: `interval_s`, or one lease period while all is
        quiet (every load held is quiet, nothing in flight here, no request within
        `idle_interval_s`): a quiet engine's holder writes its load once per
        `idle_interval_s`, so reading four times a second found nothing new."""
        share, s = self.share, self.settings
        if share is None or not share.sharing or s.quiet_grace_s <= 0:
            return s.interval_s
        if self._clock() - self._busy_at < s.idle_interval_s:
            return s.interval_s
        if self._in_flight is not None and any(self._in_flight.values()):
            return s.interval_s
        loads = self._loads
        if len(loads) < len(self._known) or any(not load.grace_s for load in loads.values()):
            return s.interval_s  # a busy engine, a failed read, or one not read yet
        return max(s.interval_s, min(s.idle_interval_s, share.lease_period_s))

    async def _supervise(self) -> None:
        period = self.settings.interval_s / FLUSHES_PER_INTERVAL
        ticks = 0
        while True:
            await asyncio.sleep(period)
            self.flush()
            ticks += 1
            if ticks % FLUSHES_PER_INTERVAL == 0:
                self._reconcile()

    def wake(self, replica: ReplicaId) -> None:
        """This gateway sends `replica` a request: read it now if it was quiet (or, when
        another gateway reads it, take in the shared loads now and at the busy rate)."""
        event = self._quiet.get(replica)
        if event is not None:
            event.set()
        share = self.share
        if share is not None and not share.owns(replica):
            load = self._loads.get(replica)
            if load is not None and load.grace_s:  # its holder reads it only now and then
                share.wake_holder(replica)
        if self._clock() - self._busy_at >= self.settings.idle_interval_s:
            self._share_wakeup.set()
        self._busy_at = self._clock()

    def _is_quiet(self, replica: ReplicaId, waiting: float, running: float) -> bool:
        if waiting or running or self.settings.quiet_grace_s <= 0:
            return False
        return self._in_flight is not None and not self._in_flight.get(replica, 0)

    async def _poll(self, target: ScrapeTarget) -> None:
        interval = self.settings.interval_s
        quiet = self.settings.idle_interval_s
        while True:
            started = self._clock()
            load = None
            try:
                load = await self.scrape_once(target, publish=False)
            except Exception:  # outermost boundary of this task: keep scraping, but say so
                log.exception("scraping replica %s failed unexpectedly", target.id)
                self._failed(target.id, "internal")
            if load is None or not load.grace_s:
                await asyncio.sleep(max(0.0, interval - (self._clock() - started)))
                continue
            event = self._quiet[target.id] = asyncio.Event()  # set by `wake`
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, quiet - (self._clock() - started))):
                        await event.wait()
            finally:
                del self._quiet[target.id]
