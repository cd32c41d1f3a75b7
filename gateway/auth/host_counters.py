"""Quota counters shared by the worker processes of one `kvgate serve --workers N`.

Without a Redis store each worker would enforce the whole budget on its own (a 60/min key
served 120 by two workers). The workers share a directory already (their metrics,
gateway.workers.directory); the counters live in a small memory-mapped file there: a fixed
table of slots, one per scope name, each holding the minute index, the previous and
current minute's counts per kind and the requests in flight. Every read-check-count runs
under an exclusive `flock` on the file (a few microseconds; the two workers of a host never
wait on each other for longer than one such update), so the verdicts are as exact as one
process's.

Limits: a worker killed with requests in flight leaves their concurrency slots counted
until the gateway restarts (the file is new each run); with `store.backend: redis` leases
expire instead. A table that fills up (more than `SLOTS` keys and tenants with limits)
counts the overflow per worker, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import xxhash

from gateway.auth.limiter import Clock, LocalCounters
from gateway.auth.limits import KINDS, WINDOW_S, Usage

log = logging.getLogger("kvgate.auth")

FILE_NAME = "kvgate_quota_counters.bin"
SLOTS = 4096
# name hash, minute index, previous minute per kind, current minute per kind, in flight.
_SLOT = struct.Struct("<Qq3d3dq")
_EMPTY = (0.0, 0.0, 0.0)


class HostCounters(LocalCounters):
    """`LocalCounters` whose state is the shared file's (same interface, same arithmetic)."""

    def __init__(self, directory: Path, wall: Clock) -> None:
        super().__init__(wall)
        path = directory / FILE_NAME
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = SLOTS * _SLOT.size
        with self._flock():
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._held = 0  # re-entrant: acquire holds the lock across its reads and writes
        self._overflow = LocalCounters(wall)
        self._warned = False

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if self._held:
            self._held += 1
            try:
                yield
            finally:
                self._held -= 1
            return
        with self._flock():
            self._held = 1
            try:
                yield
            finally:
                self._held = 0

    def _slot(self, name: str) -> int | None:
        key = xxhash.xxh64_intdigest(name.encode()) or 1
        start = key % SLOTS
        for i in range(SLOTS):
            at = (start + i) % SLOTS
            found = struct.unpack_from("<Q", self._map, at * _SLOT.size)[0]
            if found == key:
                return at
            if found == 0:
                _SLOT.pack_into(self._map, at * _SLOT.size, key, 0, *_EMPTY, *_EMPTY, 0)
                return at
        if not self._warned:
            self._warned = True
            log.warning("the shared quota table is full: further scopes count per worker")
        return None

    def _read(self, at: int, index: int) -> tuple[int, list[float], list[float], int]:
        """The slot's counts rolled forward to minute `index`."""
        fields = _SLOT.unpack_from(self._map, at * _SLOT.size)
        stored, previous, current = fields[1], list(fields[2:5]), list(fields[5:8])
        if stored < index - 1:
            previous, current = [0.0] * len(KINDS), [0.0] * len(KINDS)
        elif stored == index - 1:
            previous, current = current, [0.0] * len(KINDS)
        return fields[0], previous, current, fields[8]

    def _write(
        self, at: int, key: int, index: int, previous: list[float], current: list[float], n: int
    ) -> None:
        _SLOT.pack_into(self._map, at * _SLOT.size, key, index, *previous, *current, n)

    def usage(self, name: str, now: float) -> Usage:
        with self.locked():
            at = self._slot(name)
            if at is None:
                return self._overflow.usage(name, now)
            _, previous, current, inflight = self._read(at, int(now / WINDOW_S))
        return Usage(tuple(zip(previous, current)), inflight)

    def add(
        self, name: str, kind: int, amount: float, now: float, index: int | None = None
    ) -> None:
        with self.locked():
            at = self._slot(name)
            if at is None:
                self._overflow.add(name, kind, amount, now, index)
                return
            current_index = int(now / WINDOW_S)
            key, previous, current, inflight = self._read(at, current_index)
            target = current_index if index is None else index
            counts = (
                current
                if target == current_index
                else previous
                if target == current_index - 1
                else None
            )
            if counts is not None:
                counts[kind] = max(0.0, counts[kind] + amount)
            self._write(at, key, current_index, previous, current, inflight)

    def _step_inflight(self, name: str, step: int) -> None:
        with self.locked():
            at = self._slot(name)
            if at is None:
                if step > 0:
                    self._overflow.enter(name)
                else:
                    self._overflow.leave(name)
                return
            index = int(self.wall() / WINDOW_S)
            key, previous, current, inflight = self._read(at, index)
            self._write(at, key, index, previous, current, max(0, inflight + step))

    def enter(self, name: str) -> None:
        self._step_inflight(name, 1)

    def leave(self, name: str) -> None:
        self._step_inflight(name, -1)
