"""How one gauge merges across worker processes (`--workers N`): the vocabulary the
metrics modules declare and gateway.workers applies, on the ground floor so that a metrics
module need not import the workers package."""

from __future__ import annotations

from typing import Literal

MergeMode = Literal["sum", "max", "min", "latest", "worker"]
MERGE_MODES: frozenset[str] = frozenset({"sum", "max", "min", "latest", "worker"})
