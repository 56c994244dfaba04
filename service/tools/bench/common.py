"""Small helpers shared by the benchmarks: timing, fragmented page lists and the raw-engine
baselines (one engine from this process, or one per stage in parallel)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks
from transport.config import DEFAULT_MAX_BYTES_PER_BATCH
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
    """`batch_transfer_sync_write` over batches of at most 2,048 blocks and 1 GiB (as the
    service's transport cuts them: the engine refuses a call of 2 GiB), in order, from the
    calling thread: the plain way to use the engine."""
    for batch in blocks.batches(DEFAULT_MAX_BLOCKS_PER_BATCH, DEFAULT_MAX_BYTES_PER_BATCH):
        rc = engine.batch_transfer_sync_write(
            target, batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.length.tolist()
        )
        if rc < 0:
            raise RuntimeError(f"raw engine write failed (rc {rc})")


class StageEngines:
    """One raw Transfer Engine per prefill stage, each with only its stage's pool registered,
    writing its own blocks at the same time as the others: the same process topology as the
    service (one engine per stage, in parallel), with no kvhandoff code on the path."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.engines: list[RawEngine] = []
        try:
            for pool in pools:
                self.engines.append(RawEngine([pool]))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def seconds(self, target: str, per_stage: Sequence[Blocks]) -> float:
        """Wall time of every stage's engine writing its `per_stage[r]` at once (threads: the
        engine call releases the GIL), from the first start to the last end."""
        if len(per_stage) != len(self.engines):
            raise ValueError(f"{len(per_stage)} block lists for {len(self.engines)} engines")
        errors: list[BaseException] = []
        start = threading.Barrier(len(self.engines) + 1)

        def one(engine: RawEngine, blocks: Blocks) -> None:
            start.wait()
            try:
                raw_write(engine.engine, target, blocks)
            except Exception as exc:  # noqa: BLE001 - re-raised in the calling thread below
                errors.append(exc)

        threads = [
            threading.Thread(target=one, args=(e, b), daemon=True)
            for e, b in zip(self.engines, per_stage)
        ]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return elapsed


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
