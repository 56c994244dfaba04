"""Small helpers shared by the benchmarks: timing and fragmented page lists."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt


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
