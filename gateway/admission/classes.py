"""Which class a request belongs to. Pure (gateway.admission.engine_order: what `priority`
its engine then sees).

Resolution order: the API key's configured class, then the `X-Priority` header, then the
body's `priority`, then the default class. The body may name a class (`"batch"`) or carry
a vLLM-style integer, which selects the class with that engine priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.admission.config import AdmissionSettings
from gateway.errors import BadRequest

PRIORITY_HEADER = "x-priority"
BODY_FIELD = "priority"


@dataclass(frozen=True, slots=True)
class ClassMap:
    names: frozenset[str]
    default: str
    by_engine_priority: Mapping[int, str]
    engine_priority: Mapping[str, int]
    key_classes: Mapping[str, str]

    @classmethod
    def from_settings(cls, settings: AdmissionSettings) -> ClassMap:
        engine = {
            c.name: (c.engine_priority if c.engine_priority is not None else i)
            for i, c in enumerate(settings.classes)
        }
        by_engine: dict[int, str] = {}
        for name, prio in engine.items():
            by_engine.setdefault(prio, name)
        return cls(
            names=frozenset(engine),
            default=settings.default_class,
            by_engine_priority=by_engine,
            engine_priority=engine,
            key_classes=dict(settings.key_classes),
        )


def _from_value(value: Any, classes: ClassMap, param: str) -> str:
    if isinstance(value, str):
        name = value.strip().lower()
        if name in classes.names:
            return name
        if name.lstrip("-").isdigit():
            value = int(name)
    if isinstance(value, int) and not isinstance(value, bool):
        found = classes.by_engine_priority.get(value)
        if found is not None:
            return found
    raise BadRequest(
        f"unknown priority {value!r}; known classes: {', '.join(sorted(classes.names))}",
        param=param,
    )


def resolve_class(
    classes: ClassMap,
    *,
    api_key: str | None,
    header: str | None,
    body_priority: Any,
    header_name: str = PRIORITY_HEADER,
) -> str:
    """The request's class; an unknown explicit value is a 400 naming the known classes."""
    if api_key is not None:
        keyed = classes.key_classes.get(api_key)
        if keyed is not None:
            return keyed
    if header:
        return _from_value(header, classes, header_name)
    if body_priority is not None:
        return _from_value(body_priority, classes, BODY_FIELD)
    return classes.default
