"""The `kvhandoff` command line itself (`kvhandoff.service.cli`): `--version`, and defaults in
`--help`."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvhandoff.service.cli import build_parser, main


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
    assert "small handoffs to run (control plane) (default: 200)" in text
    assert "large handoffs to run first (data plane; 0: none) (default: 16)" in text
    assert "prefill pipeline-parallel stages (default: 4)" in text
    assert "(default: False)" not in text  # a flag that is off says nothing
    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert "(default: None)" not in serve.format_help()  # overrides default to the config


@pytest.mark.parametrize("extra", [[], ["--inprocess"]])
def test_demo_with_more_stages_than_layers_prints_one_line_and_exits_2(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 18 D: `demo --pp 100` was a LayoutError traceback listing 100 boundaries.
    assert main(["demo", "--pp", "100", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvhandoff demo: --pp 100: the demo's model has 48 layers, so 1..48 stages"]
