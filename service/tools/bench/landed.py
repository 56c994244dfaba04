"""The landed path's own costs, in this one process (no HTTP, no engine): the cases of
`kvhandoff bench handoff` that need no deployment.

- `segments`: planning and bookkeeping of one stage sent as 61 one-layer segments against one
  segment of all layers (the same bytes; none moved): the prefill's packer, piece sizes, block
  list and notice, and the decode's checks and coverage — everything a segment costs but its
  copies.
- `planning`: per-request work before the engine call on a prefill stage (validation, runs or
  pieces, the transfer list as the engine takes it) at `--plan-layers` x `--plan-pages`
  fragmented pages: the landed packer (validation, `StagePacker` in window-sized segments, the
  decode's `check_pieces`, the 1 MiB block list) against the direct planner (`plan`, its block
  list).
- `gather`: the prefill's gather (one `np.take` per piece into a staging buffer) of a
  fragmented request, window by window, against memcpy of the same bytes from contiguous
  memory: bandwidth and ratio. And the prefill's whole staging of it, digest included: the
  one pass (`chunked.gather_digest`) against the three passes it replaced (gather into a
  scratch, digest it, copy it into the staging buffer), interleaved.
- `commit`: the decode's commit of the same request, window by window (GB/s): the one pass
  (`chunked.scatter_digest`: scatter, then digest the pages written) against the three passes
  of the first design (copy out, digest, scatter; each timed), interleaved — what the bulk
  case's share of commit time is set against.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvhandoff.pipelines.chunked import Scratch, gather_digest, scatter_digest
from kvhandoff.pipelines.decode.coverage import piece_cells
from kvhandoff.pipelines.digest import Digester, digest
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.models import (
    ModelSpec,
    decode_layout,
    dense_mla,
    partition_layers,
    stage_layout,
)
from kvhandoff.pipelines.packing import (
    Pieces,
    Side,
    check_pieces,
    copy_out,
    destination_side,
    gather,
    piece_bytes,
    piece_views,
    scatter,
    source_side,
)
from kvhandoff.pipelines.pairing import Pairing, pair
from kvhandoff.pipelines.planning import plan, validate_request
from kvhandoff.pipelines.prefill.staged import staged_blocks
from kvhandoff.pipelines.stage_packer import StagePacker
from kvhandoff.service.tools.bench.common import fragmented_pages, median, time_call

WINDOW_BYTES = 16 << 20  # transfer.window_bytes' default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan-layers", type=int, default=61, help="layers of the planning cases")
    parser.add_argument("--plan-pages", type=int, default=4096, help="pages of the planning cases")
    parser.add_argument(
        "--copy-pages", type=int, default=192, help="pages of the gather and commit cases"
    )
    parser.add_argument(
        "--copy-scale", type=int, default=8, help="divide the copy cases' page bytes by this"
    )


def dense_model(layers: int, scale: int = 1) -> ModelSpec:
    return msgspec.structs.replace(dense_mla(num_layers=layers, scale=scale), num_draft_layers=0)


def _placed(layout: StageLayout, base: int) -> StageLayout:
    sizes = layout.region_sizes
    bases = np.concatenate(([0], np.cumsum(sizes)[:-1])) + base
    n = len(layout.kv)
    return layout.with_bases(bases[:n].tolist(), bases[n:].tolist())


def placed_pairing(model: ModelSpec, pool_pages: int) -> Pairing:
    part = partition_layers(model.num_layers, 1)
    src = _placed(stage_layout(model, part, 0, num_pages=pool_pages, num_slots=1), 1 << 36)
    dst = _placed(decode_layout(model, num_pages=pool_pages, num_slots=1), 1 << 40)
    return pair(src, dst)


def _best(fn: Callable[[], object], repeat: int) -> float:
    return min(time_call(fn, repeat=repeat))


def _interleaved(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Each run's best seconds over `reps` rounds of one call each, in turn, so every run sees
    the same machine."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(reps):
        for name, fn in runs.items():
            best[name] = min(best[name], _best(fn, 1))
    return best


# -- segments -----------------------------------------------------------------------------------


def _segment_bookkeeping(pairing: Pairing, n: int, layers: list[list[int]] | None) -> int:
    """One stage through the packer and the decode's checks: one segment of every layer
    (`layers` None), or one segment per entry of `layers`. Returns the segments made."""
    packer = StagePacker(pairing, n, has_slot=False)
    covered = np.zeros((pairing.num_kv_pairs, max(n, 1)), dtype=np.bool_)
    budget = packer.total_bytes
    made = 0
    for ready in [None] if layers is None else layers:
        packer.make_ready(ready)
        while (pieces := packer.next_segment(budget)) is not None:
            # Prefill: the segment's size, its blocks, its notice's lists.
            nbytes = int(piece_bytes(pairing, pieces).sum())
            blocks = staged_blocks(1 << 30, 1 << 31, nbytes)
            notice = (pieces.rows.tolist(), pieces.starts.tolist(), pieces.ends.tolist())
            blocks.src_addr.tolist()
            # Decode: the notice's pieces checked, and its cells covered.
            got = Pieces.of(*notice)
            check_pieces(pairing, got, n, False, pp_rank=0)
            cells = piece_cells(pairing, got)
            if covered[cells].any():
                raise AssertionError("a cell was covered twice")
            covered[cells] = True
            made += 1
    if not covered.all():
        raise AssertionError("the segments did not cover the stage")
    return made


def segments(args: argparse.Namespace) -> dict[str, Any]:
    model = dense_model(args.plan_layers)
    pool = args.plan_pages * 4
    pairing = placed_pairing(model, pool)
    n = args.plan_pages
    one_layer = [[int(layer)] for layer in sorted(set(pairing.kv_layer.tolist()))]
    reps = max(5, args.repeat * 5)
    one_s = _best(lambda: _segment_bookkeeping(pairing, n, None), reps)
    many_s = _best(lambda: _segment_bookkeeping(pairing, n, one_layer), reps)
    return {
        "case": "segments",
        "layers": args.plan_layers,
        "pages": n,
        "bytes": StagePacker(pairing, n, False).total_bytes,
        "one_segment_ms": one_s * 1e3,
        "one_layer_segments": _segment_bookkeeping(pairing, n, one_layer),
        "one_layer_segments_ms": many_s * 1e3,
        "ratio": many_s / one_s,
        "target": "ratio <= 2",
    }


# -- planning -----------------------------------------------------------------------------------


def landed_plan(pairing: Pairing, src: Any, dst: Any, segments: int | None = None) -> int:
    """What a landed prefill stage does per request before its engine calls, minus the
    copies: validation, then per segment its pieces, size, 1 MiB blocks (as the engine takes
    them) and notice lists. `segments`: stop after that many (the first engine call waits
    for one only; the rest are planned while earlier segments move). The decode's check of
    each notice is the `segments` case's."""
    src_pages, _ = validate_request(pairing, src, dst, None, None)
    n = int(src_pages.shape[0])
    packer = StagePacker(pairing, n, has_slot=False)
    packer.make_ready(None)
    blocks = made = 0
    while (segments is None or made < segments) and (
        pieces := packer.next_segment(WINDOW_BYTES)
    ) is not None:
        nbytes = int(piece_bytes(pairing, pieces).sum())
        b = staged_blocks(1 << 30, 1 << 31, nbytes)
        b.src_addr.tolist(), b.dst_addr.tolist(), b.length.tolist()
        pieces.rows.tolist(), pieces.starts.tolist(), pieces.ends.tolist()
        blocks += len(b)
        made += 1
    return blocks


