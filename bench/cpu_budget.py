"""The control section's CPU budget in BENCHMARKS.md: what one handoff costs each process
against what one `GET /healthz` costs, as a table under the control rows (`table_text`) and as
the measured half of the control targets' "what limits it" (`limits`).

The argument it makes: on a host whose cores are all busy, a rate is about cores ÷ CPU per job,
so handoffs/s ÷ healthz/s cannot exceed healthz's CPU per request ÷ a handoff's once both keep
the same cores busy; a target above that ratio needs less CPU per handoff, not less waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.tables import num, ratio, table
from bench.targets import HEALTHZ_SHARE, shape_of, shapes_of


def _budgeted(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [x for x in rows if "cpu_us" in x]


def _stages(cpu_us: Mapping[str, float]) -> str:
    """The prefill processes' CPU µs per handoff, each, in stage order."""
    stages = sorted((k for k in cpu_us if k.startswith("prefill-")), key=lambda k: int(k[8:]))
    return " + ".join(num(cpu_us[k]) for k in stages) or "-"


def table_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """The CPU budget of the control rows that carry one (none: empty): a table and how to
    read it."""
    rows = _budgeted(rows)
    if not rows:
        return ""
    body = table(
        ["PP", "router", "concurrency", "router µs", "decode µs", "prefill µs (each)",
         "all µs", "cores busy", "healthz µs", "healthz cores busy",
         "healthz µs ÷ handoff µs", "all cores: handoffs/s"],
        (
            [num(x["pp"]), shape_of(x), num(x["concurrency"]),
             num(x["cpu_us"].get("router")), num(x["cpu_us"].get("decode")),
             _stages(x["cpu_us"]), num(x["cpu_us_all"]), num(x["cores_busy"]),
             num(x["healthz_cpu_us_all"]), num(x["healthz_cores_busy"]),
             ratio(x["cpu_ratio"]), num(x["cpu_ceiling_per_s"])]
            for x in rows
        ),
    )  # fmt: skip
    return (
        "CPU budget of the same runs (from /proc, summed over every run of the shape at that "
        "point): CPU µs per handoff of each process (the router is the benchmark's own client), "
        "the cores they kept busy, and the same for one `GET /healthz` round trip. When both "
        "rates keep the same cores busy, handoffs ÷ healthz is healthz µs ÷ handoff µs; `all "
        f"cores: handoffs/s` is what this host's {rows[0]['cpus']} cores would carry at this CPU "
        f"per handoff.\n\n{body}"
    )


def _spent(x: Mapping[str, Any]) -> str:
    cpu = x["cpu_us"]
    prefill = sum(v for k, v in cpu.items() if k.startswith("prefill-"))
    return (
        f"{num(x['cpu_us_all'])} µs of CPU in all (router {num(cpu.get('router'))}, decode "
        f"{num(cpu.get('decode'))}, prefill{'s' if x['pp'] > 1 else ''} {num(prefill)})"
    )


def _share(x: Mapping[str, Any], share: float) -> str:
    """One concurrency-64 row against its healthz share target."""
    need = x["healthz_cpu_us_all"] / share
    return (
        f"PP={x['pp']}, {shape_of(x)} router: a handoff costs {_spent(x)}, a `GET /healthz` "
        f"{num(x['healthz_cpu_us_all'])} µs, so at equal cores busy the ratio is at most "
        f"{ratio(x['cpu_ratio'])} ({share:g}x needs ≤ {num(need)} µs per handoff), and "
        f"{x['cpus']} busy cores would carry {num(x['cpu_ceiling_per_s'])} handoffs/s. The run "
        f"kept {num(x['cores_busy'])} cores busy (healthz {num(x['healthz_cores_busy'])})."
    )


def _latency(x: Mapping[str, Any]) -> str:
    """One concurrency-1 row: the CPU its processes spent per handoff against its wall time."""
    wall_ms = 1e3 / x["handoffs_per_s"]
    return (
        f"PP=1, {shape_of(x)} router, concurrency 1: a handoff costs {_spent(x)} in "
        f"{num(wall_ms)} ms of wall each (p50 {num(x['p50_ms'])} ms), so its processes kept "
        f"{num(x['cores_busy'])} cores busy; a chain of short steps that mostly waited between "
        "them would keep well under one."
    )


def limits(doc: Mapping[str, Any]) -> dict[str, str]:
    """The measured sentences for the control targets' "what limits it", by limit key
    (`targets.LIMITS`); none where the run has no CPU budget."""
    rows = _budgeted(doc.get("sections", {}).get("control", {}).get("result", {}).get("rows", []))
    shares, latency = [], []
    for shape in shapes_of(rows):
        for x in rows:
            if shape_of(x) != shape:
                continue
            if x["concurrency"] == 64 and x["pp"] in HEALTHZ_SHARE:
                shares.append(_share(x, HEALTHZ_SHARE[x["pp"]]))
            if x["concurrency"] == 1 and x["pp"] == 1:
                latency.append(_latency(x))
    out = {}
    if shares:
        out["control"] = "Measured in this run: " + " ".join(shares)
    if latency:
        out["latency"] = "Measured in this run: " + " ".join(latency)
    return out
