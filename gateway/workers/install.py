"""Wire one worker into the shared `/metrics` when the process has a shared directory."""

from __future__ import annotations

from gateway.state import GatewayState
from gateway.workers.directory import shared_directory
from gateway.workers.service import WorkerMetrics


def install(state: GatewayState) -> None:
    directory = shared_directory()
    if directory is None:
        return  # one process: /metrics is this registry, as before
    worker = WorkerMetrics(state.metrics.registry, directory)
    state.metrics.exposition = worker.exposition
    state.extras["workers"] = worker
    state.services.append(worker)
