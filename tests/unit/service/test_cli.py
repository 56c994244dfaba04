"""The `kvhandoff` command line itself (`service.cli`): `--version`, and defaults in `--help`."""

from __future__ import annotations

import importlib.metadata

import pytest

from service.cli import build_parser, main


def test_version_prints_the_installed_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvhandoff {importlib.metadata.version('kvhandoff')}"


def test_help_shows_the_defaults_options_have() -> None:
    demo = build_parser(["demo"])._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    text = " ".join(demo.format_help().split())
    assert "handoffs to run (default: 200)" in text
    assert "prefill pipeline-parallel stages (default: 4)" in text
    assert "(default: False)" not in text  # a flag that is off says nothing
    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert "(default: None)" not in serve.format_help()  # overrides default to the config
