"""The README's five-minute tour, run as a new user would: its Python blocks in order, with the
official `openai` client, against `kvgate serve` started with no arguments (its embedded
simulated engines). What the tour's comments promise is checked from what the blocks print."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

from gateway.testing.process import kvgate_serve

ROOT = Path(__file__).resolve().parents[1]
TOUR_URL = "http://127.0.0.1:8000"


def tour_blocks(readme: str) -> list[str]:
    """The fenced Python blocks between the tour's heading and the next section."""
    start = readme.index("## A five-minute tour")
    end = readme.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", readme[start:end], flags=re.DOTALL)


def test_the_tour_has_the_blocks_this_test_reads() -> None:
    blocks = tour_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 3, blocks  # the first request, stickiness, streaming
    for block in blocks:
        ast.parse(block)
    assert TOUR_URL in blocks[0]


def test_the_tour_runs_and_keeps_its_promises() -> None:
    blocks = tour_blocks((ROOT / "README.md").read_text())
    namespace: dict[str, object] = {"__name__": "tour"}
    printed: list[list[str]] = []
    # The README's command as it is; only the port differs, so tests can run side by side.
    with kvgate_serve(cwd=ROOT) as (_, port):
        for block in blocks:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                # The README is this repository's own text: running it is the point.
                exec(block.replace(TOUR_URL, f"http://127.0.0.1:{port}"), namespace)
            printed.append(out.getvalue().splitlines())
    first, sticky, streamed = printed

    replica, request_id = first[0].split()
    assert len(request_id) >= 16, first
    assert first[1], "the first request answered nothing"

    assert len(sticky) == 5, sticky
    per_turn, growing, spread = sticky[:2], sticky[2:4], sticky[4]
    assert per_turn[0] == per_turn[1], f"one message per turn moved: {per_turn}"
    assert growing[0] == growing[1], f"the growing user message moved: {growing}"
    replicas = ast.literal_eval(spread)
    assert isinstance(replicas, set)
    # 20 header sessions over the 4 embedded engines: placed by load, so every one is used.
    assert len(replicas) == 4, f"20 sessions did not spread over the replicas: {replicas}"
    assert replica in replicas, (replica, replicas)

    assert "".join(streamed).strip(), "the stream relayed no content"
