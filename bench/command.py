"""The command line of a benchmark run from the repository (`python -m bench.<name>`).

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`, as the `kvhandoff
bench` commands do, so the suite can build any module's arguments at their defaults and a module
can move between the wheel and `bench/` without changing shape.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def main(
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse `argv` (the process's by default) with `add_arguments` and return `run`'s status."""
    description = (doc or "").strip().splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_arguments(parser)
    return int(run(parser.parse_args(argv)))
