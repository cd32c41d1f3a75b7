"""Shared scraping: gateways that share a Redis store scrape each engine once between them.

Each engine has a lease in the store (`SET ... PX`). The live gateways register in a sorted
set (member -> expiry, `scrape.lease_ttl_s`) renewed every third of the TTL; each engine
goes to one of them by rendezvous hashing, so the work spreads evenly and moves only as
gateways come and go. A gateway claims (or renews) the leases of the engines it is
preferred for and lets go of the ones it holds but is no longer preferred for; it never
takes a lease a live member holds. A lease lasts `LEASE_HOLD_TTLS` TTLs and the lease
script runs only when it is due for renewal (every third of that), when the engines or the
members changed, or while an engine this gateway is preferred for is held by another: a
holder's death is read from its membership, not from its leases. When a gateway dies, its
member entry expires within `lease_ttl_s`; the survivors' next membership round sees it
gone and claims its engines at once (a lease whose holder is no live member is free): a
dead holder's engines are scraped again within about `lease_ttl_s * 4 / 3`, during which
their loads age (and turn stale, as after a failed scrape). A gateway of the previous
version (leases of one TTL, renewed every round) takes over a dead new one's engines only
when their leases end.

The lease holder writes each scraped load, stamped with its wall-clock time, to one hash;
the others read the loads of the engines they do not hold from it once per scrape interval
(once per lease round while every load this gateway holds is quiet and it sends no engine
a request: a quiet engine's holder reads it every `scrape.idle_interval_s`) and age them by
that stamp (gateways' clocks are assumed to agree to well under
`scrape.stale_after_s`). One pipeline per round carries the membership, the lease script
when it runs, the writes and the reads (a change of members adds a second round trip), and
every key carries the hash tag `{scrape}`, so on a Redis Cluster that pipeline is one
round trip to one node and the lease script finds all its keys in one slot.

A quiet engine's holder reads it every `scrape.idle_interval_s`, so requests other
gateways send it would show only then. A gateway that begins sending requests to an engine
it does not hold, while that engine's shared load reads quiet, adds the engine to its
holder's wake set in its next round; the holder pops its set every round (once per lease
period while it is quiet itself) and reads those engines at once.

When the store is unreachable (degraded, or a round fails), the gateway scrapes every
engine itself, as a gateway without a shared store does, until a round succeeds again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.scrape.config import EngineKind
from gateway.store.connect import RedisClient
from gateway.store.keys import StoreKeys
from gateway.types import EngineLoad, ReplicaId

log = logging.getLogger("kvgate.scrape")

_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

# KEYS: the members' sorted set, then one lease per engine. ARGV: me, hold ms, now (epoch
# ms), then one mode per lease: "1" claim or renew (when free, mine, or its holder is no live
# member any more), "0" let go (when mine). Answers 1 per lease held after the call.
CLAIM = """
local me, hold, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for i = 2, #KEYS do
  local key = KEYS[i]
  local holder = redis.call('GET', key)
  local free = not holder or holder == me
  if not free then
    local expiry = redis.call('ZSCORE', KEYS[1], holder)
    free = not expiry or tonumber(expiry) < now
  end
  out[i - 1] = 0
  if ARGV[i + 2] == '1' then
    if free then
      redis.call('SET', key, me, 'PX', hold)
      out[i - 1] = 1
    end
  elseif holder == me then
    redis.call('DEL', key)
  end
end
return out
"""

# The membership round runs this many times per lease TTL: a member renews twice before
# its entry expires.
LEASE_ROUNDS_PER_TTL = 3
LEASE_SLACK = 0.05  # of a lease period
# An engine's lease lasts this many lease TTLs and is renewed every third of that: who holds
# it is judged by its holder's membership (renewed every round), so renewing every lease
# every round (the script over every engine, each second) bought nothing but store work.
LEASE_HOLD_TTLS = 10
# Engines popped from this gateway's wake set per round (more wait for the next round).
WAKES_PER_ROUND = 1024


@dataclass(frozen=True, slots=True)
class SharedLoad:
    """A load as another gateway scraped it: `at` is the holder's wall clock."""

    load: EngineLoad
    kind: EngineKind | None
    at: float

    def aged(self, wall_now: float, clock_now: float) -> EngineLoad:
        """The load with `scraped_at` on this gateway's clock, as old as the holder says."""
        return replace(self.load, scraped_at=clock_now - max(0.0, wall_now - self.at))


