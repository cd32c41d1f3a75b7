"""Dynamic pool weights: a pure step function and the background task that runs it.

`step` moves at most `max_step` of traffic share per call between two pools:
* off a pool above the high watermark, onto the coolest other pool;
* otherwise onto the cheapest pool under the low watermark, from the priciest pool that
  still has weight.
Between the watermarks nothing moves. A move must be proposed several steps in a row before
it happens, and again before each further move (`dwell_steps` onto a cheaper pool,
`relieve_dwell_steps` off a hot one, `return_dwell_steps` back onto a pool the last move
relieved), and reversing the previous move needs an extra `hysteresis` margin, so neither
a load sitting near a watermark nor a load that answers the weights late (they steer new
sessions only) makes the weights flap.

The task publishes an immutable `WeightSnapshot` each interval; the selector reads one
attribute per request and never waits on the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gateway.pools.config import ControllerSettings, PoolSpec, PoolsSettings
from gateway.pools.latency import with_latency
from gateway.pools.utilisation import pool_utilisation
from gateway.types import ClusterView

log = logging.getLogger(__name__)

_EPS = 1e-9
_MIN_MOVE = 0.01
_EMPTY: Mapping[str, float | None] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Move:
    donor: str
    receiver: str
    code: str
    why: str


@dataclass(frozen=True, slots=True)
class ControllerState:
    """What `step` remembers between calls."""

    last_move: tuple[str, str] | None = None
    last_code: str | None = None
    pending: tuple[str, str, str] | None = None
    streak: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    weights: Mapping[str, float]
    state: ControllerState
    moved: bool
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class WeightSnapshot:
    """Published weights. `reason`/`code` explain the last change, `status` the last step."""

    weights: Mapping[str, float]
    utilisation: Mapping[str, float | None] = field(default_factory=lambda: _EMPTY)
    code: str = "initial"
    reason: str = "initial weights"
    status: str = "initial weights"
    changed_at: float = 0.0
    version: int = 0
    steps: int = 0


def initial_weights(settings: PoolsSettings) -> dict[str, float]:
    """Configured starting shares normalised to 1; equal shares when none are given."""
    names = [p.name for p in settings.pools]
    raw = {n: settings.initial_weights.get(n, 0.0) for n in names}
    if not settings.initial_weights:
        raw = {n: 1.0 for n in names}
    total = sum(raw.values())
    return {n: w / total for n, w in raw.items()}


def _price_order(specs: Mapping[str, PoolSpec]) -> list[str]:
    return sorted(specs, key=lambda n: (specs[n].price_per_replica_hour, n))


def _propose(
    weights: Mapping[str, float],
    util: Mapping[str, float],
    specs: Mapping[str, PoolSpec],
    cfg: ControllerSettings,
    last: tuple[str, str] | None,
) -> Move | None:
    def margin(donor: str, receiver: str) -> float:
        return cfg.hysteresis if last == (receiver, donor) else 0.0

    order = _price_order({n: specs[n] for n in util})
    rank = {n: i for i, n in enumerate(order)}
    for hot in sorted(util, key=lambda n: (-util[n], rank[n])):
        if weights[hot] <= cfg.min_weight + _EPS:
            continue
        cooler = [n for n in util if n != hot and util[n] < util[hot] - cfg.hysteresis]
        if not cooler:
            continue
        receiver = min(cooler, key=lambda n: (util[n], rank[n]))
        if util[hot] > cfg.high_watermark + margin(hot, receiver):
            return Move(
                hot,
                receiver,
                "relieve_hot",
                f"pool {hot} utilisation {util[hot]:.2f} above high watermark "
                f"{cfg.high_watermark:.2f}; moving traffic to {receiver} ({util[receiver]:.2f})",
            )
    for cheap in order:
        donors = [n for n in reversed(order) if rank[n] > rank[cheap]]
        donors = [n for n in donors if weights[n] > cfg.min_weight + _EPS]
        if not donors:
            continue
        donor = donors[0]
        if util[cheap] < cfg.low_watermark - margin(donor, cheap):
            return Move(
                donor,
                cheap,
                "prefer_cheaper",
                f"cheaper pool {cheap} utilisation {util[cheap]:.2f} below low watermark "
                f"{cfg.low_watermark:.2f}; moving traffic from {donor}",
            )
    return None


def _amount(
    move: Move, weights: Mapping[str, float], util: Mapping[str, float], cfg: ControllerSettings
) -> float:
    """How much share to move: at most `max_step`, and no further than a linear model
    (utilisation proportional to share) says is useful, so a move never overshoots into
    the opposite move on the next step."""
    amount = min(cfg.max_step, weights[move.donor] - cfg.min_weight)
    wd, wr = weights[move.donor], weights[move.receiver]
    ud, ur = util[move.donor], util[move.receiver]
    if wr <= _EPS or ur <= _EPS:
        return amount  # nothing to extrapolate from: the step bound alone applies
    if move.code == "relieve_hot":
        # equalise: ud * (wd - a) / wd == ur * (wr + a) / wr
        amount = min(amount, (ud - ur) / (ud / wd + ur / wr))
    else:
        target = (cfg.low_watermark + cfg.high_watermark) / 2
        amount = min(amount, wr * (target / ur - 1))
    return max(amount, 0.0)


def step(
    weights: Mapping[str, float],
    utilisation: Mapping[str, float | None],
    specs: Mapping[str, PoolSpec],
    cfg: ControllerSettings,
    state: ControllerState = ControllerState(),
) -> StepResult:
    """One controller decision. Pure: same inputs, same output.

    Pools whose utilisation is None (no healthy replica) neither give nor take weight.
    """
    util = {n: u for n, u in utilisation.items() if u is not None and n in weights}
    move = _propose(weights, util, specs, cfg, state.last_move) if len(util) > 1 else None
    if move is None:
        return StepResult(
            weights,
            replace(state, pending=None, streak=0),
            False,
            "hold",
            "utilisation within watermarks",
        )
    key = (move.donor, move.receiver, move.code)
    streak = state.streak + 1 if state.pending == key else 1
    dwell = cfg.relieve_dwell_steps if move.code == "relieve_hot" else cfg.dwell_steps
    if (
        move.code == "prefer_cheaper"
        and state.last_code == "relieve_hot"
        and state.last_move == (move.receiver, move.donor)
    ):
        # Weights steer new sessions only, so a relieved pool reads cool long before its
        # load has settled; refilling it on that lagged figure is what makes weights flap.
        dwell = max(dwell, cfg.return_dwell_steps)
    if streak < dwell:
        return StepResult(
            weights,
            replace(state, pending=key, streak=streak),
            False,
            "hold",
            f"waiting ({streak}/{dwell}): {move.why}",
        )
    amount = _amount(move, weights, util, cfg)
    if amount < _MIN_MOVE:
        return StepResult(
            weights,
            replace(state, pending=key, streak=streak),
            False,
            "hold",
            f"converged: {move.why}",
        )
    new = dict(weights)
    new[move.donor] = weights[move.donor] - amount
    new[move.receiver] = weights[move.receiver] + amount
    new = {n: round(w, 6) for n, w in new.items()}
    reason = f"{move.why} ({amount:.2f} moved)"
    # The streak starts again: each further move needs its own dwell, so a pool whose load
    # answers the weights late (they steer new sessions only) is not filled or drained on
    # readings that predate the previous move.
    return StepResult(
        new, ControllerState((move.donor, move.receiver), move.code), True, move.code, reason
    )


def smooth(
    previous: Mapping[str, float | None], sample: Mapping[str, float | None], alpha: float
) -> dict[str, float | None]:
    """Exponential moving average per pool; a pool without a sample restarts from scratch."""
    out: dict[str, float | None] = {}
    for pool, value in sample.items():
        old = previous.get(pool)
        out[pool] = value if value is None or old is None else alpha * value + (1 - alpha) * old
    return out


class WeightController:
    """Runs `step` every `interval_s` against a fresh view and publishes a snapshot."""

    def __init__(
        self,
        settings: PoolsSettings,
        view_source: Callable[[], ClusterView],
        *,
        clock: Callable[[], float] = time.time,
        on_publish: Callable[[WeightSnapshot], None] | None = None,
        latency_source: Callable[[], Mapping[str, float | None]] | None = None,
    ) -> None:
        self._latency_source = latency_source
        self._settings = settings
        self._specs = {p.name: p for p in settings.pools}
        self._view_source = view_source
        self._clock = clock
        self._on_publish = on_publish
        self._state = ControllerState()
        self._task: asyncio.Task[None] | None = None
        self.snapshot = WeightSnapshot(
            MappingProxyType(initial_weights(settings)), changed_at=clock()
        )
        if on_publish is not None:
            on_publish(self.snapshot)

    def tick(self) -> WeightSnapshot:
        """One step now: synchronous and O(replicas), so safe on the event loop."""
        cfg = self._settings.controller
        sample = pool_utilisation(self._view_source(), self._specs)
        if cfg.ttft_target_s is not None and self._latency_source is not None:
            sample = with_latency(
                sample, self._latency_source(), cfg.ttft_target_s, cfg.high_watermark
            )
        util = smooth(self.snapshot.utilisation, sample, cfg.smoothing)
        prev = self.snapshot
        if cfg.enabled:
            result = step(prev.weights, util, self._specs, cfg, self._state)
            self._state = result.state
        else:
            result = StepResult(prev.weights, self._state, False, "static", "controller disabled")
        snap = replace(
            prev,
            utilisation=MappingProxyType(dict(util)),
            status=result.reason,
            steps=prev.steps + 1,
        )
        if result.moved:
            snap = replace(
                snap,
                weights=MappingProxyType(dict(result.weights)),
                code=result.code,
                reason=result.reason,
                changed_at=self._clock(),
                version=prev.version + 1,
            )
            log.info("pool weights %s: %s", dict(result.weights), result.reason)
        self.snapshot = snap
        if self._on_publish is not None:
            self._on_publish(snap)
        return snap

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.controller.interval_s)
            try:
                self.tick()
            except Exception:  # the loop must outlive one bad view; logged with traceback
                log.exception("pool weight controller step failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-pool-controller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
