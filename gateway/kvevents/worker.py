"""A tokenizer worker process: `python -m gateway.kvevents.worker`, started by
`gateway.kvevents.workers.ProcessJobs`.

It reads frames from stdin (gateway.kvevents.workers.frame): first the tokenizer settings
and the block size, answered with ("ready", None) once its renderer is built; then jobs,
each answered in order with ("ok", result) or ("error", what went wrong). It exits at the
end of its input. Its stdout carries only frames: anything a library prints goes to stderr.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, BinaryIO

from gateway.kvevents.config import TokenizerSettings
from gateway.kvevents.workers import HEADER_BYTES, frame, make_cache, make_renderer, run_job
from gateway.types import Endpoint


def _read(stream: BinaryIO) -> Any:
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    size = int.from_bytes(header, "little")
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _write(stream: BinaryIO, obj: object) -> None:
    stream.write(frame(obj))
    stream.flush()


def main() -> int:
    # The frames keep the real stdout; fd 1 becomes stderr, for whatever else prints.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    stdin = sys.stdin.buffer
    first = _read(stdin)
    if first is None:
        return 0
    raw, block_size = first
    try:
        settings = TokenizerSettings.model_validate(raw)
        cache = make_cache(settings)
        renderer = make_renderer(settings, cache, block_size)
    except Exception as exc:  # noqa: BLE001 - reported to the gateway, which fails to start
        _write(out, ("error", repr(exc)))
        return 1
    _write(out, ("ready", None))
    while (job := _read(stdin)) is not None:
        body, endpoint, hashes, block_bytes = job
        try:
            result = run_job(
                renderer, cache, body, Endpoint(endpoint), hashes, block_bytes, block_size
            )
        except Exception as exc:  # noqa: BLE001 - one bad prompt fails its job, not the worker
            _write(out, ("error", repr(exc)))
            continue
        _write(out, ("ok", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
