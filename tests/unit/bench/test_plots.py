"""The plots draw what the results hold: both router shapes in the control plot, and the
decode's CPU per GB beside the e2e figures where the rows carry it. Drawn on a recorder of the
few pyplot calls they make (matplotlib is the `bench` extra, not in the test environment); the
fixtures are test_targets'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import plots

FIXTURES = Path(__file__).with_name("fixtures")


class Axes:
    """Records each line drawn; every other call is accepted and ignored."""

    def __init__(self) -> None:
        self.lines: dict[str, tuple[list[Any], list[Any], str]] = {}

    def plot(self, xs: list[Any], ys: list[Any], style: str, **kw: Any) -> None:
        assert kw["label"] not in self.lines, f"{kw['label']} drawn twice"
        self.lines[kw["label"]] = (list(xs), list(ys), kw.get("marker", ""))

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Pyplot:
    """Hands out recording axes and keeps them for the test to read."""

    def __init__(self) -> None:
        self.axes: list[Axes] = []

    def subplots(self, rows: int, cols: int, **kw: Any) -> tuple[object, list[Axes]]:
        self.axes = [Axes() for _ in range(cols)]
        return object(), self.axes


def _draw(figure: Any, result: dict[str, Any]) -> list[Axes]:
    plt = Pyplot()
    figure(plt, result)
    return plt.axes


def _section(path: Path, name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())["sections"][name]["result"]
    return result


def test_the_control_plot_draws_each_router_shape_and_healthz_once_per_pp() -> None:
    result = _section(FIXTURES / "issue35" / "results.json", "control")
    rate, latency = _draw(plots._control, result)
    assert set(rate.lines) == {
        "handoffs, PP=1, per-request", "handoffs, PP=1, coalesced", "healthz, PP=1",
        "handoffs, PP=4, per-request", "handoffs, PP=4, coalesced", "healthz, PP=4",
    }  # fmt: skip
    concurrency, handoffs, marker = rate.lines["handoffs, PP=1, coalesced"]
    assert concurrency == [1, 64] and handoffs == [600.0, 2400.0] and marker == "s"
    assert rate.lines["handoffs, PP=1, per-request"][2] == "o"
    assert len(latency.lines) == 8 and "p99, PP=4, coalesced" in latency.lines


def test_the_control_plot_of_rows_without_a_router_key_keeps_its_labels() -> None:
    result = _section(FIXTURES / "bench_results.json", "control")
    rate, latency = _draw(plots._control, result)
    assert set(rate.lines) == {"handoffs, PP=1", "healthz, PP=1", "handoffs, PP=4", "healthz, PP=4"}
    assert set(latency.lines) == {"p50, PP=1", "p99, PP=1", "p50, PP=4", "p99, PP=4"}


def test_the_e2e_plot_adds_decode_cpu_per_gb_where_the_rows_carry_it() -> None:
    result = _section(FIXTURES / "issue35" / "results.json", "e2e")
    assert plots.has_decode_cpu(result["rows"])
    axes = _draw(plots._e2e, result)
    assert len(axes) == 3
    mb, cpu, _ = axes[2].lines["landed, PP=1"]
    assert cpu == [0.3, 0.46, 0.33] and len(mb) == 3
    assert set(axes[2].lines) == {
        f"{run}, PP={pp}" for run in ("landed", "direct", "raw 1 MiB") for pp in (1, 4)
    }
    for row in result["rows"]:
        del row["raw_decode_cpu_s_per_gb"]
    axes = _draw(plots._e2e, result)  # raw's receiving decode not measured: no line for it
    assert set(axes[2].lines) == {"landed, PP=1", "direct, PP=1", "landed, PP=4", "direct, PP=4"}
    old = _section(FIXTURES / "bench_results.json", "e2e")
    assert not plots.has_decode_cpu(old["rows"])
    axes = _draw(plots._e2e, old)
    assert len(axes) == 2 and "raw 1 MiB, PP=1" in axes[0].lines
