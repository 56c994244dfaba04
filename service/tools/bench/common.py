"""Small helpers shared by the benchmarks: timing and fragmented page lists."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks
from transport.pool_base import Pool


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


class RawEngine:
    """The Transfer Engine called directly from this process (no kvhandoff code on the path),
    with `pools` registered as sources: the baseline whole-handoff numbers are compared with."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        from transport.config import MooncakeConfig
        from transport.mooncake import start_engine

        self.engine = start_engine(MooncakeConfig())
        self._addrs = [g.addr for pool in pools for g in pool.registrations]
        lengths = [g.length for pool in pools for g in pool.registrations]
        rc = self.engine.batch_register_memory(self._addrs, lengths)
        if rc != 0:
            raise RuntimeError(f"the raw engine could not register the source pools (rc {rc})")

    def close(self) -> None:
        """Unregister the pools (before they are unmapped); the engine goes with the object."""
        if self._addrs:
            self.engine.batch_unregister_memory(self._addrs)
            self._addrs = []

    def seconds(self, target: str, blocks: Blocks) -> float:
        """Wall time of one `raw_write` of `blocks`."""
        t0 = time.perf_counter()
        raw_write(self.engine, target, blocks)
        return time.perf_counter() - t0


def raw_write(engine: Any, target: str, blocks: Blocks) -> None:
    """`batch_transfer_sync_write` over batches of at most 2,048 blocks, in order, from the
    calling thread: the plain way to use the engine."""
    for batch in blocks.batches(DEFAULT_MAX_BLOCKS_PER_BATCH):
        rc = engine.batch_transfer_sync_write(
            target, batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.length.tolist()
        )
        if rc < 0:
            raise RuntimeError(f"raw engine write failed (rc {rc})")
