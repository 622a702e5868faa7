"""docs/cli.md is what `make docs` generates from the parser and envs.py today: a flag or an
environment variable added, removed or re-documented without regenerating it fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pipeserve import cli_reference
from pipeserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text() == cli_reference.render(), (
        "docs/cli.md is out of date: run `make docs` and commit it"
    )


def test_every_flag_of_every_command_is_on_the_page() -> None:
    page = cli_reference.render()
    for name, sub in cli_reference.commands(build_parser()).items():
        assert f"## pipeserve {name}" in page
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert re.search(rf"(`|, ){re.escape(flag)}[ ,`]", page), (name, flag)


def test_every_environment_variable_the_package_reads_is_in_the_table() -> None:
    read = set()
    for path in (ROOT / "pipeserve").rglob("*.py"):
        read |= set(re.findall(r"environ\.get\(\s*\"([A-Z][A-Z0-9_]+)\"", path.read_text()))
    read -= {"XDG_CACHE_HOME", "TRITON_INTERPRET"}  # others' variables, read as they define
    table = {name for name, _ in cli_reference.env_variables()}
    assert read and read <= table, sorted(read - table)


def test_every_flag_says_what_it_does() -> None:
    silent = [
        (name, action.option_strings[0])
        for name, sub in cli_reference.commands(build_parser()).items()
        for action in sub._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert silent == []