def encode(load: EngineLoad, kind: EngineKind | None, at: float) -> bytes:
    return orjson.dumps(
        [
            load.waiting,
            load.running,
            load.kv_usage,
            load.prefix_hit_rate,
            load.kv_capacity_tokens,
            load.engine,
            kind.value if kind is not None else None,
            at,
            load.grace_s,
        ]
    )


def decode(raw: bytes) -> SharedLoad | None:
    try:
        # The ninth field (the quiet grace) is new: a gateway of the previous version writes
        # eight, which read as a busy replica's load.
        w, r, kv, hit, cap, engine, kind, at, *rest = orjson.loads(raw)
        grace = float(rest[0]) if rest else 0.0
        load = EngineLoad(
            waiting=float(w),
            running=float(r),
            kv_usage=None if kv is None else float(kv),
            prefix_hit_rate=None if hit is None else float(hit),
            kv_capacity_tokens=None if cap is None else int(cap),
            engine=bool(engine),
            grace_s=grace,
        )
        return SharedLoad(load, None if kind is None else EngineKind(kind), float(at))
    except (orjson.JSONDecodeError, ValueError, TypeError):
        return None  # another version's or a broken entry: as if not there


def preferred(replica: ReplicaId, members: Sequence[str]) -> str:
    """The member that scrapes `replica` (rendezvous hashing: stable as members change)."""
    return max(
        members,
        key=lambda m: hashlib.blake2b(f"{m}\0{replica}".encode(), digest_size=8).digest(),
    )


