"""`kvgate trace` through the installed `kvgate` console script, in a child process, on real
files: what a user sees (exit code, stdout, the one-line error on stderr) for good and bad
traces in each format. (In-process CLI paths: test_trace_cli.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gateway.trace.format import read_trace

ROOT = Path(__file__).resolve().parents[2]
# The console script as installed (project.scripts), loaded from this checkout.
LAUNCH = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "(ep,) = entry_points(group='console_scripts', name='kvgate')\n"
    "sys.argv[0] = 'kvgate'\n"
    "sys.exit(ep.load()())\n"
)
MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1030, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 1000, "input_length": 512, "output_length": 1, "hash_ids": [4]},
]


def kvgate(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "m.jsonl"
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in MOONCAKE))
    return path


def test_the_console_script_is_this_checkouts_cli() -> None:
    done = kvgate("trace", "--help")
    assert done.returncode == 0
    for command in ("stats", "convert", "replay", "generate"):
        assert command in done.stdout


def test_convert_mooncake_to_kvgate_and_back(mooncake: Path, tmp_path: Path) -> None:
    mid, back = tmp_path / "k.jsonl", tmp_path / "back.jsonl"
    done = kvgate("trace", "convert", mooncake, "-o", mid, "--to", "kvgate")
    assert done.returncode == 0, done.stderr
    assert b'"kvgate_trace"' in mid.read_bytes().splitlines()[0]
    done = kvgate("trace", "convert", mid, "-o", back, "--to", "mooncake")
    assert done.returncode == 0, done.stderr
    assert back.read_bytes() == mooncake.read_bytes()
    assert read_trace(back).records == read_trace(mooncake).records


def test_stats_as_json_counts_every_request(mooncake: Path) -> None:
    done = kvgate("trace", "stats", mooncake, "--json")
    assert done.returncode == 0, done.stderr
    stats = orjson.loads(done.stdout)
    assert (stats["source"], stats["block_tokens"], stats["requests"]) == ("m.jsonl", 512, 3)
    assert stats["total_input_tokens"] == sum(o["input_length"] for o in MOONCAKE)
    assert stats["total_output_tokens"] == sum(o["output_length"] for o in MOONCAKE)
    assert stats["duration_s"] == 1.0
    # Two of the three prompts open with the same two 512-token blocks.
    assert 0 < stats["hit_rate_infinite"] < 1


def test_an_azure_csv_converts_with_its_arrivals(tmp_path: Path) -> None:
    src, out = tmp_path / "a.csv", tmp_path / "out.jsonl"
    src.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.5,374,44\n"
        "2023-11-16 18:15:47.0,396,109\n"
    )
    done = kvgate("trace", "convert", src, "-o", out, "--to", "kvgate")
    assert done.returncode == 0, done.stderr
    t = read_trace(out)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in t.records] == [
        (0.0, 374, 44),
        (0.5, 396, 109),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read trace"),
        (
            b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}\n',
            "hash_ids",
        ),
        (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,many,1\n", ":2: bad row"),
        (b"when,what\n1,2\n", "expected CSV columns"),
        (b"\xff\xfe\x00\x80", "neither JSON lines"),
    ],
)
def test_a_bad_trace_is_exit_2_with_one_line_saying_why(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.trace"
    if content is not None:
        path.write_bytes(content)
    done = kvgate("trace", "convert", path, "-o", tmp_path / "o", "--to", "kvgate")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("kvgate: ") and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_a_usage_error_is_argparses_exit_2(mooncake: Path) -> None:
    done = kvgate("trace", "convert", mooncake, "--to", "yaml", "-o", "x")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
