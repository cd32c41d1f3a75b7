"""Every setting the console's text and the docs name exists (issue 46: the console told
operators to set `price_per_replica_hour`, which check-config rejects). Dotted names in
inline code (`section.key`, `section[].key`, `<placeholder>` for free dict keys) are
resolved against the settings model; YAML blocks made of settings sections are loaded by
it, and may only fail on placeholder values, never on an unknown key."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from gateway.settings import KvgateSettings

ROOT = Path(__file__).resolve().parents[1]
CONSOLE = sorted((ROOT / "gateway/console/static").iterdir())
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "deploy/README.md"]
SECTIONS = sorted(KvgateSettings.model_fields, key=len, reverse=True)
SEGMENT = r"(?:\[\d*\])?(?:\.[A-Za-z_<*][\w<>*-]*(?:\[\d*\])?)+"
DOTTED = re.compile(rf"(?<![\w.$/-])((?:{'|'.join(SECTIONS)}){SEGMENT})")


def inner(annotation: Any) -> Any:
    """The model (or dict) a field's annotation leads to, through Optional and sequences."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [inner(a) for a in typing.get_args(annotation) if a is not type(None)]
        return next((o for o in options if o is not None), None)
    if origin in (tuple, list, frozenset, set):
        return inner(typing.get_args(annotation)[0])
    if origin is dict or origin is typing.Mapping:
        return ("dict", inner(typing.get_args(annotation)[1]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def resolves(path: str) -> bool:
    node: Any = KvgateSettings
    for raw in path.split("."):
        key = re.sub(r"\[\d*\]$", "", raw)
        if isinstance(node, tuple):  # a dict's free key (a model name, a replica id)
            node = node[1]
            continue
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return False  # a key below a plain value
        field = node.model_fields.get(key)
        if field is None:
            return False
        node = inner(field.annotation)
    return True


def text_of(file: Path) -> str:
    """What a reader sees: for a script, its string literals only (not its code)."""
    text = file.read_text()
    if file.suffix == ".js":
        return "\n".join(
            next(g for g in m.groups() if g is not None) for m in STRING.finditer(text)
        )
    return text


STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"|`((?:[^`\\]|\\.)*)`|\'((?:[^\'\\\n]|\\.)*)\'')


def named(files: list[Path], pattern: re.Pattern[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for file in files:
        for match in pattern.finditer(text_of(file)):
            out.setdefault(match[1].rstrip("."), file.name)
    return out


def test_every_setting_the_console_names_exists() -> None:
    names = named(CONSOLE, DOTTED)
    assert "pools.pools[].price_per_card_hour" in names  # the cost hint names a real key
    bad = {n: f for n, f in names.items() if not resolves(n)}
    assert not bad, bad
    text = " ".join(f.read_text() for f in CONSOLE)
    assert "price_per_replica_hour" not in text  # a computed property, not a setting


def test_every_dotted_setting_in_the_docs_exists() -> None:
    names = named(DOCS, re.compile(rf"`{DOTTED.pattern}"))
    assert len(names) >= 40, names
    bad = {n: f for n, f in names.items() if not resolves(n)}
    assert not bad, bad


def test_the_check_rejects_what_does_not_exist() -> None:
    assert not resolves("pools.pools[].price_per_replica_hour")
    assert not resolves("server.prot")
    assert resolves("pd.models.<model>.kv_bytes_per_token")
    assert resolves("replicas[].price_per_hour")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_yaml_settings_blocks_in_the_docs_have_no_unknown_keys(doc: Path) -> None:
    for block in re.findall(r"```ya?ml\n(.*?)```", doc.read_text(), re.DOTALL):
        data = yaml.safe_load(block)
        if not isinstance(data, dict) or not set(data) <= set(KvgateSettings.model_fields):
            continue
        try:
            KvgateSettings(**data)
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            assert not unknown, f"{doc.name}: unknown settings {unknown}"
