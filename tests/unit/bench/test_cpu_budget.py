"""The control section's CPU budget: measured from /proc by `bench.control` over the same runs
as the rates, shown under the control rows and in the control targets' "what limits it"
(`bench.cpu_budget`), and absent, not invented, from results that predate it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import control, cpu_budget, report, targets

RUN = Path(__file__).with_name("fixtures") / "issue35" / "results.json"


def _budget(row: dict[str, Any], per: dict[str, float], healthz_us: float) -> None:
    """What `control.Point` adds to a row: per-process µs, the cores busy, healthz's µs."""
    all_us = sum(per.values())
    row.update(
        cpu_us=per, cpu_us_all=all_us, cores_busy=1.9, healthz_cpu_us_all=healthz_us,
        healthz_cores_busy=1.5, cpus=2, cpu_ratio=healthz_us / all_us,
        cpu_ceiling_per_s=2 / all_us * 1e6,
    )  # fmt: skip


@pytest.fixture
def doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(RUN.read_text())
    for row in doc["sections"]["control"]["result"]["rows"]:
        key = (row["pp"], row["concurrency"], row["router"])
        if key == (1, 64, "coalesced"):
            _budget(row, {"router": 130.0, "decode": 600.0, "prefill-0": 610.0}, 134.0)
        elif key == (4, 64, "coalesced"):
            stages = {f"prefill-{k}": 700.0 + k for k in range(4)}
            _budget(row, {"router": 200.0, "decode": 1430.0, **stages}, 140.0)
        elif key == (1, 1, "per-request"):
            _budget(row, {"router": 300.0, "decode": 400.0, "prefill-0": 300.0}, 150.0)
    return doc


def _control(text: str) -> str:
    return text.split("## Control plane against concurrency", 1)[1].split("\n## ", 1)[0]


def test_the_budget_table_shows_each_process_beside_healthz(
    doc: dict[str, Any], tmp_path: Path
) -> None:
    control = _control(report.render(doc, {}, base=tmp_path))
    assert "| PP | router | concurrency | router µs | decode µs | prefill µs (each) |" in control
    row = "| 1 | coalesced | 64 | 130 | 600 | 610 | 1,340 | 1.90 | 134 | 1.50 | 0.10x | 1,493 |"
    assert row in control
    # Every prefill stage of PP=4, in stage order.
    assert "| 4 | coalesced | 64 | 200 | 1,430 | 700 + 701 + 702 + 703 | 4,436 |" in control
    # Only the rows that carry a budget.
    assert "| 1 | per-request | 8 | " not in control.split("CPU budget of the same runs", 1)[1]
    assert "this host's 2 cores would carry" in control


def test_the_control_limits_say_what_the_budget_allows(doc: dict[str, Any], tmp_path: Path) -> None:
    text = report.render(doc, {}, base=tmp_path)
    section = text.split(f"\n## {targets.TITLE}\n", 1)[1].split("\n## ", 1)[0]
    control = targets.LIMITS["control"]
    measured = section.split(control.text, 1)[1].split("\n- **", 1)[0]
    assert (
        "PP=1, coalesced router: a handoff costs 1,340 µs of CPU in all (router 130, decode 600, "
        "prefill 610), a `GET /healthz` 134 µs, so at equal cores busy the ratio is at most "
        "0.10x (0.15x needs ≤ 893 µs per handoff), and 2 busy cores would carry 1,493 "
        "handoffs/s. The run kept 1.90 cores busy (healthz 1.50)."
    ) in measured
    assert "PP=4, coalesced router: a handoff costs 4,436 µs of CPU in all (router 200, decode " \
        "1,430, prefills 2,806)" in measured  # fmt: skip
    latency = section.split(targets.LIMITS["latency"].text, 1)[1].split("\n- **", 1)[0]
    # 426.5 handoffs/s in the fixture's row: 2.34 ms of wall each.
    assert (
        "PP=1, per-request router, concurrency 1: a handoff costs 1,000 µs of CPU in all "
        "(router 300, decode 400, prefill 300) in 2.34 ms of wall each (p50 2.16 ms), so its "
        "processes kept 1.90 cores busy"
    ) in latency


def test_results_without_a_budget_have_neither_table_nor_measured_limits(
    tmp_path: Path,
) -> None:
    text = report.render(json.loads(RUN.read_text()), {}, base=tmp_path)
    assert "CPU budget of the same runs" not in text and "Measured in this run" not in text
    assert cpu_budget.limits({"sections": {}}) == {}


def test_a_budget_counts_the_cpu_a_process_spent_per_job() -> None:
    budget = control.Budget({"me": os.getpid()})
    budget.meter.start()
    spin = time.process_time() + 0.3
    while time.process_time() < spin:
        pass
    budget.meter.stop()
    budget.jobs = 100
    figures = budget.figures()
    # 0.3 s over 100 jobs, within a few clock ticks.
    assert 2_500 <= figures["cpu_us"]["me"] <= 3_600
    assert figures["cpu_us_all"] == figures["cpu_us"]["me"]
    assert 0.1 < figures["cores_busy"] <= 1.2


def test_a_row_carries_the_budget_of_its_shape_against_healthz() -> None:
    args = SimpleNamespace(repeat=1, control_seconds=1.0)
    point = control.Point(args, None, None, [], "x", 100.0)  # type: ignore[arg-type]
    assert point._budget("coalesced") == {}  # nothing metered: no budget, not zeros
    point.meter_processes({"router": 1, "decode": 2})
    for shape, seconds, jobs in (("coalesced", (0.1, 0.5), 500), ("healthz", (0.2, 0.4), 4000)):
        budget = point.budgets[shape]
        budget.meter.seconds = dict(zip(("router", "decode"), seconds, strict=True))
        budget.meter.wall_s, budget.jobs = 0.5, jobs
    out = point._budget("coalesced")
    assert out["cpu_us"] == pytest.approx({"router": 200.0, "decode": 1000.0})
    assert out["cpu_us_all"] == pytest.approx(1200.0) and out["cores_busy"] == pytest.approx(1.2)
    assert out["healthz_cpu_us_all"] == pytest.approx(150.0)
    assert out["cpu_ratio"] == pytest.approx(0.125)
    assert out["cpu_ceiling_per_s"] == pytest.approx(point.cpus / 1200e-6)
    assert point._budget("per-request") == {}  # a shape that never ran
