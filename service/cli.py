"""The `kvhandoff` command line: `serve`, `demo` and `bench <name>`.

Each sub-command lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int` (the exit status). Only the chosen module is imported, so `kvhandoff --help`
stays fast and an optional dependency only matters to the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvhandoff.service.serve", "run a prefill or decode service from a TOML config"),
    "demo": (
        "kvhandoff.service.tools.demo",
        "start a local PP prefill + decode deployment and verify handoffs",
    ),
    "load": (
        "kvhandoff.service.tools.load",
        "many handoffs in flight through a local deployment; fails on loss or memory growth",
    ),
}
#: What an operator measures on their own machines. The comparison suites, report generators and
#: plots of `make bench` live outside the package, in the repository's `bench/`.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "transport": (
        "kvhandoff.service.tools.bench.transport",
        "transports vs. memcpy and raw Mooncake calls",
    ),
    "handoff": (
        "kvhandoff.service.tools.bench.handoff",
        "handoffs through the HTTP services vs. raw baselines",
    ),
}


class _Defaults(argparse.HelpFormatter):
    """`--help` shows each option's default, where it has one (not for flags that are off, nor
    for overrides whose absence means "as the config says")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.help is not None
            and "%(default)" not in text
            and default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def version() -> str:
    """This installation's version (the package metadata; "unknown" when not installed)."""
    try:
        return importlib.metadata.version("kvhandoff")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Build the parser; only the sub-command named in `argv` gets its arguments (and import)."""
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvhandoff {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = list(argv[:2])
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Defaults)
        _bind(p, module, load=bool(chosen) and chosen[0] == name)
    bench = sub.add_parser("bench", help="run a benchmark", description="run a benchmark")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=_Defaults
        )
        _bind(p, module, load=chosen == ["bench", name])
    return parser


def _bind(parser: argparse.ArgumentParser, module: str, *, load: bool) -> None:
    parser.set_defaults(command_module=module)
    if load:
        mod: Any = importlib.import_module(module)
        mod.add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    mod: Any = importlib.import_module(args.command_module)
    return int(mod.run(args))


if __name__ == "__main__":
    sys.exit(main())
