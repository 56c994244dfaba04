"""Per-request planning against pages x layers, four ways over the same fragmented request, for
`make bench` (its `planning` section): a landed stage, a direct stage, the per-entry Python
reference (`kvhandoff.pipelines.planning_reference`) and SGLang's own path, timed in SGLang's
environment (`sglang_path.py`, `make sglang-env`; not measured without it).

`python -m bench.planning` runs the grid alone and prints its rows as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.stage_packer import StagePacker
from kvhandoff.service.tools.bench.common import fragmented_pages, median, time_call
from kvhandoff.service.tools.bench.landed import (
    dense_model,
    direct_plan,
    landed_plan,
    placed_pairing,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", default="8,61", help="comma-separated layer counts")
    parser.add_argument("--pages", default="64,256,1024,4096", help="comma-separated page counts")
    parser.add_argument("--repeat", type=int, default=3, help="SGLang's path: best of 5x this")
    parser.add_argument("--seed", type=int, default=0, help="of the fragmented page lists")
    parser.add_argument(
        "--sglang-python",
        help="the SGLang environment's interpreter, for SGLang's path "
        "(default: .venv-sglang/bin/python if present, or $KVHANDOFF_SGLANG_PYTHON)",
    )


def run(args: argparse.Namespace) -> int:
    layers = [int(x) for x in args.layers.split(",")]
    pages = [int(x) for x in args.pages.split(",")]
    print(json.dumps(planning_grid(args, layers, pages), indent=1))
    return 0


def _adaptive_median(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    """Median wall time of `fn` over as many calls as fit in about `budget_s` (3 to 50)."""
    t0 = time.perf_counter()
    fn()  # warm-up, and the estimate
    once = max(time.perf_counter() - t0, 1e-6)
    return median(time_call(fn, repeat=int(min(50, max(3, budget_s / once))), warmup=0))


def planning_grid(
    args: argparse.Namespace,
    layers_list: list[int],
    pages_list: list[int],
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Per-request planning before the engine call against pages x layers, four ways over the
    same fragmented request: a landed stage (whole plan, and up to its first engine call), a
    direct stage, the per-entry Python reference (`kvhandoff.pipelines.planning_reference`) and
    SGLang's own path (its installed functions, in its environment: `sglang_path.py`, one
    interpreter for the whole grid)."""
    from kvhandoff.pipelines.planning_reference import reference_plan

    rows: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    for layers in layers_list:
        model = dense_model(layers)
        pool = max(pages_list) * 4
        pairing = placed_pairing(model, pool)
        for pages in pages_list:
            if on_step is not None:
                on_step(f"{layers} layers x {pages} pages")
            rng = np.random.default_rng(args.seed)
            src = fragmented_pages(pages, pool, rng)
            dst = fragmented_pages(pages, pool, rng)
            src_list, dst_list = src.tolist(), dst.tolist()
            landed_s = _adaptive_median(functools.partial(landed_plan, pairing, src, dst))
            first_s = _adaptive_median(functools.partial(landed_plan, pairing, src, dst, 1))
            direct_s = _adaptive_median(functools.partial(direct_plan, pairing, src, dst))
            ref_s = _adaptive_median(functools.partial(reference_plan, pairing, src_list, dst_list))
            rows.append(
                {
                    "layers": layers,
                    "pages": pages,
                    "bytes": StagePacker(pairing, pages, False).total_bytes,
                    "landed_ms": landed_s * 1e3,
                    "landed_first_segment_ms": first_s * 1e3,
                    "direct_ms": direct_s * 1e3,
                    "reference_ms": ref_s * 1e3,
                    "direct_blocks": direct_plan(pairing, src, dst),
                    "landed_blocks": landed_plan(pairing, src, dst),
                    "reference_over_direct": ref_s / direct_s,
                    "reference_over_landed": ref_s / landed_s,
                }
            )
            requests.append(_sglang_request(pairing, src, dst, reps=max(5, args.repeat * 5)))
    out: dict[str, Any] = {"case": "planning_grid", "rows": rows}
    if on_step is not None:
        on_step("SGLang's path, in its environment")
    sglang = _sglang_many(args, requests)
    if isinstance(sglang, str):
        out["sglang"] = sglang
        return out
    for row, got in zip(rows, sglang):
        row["sglang_ms"] = got["ms"]
        row["sglang_blocks"] = got["blocks"]
        row["sglang_over_landed"] = got["ms"] / row["landed_ms"]
        row["sglang_over_landed_first_call"] = got["ms"] / row["landed_first_segment_ms"]
        row["sglang_over_direct"] = got["ms"] / row["direct_ms"]
        out["sglang"] = got["sglang"]
    return out


def _sglang_request(pairing: Pairing, src: Any, dst: Any, *, reps: int) -> dict[str, Any]:
    return {
        "src_pages": np.asarray(src).tolist(),
        "dst_pages": np.asarray(dst).tolist(),
        "src_ptrs": [e.base for e in pairing.src.kv],
        "dst_ptrs": [e.base for e in pairing.dst.kv],
        "item_lens": [e.item_len for e in pairing.src.kv],
        "dst_item_lens": [e.item_len for e in pairing.dst.kv],
        "src_layer_ids": [e.layer_id for e in pairing.src.kv],
        "dst_layer_ids": [e.layer_id for e in pairing.dst.kv],
        "repeat": reps,
    }


def _sglang_many(args: argparse.Namespace, requests: list[dict[str, Any]]) -> list[Any] | str:
    """SGLang's planning of each request (one subprocess); a reason string if not measured."""
    python = _sglang_python(args)
    if python is None:
        return "not measured: no SGLang environment (make sglang-env)"
    done = _run_sglang(python, {"requests": requests})
    result: list[Any] = json.loads(done.strip().splitlines()[-1])
    return result


def _sglang_python(args: argparse.Namespace) -> str | None:
    given = args.sglang_python or os.environ.get("KVHANDOFF_SGLANG_PYTHON")
    if given:
        return str(given)
    default = Path(".venv-sglang/bin/python")
    return str(default) if default.exists() else None


def _run_sglang(python: str, request: dict[str, Any]) -> str:
    """`sglang_path.py` under the SGLang environment's `python`: its stdout."""
    script = Path(__file__).with_name("sglang_path.py")
    # SGLang's config modules import torchvision, whose wheel fails against a CPU torch: the
    # SGLang tests' stand-in (tests/sglang/stubs) goes first on the path, as in those tests.
    stubs = Path(__file__).resolve().parents[1] / "tests" / "sglang" / "stubs"
    path = os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [python, str(script)],
        env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"},
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"SGLang's planning path failed in {python}: {done.stderr[-2000:]}")
    return done.stdout


if __name__ == "__main__":
    from bench.command import main

    sys.exit(main(__doc__, add_arguments, run))