class ScrapeShare:
    """One gateway's side of the shared scraping; `ScrapeShare.round` runs every interval."""

    def __init__(
        self,
        redis: Callable[[], RedisClient | None],
        keys: StoreKeys,
        instance_id: str,
        *,
        lease_ttl_s: float,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis  # None while the store is degraded
        self.keys = keys
        self.me = instance_id
        self.lease_ttl_s = lease_ttl_s
        self._wall = wall
        self._clock = clock
        # None: not sharing (no store, or it failed): every engine is scraped here.
        self._owned: frozenset[ReplicaId] | None = None
        self._members: tuple[str, ...] = (instance_id,)
        self._preferred: dict[ReplicaId, bool] = {}
        self._preferred_for: tuple[str, ...] = ()
        self._last_lease = -float("inf")
        self._last_claim = -float("inf")
        self._claimed_for: tuple[tuple[ReplicaId, ...], tuple[str, ...]] | None = None
        self.claims = 0  # runs of the lease script
        self._outbox: dict[ReplicaId, bytes] = {}
        # The entry last taken in per engine: an unchanged one is not decoded again (most
        # rounds, as a quiet engine's holder writes it once per scrape.idle_interval_s).
        self._seen: dict[ReplicaId, bytes] = {}
        self._gone: set[ReplicaId] = set()
        # Engines others hold that this gateway began sending requests to while they read
        # quiet (out in the next round), and those others asked this one to read (popped).
        self._wakes_out: set[ReplicaId] = set()
        self.woken: frozenset[ReplicaId] = frozenset()
        self.rounds = 0
        self.failures = 0

    @property
    def sharing(self) -> bool:
        return self._owned is not None

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def owns(self, replica: ReplicaId) -> bool:
        """Whether this gateway scrapes `replica` itself (always, while not sharing)."""
        return self._owned is None or replica in self._owned

    @property
    def owned(self) -> frozenset[ReplicaId] | None:
        return self._owned

    def offer(self, replica: ReplicaId, load: EngineLoad, kind: EngineKind | None) -> None:
        """A load this gateway scraped: written to the store in the next round."""
        self._outbox[replica] = encode(load, kind, self._wall())

    def wake_holder(self, replica: ReplicaId) -> None:
        """This gateway began sending `replica` requests and another holds it: ask the
        holder, in the next round, to read it now (see the module docstring)."""
        if not self.owns(replica):
            self._wakes_out.add(replica)

    def forget(self, replica: ReplicaId) -> None:
        self._outbox.pop(replica, None)
        self._seen.pop(replica, None)
        self._gone.add(replica)

    @property
    def lease_period_s(self) -> float:
        """Seconds between two lease rounds."""
        return self.lease_ttl_s / LEASE_ROUNDS_PER_TTL

    def lease_due(self) -> bool:
        # A round woken a hair early by its timer still renews (else the next renewal
        # would come a whole period later, close to the leases' expiry).
        period = self.lease_period_s
        return self._clock() - self._last_lease >= period * (1 - LEASE_SLACK)

    @property
    def hold_s(self) -> float:
        """How long an engine's lease lasts unless renewed (its holder's death is seen
        sooner, by its membership)."""
        return self.lease_ttl_s * LEASE_HOLD_TTLS

    def _claim_due(self, replicas: tuple[ReplicaId, ...]) -> bool:
        """Whether this membership round runs the lease script: the leases' renewal is
        due, the engines or the members changed since it last ran, or an engine this
        gateway is preferred for is still held by another (a handover in progress)."""
        if self._owned is None or self._claimed_for != (replicas, self._members):
            return True
        if self._clock() - self._last_claim >= self.hold_s / LEASE_ROUNDS_PER_TTL:
            return True
        return any(
            m == "1" and r not in self._owned for r, m in zip(replicas, self._modes(replicas))
        )

    def _claim(self, pipe: Any, replicas: tuple[ReplicaId, ...], now: float) -> None:
        keys = [self.keys.scrape_members(), *(self.keys.scrape_lease(r) for r in replicas)]
        hold_ms = int(self.hold_s * 1000)
        pipe.eval(
            CLAIM, len(keys), *keys, self.me, hold_ms, int(now * 1000), *self._modes(replicas)
        )

    def _claimed(self, replicas: tuple[ReplicaId, ...], held: Sequence[int]) -> None:
        self.claims += 1
        self._last_claim = self._clock()
        self._claimed_for = (replicas, self._members)
        self._owned = frozenset(r for r, h in zip(replicas, held) if h)

    def _modes(self, replicas: Sequence[ReplicaId]) -> list[str]:
        if self._preferred_for != self._members:
            self._preferred.clear()
            self._preferred_for = self._members
        out = []
        for replica in replicas:
            mine = self._preferred.get(replica)
            if mine is None:
                mine = self._preferred[replica] = preferred(replica, self._members) == self.me
            out.append("1" if mine else "0")
        return out

    async def round(
        self, replicas: Sequence[ReplicaId]
    ) -> Mapping[ReplicaId, tuple[EngineLoad, EngineKind | None]]:
        """One pipeline: the leases (every third of the TTL), this gateway's fresh loads
        out, the loads of the engines others hold in. Answers those loads (new ones only);
        on any store failure, stops sharing (every engine scraped here) and answers none."""
        self.woken = frozenset()  # this round's asks only, also when it fails
        redis = self._redis()
        if redis is None:
            self._stop_sharing("the store is degraded")
            return {}
        now = self._wall()
        ttl_ms = int(self.lease_ttl_s * 1000)
        engines = tuple(replicas)
        was_sharing = self.sharing
        lease_round = not was_sharing or self.lease_due()
        claim = lease_round and self._claim_due(engines)
        others = [r for r in replicas if self._owned is not None and r not in self._owned]
        outbox, self._outbox = self._outbox, {}
        gone, self._gone = self._gone, set()
        pipe: Any = redis.pipeline(transaction=False)
        members_key, loads_key = self.keys.scrape_members(), self.keys.scrape_loads()
        if lease_round:
            pipe.zadd(members_key, {self.me: int(now * 1000) + ttl_ms})
            pipe.zremrangebyscore(members_key, "-inf", int(now * 1000))
            pipe.zrange(members_key, 0, -1)
            pipe.pexpire(members_key, 4 * ttl_ms)
            if claim and engines:
                self._claim(pipe, engines, now)
        if outbox:
            pipe.hset(loads_key, mapping=outbox)
            pipe.pexpire(loads_key, 4 * ttl_ms)
        if gone:
            pipe.hdel(loads_key, *gone)
        wakes, self._wakes_out = self._wakes_out, set()
        for holder, asked in self._by_holder(wakes).items():
            wake_key = self.keys.scrape_wakes(holder)
            pipe.sadd(wake_key, *asked)
            pipe.pexpire(wake_key, 4 * ttl_ms)
        popped_at = None
        if was_sharing:
            popped_at = len(pipe)
            pipe.spop(self.keys.scrape_wakes(self.me), WAKES_PER_ROUND)
        if others:
            pipe.hmget(loads_key, others)
        try:
            # A round that outlasts a lease renewal period is a store in trouble.
            async with asyncio.timeout(self.lease_ttl_s / LEASE_ROUNDS_PER_TTL):
                results = await pipe.execute()
                if lease_round:
                    live = tuple(sorted({m.decode() for m in results[2]} | {self.me}))
                    if claim:  # run with the members of the last round
                        self._claimed(engines, results[4] if engines else [])
                    if live != self._members:
                        # Members came or went: who scrapes what changes now, not at
                        # the next renewal (a dead holder's engines are taken over).
                        self._members = live
                        if engines:
                            again: Any = redis.pipeline(transaction=False)
                            self._claim(again, engines, now)
                            (held,) = await again.execute()
                        else:
                            held = []
                        self._claimed(engines, held)
        except _FAILURES as exc:
            self.failures += 1
            self._wakes_out |= wakes
            self._stop_sharing(f"a scrape round failed: {exc!r}")
            return {}
        popped = results[popped_at] if popped_at is not None else None
        self.woken = frozenset(ReplicaId(r.decode()) for r in popped or ())
        self.rounds += 1
        if lease_round:
            if not was_sharing:
                log.info("scraping shared through the store with %d gateway(s)", len(self._members))
            self._last_lease = self._clock()
        return self._taken_in(others, results[-1] if others else [])

    def _by_holder(self, replicas: set[ReplicaId]) -> dict[str, list[ReplicaId]]:
        """The engines grouped by the member that scrapes them (by rendezvous hashing, as
        the leases go; during a handover the ask may miss, and costs a quiet read's wait)."""
        out: dict[str, list[ReplicaId]] = {}
        for replica in replicas:
            if self._owned is not None and replica not in self._owned:
                out.setdefault(preferred(replica, self._members), []).append(replica)
        return out

    def _taken_in(
        self, replicas: Sequence[ReplicaId], raws: Sequence[bytes | None]
    ) -> dict[ReplicaId, tuple[EngineLoad, EngineKind | None]]:
        out: dict[ReplicaId, tuple[EngineLoad, EngineKind | None]] = {}
        wall_now, clock_now = self._wall(), self._clock()
        seen = self._seen
        for replica, raw in zip(replicas, raws):
            if raw is None or seen.get(replica) == raw:
                continue  # nothing new since the last round
            seen[replica] = raw
            shared = decode(raw)
            if shared is None:
                continue
            out[replica] = (shared.aged(wall_now, clock_now), shared.kind)
        return out

    def _stop_sharing(self, why: str) -> None:
        if self._owned is not None:
            log.warning("scraping every engine from this gateway: %s", why)
        self._owned = None
        self._members = (self.me,)
        # A load written before the outage is re-sent by the next scrape anyway.
        self._outbox.clear()
