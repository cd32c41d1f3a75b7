"""Issue 45's candidate for `bench_lineage.py`: `lineage` with the owed-prefill rule on.

`kvgate-loadtests.lineage_owed:LineageOwed` runs it beside the default `kvgate` (the
same policy with `band_owed_s` unset): a new session from a hot prefix is placed by the
prefill its candidate replicas' active sessions will send (plugins.owed_prefill), in
seconds at their measured prefill speed, and a preamble held by the replica earlier
sessions went to pulls a new one only while that replica owes less than the preamble.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from plugins.lineage import Lineage, LineageConfig


class LineageOwedConfig(LineageConfig):
    band_owed_s: float | None = Field(
        default=0.2,
        ge=0,
        description="seconds of owed prefill within which of the lowest a replica is in "
        "the band (about one main-agent turn's prefill on the simulated engines)",
    )


class LineageOwed(Lineage):
    name: ClassVar[str] = "lineage_owed"
    Config: ClassVar[type[LineageConfig]] = LineageOwedConfig
