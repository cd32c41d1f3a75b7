"""`EventIntake`: one background thread subscribed to every replica's KV event publisher.

The thread owns the ZMQ sockets (a SUB per replica, a socket monitor to see connects and
disconnects, a DEALER for replay requests) and decodes payloads, so neither socket waits
nor msgpack decoding run on the event loop. It hands each decoded batch to the loop
through a `LoopInbox` (in order, a slice of the loop's time at a time); the loop side
(`EventFeed`) applies it to the index, so the index is only ever touched by one thread.

Resynchronisation, per replica (see gateway.kvevents.sequence for the verdicts):

* connected, with a replay endpoint: ask it for everything from batch 0 at once (an idle
  engine is known before traffic reaches it); synced if its buffer still starts at 0,
  otherwise the first batch decides, as below;
* first batch or a reset numbered 0: the cache was empty at that point: clear, synced;
* a gap, a first batch above 0, a reset above 0, a reconnect: ask the replay endpoint for
  the missing batches (vLLM's ROUTER protocol: send the start number, receive
  ``[topic, seq, payload]`` frames (or, from older publishers, ``[seq, payload]``) until
  seq -1; a history from 0 is folded first, see
  gateway.kvevents.fold). Complete coverage keeps the replica synced;
  otherwise (no replay endpoint, buffer rolled over, timeout) the replica's index is
  cleared and marked warming, and routing uses the approximate index for it meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash
import zmq
from zmq.utils.monitor import parse_monitor_message

from gateway.kvevents.fold import fold_history
from gateway.kvevents.inbox import LoopInbox
from gateway.kvevents.rechunk import Rechunker
from gateway.kvevents.sequence import SeqTracker
from gateway.kvevents.wire import (
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    decode_seq,
    encode_seq,
)
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.kvevents")

POLL_MS = 100
# A connection counts once the ZMTP handshake is done (libzmq 4.3+), else once connected.
_UP_EVENT: int = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)


RANK_MARK = "#dp"


@dataclass(frozen=True, slots=True)
class Source:
    replica: ReplicaId
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    # The data-parallel rank publishing here (rank r on port + r): each rank is a stream of
    # its own, with its own numbering, replay and index, under one replica.
    rank: int = 0

    @property
    def stream(self) -> ReplicaId:
        """What the feed and the index know this stream as: the replica for rank 0, else
        `<replica>#dp<rank>` (gateway.kvevents.evidence answers for the replica with the
        best of its ranks)."""
        return self.replica if not self.rank else stream_id(self.replica, self.rank)


def stream_id(replica: ReplicaId, rank: int) -> ReplicaId:
    return replica if not rank else ReplicaId(f"{replica}{RANK_MARK}{rank}")


def replica_of(stream: ReplicaId) -> ReplicaId:
    """The replica a stream belongs to (itself for rank 0)."""
    head, mark, rank = stream.rpartition(RANK_MARK)
    return ReplicaId(head) if mark and rank.isdigit() else stream


class FeedSink(Protocol):
    """What the intake tells the loop (each method is called on the event loop)."""

    def batch(self, replica: ReplicaId, seq: int, batch: EventBatch) -> None: ...

    def reset(self, replica: ReplicaId, complete: bool, reason: str) -> None:
        """Start the replica's index over: synced when nothing before is missing, else
        warming."""
        ...

    def recovered(self, replica: ReplicaId, reason: str) -> None:
        """Lost batches were replayed: the index is whole again."""
        ...

    def connection(self, replica: ReplicaId, up: bool) -> None: ...

    def gap(self, replica: ReplicaId, missed: int) -> None: ...

    def malformed(self, replica: ReplicaId) -> None: ...


class _Sub:
    __slots__ = ("monitor", "rechunk", "replay", "rolled", "socket", "source", "tracker", "ups")

    def __init__(
        self, source: Source, socket: zmq.Socket[bytes], monitor: zmq.Socket[bytes]
    ) -> None:
        self.source = source
        self.socket = socket
        self.monitor = monitor
        self.replay: zmq.Socket[bytes] | None = None
        self.tracker = SeqTracker()
        # The publisher's replay buffer no longer held batch 0 when last asked (it only
        # moves on): asking again on the first batch would fetch the whole buffer for
        # nothing.
        self.rolled = False
        self.ups = 0  # connections made (the first is the join, any later a reconnect)
        # Set once the engine shows a page size other than kvgate's block size.
        self.rechunk: Rechunker | None = None


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class EventIntake:
    """A `Service`: `start()` spawns the thread, `stop()` joins it."""

    def __init__(
        self,
        sources: tuple[Source, ...],
        sink: FeedSink,
        *,
        replay_timeout_s: float = 1.0,
        hwm: int = 100_000,
        dynamic: bool = False,
        block_size: int | None = None,
    ) -> None:
        self.sources = sources
        # kvgate's block size: an engine paging at another size is re-cut to it
        # (gateway.kvevents.rechunk); None: events are passed on as they come.
        self.block_size = block_size
        # Sources found later (gateway.kvevents.discover): the thread subscribes to them.
        self.dynamic = dynamic
        self._added: queue.SimpleQueue[tuple[ReplicaId, tuple[Source, ...], bool]] = (
            queue.SimpleQueue()
        )
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.hwm = hwm
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inbox: LoopInbox | None = None

    async def start(self) -> None:
        if self._thread is not None or not (self.sources or self.dynamic):
            return
        self._inbox = LoopInbox(asyncio.get_running_loop())
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        await asyncio.to_thread(thread.join, 5.0)

    def add(self, source: Source) -> None:
        """Subscribe to one more publisher (any thread; taken up within `POLL_MS`)."""
        self._added.put((source.replica, (source,), True))

    def replace(self, replica: ReplicaId, sources: tuple[Source, ...]) -> None:
        """The replica publishes on `sources` now (one per DP rank; none: stop following
        it): streams no longer listed are dropped (their index cleared, shown down), new
        ones subscribed, unchanged ones kept as they are (any thread)."""
        self._added.put((replica, tuple(s for s in sources if s.replica == replica), False))

    # -- thread side --------------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: object) -> None:
        if self._inbox is not None:
            self._inbox.post(fn, *args)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        subs: dict[zmq.Socket[bytes], _Sub] = {}
        monitors: dict[zmq.Socket[bytes], _Sub] = {}
        poller = zmq.Poller()

        def subscribe(source: Source) -> None:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _UP_EVENT)
            sock.connect(source.endpoint)
            sub = _Sub(source, sock, monitor)
            subs[sock], monitors[monitor] = sub, sub
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)

        def close(sub: _Sub) -> None:
            poller.unregister(sub.socket)
            poller.unregister(sub.monitor)
            subs.pop(sub.socket, None)
            monitors.pop(sub.monitor, None)
            sub.socket.disable_monitor()
            sub.monitor.close(0)
            sub.socket.close(0)
            if sub.replay is not None:
                sub.replay.close(0)
            stream = sub.source.stream
            self._post(self.sink.reset, stream, False, "source_changed")
            self._post(self.sink.connection, stream, False)

        def update(replica: ReplicaId, sources: tuple[Source, ...], only_add: bool) -> None:
            current = [sub for sub in subs.values() if sub.source.replica == replica]
            if not only_add:
                for sub in current:
                    if sub.source not in sources:
                        close(sub)
            have = {sub.source for sub in current}
            for source in sources:
                if source not in have:
                    subscribe(source)

        try:
            for source in self.sources:
                subscribe(source)
            while not self._stop.is_set():
                while not self._added.empty():
                    update(*self._added.get())
                for sock, _ in poller.poll(POLL_MS):
                    if sock in monitors:
                        self._on_monitor(ctx, monitors[sock])
                    else:
                        self._on_message(ctx, subs[sock])
        except Exception:  # the thread's boundary: log once, routing falls back to approximate
            log.exception("KV event intake stopped")
            for sub in subs.values():
                self._post(self.sink.connection, sub.source.stream, False)
        finally:
            for sub in subs.values():
                sub.socket.disable_monitor()
                sub.monitor.close(0)
                sub.socket.close(0)
                if sub.replay is not None:
                    sub.replay.close(0)
            ctx.term()

    def _on_monitor(self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub) -> None:
        event = parse_monitor_message(sub.monitor.recv_multipart())["event"]
        replica = sub.source.stream
        if event == zmq.EVENT_DISCONNECTED:
            self._post(self.sink.connection, replica, False)
        elif event == _UP_EVENT and sub.source.replay_endpoint is not None:
            sub.ups += 1
            if sub.tracker.last is None:
                # Joined (or back before any batch came): what the engine holds is in its
                # buffer now; waiting for its next batch to ask would leave an idle engine
                # unknown until traffic reaches it.
                self._replay_all(ctx, sub, "join")
            elif sub.ups > 1:  # (not a batch read before the first connection's event)
                # Reconnected: batches sent meanwhile are gone from the SUB socket; the
                # replay endpoint tells now whether any were missed (or the publisher
                # changed).
                self._reconnected(ctx, sub)

    def _on_message(self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub) -> None:
        frames = sub.socket.recv_multipart()
        replica = sub.source.stream
        try:
            if len(frames) != 3:
                raise WireError(f"expected 3 frames, got {len(frames)}")
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except WireError as exc:
            log.warning("replica %s: malformed KV event message: %s", replica, exc)
            self._post(self.sink.malformed, replica)
            return
        tracker = sub.tracker
        verdict = tracker.classify(seq)
        if verdict == "dup":
            return
        if verdict == "next":
            self._deliver(sub, seq, batch, frames[2])
            return
        if verdict == "gap":
            assert tracker.last is not None
            self._post(self.sink.gap, replica, seq - tracker.last - 1)
            self._catch_up(ctx, sub, tracker.last + 1, seq, "gap")
        elif seq == 0:
            self._reset(sub, True, "start" if verdict == "first" else "reset")
        elif verdict == "first" and sub.rolled:
            self._reset(sub, False, "join_cleared")
        else:
            self._catch_up(ctx, sub, 0, seq, "join" if verdict == "first" else "reset")
        self._deliver(sub, seq, batch, frames[2])

    def _deliver(self, sub: _Sub, seq: int, batch: EventBatch, payload: bytes) -> None:
        sub.tracker.advance(seq, _digest(payload))
        self._emit(sub, seq, batch)

    def _emit(self, sub: _Sub, seq: int, batch: EventBatch) -> None:
        """Hand a batch to the loop, re-cut to kvgate's block size when the engine pages at
        another size."""
        if sub.rechunk is None and self.block_size is not None:
            size = self.block_size
            if any(isinstance(e, BlockStored) and e.block_size != size for e in batch.events):
                sub.rechunk = Rechunker(size)
                log.info(
                    "replica %s: engine pages of %d tokens, re-cut to blocks of %d",
                    sub.source.stream,
                    next(e.block_size for e in batch.events if isinstance(e, BlockStored)),
                    size,
                )
        if sub.rechunk is not None:
            batch = sub.rechunk.batch(batch)
        self._post(self.sink.batch, sub.source.stream, seq, batch)

    def _reset(self, sub: _Sub, complete: bool, reason: str) -> None:
        if sub.rechunk is not None:
            sub.rechunk.clear()
        self._post(self.sink.reset, sub.source.stream, complete, reason)

    def _catch_up(
        self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub, start: int, upto: int, reason: str
    ) -> None:
        """Fill [start, upto) from the replay endpoint, or clear the replica (warming)."""
        replica = sub.source.stream
        got = self._replay(ctx, sub, start)
        wanted = [(s, b) for s, b, _ in got if start <= s < upto]
        if [s for s, _ in wanted] == list(range(start, upto)):
            batches = [b for _, b in wanted]
            if start == 0:
                self._reset(sub, True, f"{reason}_replayed")
                batches = fold_history(batches)
            for s, b in zip(range(start, upto), batches, strict=True):
                self._emit(sub, s, b)
            if start > 0:
                self._post(self.sink.recovered, replica, f"{reason}_replayed")
            return
        self._reset(sub, False, f"{reason}_cleared")

    def _reconnected(self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub) -> None:
        tracker = sub.tracker
        assert tracker.last is not None
        last = tracker.last
        got = self._replay(ctx, sub, last)
        if got and got[0][0] == last and got[0][2] == tracker.last_digest:
            # Same publisher: whatever came after `last` is what we missed.
            ordered = [(s, b, d) for s, b, d in got if s > last]
            if [s for s, _, _ in ordered] == list(range(last + 1, last + 1 + len(ordered))):
                for s, b, d in ordered:
                    self._emit(sub, s, b)
                    tracker.advance(s, d)
                tracker.replayed_upto = tracker.last if tracker.last is not None else -1
                self._post(self.sink.recovered, sub.source.stream, "reconnect_replayed")
                return
        # A different publisher (restarted engine) or a rolled-over buffer: start over.
        tracker.last = None
        if not self._replay_all(ctx, sub, "reconnect"):
            self._reset(sub, False, "reconnect_cleared")

    def _replay_all(self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub, reason: str) -> bool:
        """Rebuild the replica from the publisher's whole history, if its buffer still
        holds it from batch 0; False, having changed nothing, otherwise."""
        full = self._replay(ctx, sub, 0)
        if not full or full[0][0] != 0 or [s for s, _, _ in full] != list(range(len(full))):
            return False
        tracker = sub.tracker
        self._reset(sub, True, f"{reason}_replayed")
        folded = fold_history([b for _, b, _ in full])
        for (s, _, d), b in zip(full, folded, strict=True):
            self._emit(sub, s, b)
            tracker.advance(s, d)
        tracker.replayed_upto = tracker.last if tracker.last is not None else -1
        return True

    def _replay(
        self, ctx: zmq.Context[zmq.Socket[bytes]], sub: _Sub, start: int
    ) -> list[tuple[int, EventBatch, int]]:
        """Batches numbered `start` and later from the publisher's replay buffer, in order
        ([] without an endpoint, when the buffer does not hold `start`, on timeout or on a
        malformed answer)."""
        endpoint = sub.source.replay_endpoint
        if endpoint is None:
            return []
        if sub.replay is None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sub.replay = sock
        sock = sub.replay
        out: list[tuple[int, EventBatch, int]] = []
        useful = True
        try:
            sock.send_multipart([b"", encode_seq(start)])
            timeout_ms = int(self.replay_timeout_s * 1000)
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                # vLLM 0.33 and SGLang 0.5.23 answer [empty, topic, seq, payload] (end:
                # [empty, empty, -1, empty]); older publishers left the topic out.
                if len(frames) == 4:
                    frames = [frames[0], frames[2], frames[3]]
                elif len(frames) != 3:
                    raise WireError("a replay frame is [empty, topic?, seq, payload]")
                seq = decode_seq(frames[1])
                if seq == -1:
                    if start == 0:
                        sub.rolled = not useful
                    return out if useful else []
                if not out and seq != start:
                    # The buffer no longer reaches back to `start`, and every caller needs
                    # it to: read the rest off the socket without decoding it (a rolled
                    # buffer is thousands of batches of token ids).
                    useful = False
                if useful:
                    out.append((seq, decode_batch(frames[2]), _digest(frames[2])))
        except (WireError, zmq.ZMQError) as exc:
            log.warning("replica %s: replay from %d failed: %s", sub.source.stream, start, exc)
        # Timed out or broken: a late answer must not be read as the next one.
        sock.close(0)
        sub.replay = None
        return []