def direct_plan(pairing: Pairing, src: Any, dst: Any) -> int:
    """What a direct stage does per request before its engine calls: the plan, as lists."""
    p = plan(pairing, src, dst)
    b = p.blocks
    b.src_addr.tolist(), b.dst_addr.tolist(), b.length.tolist()
    return len(b)


def planning(args: argparse.Namespace) -> dict[str, Any]:
    model = dense_model(args.plan_layers)
    pool = args.plan_pages * 4
    pairing = placed_pairing(model, pool)
    out: dict[str, Any] = {"case": "planning", "layers": args.plan_layers, "by_pages": []}
    for pages in sorted({64, args.plan_pages}):
        rng = np.random.default_rng(args.seed)
        src = fragmented_pages(pages, pool, rng)
        dst = fragmented_pages(pages, pool, rng)
        reps = max(5, args.repeat * 5)
        landed_s = median(time_call(functools.partial(landed_plan, pairing, src, dst), repeat=reps))
        direct_s = median(time_call(functools.partial(direct_plan, pairing, src, dst), repeat=reps))
        first_s = median(
            time_call(functools.partial(landed_plan, pairing, src, dst, 1), repeat=reps)
        )
        row: dict[str, Any] = {
            "pages": pages,
            "bytes": StagePacker(pairing, pages, False).total_bytes,
            "landed_ms": landed_s * 1e3,
            "landed_first_segment_ms": first_s * 1e3,
            "landed_blocks": landed_plan(pairing, src, dst),
            "direct_ms": direct_s * 1e3,
            "direct_blocks": direct_plan(pairing, src, dst),
            "direct_over_landed": direct_s / landed_s,
        }
        out["by_pages"].append(row)
    return out


