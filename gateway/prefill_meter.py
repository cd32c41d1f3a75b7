"""Per replica: the prefill queued there and its prefill speed, measured from its answers.

The gateway tells the meter when it sends a request (with the prompt tokens the replica is
expected not to hold: its uncached prefill) and when the first token comes back. From
that it keeps, per replica:

* **queued prefill**: uncached tokens sent there that have not produced a first token;
* **prefill speed**, tokens per second, learnt online: while a replica has prefill queued,
  every first token that comes back closes an interval since the previous one (or since
  the replica went from idle to busy) during which it prefilled that request's uncached
  tokens. The speed is the ratio of the two sums, each decayed by `memory` per sample, so
  a replica's speed follows its load (decode batches slow prefill down) and its hardware,
  with nothing configured. A replica with fewer than `min_samples` samples borrows the
  mean speed of the measured ones (or has none while none is measured).

Requests whose attempt fails, or that end without a first token, leave the queue without
a sample. Policies read it through `ClusterView.prefill` (a live object, like the
in-flight counts) and never write it. Synchronous, O(1) per call, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.types import ReplicaId

DEFAULT_MEMORY = 0.95  # per sample: about the last 20 first tokens weigh most
MIN_SAMPLES = 3


@dataclass(slots=True)
class _Replica:
    queued: float = 0.0
    requests: int = 0
    mark: float | None = None  # the last first token, or when it went busy
    tokens: float = 0.0  # decayed sums of the intervals' tokens and seconds
    seconds: float = 0.0
    samples: int = 0


class PrefillMeter:
    __slots__ = ("_mean", "_open", "_replicas", "_request_tokens", "memory", "min_samples")

    def __init__(self, memory: float = DEFAULT_MEMORY, min_samples: int = MIN_SAMPLES) -> None:
        self.memory = memory
        self.min_samples = max(1, min_samples)
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._open: dict[str, tuple[ReplicaId, float]] = {}
        self._mean: float | None = None
        self._request_tokens = 0.0

    def dispatched(self, request_id: str, replica: ReplicaId, tokens: float, now: float) -> None:
        """`request_id` was sent to `replica` with `tokens` of uncached prefill (a retry
        replaces its earlier attempt)."""
        self.abandoned(request_id)
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        if not r.requests:
            r.mark = now  # idle until now: the interval starts here
        tokens = max(0.0, tokens)
        # The mean uncached prefill of a request: what one the engine reports waiting costs.
        self._request_tokens += (1.0 - self.memory) * (tokens - self._request_tokens)
        r.queued += tokens
        r.requests += 1
        self._open[request_id] = (replica, tokens)

    def first_token(self, request_id: str, now: float) -> None:
        """Its first token is back: the replica prefilled its tokens since the last mark."""
        entry = self._open.pop(request_id, None)
        if entry is None:
            return
        replica, tokens = entry
        r = self._release(replica, tokens)
        if r is None:
            return
        if r.mark is not None and tokens > 0:
            elapsed = max(0.0, now - r.mark)
            m = self.memory
            r.tokens = r.tokens * m + tokens
            r.seconds = r.seconds * m + elapsed
            r.samples += 1
            self._mean = None
        r.mark = now if r.requests else None

    def abandoned(self, request_id: str) -> None:
        """The attempt failed or ended without a first token: no sample; idempotent."""
        entry = self._open.pop(request_id, None)
        if entry is not None:
            r = self._release(*entry)
            if r is not None and not r.requests:
                r.mark = None

    def _release(self, replica: ReplicaId, tokens: float) -> _Replica | None:
        r = self._replicas.get(replica)
        if r is None:
            return None
        r.queued = max(0.0, r.queued - tokens) if r.requests > 1 else 0.0
        r.requests = max(0, r.requests - 1)
        return r

    def forget(self, replica: ReplicaId) -> None:
        self._replicas.pop(replica, None)
        self._mean = None

    # -- readers ------------------------------------------------------------------------

    def queued_tokens(self, replica: ReplicaId) -> float:
        r = self._replicas.get(replica)
        return r.queued if r is not None else 0.0

    def queued_requests(self, replica: ReplicaId) -> int:
        r = self._replicas.get(replica)
        return r.requests if r is not None else 0

    def mean_request_tokens(self) -> float:
        return self._request_tokens

    def measured(self, replica: ReplicaId) -> float | None:
        """The replica's own measured speed (tokens/s), or None before enough samples."""
        r = self._replicas.get(replica)
        if r is None or r.samples < self.min_samples or r.seconds <= 0:
            return None
        return r.tokens / r.seconds

    def mean_speed(self) -> float | None:
        """The mean of the measured replicas' speeds, or None while none is measured."""
        if self._mean is None:
            speeds = [s for s in map(self.measured, self._replicas) if s is not None]
            self._mean = sum(speeds) / len(speeds) if speeds else 0.0
        return self._mean or None

    def speed(self, replica: ReplicaId) -> float | None:
        """Tokens/s: the replica's measured speed, else the cluster's mean, else None."""
        own = self.measured(replica)
        return own if own is not None else self.mean_speed()
