"""The image's recipe: dependencies from the lock before the source, a base pinned by digest,
OCI labels (deploy/docker/Dockerfile)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "deploy/docker/Dockerfile").read_text().replace("\\\n", " ")
    return [(m[0].upper(), m[1].strip()) for m in re.findall(r"^(\w+)\s+(.*)$", text, re.MULTILINE)]


def test_dependencies_install_from_the_lock_before_the_source_is_copied() -> None:
    steps = instructions()
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    assert len(stages) == 2
    build = steps[stages[0] : stages[1]]
    deps = next(
        i for i, (op, args) in enumerate(build) if op == "RUN" and "-c constraints.txt" in args
    )
    assert any(op == "COPY" and "constraints.txt" in args for op, args in build[:deps])
    source = [i for i, (op, args) in enumerate(build) if op == "COPY" and "gateway" in args]
    assert source and deps < min(source)
    # kvgate's own wheel comes after the source and adds nothing to the locked dependencies.
    own = next(i for i, (op, args) in enumerate(build) if op == "RUN" and "--no-deps" in args)
    assert own > max(source)
    final = next(args for op, args in reversed(steps) if op == "RUN" and "pip install" in args)
    assert "--no-index" in final


def test_the_base_is_pinned_by_digest() -> None:
    arg = next(args for op, args in instructions() if op == "ARG" and "PYTHON_IMAGE=" in args)
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", image), image
    froms = [args for op, args in instructions() if op == "FROM"]
    assert froms and all(args.startswith("${PYTHON_IMAGE}") for args in froms)
    # The lock was made with the base's Python.
    python = image.split(":")[1].split("-")[0]
    header = (ROOT / "constraints.txt").read_text().splitlines()[1]
    assert f"Python {python}," in header


def test_oci_labels_name_the_image_and_its_version() -> None:
    labels = " ".join(args for op, args in instructions() if op == "LABEL")
    found = dict(re.findall(r"(org\.opencontainers\.image\.[a-z.]+)=\"([^\"]*)\"", labels))
    for key in ("title", "description", "licenses", "version", "revision", "created", "base.name"):
        assert found.get(f"org.opencontainers.image.{key}"), key
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    version = next(args for op, args in instructions() if op == "ARG" and "VERSION=" in args)
    assert version == f"VERSION={project['version']}"
    assert found["org.opencontainers.image.licenses"] == project["license"]["text"]