# -- gather and commit ------------------------------------------------------------------------


class _Regions:
    """Host regions for `kvhandoff.pipelines.packing`: one numpy array per entry."""

    def __init__(self, sizes: list[int]) -> None:
        self.arrays = [np.zeros(s, dtype=np.uint8) for s in sizes]
        for k, a in enumerate(self.arrays):
            a[:] = np.arange(a.shape[0], dtype=np.uint64).astype(np.uint8) + k  # touched: no faults

    def array(self, index: int) -> np.ndarray:
        return self.arrays[index]


def _copy_setup(args: argparse.Namespace) -> tuple[Pairing, _Regions, Any, Any, list[Pieces]]:
    model = dense_model(args.plan_layers, args.copy_scale)
    pool = args.copy_pages * 4
    pairing = placed_pairing(model, pool)
    rng = np.random.default_rng(args.seed)
    src_pages = fragmented_pages(args.copy_pages, pool, rng)
    dst_pages = fragmented_pages(args.copy_pages, pool, rng)
    regions = _Regions(pairing.src.region_sizes)
    packer = StagePacker(pairing, args.copy_pages, has_slot=False)
    packer.make_ready(None)
    segs = []
    while (pieces := packer.next_segment(WINDOW_BYTES)) is not None:
        segs.append(pieces)
    return pairing, regions, src_pages, dst_pages, segs


def _gather_runs(
    pairing: Pairing,
    side: Side,
    segs: list[Pieces],
    sizes: list[int],
    staging: np.ndarray,
) -> dict[str, Callable[[], object]]:
    """The gather case's runs over the same segments: the gather, the gather without numpy's
    buffering, a plain memcpy of as many bytes, and staging with its digest in three passes and
    in one."""
    contiguous = np.ones(sum(sizes), dtype=np.uint8)

    def gather_all() -> None:
        for pieces, size in zip(segs, sizes):
            gather(pairing, side, pieces, staging[:size])

    def gather_unbuffered() -> None:
        # The same pieces with `np.take(mode="clip")`: numpy buffers `out` under the default
        # mode="raise" (a second pass over the bytes); the pieces were checked already.
        for pieces, size in zip(segs, sizes):
            for rows, idx, out in piece_views(pairing, side, pieces, staging[:size]):
                np.take(rows, idx, axis=0, out=out, mode="clip")

    def memcpy_all() -> None:
        off = 0
        for size in sizes:
            np.copyto(staging[:size], contiguous[off : off + size])
            off += size

    scratch_all = np.zeros(WINDOW_BYTES, dtype=np.uint8)
    chunks = Scratch()

    def stage_three_pass() -> None:
        for pieces, size in zip(segs, sizes):
            gather(pairing, side, pieces, scratch_all[:size])
            digest(scratch_all[:size], "xxh3_128", seed=size)
            np.copyto(staging[:size], scratch_all[:size])

    def stage_one_pass() -> None:
        for pieces, size in zip(segs, sizes):
            digester = Digester("xxh3_128", seed=size)
            gather_digest(pairing, side, pieces, staging[:size], digester, chunks)

    return {
        "gather": gather_all,
        "clip": gather_unbuffered,
        "memcpy": memcpy_all,
        "three": stage_three_pass,
        "one": stage_one_pass,
    }


