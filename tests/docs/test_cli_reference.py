from __future__ import annotations

import argparse

from fastllm.cli import build_parser
from fastllm.cli_reference import cli_page, commands
from fastllm.config.reference import DIRECTORY
from tests.conftest import ROOT


def test_cli_reference_page_matches_the_argument_parsers() -> None:
    page = (ROOT / DIRECTORY / "cli.md").read_text(encoding="utf-8")
    assert page == cli_page(), "run `make reference`"


def test_cli_reference_lists_every_command_and_option() -> None:
    page = cli_page()
    found = {parser.prog for parser, _ in commands(build_parser())}
    assert {
        "fastllm",
        "fastllm train",
        "fastllm config validate",
        "fastllm tokenizer train",
    } <= found
    assert "fastllm config" not in found  # a group of actions, not a command
    for parser, _ in commands(build_parser()):
        assert f"## `{parser.prog}`" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert f"`{(action.option_strings or [action.metavar or action.dest])[0]}" in page
            assert " ".join((action.help or "").split()) in page
    assert "| `--world-size WORLD_SIZE` | required | ranks |" in page  # of `fastllm schedule`
    assert "| `--max-new-tokens MAX_NEW_TOKENS` | `64` |" in page
    assert "143" in page.split("## Exit codes", 1)[1]
