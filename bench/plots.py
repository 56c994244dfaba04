"""The PNG plots BENCHMARKS.md shows, from the results of `make bench` (matplotlib: the
`bench` extra). One figure per section, small (about 100 dpi), written beside results.json."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import targets
from bench.report import PLOTS

DPI = 100
SIZE = (7.0, 3.6)
#: A router shape's marker in the control plot, in `targets.SHAPES` order.
MARKERS = ("o", "s", "^")


def _planning(plt: Any, r: Mapping[str, Any]) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=SIZE, sharey=True)
    layers = sorted({x["layers"] for x in r["rows"]})
    for ax, n in zip(axes if len(layers) > 1 else [axes[0]], layers):
        rows = [x for x in r["rows"] if x["layers"] == n]
        pages = [x["pages"] for x in rows]
        for key, label in (
            ("landed_ms", "landed (whole plan)"),
            ("landed_first_segment_ms", "landed (to 1st call)"),
            ("direct_ms", "direct"),
            ("reference_ms", "reference"),
            ("sglang_ms", "SGLang"),
        ):
            if all(key in x for x in rows):
                ax.plot(pages, [x[key] for x in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{n} layers")
        ax.set_xlabel("pages per request")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ms per request")
    axes[0].legend(fontsize=7)
    if len(layers) < 2:
        axes[1].set_visible(False)
    return fig


def _transport(plt: Any, r: Mapping[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=SIZE)
    methods = list(dict.fromkeys(x["method"] for x in r["rows"]))
    labels = {"mooncake-raw": "raw Mooncake", "mooncake": "kvhandoff Mooncake"}
    for m in methods:
        rows = sorted((x for x in r["rows"] if x["method"] == m), key=lambda x: x["block_bytes"])
        ax.plot(
            [x["block_bytes"] >> 10 for x in rows],
            [x["best_gbps"] for x in rows],
            marker="o",
            label=labels.get(m, m),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (KiB)")
    ax.set_ylabel("GB/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


#: The e2e rows' decode CPU per GB (`bench.e2e`, since issue #35), as (key, label, style) like
#: the GB/s panel's: a third panel where the rows carry landed and direct mode's (raw Mooncake's
#: receiving decode beside them where they carry it).
DECODE_CPU = (
    ("landed_decode_cpu_s_per_gb", "landed", "-"),
    ("direct_decode_cpu_s_per_gb", "direct", "--"),
    ("raw_decode_cpu_s_per_gb", "raw 1 MiB", ":"),
)


def has_decode_cpu(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every e2e row carries the decode's CPU per GB of both modes (older results
    do not: their plot keeps two panels)."""
    return bool(rows) and all(x.get(k) is not None for x in rows for k, _, _ in DECODE_CPU[:2])


def _e2e(plt: Any, r: Mapping[str, Any]) -> Any:
    cpu = has_decode_cpu(r["rows"])
    fig, axes = plt.subplots(1, 3 if cpu else 2, figsize=(10.0, SIZE[1]) if cpu else SIZE)
    ax, lat = axes[0], axes[1]
    for i, pp in enumerate(sorted({x["pp"] for x in r["rows"]})):
        rows = [x for x in r["rows"] if x["pp"] == pp]
        mb = [x["bytes_per_request"] / 1e6 for x in rows]
        c = f"C{i}"
        for a, key, label, style in (
            (ax, "landed_gb_s", "landed", "-"),
            (ax, "direct_gb_s", "direct", "--"),
            (ax, "raw_large_gb_s", "raw 1 MiB", ":"),
            (lat, "landed_p50_ms", "landed", "-"),
            (lat, "direct_p50_ms", "direct", "--"),
            *(
                (axes[2], key, label, style)
                for key, label, style in DECODE_CPU
                if cpu and all(x.get(key) is not None for x in rows)
            ),
        ):
            ys = [x[key] for x in rows]
            a.plot(mb, ys, style, color=c, marker="o", label=f"{label}, PP={pp}")
    sizes = sorted({x["bytes_per_request"] / 1e6 for x in r["rows"]})
    ylabels = ["GB/s", "p50 ms per handoff", "decode CPU s per GB"]
    for a, ylabel in zip(axes, ylabels):
        a.set_xscale("log")
        a.set_xticks(sizes, [f"{x:.0f}" for x in sizes])
        a.minorticks_off()
        a.set_xlabel("MB per request")
        a.set_ylabel(ylabel)
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=6)
    return fig


def _segments(plt: Any, r: Mapping[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(5.0, 3.0))
    ways = list(r["handoffs_per_s"])
    ax.bar(ways, [r["handoffs_per_s"][w] for w in ways], color=["C0", "C1", "C2"][: len(ways)])
    ax.set_ylabel("handoffs/s")
    ax.set_title(f"{r['pages']} pages per request, PP={len(r['layers_per_stage'])}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _control(plt: Any, r: Mapping[str, Any]) -> Any:
    fig, (ax, lat) = plt.subplots(1, 2, figsize=SIZE)
    shapes = targets.shapes_of(r["rows"])
    for i, pp in enumerate(sorted({x["pp"] for x in r["rows"]})):
        c, healthz = f"C{i}", False
        for j, shape in enumerate(shapes):
            rows = [x for x in r["rows"] if x["pp"] == pp and targets.shape_of(x) == shape]
            if not rows:
                continue
            # One shape: today's labels; several: each line names its shape and has its marker.
            named = f"PP={pp}, {shape}" if len(shapes) > 1 else f"PP={pp}"
            lines = [
                (ax, "handoffs_per_s", "-", f"handoffs, {named}"),
                (lat, "p50_ms", "-", f"p50, {named}"),
                (lat, "p99_ms", "--", f"p99, {named}"),
            ]
            if not healthz:  # the same baseline whichever router shape ran beside it: once
                lines.append((ax, "healthz_per_s", ":", f"healthz, PP={pp}"))
                healthz = True
            conc = [x["concurrency"] for x in rows]
            for a, key, style, label in lines:
                ys = [x[key] for x in rows]
                a.plot(conc, ys, style, color=c, marker=MARKERS[j % len(MARKERS)], label=label)
    for a, ylabel in ((ax, "per second"), (lat, "ms create → completed")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("concurrency")
        a.set_ylabel(ylabel)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=6)
    return fig


def _load(plt: Any, r: Mapping[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=SIZE)
    for i, (name, s) in enumerate(r["rss_series"].items()):
        ax.plot(s["t_s"], s["rss_mib"], color=f"C{i}", label=f"{name} VmRSS")
        ax.plot(s["t_s"], s["anon_mib"], ":", color=f"C{i}", label=f"{name} RssAnon")
    ax.axvline(r["warmup_s"], color="grey", lw=0.8)
    ax.axvline(r["duration_s"], color="grey", lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return fig


FIGURES: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {
    "planning": _planning,
    "transport": _transport,
    "e2e": _e2e,
    "segments": _segments,
    "control": _control,
    "load": _load,
}


def render_all(doc: Mapping[str, Any], out_dir: Path) -> dict[str, str]:
    """Write the plot of every section that has results; {section: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = {}
    for name, section in doc["sections"].items():
        if name not in FIGURES or "result" not in section:
            continue
        fig = FIGURES[name](plt, section["result"])
        fig.tight_layout()
        path = out_dir / PLOTS[name]
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written[name] = str(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.plots [bench/results.json]`: the plots again, beside it."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    results = Path(args[0] if args else "bench/results.json")
    render_all(json.loads(results.read_text()), results.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