def gather_case(args: argparse.Namespace) -> dict[str, Any]:
    pairing, regions, src_pages, _, segs = _copy_setup(args)
    side = source_side(pairing, regions, src_pages, None)
    staging = np.zeros(WINDOW_BYTES, dtype=np.uint8)
    sizes = [int(piece_bytes(pairing, p).sum()) for p in segs]
    total = sum(sizes)
    reps = max(3, args.repeat)
    best = _interleaved(_gather_runs(pairing, side, segs, sizes, staging), reps)
    gather_s, clip_s, memcpy_s = best["gather"], best["clip"], best["memcpy"]
    three_s, one_s = best["three"], best["one"]
    return {
        "case": "gather",
        "layers": args.plan_layers,
        "pages": args.copy_pages,
        "bytes": total,
        "segments": len(segs),
        "pieces": int(sum(len(p) for p in segs)),
        "gather_gb_s": total / gather_s / 1e9,
        "memcpy_gb_s": total / memcpy_s / 1e9,
        "ratio": memcpy_s / gather_s,
        "gather_unbuffered_gb_s": total / clip_s / 1e9,
        "unbuffered_ratio": memcpy_s / clip_s,
        "stage_three_pass_gb_s": total / three_s / 1e9,
        "stage_one_pass_gb_s": total / one_s / 1e9,
        "stage_one_pass_speedup": three_s / one_s,
        "target": "ratio >= 0.8",
    }


def commit_case(args: argparse.Namespace) -> dict[str, Any]:
    """The decode's work per segment on host memory: one pass against three (copy out,
    xxh3-128, scatter)."""
    pairing, regions, src_pages, dst_pages, segs = _copy_setup(args)
    dst = _Regions(pairing.dst.region_sizes)
    src_side = source_side(pairing, regions, src_pages, None)
    dst_side = destination_side(pairing, dst, dst_pages, None)
    sizes = [int(piece_bytes(pairing, p).sum()) for p in segs]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    total = sum(sizes)
    arena = np.zeros(total, dtype=np.uint8)  # every segment landed in its own window
    digests = []
    for pieces, off, size in zip(segs, offsets, sizes):
        gather(pairing, src_side, pieces, arena[off : off + size])
        # Each segment under its own seed, as a prefill digests it for its grant.
        digests.append(digest(arena[off : off + size], "xxh3_128", seed=off))

    parts = {"copy_out": 0.0, "digest": 0.0, "scatter": 0.0}

    def commit_all() -> None:
        for pieces, off, size, want in zip(segs, offsets, sizes, digests):
            t0 = time.perf_counter()
            snap = copy_out(arena, off, size)
            t1 = time.perf_counter()
            if digest(snap, "xxh3_128", seed=off) != want:
                raise AssertionError("a landed segment did not match its digest")
            t2 = time.perf_counter()
            scatter(pairing, dst_side, pieces, snap)
            t3 = time.perf_counter()
            parts["copy_out"] += t1 - t0
            parts["digest"] += t2 - t1
            parts["scatter"] += t3 - t2

    def commit_one_pass() -> None:
        for pieces, off, want in zip(segs, offsets, digests):
            digester = Digester("xxh3_128", seed=off)
            got = scatter_digest(arena, off, pairing, dst_side, pieces, digester)
            if got != want:
                raise AssertionError("a landed segment did not match its digest")

    reps = max(3, args.repeat)
    best = one = float("inf")
    for _ in range(reps):  # interleaved, so both see the same machine
        for k in parts:
            parts[k] = 0.0
        best = min(best, _best(commit_all, 1))
        one = min(one, _best(commit_one_pass, 1))
    return {
        "case": "commit",
        "bytes": total,
        "segments": len(segs),
        "commit_gb_s": total / one / 1e9,
        "three_pass_gb_s": total / best / 1e9,
        "one_pass_speedup": best / one,
        "copy_out_gb_s": total / parts["copy_out"] / 1e9,
        "digest_gb_s": total / parts["digest"] / 1e9,
        "scatter_gb_s": total / parts["scatter"] / 1e9,
    }
