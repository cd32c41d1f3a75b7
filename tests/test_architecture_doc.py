"""docs/architecture.md stays a true map: every module, file, CLI command, installer and
`state` hook it names exists, and the lists it claims to give in full (commands,
installers in order, hooks) are the code's."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from gateway.app import FEATURE_INSTALLERS
from gateway.cli import build_parser
from gateway.state import GatewayState

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()

# Fields of GatewayState that are its core, not hooks a feature sets; the router's
# abilities are named as one group beside the policy abilities.
_CORE = {"settings", "cluster", "router", "client", "metrics", "health", "models"}
_ABILITIES = {"router_placed", "router_finished", "router_prefill", "router_cached"}


def _dotted_names() -> set[str]:
    return set(re.findall(r"\b((?:gateway|plugins)(?:\.[A-Za-z_]\w*)+)", DOC))


def _resolves(name: str) -> bool:
    """The longest importable prefix of `name`, then attributes down the rest."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_symbol_named_exists() -> None:
    names = _dotted_names()
    assert len(names) > 20  # the page names the modules it maps
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, missing


def test_every_file_named_exists() -> None:
    files = set(re.findall(r"\b((?:[\w.-]+/)+[\w-]+\.(?:py|md|yaml|sh))\b", DOC))
    assert files
    missing = sorted(
        f
        for f in files
        if not any((base / f).exists() for base in (ROOT, ROOT / "gateway", ROOT / "docs"))
    )
    assert not missing, missing


def test_the_cli_line_lists_every_command_and_only_those() -> None:
    line = re.search(r"^`kvgate ([^`]+)`\.", DOC, re.MULTILINE)
    assert line is not None
    documented = [c.strip().split()[0] for c in line.group(1).split("|")]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert documented == list(sub.choices)


def test_the_installers_are_listed_in_their_order() -> None:
    paragraph = DOC.split("The installers run in this order", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"`(gateway\.[\w.]+)`", paragraph)
    assert documented == [installer.module for installer in FEATURE_INSTALLERS]


def test_every_state_hook_is_in_the_table_and_every_one_named_exists() -> None:
    fields = {f.name for f in dataclasses.fields(GatewayState)}
    named = set(re.findall(r"`state\.(\w+)", DOC))
    assert named <= fields | {n for n in dir(GatewayState) if not n.startswith("_")}, named - fields
    hooks = fields - _CORE - _ABILITIES - {"router_layers"}
    assert not hooks - named, sorted(hooks - named)
    for ability in _ABILITIES:
        assert ability in DOC, ability


@pytest.mark.parametrize("name", ["TracksPrefill", "EstimatesCachedTokens", "ReactsToMembership"])
def test_policy_abilities_named_are_the_registry_protocols(name: str) -> None:
    import gateway.policy

    assert hasattr(gateway.policy, name) and name in DOC
