"""The feature installers' declared needs: `build_app` refuses an order that breaks one,
and the shipped order keeps every one."""

from __future__ import annotations

import pytest

from gateway import app as app_module
from gateway.app import FEATURE_INSTALLERS, build_app
from gateway.errors import ConfigError
from gateway.installers import Installer, check_order
from gateway.settings import KvgateSettings
from gateway.wrappers import ROUTER_LAYERS

REPLICAS = [{"url": "http://127.0.0.1:9", "id": "a", "models": ["m"]}]


def _by_name() -> dict[str, Installer]:
    return {installer.name: installer for installer in FEATURE_INSTALLERS}


def test_the_shipped_order_keeps_every_requirement() -> None:
    check_order(FEATURE_INSTALLERS)
    names = [installer.name for installer in FEATURE_INSTALLERS]
    for installer in FEATURE_INSTALLERS:
        for needed in installer.requires:
            assert names.index(needed) < names.index(installer.name)


def test_installers_that_wrap_the_router_come_in_the_layer_order() -> None:
    # pools, then the store's sticky layer, then PD's: the order ROUTER_LAYERS declares.
    assert ROUTER_LAYERS == ("pools", "sticky", "pd_colocated")
    found = _by_name()
    assert "pools" in found["store"].requires and {"pools", "store"} <= set(found["pd"].requires)
    assert {"pools", "store", "pd"} <= set(found["admission"].requires)


def test_build_app_refuses_an_installer_before_what_it_requires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = _by_name()
    wrong = tuple(i for i in FEATURE_INSTALLERS if i.name != "auth")
    at = [i.name for i in wrong].index("store")
    wrong = (*wrong[:at], found["auth"], *wrong[at:])  # auth before the store it uses
    monkeypatch.setattr(app_module, "FEATURE_INSTALLERS", wrong)
    with pytest.raises(ConfigError) as caught:
        build_app(KvgateSettings(replicas=REPLICAS))
    message = caught.value.message
    assert "'auth' requires 'store', listed after it" in message
    assert "move 'store' before 'auth'" in message


def test_a_missing_requirement_and_a_duplicate_are_named() -> None:
    found = _by_name()
    with pytest.raises(ConfigError, match="'facts' requires 'scrape', which is not listed"):
        check_order((found["facts"],))
    with pytest.raises(ConfigError, match="installers listed twice: pools"):
        check_order((found["pools"], found["pools"]))
