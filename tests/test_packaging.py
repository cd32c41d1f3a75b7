"""What installs kvgate: pyproject's dependencies, the constraints (lock) file CI and the image
install from, and the test extra covering every module the code and tests import. CI runs
these in a fresh virtual environment, so a module installed only by hand fails them there."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def requirements() -> list[Requirement]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data = tomllib.load(f)["project"]
    listed = list(data["dependencies"])
    for extra in data["optional-dependencies"].values():
        listed += extra
    return [Requirement(text) for text in listed]


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line.strip())
        assert match, f"constraints.txt: {line!r} is not an exact pin (name==version)"
        found[canonicalize_name(match[1])] = Version(match[2])
    return found


def test_every_dependency_and_extra_is_pinned_within_its_bounds() -> None:
    pinned = pins()
    stale = []
    for req in requirements():
        version = pinned.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            stale.append(f"{req} (constraints.txt: {version or 'no pin'})")
    assert not stale, "refresh the lock with tools/lock.sh: " + ", ".join(stale)


def test_users_get_bounds_and_the_exact_pins_stay_in_the_lock() -> None:
    for req in requirements():
        assert not any(spec.operator in ("==", "===") for spec in req.specifier), str(req)


def imported_modules() -> dict[str, str]:
    """Top-level third-party modules imported anywhere in the code, tests and benchmarks."""
    ours = {"gateway", "plugins", "tests", "loadtests"}
    for folder in ("tests", "loadtests", "deploy"):
        ours |= {path.stem for path in (ROOT / folder).rglob("*.py")}
    found: dict[str, str] = {}
    for folder in ("gateway", "plugins", "tests", "loadtests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_module_the_code_and_tests_import_is_installed() -> None:
    modules = imported_modules()
    # The scan must see the lazy imports too (the chaos fuzzer imports hypothesis in a function).
    assert {"hypothesis", "redis", "openai", "selenium", "matplotlib"} <= set(modules)
    # find_spec, not import: locust patches the standard library when imported.
    missing = [f"{m} ({where})" for m, where in modules.items() if not importlib.util.find_spec(m)]
    assert not missing, "add to pyproject.toml's [test] extra: " + ", ".join(missing)


@pytest.mark.parametrize("path", ["tools/lock.sh", ".ci/run"])
def test_ci_and_the_lock_script_install_into_a_fresh_venv_with_the_constraints(path: str) -> None:
    script = (ROOT / path).read_text()
    assert "-m venv" in script
    if path == ".ci/run":
        assert 'PIP_CONSTRAINT="$PWD/constraints.txt"' in script
        # The README's two commands, unchanged.
        assert "pip install --quiet .\n" in script
        assert "pip install --quiet '.[test]'" in script
        assert "python -m pytest -q\n" in script
