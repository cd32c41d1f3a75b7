"""Attaches the per-request observer while someone reads the console, detaches it after.

`watched` mode: the first admin read attaches it, a sampler tick `watch_idle_s` after the
last read detaches it. Nobody reading means the proxy runs exactly as without a console.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from gateway.hooks import OutcomeObserver

WatchMode = Literal["watched", "always", "off"]  # the settings' `auto` resolved


class Watch:
    def __init__(
        self,
        observers: list[OutcomeObserver],
        observer: OutcomeObserver,
        mode: WatchMode,
        idle_s: float,
        *,
        on_attach: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_attach = on_attach
        self._observers = observers
        self._observer = observer
        self.mode = mode
        self._idle_s = idle_s
        self._clock = clock
        self._last_read: float | None = None
        self.since: float | None = None  # wall clock of the current attachment
        if mode == "always":
            self._attach()

    @property
    def measuring(self) -> bool:
        return self._observer in self._observers

    @property
    def read_recently(self) -> bool:
        """Whether the console or its JSON was read within `idle_s`."""
        last = self._last_read
        return last is not None and self._clock() - last < self._idle_s

    def touch(self) -> None:
        """An admin read: start measuring (in `watched` mode) and push back the idle end."""
        self._last_read = self._clock()
        if self.mode == "watched" and not self.measuring:
            self._attach()

    def tick(self) -> None:
        if self.mode != "watched" or not self.measuring or self._last_read is None:
            return
        if self._clock() - self._last_read >= self._idle_s:
            self._observers.remove(self._observer)
            self.since = None

    def close(self) -> None:
        if self.measuring:
            self._observers.remove(self._observer)

    def _attach(self) -> None:
        self._on_attach()  # figures restart: a gap unmeasured must not read as one burst
        self._observers.append(self._observer)
        self.since = time.time()
