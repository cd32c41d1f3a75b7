"""The background half of RedisStore: pending writes, one pipelined flush-and-pull, events.

Everything a request changed since the last sync is written, and everything other
instances changed is read, in one pipeline per `sync_interval_s` (or at once when a
placement moved). Nothing here runs on a request's path.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.store.base import Ejection, PrefixPlacement
from gateway.types import ReplicaId, SessionKey

if TYPE_CHECKING:
    from gateway.store.redis import RedisStore

# Refresh a placement's TTL, or recreate it when Redis lost it (restart, eviction); either
# way answer what Redis holds now, so a diverged local copy converges to one placement.
RECONCILE_LUA = """
if redis.call('PEXPIRE', KEYS[1], ARGV[2]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return redis.call('GET', KEYS[1])
"""
RECONCILE_SHA = hashlib.sha1(RECONCILE_LUA.encode()).hexdigest()

# Delete a placement only if it still points at the departed replica.
FORGET_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_STREAM_READ_MAX = 1000
_RESYNC_CHUNK = 2000
_SCAN_COUNT = 1000


@dataclass
class SyncBatch:
    """Writes queued by requests since the last flush."""

    assigned: dict[SessionKey, tuple[ReplicaId, bool]] = field(default_factory=dict)
    touched: set[SessionKey] = field(default_factory=set)
    forgotten: set[ReplicaId] = field(default_factory=set)
    ejected: dict[ReplicaId, Ejection] = field(default_factory=dict)
    readmitted: set[ReplicaId] = field(default_factory=set)
    linked: dict[str, str] = field(default_factory=dict)

    def pending(self) -> bool:
        """Whether anything waits to be written."""
        return bool(
            self.assigned
            or self.touched
            or self.forgotten
            or self.ejected
            or self.readmitted
            or self.linked
        )

    def take(self) -> SyncBatch:
        taken = SyncBatch(
            self.assigned, self.touched, self.forgotten, self.ejected, self.readmitted
        )
        self.assigned, self.touched, self.forgotten = {}, set(), set()
        self.ejected, self.readmitted = {}, set()
        taken.linked, self.linked = self.linked, {}
        return taken

    def restore(self, taken: SyncBatch) -> None:
        """Put back a batch whose flush failed; newer entries win."""
        self.assigned = {**taken.assigned, **self.assigned}
        self.touched |= taken.touched
        self.linked = {**taken.linked, **self.linked}
        self.forgotten |= taken.forgotten
        self.ejected = {**taken.ejected, **self.ejected}
        self.readmitted |= taken.readmitted - set(self.ejected)


def encode_event(origin: str, kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"o": origin, "k": kind, **fields})


def apply_event(store: RedisStore, event: dict[str, Any]) -> None:
    """Apply a change another instance pushed over pub/sub to the local copy."""
    if event.get("o") == store.instance_id:
        return
    kind = event.get("k")
    local = store.local
    if kind == "s":
        local.local_assign(SessionKey(event["s"]), ReplicaId(event["r"]))
    elif kind == "f":
        local.local_forget(ReplicaId(event["r"]))
    elif kind == "e":
        local.local_eject(Ejection(ReplicaId(event["r"]), float(event["u"]), event.get("m", "")))
    elif kind == "a":
        local.local_readmit(ReplicaId(event["r"]))
    elif kind == "p":
        store.pull_soon()  # prefix placements written after a quiet spell: pull them now


def decode_prefix(fields: dict[bytes, bytes]) -> PrefixPlacement:
    hashes = array("Q")
    hashes.frombytes(fields[b"h"])
    return PrefixPlacement(
        model=fields[b"m"].decode(),
        replica=ReplicaId(fields[b"r"].decode()),
        prefix_hashes=tuple(hashes),
        block_tokens=int(fields[b"b"]),
        origin=fields[b"o"].decode(),
        at=float(fields[b"t"]),
    )


def encode_prefix(p: PrefixPlacement, origin: str) -> dict[Any, Any]:
    return {
        "m": p.model,
        "r": p.replica,
        "h": array("Q", p.prefix_hashes).tobytes(),
        "b": p.block_tokens,
        "o": origin,
        "t": p.at,
    }


Handler = Callable[[Any], None]


async def run_batch(store: RedisStore, *, full: bool) -> None:
    """One flush-and-pull. `full` (after a (re)connect) reconciles every local placement."""
    now = store.local.now_wall()
    batch = store.batch.take()
    prefixes = list(store.prefixes_out)
    store.prefixes_out.clear()
    try:
        if full:
            await store.redis.script_load(RECONCILE_LUA)
            await _reconcile_all(store)
        await _flush(store, batch, prefixes, now)
    except BaseException:
        store.batch.restore(batch)
        store.prefixes_out.extendleft(reversed(prefixes))
        raise
    for replica in batch.forgotten:
        await _purge_replica(store, replica)


async def _reconcile_all(store: RedisStore) -> None:
    placements = list(store.local.local_sessions())
    for start in range(0, len(placements), _RESYNC_CHUNK):
        pipe = store.redis.pipeline(transaction=False)
        chunk = placements[start : start + _RESYNC_CHUNK]
        for session, replica, remaining in chunk:
            ttl = max(1, math.ceil(remaining * 1000))
            pipe.evalsha(RECONCILE_SHA, 1, store.keys.session(session), replica, ttl)
        results = await pipe.execute()
        for (session, replica, remaining), held in zip(chunk, results):
            if held is not None and held.decode() != replica:
                store.local.local_assign(session, ReplicaId(held.decode()), remaining)


async def _flush(
    store: RedisStore,
    batch: SyncBatch,
    prefixes: list[PrefixPlacement],
    now: float,
) -> None:
    keys, local, ttl = store.keys, store.local, store.ttl_ms()
    pipe = store.redis.pipeline(transaction=False)
    handlers: list[Handler | None] = []

    def add(command: Any, handler: Handler | None = None) -> None:
        handlers.append(handler)

    def adopt(session: SessionKey, mine: ReplicaId) -> Handler:
        def handle(held: Any) -> None:
            if held is not None and held.decode() != mine and local.local_peek(session) == mine:
                local.local_assign(session, ReplicaId(held.decode()))

        return handle

    for session, (replica, move) in batch.assigned.items():
        key = keys.session(session)
        if move:
            add(pipe.set(key, replica, px=ttl))
            add(pipe.publish(keys.events(), store.encode_event("s", s=session, r=replica)))
        else:
            add(pipe.evalsha(RECONCILE_SHA, 1, key, replica, ttl), adopt(session, replica))
    for session in batch.touched - batch.assigned.keys():
        held = local.local_peek(session)
        if held is not None:
            key = keys.session(session)
            add(pipe.evalsha(RECONCILE_SHA, 1, key, held, ttl), adopt(session, held))
    for response, root in batch.linked.items():
        add(pipe.set(keys.response_root(response), root, px=ttl))
    for replica in batch.forgotten:
        add(pipe.publish(keys.events(), store.encode_event("f", r=replica)))
    cooldown = 1
    for replica, ejection in batch.ejected.items():
        value = orjson.dumps({"u": ejection.until, "m": ejection.reason})
        add(pipe.hset(keys.ejections(), replica, value))
        event = store.encode_event("e", r=replica, u=ejection.until, m=ejection.reason)
        add(pipe.publish(keys.events(), event))
        cooldown = max(cooldown, math.ceil(ejection.until - now) + 1)
    if batch.ejected:
        add(pipe.expire(keys.ejections(), cooldown, nx=True))
        add(pipe.expire(keys.ejections(), cooldown, gt=True))
    for replica in batch.readmitted:
        add(pipe.hdel(keys.ejections(), replica))
        add(pipe.publish(keys.events(), store.encode_event("a", r=replica)))
    if prefixes and store.quiet:
        # The others sync at the quiet rate too: say there is something to pull.
        add(pipe.publish(keys.events(), store.encode_event("p")))
    for placement in prefixes:
        entry = encode_prefix(placement, store.instance_id)
        add(
            pipe.xadd(
                keys.prefixes(), entry, maxlen=store.settings.prefix_stream_max, approximate=True
            )
        )
    add(pipe.hgetall(keys.ejections()), lambda raw: _pull_ejections(store, raw, now))
    add(
        pipe.xread({keys.prefixes(): store.stream_cursor}, count=_STREAM_READ_MAX),
        lambda raw: _pull_prefixes(store, raw),
    )
    results = await pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, RedisConnectionError):
            raise result
        if isinstance(result, RedisError) and "NOSCRIPT" in str(result):
            raise result
    for handler, result in zip(handlers, results):
        if handler is not None and not isinstance(result, Exception):
            handler(result)


def _pull_ejections(store: RedisStore, raw: dict[bytes, bytes], now: float) -> None:
    remote: dict[ReplicaId, Ejection] = {}
    for field_name, value in raw.items():
        d = orjson.loads(value)
        if d["u"] > now:
            replica = ReplicaId(field_name.decode())
            remote[replica] = Ejection(replica, float(d["u"]), d.get("m", ""))
    # Ejections queued after this batch was taken are not in Redis yet: keep them.
    remote.update(store.batch.ejected)
    for replica in store.batch.readmitted:
        remote.pop(replica, None)
    store.local.local_replace_ejections(remote)


def _pull_prefixes(store: RedisStore, raw: Any) -> None:
    if not raw:
        return
    for _stream, entries in raw:
        for entry_id, fields in entries:
            store.stream_cursor = entry_id.decode()
            placement = decode_prefix(fields)
            if placement.origin != store.instance_id:
                store.local.deliver_prefix(placement)


async def _purge_replica(store: RedisStore, replica: ReplicaId) -> None:
    """Delete the departed replica's placements (SCAN, so Redis is never blocked)."""
    keys: list[bytes] = []
    async for key in store.redis.scan_iter(match=store.keys.session_pattern(), count=_SCAN_COUNT):
        keys.append(key)
        if len(keys) >= _SCAN_COUNT:
            await _forget_keys(store, keys, replica)
            keys = []
    if keys:
        await _forget_keys(store, keys, replica)


async def _forget_keys(store: RedisStore, keys: list[bytes], replica: ReplicaId) -> None:
    pipe = store.redis.pipeline(transaction=False)
    for key in keys:
        pipe.eval(FORGET_LUA, 1, key, replica)
    await pipe.execute()
