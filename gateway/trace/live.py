"""The gateway capturing its own traffic as a private trace (opt-in: `trace_capture:`).

An outcome observer (gateway.hooks) copies a few numbers per request into a bounded queue
and returns; when the queue is full the record is dropped and counted, so capture never
slows a request down. A writer thread re-keys the gateway's prefix hashes with the secret
salt, re-chunks them to the trace block size and appends lines to the file.

Source of the hashes: `RouteRequest.prefix_hashes` (gateway.keys), i.e. whole blocks of
the prompt text, up to `session.max_prefix_blocks`. Prompt tokens past the hashed region
become blocks of their own that match nothing (a capped prompt under-states sharing, never
over-states it); raise `session.max_prefix_blocks` to capture long contexts fully.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gateway.errors import ConfigError
from gateway.forecast import Forecast
from gateway.hooks import RequestOutcome
from gateway.trace.capture import BlockHasher, salt_id
from gateway.trace.config import TraceCaptureSettings
from gateway.trace.format import (
    Rechunker,
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    header_line,
    parse_kvgate,
    record_line,
)
from gateway.trace.tokenize import APPROX_TOKENIZER_NAME
from gateway.types import ROUTE_SPECS

log = logging.getLogger(__name__)

# The routes whose traffic a trace is about: those that prefill a prompt and decode (a
# tokenize or an embedding leaves no reusable KV behind).
_GENERATING = frozenset(e.value for e, spec in ROUTE_SPECS.items() if spec.generates)

TOKENIZER_NAME = f"gateway:{APPROX_TOKENIZER_NAME}"
_FLUSH_EVERY = 256


@dataclass(frozen=True, slots=True)
class _Item:
    started_at: float
    prefix_hashes: tuple[int, ...]
    block_tokens: int
    prompt_tokens: int
    completion_tokens: int
    session: str
    forecast: Forecast | None = None
    achieved: int | None = None
    tier: str | None = None
    tier_reason: str | None = None
    tier_score: float | None = None


class GatewayCapture:
    """Observer (`observe`) plus `Service` (`start`/`stop`) writing the trace file."""

    def __init__(self, settings: TraceCaptureSettings, salt: bytes) -> None:
        if not settings.path:
            raise ConfigError("trace_capture.path is required", param="trace_capture.path")
        self.settings = settings
        self.path = Path(settings.path)
        self._hasher = BlockHasher(salt, settings.block_tokens)
        self._key = hashlib.blake2b(salt, digest_size=32, person=b"kvgate-live").digest()
        self._salt_id = salt_id(salt)
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=settings.queue_size)
        self._thread: threading.Thread | None = None
        self._tail_ids = itertools.count()
        self._rechunkers: dict[int, Rechunker] = {}
        self.epoch_s = 0.0
        self.captured = 0
        self.dropped = 0

    # ---- on the request path: O(1), never blocks, never raises ------------------------
    def observe(self, outcome: RequestOutcome) -> None:
        req = outcome.request
        if req is None or outcome.endpoint not in _GENERATING or outcome.replica is None:
            return
        tier = outcome.tier
        item = _Item(
            started_at=outcome.started_at,
            prefix_hashes=req.prefix_hashes,
            block_tokens=req.block_tokens,
            prompt_tokens=outcome.prompt_tokens
            if outcome.prompt_tokens is not None
            else req.prompt_tokens,
            completion_tokens=outcome.completion_tokens or 0,
            session=str(req.session_key),
            forecast=outcome.forecast,
            achieved=outcome.cached_tokens,
            tier=tier.tier if tier is not None else None,
            tier_reason=tier.reason if tier is not None else None,
            tier_score=tier.score if tier is not None else None,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("trace capture queue full: %d records dropped so far", self.dropped)

    # ---- lifespan ------------------------------------------------------------------------
    async def start(self) -> None:
        fh = await asyncio.to_thread(self._open)
        self._thread = threading.Thread(
            target=self._run, args=(fh,), name="kvgate-trace-capture", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        await asyncio.to_thread(self._queue.put, None)
        await asyncio.to_thread(thread.join)
        log.info(
            "trace capture stopped: %d records written, %d dropped", self.captured, self.dropped
        )

    def _open(self) -> BinaryIO:
        header = TraceHeader(
            block_tokens=self.settings.block_tokens,
            tokenizer=TOKENIZER_NAME,
            salt_id=self._salt_id,
            source="gateway",
            epoch_s=round(time.time(), 3),
        )
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as existing:
                try:
                    old = parse_kvgate([existing.readline()], str(self.path)).header
                except TraceFormatError as exc:
                    raise ConfigError(f"cannot append to {self.path}: {exc.message}") from exc
            if old.block_tokens != header.block_tokens or old.salt_id != header.salt_id:
                raise ConfigError(
                    f"cannot append to {self.path}: it was captured with block_tokens"
                    f" {old.block_tokens} and salt id {old.salt_id}, not"
                    f" {header.block_tokens} and {header.salt_id}",
                    param="trace_capture.path",
                )
            self.epoch_s = old.epoch_s if old.epoch_s is not None else header.epoch_s or 0.0
            return open(self.path, "ab")
        self.epoch_s = header.epoch_s or 0.0
        fh = open(self.path, "wb")  # noqa: SIM115 -- returned open; the writer thread closes it
        fh.write(header_line(header))
        fh.flush()
        return fh

    # ---- writer thread -------------------------------------------------------------------
    def _run(self, fh: BinaryIO) -> None:
        pending = 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.settings.flush_interval_s)
                except queue.Empty:
                    if pending:
                        fh.flush()
                        pending = 0
                    continue
                if item is None:
                    break
                fh.write(record_line(self.record_for(item)))
                self.captured += 1
                pending += 1
                if pending >= _FLUSH_EVERY:
                    fh.flush()
                    pending = 0
        finally:
            fh.close()

    def record_for(self, item: _Item) -> TraceRecord:
        """Salted, re-chunked hashes; unhashed tail tokens become blocks matching nothing."""
        bt = self.settings.block_tokens
        key = self._key
        keyed = [
            int.from_bytes(
                hashlib.blake2b(h.to_bytes(8, "little"), key=key, digest_size=8).digest(), "little"
            )
            for h in item.prefix_hashes
        ]
        covered = len(keyed) * item.block_tokens
        whole = covered // bt
        rechunk = self._rechunkers.get(item.block_tokens)
        if rechunk is None:
            rechunk = self._rechunkers[item.block_tokens] = Rechunker(item.block_tokens, bt)
        hashes = list(rechunk(keyed, covered)[:whole])
        n_tokens = max(item.prompt_tokens, whole * bt)
        tail = n_tokens - whole * bt
        if tail > 0:
            tail_id = next(self._tail_ids)
            for i in range(-(-tail // bt)):
                seed = f"tail:{self.epoch_s}:{tail_id}:{i}".encode()
                digest = hashlib.blake2b(seed, key=key, digest_size=8).digest()
                hashes.append(int.from_bytes(digest, "little"))
        last = n_tokens - (len(hashes) - 1) * bt if hashes else 0
        forecast = item.forecast
        return TraceRecord(
            arrival_s=max(0.0, item.started_at - self.epoch_s),
            input_tokens=n_tokens,
            output_tokens=item.completion_tokens,
            block_hashes=tuple(hashes),
            last_block_tokens=last,
            session_id=self._hasher.pseudonym(item.session),
            predicted_cached=forecast.predicted if forecast is not None else None,
            best_cached=forecast.best if forecast is not None else None,
            achieved_cached=item.achieved,
            tier=item.tier,
            tier_reason=item.tier_reason,
            tier_score=item.tier_score,
        )
