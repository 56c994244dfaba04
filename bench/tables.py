"""How a figure is written in BENCHMARKS.md: numbers, ratios and Markdown tables, shared by the
report's sections (`report`) and its verdicts (`targets`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def num(value: Any, digits: int = 2) -> str:
    """A figure for a table: `-` when absent, thousands separated when large."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.{digits}f}"
    return str(value)


def ratio(value: Any) -> str:
    return "-" if value is None else f"{num(value)}x"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def kib(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def div(a: float | None, b: float | None) -> float | None:
    """a ÷ b; None where either is missing or b is zero."""
    return None if a is None or not b else a / b
