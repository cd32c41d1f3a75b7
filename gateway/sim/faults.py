"""Fault injection for reliability tests: what a broken replica looks like from outside.

Set at start-up (CLI flags) or at run time (`POST /admin/faults` with this JSON shape; the
body replaces the whole fault set, `{}` clears it):

* ``slow``: extra seconds (real time) before the engine starts on a request.
* ``error``: answer inference requests with this HTTP status (vLLM's error body);
  ``error_rate`` < 1 fails only that fraction, deterministically from the seed.
* ``refuse``: close the listening socket, so connections are refused; ``refuse_for``
  re-opens it (same port) after that many seconds, since an engine that refuses
  connections cannot be told over HTTP to stop refusing.
* ``stall``: after this many streamed tokens (0: right after the headers) stop sending but
  keep the connection open, on every API that streams (chat, completions, Responses,
  Messages); a non-streaming request never gets an answer.
* ``unhealthy``: `/health` answers 503.
* ``hard_marker``: a non-streamed chat/completions request whose prompt contains this text
  is answered with ``finish_reason: "length"`` (a small model failing a hard request), for
  ``hard_fail_rate`` of them (deterministically from the seed); the tokens are generated
  as usual. Tiered models' escalation is tested with it (docs/tiers.md).
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field


class FaultConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    slow: float = Field(default=0.0, ge=0.0, le=3600.0)
    error: int | None = Field(default=None, ge=400, le=599)
    error_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    refuse: bool = False
    refuse_for: float | None = Field(default=None, gt=0.0)
    stall: int | None = Field(default=None, ge=0)
    unhealthy: bool = False
    hard_marker: str | None = Field(default=None, min_length=1)
    hard_fail_rate: float = Field(default=1.0, ge=0.0, le=1.0)

    @property
    def active(self) -> bool:
        return self != FaultConfig()


NO_FAULTS = FaultConfig()


class FaultState:
    """The faults currently applied to one engine, and the seeded dice for `error_rate`."""

    def __init__(self, config: FaultConfig = NO_FAULTS, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self.injected_errors = 0
        self.stalled = 0

    def fails_hard(self, prompt: str) -> bool:
        marker = self.config.hard_marker
        if marker is None or marker not in prompt:
            return False
        return self.config.hard_fail_rate >= 1.0 or self._rng.random() < self.config.hard_fail_rate

    def should_error(self) -> int | None:
        status = self.config.error
        if status is None:
            return None
        if self.config.error_rate < 1.0 and self._rng.random() >= self.config.error_rate:
            return None
        self.injected_errors += 1
        return status
