"""Small helpers shared by the benchmarks: timing, fragmented page lists and large contiguous
block lists (the raw-engine baselines are `kvhandoff.service.testing.raw_engines`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvhandoff.transport.blocks import Blocks


def time_call(fn: Callable[[], object], *, repeat: int, warmup: int = 1) -> list[float]:
    """Wall times in seconds of `repeat` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)


def fragmented_pages(
    num_pages: int, pool_pages: int, rng: np.random.Generator, max_run: int = 32
) -> npt.NDArray[np.int64]:
    """`num_pages` distinct pages of a pool, in runs of 1..max_run consecutive pages at random
    places in random order — what an allocator hands out after a while of churn."""
    runs: list[npt.NDArray[np.int64]] = []
    total = 0
    while total < num_pages:
        n = min(int(rng.integers(1, max_run + 1)), num_pages - total)
        runs.append(np.arange(n, dtype=np.int64))
        total += n
    # Place runs in disjoint slots of the pool, in a shuffled order, with gaps between them.
    slot = pool_pages // len(runs)
    if slot < max_run:
        raise ValueError("pool too small for the requested fragmentation")
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] + order[i] * slot for i in range(len(runs))])


def large_blocks(
    total_bytes: int,
    src_regions: Sequence[tuple[int, int]],
    dst_regions: Sequence[tuple[int, int]],
    block_bytes: int,
) -> Blocks:
    """`total_bytes` as blocks of at most `block_bytes`, read contiguously from `src_regions`
    and written contiguously into `dst_regions` ((addr, length) each, filled in order, from the
    first again when they are used up): what moving the same count of bytes costs when nothing
    is fragmented."""
    if not src_regions or not dst_regions:
        raise ValueError("large_blocks needs source and destination regions")
    srcs, dsts, lens = [], [], []
    si = di = s_off = d_off = 0
    left = total_bytes
    while left > 0:
        (s_addr, s_len), (d_addr, d_len) = src_regions[si], dst_regions[di]
        n = min(block_bytes, s_len - s_off, d_len - d_off, left)
        srcs.append(s_addr + s_off)
        dsts.append(d_addr + d_off)
        lens.append(n)
        s_off, d_off, left = s_off + n, d_off + n, left - n
        if s_off == s_len:
            si, s_off = (si + 1) % len(src_regions), 0
        if d_off == d_len:
            di, d_off = (di + 1) % len(dst_regions), 0
    return Blocks.of(srcs, dsts, lens)
