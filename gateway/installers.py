"""Feature installers: what each needs installed before it, checked at start-up.

`build_app` runs the installers of `gateway.app.FEATURE_INSTALLERS` in their listed order.
An installer that depends on another (it wraps the router another replaced, it reads a
hook or an `extras` entry another set) says so in `requires`; `check_order` fails start-up
with a clear message when a required installer is missing or listed after it, the way
`GatewayState.wrap_router` checks the router layers. The order is data, so the reason for
it is not left to a comment alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import ConfigError

if TYPE_CHECKING:
    from gateway.state import GatewayState


@dataclass(frozen=True, slots=True)
class Installer:
    """`target`: import string of `install(state) -> None`; `requires`: the names of the
    installers that must have run before it."""

    name: str
    target: str
    requires: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    def load(self) -> Callable[[GatewayState], None]:
        module_name, _, attr = self.target.partition(":")
        install: Callable[[GatewayState], None] = getattr(
            importlib.import_module(module_name), attr
        )
        return install


def check_order(installers: Sequence[Installer]) -> None:
    """Raise `ConfigError` unless every installer comes after all it requires."""
    position = {installer.name: i for i, installer in enumerate(installers)}
    if len(position) != len(installers):
        names = [installer.name for installer in installers]
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ConfigError(f"installers listed twice: {', '.join(twice)}")
    for i, installer in enumerate(installers):
        for needed in installer.requires:
            at = position.get(needed)
            if at is None:
                raise ConfigError(
                    f"installer {installer.name!r} requires {needed!r}, which is not listed; "
                    f"listed: {', '.join(position)}"
                )
            if at > i:
                raise ConfigError(
                    f"installer {installer.name!r} requires {needed!r}, listed after it; "
                    f"move {needed!r} before {installer.name!r} in FEATURE_INSTALLERS"
                )


def run_installers(state: GatewayState, installers: Sequence[Installer]) -> None:
    """Check the order, then install each feature in it."""
    check_order(installers)
    for installer in installers:
        installer.load()(state)
