"""`SimCluster`: N simulated engines served from the current process and event loop."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Self

from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.metrics import Flavor
from gateway.sim.profiles import HardwareProfile, get_profile
from gateway.sim.server import (
    DEFAULT_BOOTSTRAP_TIMEOUT_S,
    ENGINE_KEEP_ALIVE_S,
    KVEventsOptions,
    SimEngine,
)
from gateway.sim.tokenizer import Tokenizer
from gateway.types import Role


class SimCluster:
    """Start `replicas` engines on consecutive ports (`base_port=0`: any free ports).

    Use as `async with SimCluster(...) as cluster:` or `await start()` / `await stop()`.
    `roles` gives one role per replica (shorter lists repeat their last entry); `faults`
    applies to the replicas listed in `fault_replicas` (all when None). `tokenizer`
    (default: about 4 characters a token) is shared by all engines, and so is `api_key`.
    `kv_events`: every engine publishes its KV cache events over ZMQ, as vLLM does.
    """

    def __init__(
        self,
        replicas: int = 1,
        profile: str | HardwareProfile = "h200-sparse",
        *,
        model: str = "kvgate-sim",
        flavor: Flavor = "vllm",
        seed: int = 0,
        time_scale: float = 1.0,
        roles: Sequence[Role | str] | None = None,
        priority_scheduling: bool = False,
        host: str = "127.0.0.1",
        base_port: int = 0,
        faults: FaultConfig = NO_FAULTS,
        fault_replicas: Sequence[int] | None = None,
        bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
        tokenizer: Tokenizer | None = None,
        api_key: str | None = None,
        keep_alive_s: float = ENGINE_KEEP_ALIVE_S,
        kv_events: KVEventsOptions | None = None,
        metrics_enabled: bool = True,
        low_priority_first: bool = False,
        lora_modules: Sequence[str] = (),
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        prof = get_profile(profile) if isinstance(profile, str) else profile
        role_list = [Role(r) for r in (roles or [Role.BOTH])]
        self.host = host
        self.base_port = base_port
        self.engines: list[SimEngine] = [
            SimEngine(
                prof,
                index=i,
                model_name=model,
                flavor=flavor,
                seed=seed + i,
                time_scale=time_scale,
                role=role_list[min(i, len(role_list) - 1)],
                priority_scheduling=priority_scheduling,
                faults=faults if fault_replicas is None or i in fault_replicas else NO_FAULTS,
                bootstrap_timeout_s=bootstrap_timeout_s,
                tokenizer=tokenizer,
                api_key=api_key,
                keep_alive_s=keep_alive_s,
                kv_events=kv_events,
                metrics_enabled=metrics_enabled,
                low_priority_first=low_priority_first,
                lora_modules=tuple(lora_modules),
            )
            for i in range(replicas)
        ]
        self._started: list[SimEngine] = []

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def model(self) -> str:
        return self.engines[0].model_name

    def roles(self) -> list[Role]:
        return [e.role for e in self.engines]

    async def start(self) -> SimCluster:
        try:
            for i, engine in enumerate(self.engines):
                port = self.base_port + i if self.base_port else 0
                await engine.start(self.host, port)
                self._started.append(engine)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        started, self._started = self._started, []
        for engine in reversed(started):
            await engine.stop()

    async def set_faults(self, index: int, faults: FaultConfig) -> None:
        await self.engines[index].set_faults(faults)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
