"""Quotas shared by every gateway on one Redis: one script call per request, at most.

`acquire` runs one Lua script that reads each scope's minute counters and in-flight set,
refuses or counts the request, atomically: several gateways enforce one budget. Token
charges and releases are queued and written by a background task (they never wait on
Redis). While the store is degraded, or when the script fails or takes longer than
`auth.quota_timeout_s`, the verdict comes from this process's own counts, which are kept up
to date all along.

A request in flight holds a lease in a sorted set (`CONCURRENCY_LEASE_S`), so a gateway
that dies with requests in flight frees their slots when the leases run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from gateway.auth.limiter import (
    LocalCounters,
    LocalLimiter,
    Ticket,
    TicketIds,
    after_one,
    scope_name,
    verdict_from,
)
from gateway.auth.limits import KINDS, WINDOW_S, Scope, Usage, Verdict, limit_values
from gateway.store.redis import RedisStore

log = logging.getLogger("kvgate.auth")

CONCURRENCY_LEASE_S = 900.0
_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

# KEYS, 7 per scope: requests prev/cur, input prev/cur, output prev/cur, in-flight set.
# ARGV: elapsed share of the minute, counter ttl ms, now ms, lease ms, ticket id, then 4
# limits per scope (-1: none). Returns {ok, refusing scope (1-based)} + 7 values per scope.
_SCRIPT = """
local elapsed = tonumber(ARGV[1])
local n = #KEYS / 7
local out = {1, 0}
local refused = 0
for s = 0, n - 1 do
  local k = s * 7
  local a = 5 + s * 4
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 7], '-inf', ARGV[3])
  for j = 0, 2 do
    local prev = tonumber(redis.call('GET', KEYS[k + 1 + 2 * j]) or '0')
    local cur = tonumber(redis.call('GET', KEYS[k + 2 + 2 * j]) or '0')
    out[#out + 1] = tostring(prev)
    out[#out + 1] = tostring(cur)
    local limit = tonumber(ARGV[a + 1 + j])
    if refused == 0 and limit >= 0 then
      local total = prev * (1 - elapsed) + cur
      if (j == 0 and total + 1 > limit) or (j > 0 and total >= limit) then refused = s + 1 end
    end
  end
  local c = redis.call('ZCARD', KEYS[k + 7])
  out[#out + 1] = tostring(c)
  local cl = tonumber(ARGV[a + 4])
  if refused == 0 and cl >= 0 and c + 1 > cl then refused = s + 1 end
end
if refused > 0 then
  out[1] = 0
  out[2] = refused
  return out
end
for s = 0, n - 1 do
  local k = s * 7
  redis.call('INCR', KEYS[k + 2])
  redis.call('PEXPIRE', KEYS[k + 2], ARGV[2])
  redis.call('ZADD', KEYS[k + 7], tonumber(ARGV[3]) + tonumber(ARGV[4]), ARGV[5])
  redis.call('PEXPIRE', KEYS[k + 7], ARGV[4])
end
return out
"""


class RedisLimiter:
    def __init__(self, store: RedisStore, timeout_s: float = 0.25) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.local = LocalLimiter(LocalCounters(store.local.now_wall))
        self._ids = TicketIds()
        self._script = store.redis.register_script(_SCRIPT)
        self._queue: list[tuple[str, tuple[Any, ...]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- lifecycle (a Service) ------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._flush_loop(), name="kvgate-quota-writes")

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, *_FAILURES):
                await asyncio.wait_for(self._task, 1.0)

    # -- request path ---------------------------------------------------------------------
    async def acquire(self, scopes: Sequence[Scope]) -> Ticket | Verdict:
        ticket_id = self._ids()
        # Local counts first: they decide when Redis cannot, and must then be current.
        local = self.local.acquire_now(scopes, ticket_id)
        if self.store.degraded:
            return local
        now = self.local.counters.wall()
        index = int(now / WINDOW_S)
        elapsed = now / WINDOW_S - index
        keys: list[str] = []
        args: list[Any] = [
            elapsed,
            int(3 * WINDOW_S * 1000),
            int(now * 1000),
            int(CONCURRENCY_LEASE_S * 1000),
            ticket_id,
        ]
        names = self.store.keys
        for scope in scopes:
            name = scope_name(scope)
            for kind in KINDS:
                keys += [names.quota(name, kind, index - 1), names.quota(name, kind, index)]
            keys.append(names.inflight(name))
            args += [-1 if v is None else v for v in limit_values(scope[2])]
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._script(keys=keys, args=args)
        except _FAILURES as exc:
            log.debug("quota script failed, local verdict: %s", exc)
            return local
        usages = [
            Usage(
                tuple(
                    (float(raw[2 + 7 * s + 2 * j]), float(raw[3 + 7 * s + 2 * j])) for j in range(3)
                ),
                int(float(raw[8 + 7 * s])),
            )
            for s in range(len(scopes))
        ]
        refused, headers = verdict_from(scopes, usages, elapsed)
        if int(raw[0]) == 1 or refused is None:
            if isinstance(local, Ticket):
                local.headers = after_one(headers)
                local._limiter = self
                return local
            return Ticket(self, scopes, ticket_id, after_one(headers))
        if isinstance(local, Ticket):
            self.local.release(local)
        return refused

    def window_index(self) -> int:
        return self.local.window_index()

    def add_tokens(self, ticket: Ticket, input_tokens: int, output_tokens: int, index: int) -> None:
        self.local.add_tokens(ticket, input_tokens, output_tokens, index)
        self._queue.append(("tokens", (ticket.scopes, input_tokens, output_tokens, index)))
        self._wake.set()

    def release(self, ticket: Ticket) -> None:
        self.local.release(ticket)
        self._queue.append(("release", (ticket.scopes, ticket.id)))
        self._wake.set()

    # -- background -----------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while not self._closing or self._queue:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch or self.store.degraded:
                if self._closing:
                    return
                continue
            now = self.local.counters.wall()
            oldest = int(now / WINDOW_S) - 1
            pipe = self.store.redis.pipeline(transaction=False)
            names = self.store.keys
            ttl = int(3 * WINDOW_S * 1000)
            for op, fields in batch:
                if op == "tokens":
                    scopes, d_in, d_out, index = fields
                    if index < oldest:
                        continue  # that minute counts no more (a refund of it is moot)
                    for scope in scopes:
                        for kind, amount in ((KINDS[1], d_in), (KINDS[2], d_out)):
                            if amount:
                                key = names.quota(scope_name(scope), kind, index)
                                pipe.incrbyfloat(key, amount)
                                pipe.pexpire(key, ttl)
                else:
                    scopes, ticket_id = fields
                    for scope in scopes:
                        pipe.zrem(names.inflight(scope_name(scope)), ticket_id)
            try:
                async with asyncio.timeout(self.store.settings.connect_timeout_s * 2):
                    await pipe.execute()
            except _FAILURES as exc:
                log.warning("quota writes lost (%d), Redis failed: %s", len(batch), exc)
            if self._closing and not self._queue:
                return
