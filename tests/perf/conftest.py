"""`pytest tests/perf --write-work-budgets`: rewrite `work_budgets.toml` from this run's counts
(after a change that removes work, to lower the budgets; review the diff before committing)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-work-budgets",
        action="store_true",
        help="rewrite tests/perf/work_budgets.toml from the measured work per handoff",
    )
