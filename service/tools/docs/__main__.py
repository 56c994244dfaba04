"""`python -m kvhandoff.service.tools.docs [--check] [--root DIR]`: write the generated reference
pages under DIR/docs/reference (default: the current directory), or with --check only compare them
and exit 1 naming each page that is out of date."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from kvhandoff.service.tools.docs.config import config_page
from kvhandoff.service.tools.docs.events import events_page
from kvhandoff.service.tools.docs.metrics import metrics_page
from kvhandoff.service.tools.docs.openapi import openapi_page

#: Each generated page, relative to the repository root, and what writes it.
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/openapi.md": openapi_page,
    "docs/reference/config.md": config_page,
    "docs/reference/events.md": events_page,
    "docs/reference/metrics.md": metrics_page,
}


def stale_pages(root: Path) -> list[str]:
    """The pages under `root` whose text differs from what the code generates now."""
    stale = []
    for rel, make in PAGES.items():
        path = root / rel
        if not path.exists() or path.read_text() != make():
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhandoff.service.tools.docs")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    parser.add_argument("--root", type=Path, default=Path.cwd())
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.root)
        for rel in stale:
            print(f"{rel} is out of date: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for rel, make in PAGES.items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
    return 0


if __name__ == "__main__":
    sys.exit(main())
