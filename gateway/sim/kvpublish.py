"""`KVEventPublisher`: the simulated engine's KV event stream, as vLLM publishes it.

A thread owns a PUB socket (multipart ``[topic, seq, payload]``, seq from 0, 8 bytes
big-endian) and optionally a ROUTER replay socket: a request ``[identity, b"", start]`` is
answered with every buffered ``[topic, seq, payload]`` numbered `start` or later, then
``[b"", -1, b""]``, as vLLM 0.33 and SGLang 0.5.23 do (``replay_topic=False``: the older
``[seq, payload]`` / ``[-1, b""]``). Batches are positional with map events by default
(``layout="mixed"``), as both engines send them (tests/fixtures/engines). `publish` only
queues, so the engine's step loop never waits on a socket.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from gateway.kvevents.wire import EventBatch, Layout, encode_batch, encode_seq

log = logging.getLogger(__name__)

_POLL_S = 0.02


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        layout: Layout = "mixed",
        replay_topic: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.layout: Layout = layout
        self.replay_topic = replay_topic
        self.published = 0
        self.replays_served = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Tests drop batches on purpose (a slow subscriber past the high-water mark).
        self.drop_next = 0

    def start(self) -> None:
        """Bind (resolving a `*` port) before returning, so `endpoint` is final."""
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        if self._error is not None:
            raise RuntimeError(f"cannot bind the KV event publisher: {self._error}")

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(5.0)

    def publish(self, batch: EventBatch) -> None:
        if self._thread is not None:
            self._queue.put(batch)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            pub.close(0)
            ctx.term()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = encode_batch(batch, self.layout)
                self._buffer.append((seq, payload))
                if self.drop_next > 0:
                    self.drop_next -= 1
                else:
                    pub.send_multipart((self.topic, encode_seq(seq), payload))
                seq += 1
                self.published = seq
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a replay request of %d frames", len(frames))
            return
        identity, _, start_frame = frames
        start = int.from_bytes(start_frame, "big", signed=True)
        head = (identity, b"", self.topic) if self.replay_topic else (identity, b"")
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart((*head, encode_seq(seq), payload))
        end = (identity, b"", b"") if self.replay_topic else (identity, b"")
        sock.send_multipart((*end, encode_seq(-1), b""))
        self.replays_served += 1
