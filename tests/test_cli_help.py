"""Every option of every `kvgate` subcommand explains itself, and help shows the defaults."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from gateway.cli import build_parser


def parsers(
    parser: argparse.ArgumentParser, path: str = "kvgate"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, f"{path} {name}")


def test_every_option_of_every_subcommand_has_help() -> None:
    silent = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert len(list(parsers(build_parser()))) > 15  # the walk reaches the nested subcommands
    assert silent == []


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("serve", None),
        ("sim", "(default: 8100)"),
        ("trace generate", "same seed, same trace (default: "),
        ("simulate", "(default: 4)"),
        ("plan", "(default: 0.9)"),
    ],
)
def test_help_shows_defaults(command: str, shown: str | None) -> None:
    parser = dict(parsers(build_parser()))[f"kvgate {command}"]
    text = parser.format_help()
    if shown:
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text
