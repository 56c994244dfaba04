"""mkdocs hook: BENCHMARKS.md and RELIABILITY.md are generated at the repository's top level
(`make bench`, `make reliability`) and link to bench/; the site serves them from there, at the
same relative paths, rather than from copies that would go stale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
#: What the generated reports are, and what they link to.
SERVED = (
    "BENCHMARKS.md",
    "RELIABILITY.md",
    "bench/*.png",
    "bench/results.json",
    "bench/results.csv",
)


def on_files(files: Files, config: Any) -> Files:
    for pattern in SERVED:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
