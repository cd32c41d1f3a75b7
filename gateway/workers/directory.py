"""The supervisor's side of `kvgate serve --workers N`: the workers' shared metrics files.

prometheus-client decides at import time, from `PROMETHEUS_MULTIPROC_DIR`, whether metric
values live in memory (one process) or in memory-mapped files in that directory (several).
The supervisor names a fresh private directory there before the workers spawn, so they
inherit it; files left by an earlier run would add their counts to this one's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def metrics_directory() -> Iterator[Path]:
    """A new directory (mode 0700, under $TMPDIR) named in the environment while the block
    runs; removed with its files, and the variable restored, when it ends."""
    previous = os.environ.get(MULTIPROC_ENV)
    path = Path(tempfile.mkdtemp(prefix="kvgate-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def shared_directory() -> Path | None:
    """The directory this process shares its metrics through, or None (one process)."""
    value = os.environ.get(MULTIPROC_ENV)
    if value and os.path.isdir(value):
        return Path(value)
    return None
