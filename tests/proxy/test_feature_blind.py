"""The request path is feature-blind (docs/architecture.md, "Import rules"): no module of
gateway/proxy imports a feature. Features reach the stages through `state` hooks
(gateway.hooks) and the scope keys and protocols of gateway.scope; shared vocabulary lives
on the ground floor (gateway/types.py, gateway/asgi.py, gateway/scope.py, ...).

The imports are read with `ast` from the source, so a new one fails here before review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gateway
from gateway.app import FEATURE_INSTALLERS

PACKAGE = Path(gateway.__file__).parent
STAGES = PACKAGE / "proxy"

# Subpackages that are the core itself, not features: the stages and the upstream seam.
CORE_PACKAGES = frozenset({"gateway.proxy", "gateway.upstream"})

# What is still imported against the rule, each with why; the test fails when one goes
# (take it off this list) as when one is added.
KNOWN: dict[tuple[str, str], str] = {
    # The key's priority ceiling is compared with a body `priority` naming an engine
    # integer, which only admission's class map translates.
    ("identity.py", "gateway.admission.classes"): "admission's class map",
}


def feature_modules() -> frozenset[str]:
    """Every subpackage of gateway but the core ones (auth, pd, tiers, tracing, sim, ...),
    and every module an installer lives in (top-level features such as gateway.accounting)."""
    packages = {f"gateway.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    installers = {installer.module for installer in FEATURE_INSTALLERS}
    return frozenset((packages - CORE_PACKAGES) | installers)


def imported(path: Path) -> set[str]:
    """The absolute module names `path` imports, at run time or for type checking alike."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from gateway import auth` imports a module by its attribute name.
            names.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if is_module(f"{node.module}.{alias.name}")
            )
    return names


def is_module(name: str) -> bool:
    """Whether the dotted `name` is a module or package of gateway."""
    head, _, rest = name.partition(".")
    if head != "gateway":
        return False
    path = PACKAGE.joinpath(*rest.split(".")) if rest else PACKAGE
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def is_feature(name: str, features: frozenset[str]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in features)


def violations() -> dict[tuple[str, str], str]:
    features = feature_modules()
    found: dict[tuple[str, str], str] = {}
    for path in sorted(STAGES.glob("*.py")):
        for name in sorted(imported(path)):
            if is_feature(name, features):
                found[(path.name, name)] = name
    return found


def test_the_rule_knows_the_features() -> None:
    # A sanity check on the rule itself: it would catch the imports this branch removed.
    features = feature_modules()
    for name in ("gateway.auth.principal", "gateway.tracing.spans", "gateway.tiers.ladder"):
        assert is_feature(name, features), name
    for name in ("gateway.accounting", "gateway.pd", "gateway.store.base"):
        assert is_feature(name, features), name
    for name in ("gateway.scope", "gateway.hooks", "gateway.types", "gateway.upstream.headers"):
        assert not is_feature(name, features), name
    assert not is_feature("gateway.proxy.relay", features)


def test_the_detector_reads_every_form_of_import(tmp_path: Path) -> None:
    source = tmp_path / "stage.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import gateway.pd.fields\n"
        "from gateway import auth\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from gateway.tiers.runtime import TiersRuntime\n"
        "def late() -> None:\n"
        "    from gateway.tracing.spans import RequestSpan\n"
    )
    features = feature_modules()
    assert {name for name in imported(source) if is_feature(name, features)} == {
        "gateway.pd.fields",
        "gateway.auth",
        "gateway.tiers.runtime",
        "gateway.tracing.spans",
    }


def test_no_stage_imports_a_feature() -> None:
    found = violations()
    unexpected = sorted(set(found) - set(KNOWN))
    assert not unexpected, (
        f"gateway/proxy imports a feature: {unexpected}. Reach it through a state hook "
        "(gateway.hooks) or a scope key and protocol (gateway.scope) instead."
    )
    gone = sorted(set(KNOWN) - set(found))
    assert not gone, f"no longer imported, take off KNOWN: {gone}"


def test_no_stage_reads_a_features_extras() -> None:
    """`state.extras` is a feature's own; the stages read typed hooks, not bare strings."""
    for path in sorted(STAGES.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        reads = [
            n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "extras"
        ]
        assert not reads, f"{path.name} reads state.extras at lines {reads}"
