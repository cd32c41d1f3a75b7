"""Replica health: active `/health` probes plus passive failure detection.

State machine per replica (a circuit breaker):

* HEALTHY: takes traffic. `failure_threshold` consecutive probe failures -> EJECTED, and
  only a probe success resets that count: a `/metrics` scrape or a proxied answer is not a
  probe (a vLLM whose engine core died answers 503 on `/health` and 200 on `/metrics`).
  Passively, `failure_threshold` consecutive connect failures (a refused or timed-out
  connect, a reset before any response byte) of proxied requests or scrapes eject too.
  What one request earns by itself (its own response timeout, a 4xx) is not counted, or
  one client could eject every replica. Passive evidence never ejects the last replica
  that takes traffic; probes still can.
* Outliers (`gateway.outlier`): a replica whose 5xx answers, over different requests,
  come 5 in a row or stand far above the rest of the fleet's is ejected for
  `outlier.base_ejection_s` (longer each time), while at most `outlier.max_ejection_share`
  of the fleet is outlier-ejected, and never the last replica in service.
* A stalled replica (its `/health` still answers, its engine does not) is caught by a
  canary: when a proxied request waits out its response-header timeout, the monitor sends
  that replica a one-token request of the same model with a short deadline. A healthy
  engine answers it at once even while it works on an over-long request; one that does not
  is ejected (never the last in service). At most one canary per replica is in flight.
* EJECTED: no traffic for `cooldown_s` (an outlier: its ejection time); after that the
  next probe success -> HALF_OPEN. A connect ejection (passive) ends at the first probe
  success instead: the probe just connected.
  Without active probing, the cooldown's end alone moves it to HALF_OPEN.
* HALF_OPEN: takes traffic on trial. One failure -> EJECTED again;
  `success_threshold` successes (probes or proxied answers, never scrapes) -> HEALTHY.

Only the health of the replica changes; its ring positions stay, so sessions come back when
it recovers. Probes never block a request: they run in a lifespan task.

A quiet replica is probed every `idle_interval_s` instead of every `interval_s`: healthy,
its last probe passed, its engine load (`EngineLoad.grace_s`, set by the scraper for a
replica with nothing running or waiting) says so, and this gateway sent it nothing within
`idle_interval_s`. Over an idle fleet the probes were the largest share of a gateway's idle
CPU (every replica, every 2 s). The first request to a quiet replica probes it at once
(`wake`), a failed probe brings back `interval_s`, and any other state (ejected, half-open,
no load or a stale one) is probed at `interval_s`, so a quiet engine whose core died is out
within `idle_interval_s + (failure_threshold - 1) * interval_s`.

Probes are not shared between gateways (unlike `/metrics` scrapes, gateway.scrape.shared):
each gateway probes every replica, so a failed probe takes the replica out of its service
without waiting on a lease takeover or the store, and still does while the store is down.
Ejections are shared through the store (gateway.store.install).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import orjson

from gateway.cluster import Cluster
from gateway.errors import GatewayError, UpstreamConnectError, UpstreamTimeout
from gateway.outlier import CONSECUTIVE, OutlierDetector, fingerprint
from gateway.settings import HealthSettings
from gateway.types import ReplicaId
from gateway.upstream import Timeouts, UpstreamClient

log = logging.getLogger("kvgate.health")


class Health(str, Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


# Why a replica was ejected (the `reason` of kvgate_replica_ejections_total).
PROBE, CONNECT, STALLED = "probe", "connect", "stalled"


@dataclass(slots=True)
class _Tracker:
    state: Health = Health.HEALTHY
    probe_failures: int = 0  # reset only by a probe success
    passive_failures: int = 0  # connect failures of proxied requests and scrapes
    successes: int = 0
    ejected_until: float = 0.0
    outlier: bool = False  # the current ejection is an outlier ejection
    reason: str = ""  # why the current ejection (PROBE, CONNECT, STALLED, an outlier's)
    outlier_times: int = 0  # grows the next outlier ejection (decays while healthy)
    healthy_since: float = 0.0


class HealthMonitor:
    def __init__(
        self,
        cluster: Cluster,
        client: UpstreamClient,
        settings: HealthSettings,
        *,
        clock: Callable[[], float] | None = None,
        on_change: Callable[[ReplicaId, Health], None] | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.headers = headers  # the engines' API key, if they need one
        self.settings = settings
        self.clock = clock or cluster.clock
        self.on_change = on_change
        self._trackers: dict[ReplicaId, _Tracker] = {}
        self._probe_timeouts = Timeouts(
            connect_s=settings.timeout_s,
            response_headers_s=settings.timeout_s,
            read_s=settings.timeout_s,
        )
        self._canary_timeouts = Timeouts(
            connect_s=settings.timeout_s,
            response_headers_s=settings.canary_timeout_s,
            read_s=settings.canary_timeout_s,
        )
        self._canaries: dict[ReplicaId, asyncio.Task[bool]] = {}
        self.canaries_failed = 0
        self.outliers = OutlierDetector(settings.outlier, self.clock)
        self.ejections: Counter[tuple[ReplicaId, str]] = Counter()
        self._probed_at: dict[ReplicaId, float] = {}  # when each replica's last probe began
        self._busy_at: dict[ReplicaId, float] = {}  # this gateway's last request to it began
        self._woken: set[ReplicaId] = set()
        self._wakeup = asyncio.Event()
        cluster.on_busy(self.wake)

    def state(self, replica: ReplicaId) -> Health:
        return self._tracker(replica).state

    def _tracker(self, replica: ReplicaId) -> _Tracker:
        tracker = self._trackers.get(replica)
        if tracker is None:
            tracker = self._trackers[replica] = _Tracker()
        return tracker

    def ejected_for(self, replica: ReplicaId) -> float:
        """Seconds left of the replica's current ejection (0 when it is not ejected)."""
        tracker = self._trackers.get(replica)
        if tracker is None or tracker.state is not Health.EJECTED:
            return 0.0
        return max(0.0, tracker.ejected_until - self.clock())

    def outlier_ejected(self, replica: ReplicaId) -> bool:
        tracker = self._trackers.get(replica)
        return tracker is not None and tracker.state is Health.EJECTED and tracker.outlier

    def _set(
        self, replica: ReplicaId, tracker: _Tracker, state: Health, evidence: str = ""
    ) -> None:
        if tracker.state is state:
            return
        failures = max(tracker.probe_failures, tracker.passive_failures)
        tracker.state = state
        tracker.probe_failures = tracker.passive_failures = tracker.successes = 0
        self.cluster.set_healthy(replica, state is not Health.EJECTED)
        if state is Health.EJECTED:
            why = f"after {failures} consecutive failure(s); last: " if failures else ""
            log.warning(
                "replica %s ejected for %.1f s %s%s",
                replica,
                max(0.0, tracker.ejected_until - self.clock()),
                why,
                evidence or "unknown",
            )
            self.outliers.reset(replica)
        else:
            if state is Health.HEALTHY:
                tracker.healthy_since = self.clock()
                tracker.outlier = False
            log.info("replica %s is now %s", replica, state.value)
        if self.on_change is not None:
            self.on_change(replica, state)

    def _eject(
        self,
        replica: ReplicaId,
        tracker: _Tracker,
        reason: str,
        evidence: str,
        seconds: float | None = None,
    ) -> None:
        tracker.ejected_until = self.clock() + (
            self.settings.cooldown_s if seconds is None else seconds
        )
        tracker.outlier = seconds is not None
        tracker.reason = reason
        self.ejections[(replica, reason)] += 1
        self._set(replica, tracker, Health.EJECTED, evidence)

    def record_success(self, replica: ReplicaId, *, probe: bool = False) -> None:
        tracker = self._tracker(replica)
        if tracker.state is Health.HEALTHY:
            if probe:
                tracker.probe_failures = 0
            else:
                tracker.passive_failures = 0
            return
        if tracker.state is Health.EJECTED:
            # A probe that connects and passes contradicts the evidence of a connect
            # ejection at once (as Envoy's successful_active_health_check_uneject_host):
            # under a stalled event loop or a burst of refused connects a healthy replica
            # was taken out, and with it out a dead last one could no longer be.
            lifted = tracker.reason == CONNECT
            if probe and (lifted or self.clock() >= tracker.ejected_until):
                self._set(replica, tracker, Health.HALF_OPEN)
                tracker.successes = 1
            return
        tracker.successes += 1
        if tracker.successes >= self.settings.success_threshold:
            self._set(replica, tracker, Health.HEALTHY)

    def record_failure(
        self, replica: ReplicaId, *, passive: bool = False, evidence: str = ""
    ) -> None:
        """One failure of `replica` (a probe's, or a connect failure when `passive`);
        `evidence` says what happened (logged on ejection)."""
        tracker = self._tracker(replica)
        if tracker.state is Health.EJECTED:
            return
        if passive:
            tracker.passive_failures += 1
            count = tracker.passive_failures
        else:
            tracker.probe_failures += 1
            count = tracker.probe_failures
        if tracker.state is Health.HALF_OPEN or count >= self.settings.failure_threshold:
            if passive and self._last_in_service(replica):
                return
            self._eject(replica, tracker, CONNECT if passive else PROBE, evidence)

    def _last_in_service(self, replica: ReplicaId) -> bool:
        cluster = self.cluster
        return not any(r != replica and cluster.is_healthy(r) for r in cluster.members)

    def passive_failure(self, replica: ReplicaId, error: GatewayError | None = None) -> None:
        """A proxied request to `replica` failed with `error`.

        Only a connect error (refused, timed out, reset before any response byte) counts:
        a wait for one of the gateway's own pooled connections, the request's own timeout
        and any status the engine answered are not held against the replica (a timeout is
        judged by `stalled`).
        """
        if self.settings.passive and isinstance(error, UpstreamConnectError):
            self.record_failure(replica, passive=True, evidence=f"proxied request: {error.message}")

    def answered_5xx(self, replica: ReplicaId, path: str, body: bytes, status: int) -> None:
        """`replica` answered `status` (>= 500) to the request `body` sent to `path`: books
        it for outlier detection, and ejects the replica if it now stands out."""
        if not self.settings.passive or replica not in self.cluster.members:
            return
        tracker = self._tracker(replica)
        if tracker.state is Health.EJECTED:
            return
        others = [r for r in self.cluster.members if r != replica]
        reason = self.outliers.failed(replica, path, fingerprint(path, body), status, others)
        if reason is None:
            return
        share = self.outliers.share(replica)
        if self._last_in_service(replica):
            log.warning("replica %s is an outlier (%s) but is the last in service", replica, reason)
            return
        if not self._may_outlier_eject():
            log.warning(
                "replica %s is an outlier (%s) but outlier.max_ejection_share is reached",
                replica,
                reason,
            )
            return
        o = self.settings.outlier
        now = self.clock()
        if tracker.outlier_times and tracker.healthy_since:
            healthy_for = now - tracker.healthy_since
            tracker.outlier_times = max(0, tracker.outlier_times - int(healthy_for / o.interval_s))
        tracker.outlier_times += 1
        seconds = min(o.base_ejection_s * tracker.outlier_times, o.max_ejection_s)
        what = (
            f"{o.consecutive_5xx} consecutive 5xx answers to different requests"
            if reason == CONSECUTIVE
            else f"a 5xx share of {share:.0%} over different requests, far above the fleet's"
        )
        self._eject(replica, tracker, reason, f"outlier: {what} (last {status})", seconds)

    def _may_outlier_eject(self) -> bool:
        members = self.cluster.members
        allowed = max(1, math.floor(self.settings.outlier.max_ejection_share * len(members)))
        return sum(1 for r in members if self.outlier_ejected(r)) < allowed

    async def stalled(self, replica: ReplicaId, body: bytes) -> bool:
        """A request (`body`, which names the model) waited out its response-header timeout
        on `replica`: ask a canary whether the replica or the request is to blame.

        True when the canary timed out too (the replica is then ejected, unless it is the
        last in service): the request was innocent and may go elsewhere. Concurrent callers
        share one canary per replica.
        """
        if not (self.settings.passive and self.settings.canary):
            return False
        if self.state(replica) is Health.EJECTED:
            return True
        task = self._canaries.get(replica)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._canary(replica, body))
            self._canaries[replica] = task
            task.add_done_callback(lambda _t: self._canaries.pop(replica, None))
        return await asyncio.shield(task)

    async def _canary(self, replica: ReplicaId, body: bytes) -> bool:
        try:
            model = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            return False  # not a JSON object: nothing to ask the engine for
        if not isinstance(model, str) or replica not in self.cluster.members:
            return False
        ask = orjson.dumps({"model": model, "prompt": "ok", "max_tokens": 1})
        url = self.cluster.url_of(replica) + "/v1/completions"
        headers = [*self.headers, (b"content-type", b"application/json")]
        started = time.monotonic()
        try:
            resp = await self.client.send("POST", url, headers, ask, timeouts=self._canary_timeouts)
            try:
                await resp.read()
            finally:
                await resp.aclose()
        except UpstreamTimeout as err:
            self.canaries_failed += 1
            self._stalled(
                replica,
                f"canary after a request timed out: {err.message} "
                f"({time.monotonic() - started:.1f} s)",
            )
            return True
        except GatewayError:
            return False  # refused or reset: the probes and passive connect errors judge that
        return False

    def _stalled(self, replica: ReplicaId, evidence: str) -> None:
        tracker = self._tracker(replica)
        if tracker.state is Health.EJECTED:
            return
        if self._last_in_service(replica):
            log.warning(
                "replica %s looks stalled (%s) but is the last in service", replica, evidence
            )
            return
        self._eject(replica, tracker, STALLED, evidence)

    def passive_success(self, replica: ReplicaId, path: str | None = None) -> None:
        """A proxied request to `path` got an answer below 500."""
        tracker = self._trackers.get(replica)
        if tracker is not None and tracker.state is not Health.HEALTHY:
            self.record_success(replica)
        elif tracker is not None:
            tracker.passive_failures = 0
        if path is not None and self.settings.outlier.enabled:
            self.outliers.succeeded(replica, path)

    def scrape_success(self, replica: ReplicaId) -> None:
        """A `/metrics` scrape answered: the replica is reachable (its connect failures
        reset), nothing more; a scrape neither clears a failed probe nor re-admits."""
        tracker = self._trackers.get(replica)
        if tracker is not None:
            tracker.passive_failures = 0

    def tick(self) -> None:
        """Move cooled-down ejected replicas to half-open when nothing probes them."""
        now = self.clock()
        for replica, tracker in self._trackers.items():
            if tracker.state is Health.EJECTED and now >= tracker.ejected_until:
                self._set(replica, tracker, Health.HALF_OPEN)

    async def probe(self, replica: ReplicaId) -> bool:
        if replica not in self.cluster.members:
            return False  # removed while the probe round was being scheduled
        self._probed_at[replica] = self.clock()
        url = self.cluster.url_of(replica) + self.settings.path
        try:
            resp = await self.client.send(
                "GET", url, self.headers, None, timeouts=self._probe_timeouts
            )
        except GatewayError as err:
            self.record_failure(replica, evidence=f"probe {self.settings.path}: {err.message}")
            return False
        try:
            await resp.read()
            ok = 200 <= resp.status < 300
            evidence = f"probe {self.settings.path} answered {resp.status}"
        except GatewayError as err:
            ok = False
            evidence = f"probe {self.settings.path}: {err.message}"
        finally:
            await resp.aclose()
        if ok:
            self.record_success(replica, probe=True)
            return True
        self.record_failure(replica, evidence=evidence)
        return False

    async def probe_all(self) -> None:
        replicas = list(self.cluster.members)
        await asyncio.gather(*(self.probe(r) for r in replicas))

    def wake(self, replica: ReplicaId) -> None:
        """This gateway sends `replica` a request: probe it now if it was probed as quiet."""
        now = self.clock()
        recent = now - self._probed_at.get(replica, -math.inf) < self.settings.interval_s
        if self.quiet(replica, now) and not recent:
            self._woken.add(replica)
            self._wakeup.set()
        self._busy_at[replica] = now

    def quiet(self, replica: ReplicaId, now: float) -> bool:
        """Whether `replica` is probed every `idle_interval_s` (see the module docstring)."""
        s = self.settings
        if s.idle_interval_s <= s.interval_s:
            return False
        tracker = self._trackers.get(replica)
        if tracker is not None and (tracker.state is not Health.HEALTHY or tracker.probe_failures):
            return False
        if self.cluster.in_flight.get(replica, 0):
            return False
        if now - self._busy_at.get(replica, -math.inf) < s.idle_interval_s:
            return False
        load = self.cluster.load_of(replica)
        return (
            load is not None and load.grace_s > 0 and load.is_fresh(now, self.cluster.stale_after)
        )

    def due(self, now: float) -> list[ReplicaId]:
        """The replicas whose next probe is due at `now` (rounds run every `_tick`)."""
        s = self.settings
        slack = self._tick() / 2
        out = []
        for replica in self.cluster.members:
            last = self._probed_at.get(replica)
            if last is None:
                out.append(replica)
                continue
            period = s.idle_interval_s if self.quiet(replica, now) else s.interval_s
            if now - last >= period - slack:
                out.append(replica)
        return out

    def _tick(self) -> float:
        # Rounds every half interval when quiet replicas wait longer, so that both periods
        # land on a round (2 s and 5 s with the defaults); otherwise once per interval.
        s = self.settings
        return s.interval_s / 2 if s.idle_interval_s > s.interval_s else s.interval_s

    async def _probe_round(self, woken: bool) -> None:
        members = self.cluster.members
        for table in (self._probed_at, self._busy_at):
            if len(table) > len(members):
                for replica in [r for r in table if r not in members]:
                    del table[replica]
        # A round woken by a request probes only what it woke: the others keep their round.
        replicas = [] if woken else self.due(self.clock())
        replicas += [r for r in self._woken if r in members and r not in replicas]
        self._woken.clear()
        await asyncio.gather(*(self.probe(r) for r in replicas))

    async def run(self) -> None:
        """Lifespan task: probe each replica every `interval_s`, a quiet one every
        `idle_interval_s`, a woken one at once (or only tick if disabled)."""
        woken = False
        try:
            while True:
                try:
                    if self.settings.enabled:
                        await self._probe_round(woken)
                    else:
                        self.tick()
                except Exception:  # the prober must outlive any single bad round
                    log.exception("health probe round failed")
                if not self._woken:  # a request during the round: go again at once
                    self._wakeup.clear()
                woken = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._tick()):
                        await self._wakeup.wait()
                        woken = True
        finally:
            for task in list(self._canaries.values()):
                task.cancel()
