"""The tokenizer worker process (gateway.kvevents.worker) driven through its own stdin and
stdout, as `ProcessJobs` drives it: length-prefixed pickles in, one answer per frame out,
in order; a bad job fails alone; a bad start is reported, then the worker exits."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from gateway.keys import route_request
from gateway.kvevents.config import TokenizerSettings
from gateway.kvevents.render import SimRenderer
from gateway.kvevents.workers import HEADER_BYTES, frame, run_job
from gateway.types import Endpoint

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16


def run_worker(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gateway.kvevents.worker"],
        input=stdin,
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )


def frames(out: bytes) -> list[Any]:
    got = []
    while out:
        size = int.from_bytes(out[:HEADER_BYTES], "little")
        data = out[HEADER_BYTES : HEADER_BYTES + size]
        assert len(data) == size, "a frame cut short"
        got.append(pickle.loads(data))
        out = out[HEADER_BYTES + size :]
    return got


def job(words: str) -> tuple[dict[str, Any], str, list[int], int]:
    body = {"model": "m", "messages": [{"role": "user", "content": words}]}
    hashes = route_request(
        body, Endpoint.CHAT, "q", block_tokens=64, max_prefix_blocks=4096
    ).prefix_hashes
    return body, Endpoint.CHAT.value, list(hashes), 256


def sim_start() -> bytes:
    return frame((TokenizerSettings(kind="sim").model_dump(mode="json"), BLOCK))


def test_an_empty_input_ends_the_worker_quietly() -> None:
    done = run_worker(b"")
    assert done.returncode == 0
    assert done.stdout == b""


def test_a_tokenizer_that_cannot_load_is_reported_and_the_worker_exits(tmp_path: Path) -> None:
    settings = TokenizerSettings(kind="hf", path=str(tmp_path / "missing.json"))
    done = run_worker(frame((settings.model_dump(mode="json"), BLOCK)) + frame(job("x")))
    assert done.returncode == 1
    [(kind, why)] = frames(done.stdout)
    assert kind == "error"
    assert "No such file" in why  # the cause, as the gateway will log it


def test_jobs_are_answered_in_order_as_in_process() -> None:
    words = [" ".join(f"w{i}-{j}" for j in range(300)) for i in range(3)]
    stdin = sim_start() + b"".join(frame(job(w)) for w in words)
    done = run_worker(stdin)
    assert done.returncode == 0, done.stderr
    answers = frames(done.stdout)
    assert answers[0] == ("ready", None)
    assert [kind for kind, _ in answers[1:]] == ["ok"] * 3
    for w, (_, got) in zip(words, answers[1:], strict=True):
        body, endpoint, hashes, block_bytes = job(w)
        want = run_job(
            SimRenderer(None, BLOCK), None, body, Endpoint(endpoint), hashes, block_bytes, BLOCK
        )
        assert got[0] is not None and want[0] is not None
        assert got[0][0] == want[0][0]
        assert list(got[0][1]) == list(want[0][1])


def test_a_job_that_raises_fails_alone() -> None:
    bad = (None, Endpoint.CHAT.value, [], 256)  # no body at all
    stdin = sim_start() + frame(bad) + frame(job("after the bad one"))
    done = run_worker(stdin)
    assert done.returncode == 0, done.stderr
    answers = frames(done.stdout)
    assert [kind for kind, _ in answers] == ["ready", "error", "ok"]


def test_a_frame_cut_short_ends_the_worker_after_what_it_answered() -> None:
    whole = frame(job("one whole job"))
    cut = frame(job("a job cut short"))[:-5]
    done = run_worker(sim_start() + whole + cut)
    assert done.returncode == 0
    assert [kind for kind, _ in frames(done.stdout)] == ["ready", "ok"]


def test_a_header_cut_short_ends_the_worker() -> None:
    done = run_worker(sim_start() + b"\x01\x02")
    assert done.returncode == 0
    assert frames(done.stdout) == [("ready", None)]
