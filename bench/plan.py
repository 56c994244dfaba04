"""`python -m bench.plan` (`make bench-plan`): vectorised planning against the per-entry
reference, in one run.

The reference is a Python loop over entries and runs that builds per-block tuples (see
`kvhandoff.pipelines.planning_reference`); both see the same pairing and the same fragmented
request.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import numpy as np

from kvhandoff.pipelines.models import decode_layout, dense_mla, partition_layers, stage_layout
from kvhandoff.pipelines.pairing import PairingCache, pair
from kvhandoff.pipelines.planning import plan
from kvhandoff.pipelines.planning_reference import reference_plan
from kvhandoff.service.tools.bench.common import fragmented_pages, median, time_call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", type=int, default=61, help="KV entries (layers x groups)")
    parser.add_argument("--pages", type=int, default=4096, help="pages in the request")
    parser.add_argument("--max-run", type=int, default=32, help="longest run of consecutive pages")
    parser.add_argument("--repeat", type=int, default=50, help="timed calls of the fast planner")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    model = msgspec.structs.replace(dense_mla(num_layers=args.entries), num_draft_layers=0)
    pool_pages = args.pages * 4
    rng = np.random.default_rng(args.seed)
    src_pages = fragmented_pages(args.pages, pool_pages, rng, args.max_run)
    dst_pages = fragmented_pages(args.pages, pool_pages, rng, args.max_run)

    def placed(layout_base: int, layout: object) -> object:
        sizes = layout.region_sizes  # type: ignore[attr-defined]
        bases = np.concatenate(([0], np.cumsum(sizes)[:-1])) + layout_base
        return layout.with_bases(bases.tolist(), [])  # type: ignore[attr-defined]

    src = placed(
        1 << 36,
        stage_layout(
            model, partition_layers(args.entries, 1), 0, num_pages=pool_pages, num_slots=1
        ),
    )
    dst = placed(1 << 40, decode_layout(model, num_pages=pool_pages, num_slots=1))
    pair_s = median(time_call(lambda: pair(src, dst), repeat=5))  # type: ignore[arg-type]
    cache = PairingCache()
    pairing = cache.get(src, dst)  # type: ignore[arg-type]
    cached_s = median(time_call(lambda: cache.get(src, dst), repeat=50))  # type: ignore[arg-type]

    fast = plan(pairing, src_pages, dst_pages)
    fast_s = median(time_call(lambda: plan(pairing, src_pages, dst_pages), repeat=args.repeat))
    src_list, dst_list = src_pages.tolist(), dst_pages.tolist()
    ref_repeat = max(3, args.repeat // 10)
    ref_s = median(
        time_call(lambda: reference_plan(pairing, src_list, dst_list), repeat=ref_repeat)
    )
    ref = reference_plan(pairing, src_list, dst_list)
    same = ref == list(
        zip(
            fast.blocks.src_addr.tolist(),
            fast.blocks.dst_addr.tolist(),
            fast.blocks.length.tolist(),
        )
    )
    result = {
        "entries": args.entries,
        "pages": args.pages,
        "runs": fast.num_runs,
        "blocks": len(fast),
        "bytes": fast.total_bytes,
        "pair_once_ms": pair_s * 1e3,
        "pairing_cache_hit_us": cached_s * 1e6,
        "vectorised_ms": fast_s * 1e3,
        "reference_ms": ref_s * 1e3,
        "speedup": ref_s / fast_s,
        "identical_blocks": same,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"planning {args.entries} KV entries x {args.pages} pages "
            f"({fast.num_runs} runs -> {len(fast)} blocks, {fast.total_bytes / 2**20:.1f} MiB)"
        )
        print(f"  pair (once per layout pair)   {result['pair_once_ms']:9.3f} ms")
        print(f"  pairing cache hit             {result['pairing_cache_hit_us']:9.3f} us")
        print(f"  reference (per-entry loop)    {result['reference_ms']:9.3f} ms")
        print(f"  vectorised (kvhandoff)        {result['vectorised_ms']:9.3f} ms")
        print(f"  speedup                       {result['speedup']:9.1f} x")
        print(f"  identical blocks              {same}")
    return 0 if same else 1


if __name__ == "__main__":
    from bench.command import main

    sys.exit(main(__doc__, add_arguments, run))
