"""`kvhandoff bench transport`: our transports against memcpy and raw Mooncake engine calls.

Two cases, one block list each, every method moving exactly the same bytes:

- bulk: `--bulk-mib` MiB in `--bulk-block-kib` KiB blocks (throughput ceiling);
- fragmented: one request of `--layers` layers x `--pages` pages of `--item-kib` KiB, source
  pages contiguous, destination pages in runs of 1..`--max-run` scattered over a pool twice as
  large — one block per (layer, run), as the planner produces them.

Methods: `memcpy` (numpy slice copies of the block list: the in-process floor), `local`
(LocalTransport), `mooncake-raw` (the engine's `batch_transfer_sync_write` called in a loop over
2,048-block batches from the main thread) and `mooncake` (MooncakeTransport.write, batches also
capped at `--max-bytes-per-batch`). The
destination is a shm pool owned by a receiver process; the in-process methods attach to the same
file, so every method writes the same memory. Ratios compare best times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvhandoff.service.testing.raw_engines import raw_write
from kvhandoff.service.tools.bench.common import fragmented_pages
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.mooncake_engine import start_engine
from kvhandoff.transport.pool_base import Pool, host_array
from kvhandoff.transport.pool_shm import ShmPool
from kvhandoff.transport.pools import open_pool

ALIGN = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (best/median)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--bulk-mib", type=int, default=256)
    parser.add_argument("--bulk-block-kib", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--item-kib", type=int, default=16)
    parser.add_argument("--max-run", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-bytes-per-batch",
        type=int,
        default=MooncakeConfig().max_bytes_per_batch,
        help="byte cap per engine call for `local` and `mooncake` (raw calls use 2,048 blocks)",
    )
    parser.add_argument(
        "--cases", default="bulk,fragmented", help="comma-separated: bulk, fragmented"
    )


# -- receiver process -----------------------------------------------------------------------


def _receiver(shm: str, sizes: list[int], conn: Connection) -> None:
    pool = ShmPool(shm, sizes, align_bytes=ALIGN, create=True)
    transport = MooncakeTransport.start(MooncakeConfig())
    pool.register(transport)
    conn.send((transport.local_target, pool.bases))
    conn.recv()  # any message, or EOF: stop
    pool.close()
    transport.close()


# -- cases ------------------------------------------------------------------------------------


class Case:
    """One block list between a local source pool and the receiver's shm pool."""

    def __init__(
        self, name: str, src_sizes: list[int], dst_sizes: list[int], make: Callable[..., Blocks]
    ) -> None:
        self.name = name
        self.src_sizes, self.dst_sizes, self.make = src_sizes, dst_sizes, make


def bulk_case(args: argparse.Namespace) -> Case:
    size, block = args.bulk_mib << 20, args.bulk_block_kib << 10

    def make(src: list[int], dst: list[int]) -> Blocks:
        offs = np.arange(size // block, dtype=np.uint64) * np.uint64(block)
        return Blocks.of(offs + src[0], offs + dst[0], np.full(offs.shape, block))

    return Case(
        f"bulk {args.bulk_mib} MiB / {args.bulk_block_kib} KiB blocks", [size], [size], make
    )


def fragmented_case(args: argparse.Namespace) -> Case:
    from kvhandoff.pipelines.planning import find_runs

    item = args.item_kib << 10
    rng = np.random.default_rng(args.seed)
    src_pages = np.arange(args.pages, dtype=np.int64)
    dst_pages = fragmented_pages(args.pages, 2 * args.pages, rng, max_run=args.max_run)
    s0, d0, n = find_runs(src_pages, dst_pages)

    def make(src: list[int], dst: list[int]) -> Blocks:
        it = np.uint64(item)
        src_b = np.array(src, dtype=np.uint64)[:, None]
        dst_b = np.array(dst, dtype=np.uint64)[:, None]
        grid = (len(src), s0.shape[0])
        return Blocks.of(
            (src_b + s0.astype(np.uint64)[None, :] * it).ravel(),
            (dst_b + d0.astype(np.uint64)[None, :] * it).ravel(),
            np.broadcast_to(n.astype(np.uint64)[None, :] * it, grid).ravel(),
        )

    name = f"fragmented {args.layers} layers x {args.pages} pages x {args.item_kib} KiB"
    return Case(
        name, [args.pages * item] * args.layers, [2 * args.pages * item] * args.layers, make
    )


# -- methods ------------------------------------------------------------------------------------


def memcpy_blocks(
    blocks: Blocks, src_base: int, src: np.ndarray, dst_base: int, dst: np.ndarray
) -> None:
    for s, d, n in zip(blocks.src_addr.tolist(), blocks.dst_addr.tolist(), blocks.length.tolist()):
        so, do = s - src_base, d - dst_base
        dst[do : do + n] = src[so : so + n]


def timed(fn: Callable[[], None], repeat: int) -> list[float]:
    fn()  # warm-up: page faults, connections
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_case(case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    return run_cases([case], args)


def run_cases(
    cases: list[Case], args: argparse.Namespace, on_case: Callable[[Case], None] | None = None
) -> list[dict[str, Any]]:
    """Every method on every case, one receiver process for all: the cases must share their
    source and destination sizes (a block-size sweep over the same memory). `on_case` is told
    when each case starts (progress)."""
    src_sizes, dst_sizes = cases[0].src_sizes, cases[0].dst_sizes
    if any(c.src_sizes != src_sizes or c.dst_sizes != dst_sizes for c in cases):
        raise ValueError("run_cases needs cases of the same source and destination sizes")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    shm = f"kvhandoff-bench-{uuid.uuid4().hex[:12]}"
    proc = ctx.Process(target=_receiver, args=(shm, dst_sizes, child), daemon=True)
    proc.start()
    pools: list[Pool] = []
    try:
        peer, remote_bases = parent.recv()
        src_pool = open_pool("torch:cpu", src_sizes, align_bytes=ALIGN)
        pools.append(src_pool)
        dst_pool = ShmPool(shm, dst_sizes, align_bytes=ALIGN, create=False)
        pools.append(dst_pool)
        (src_span,), (dst_span,) = src_pool.registrations, dst_pool.registrations
        src_mem, dst_mem = (
            host_array(src_span.addr, src_span.length),
            host_array(dst_span.addr, dst_span.length),
        )
        src_mem[:] = np.random.default_rng(1).integers(0, 256, src_mem.shape[0], dtype=np.uint8)
        rows: list[dict[str, Any]] = []
        for case in cases:
            if on_case is not None:
                on_case(case)
            local_blocks = case.make(src_pool.bases, dst_pool.bases)
            remote_blocks = case.make(src_pool.bases, remote_bases)
            results = _methods(
                args, peer, local_blocks, remote_blocks, (src_span, src_mem), (dst_span, dst_mem)
            )
            total = local_blocks.total_bytes
            rows += [
                {
                    "case": case.name,
                    "method": method,
                    "blocks": len(local_blocks),
                    "block_bytes": int(local_blocks.length.max()),
                    "bytes": total,
                    "best_s": min(times),
                    "median_s": statistics.median(times),
                    "best_gbps": total / min(times) / 1e9,
                    "median_gbps": total / statistics.median(times) / 1e9,
                }
                for method, times in results.items()
            ]
        return rows
    finally:
        for p in pools:
            p.close()
        parent.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _methods(
    args: argparse.Namespace,
    peer: str,
    local_blocks: Blocks,
    remote_blocks: Blocks,
    src: tuple[Any, np.ndarray],
    dst: tuple[Any, np.ndarray],
) -> dict[str, list[float]]:
    """Wall times of each method moving the same blocks (`local_blocks` within this process,
    `remote_blocks` into the receiver's mapping of the same memory)."""
    (src_span, src_mem), (dst_span, dst_mem) = src, dst
    results: dict[str, list[float]] = {}
    results["memcpy"] = timed(
        lambda: memcpy_blocks(local_blocks, src_span.addr, src_mem, dst_span.addr, dst_mem),
        args.repeat,
    )

    # Each transport registers the same spans directly (a Pool registers with one only).
    async def local_runs() -> None:
        local = LocalTransport(max_bytes_per_batch=args.max_bytes_per_batch)
        local.register([src_span, dst_span])
        results["local"] = await atimed(
            lambda: local.write(local.local_target, local_blocks), args.repeat
        )
        local.close()

    asyncio.run(local_runs())

    config = MooncakeConfig(max_bytes_per_batch=args.max_bytes_per_batch)
    raw = start_engine(config)
    if raw.batch_register_memory([src_span.addr], [src_span.length]) != 0:
        raise RuntimeError("raw engine could not register the source")
    try:
        results["mooncake-raw"] = timed(lambda: raw_write(raw, peer, remote_blocks), args.repeat)
    finally:
        raw.batch_unregister_memory([src_span.addr])

    async def mooncake_runs() -> None:
        transport = MooncakeTransport.start(config)
        transport.register([src_span])
        results["mooncake"] = await atimed(
            lambda: transport.write(peer, remote_blocks), args.repeat
        )
        transport.close()

    asyncio.run(mooncake_runs())
    return results


async def atimed(fn: Callable[[], Any], repeat: int) -> list[float]:
    await fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        best = {r["method"]: r["best_s"] for r in rows if r["case"] == case}
        out[case] = {
            "mooncake/raw": best["mooncake-raw"] / best["mooncake"],
            "local/memcpy": best["memcpy"] / best["local"],
        }
    return out


def run(args: argparse.Namespace) -> int:
    makers = {"bulk": bulk_case, "fragmented": fragmented_case}
    rows: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        rows += run_case(makers[name.strip()](args), args)
    speed = ratios(rows)
    if args.json:
        print(json.dumps({"results": rows, "ratios": speed}, indent=2))
        return 0
    print(f"{'case':<48} {'method':<13} {'blocks':>7} {'best ms':>9} {'median ms':>10} {'GB/s':>6}")
    for r in rows:
        print(
            f"{r['case']:<48} {r['method']:<13} {r['blocks']:>7} {r['best_s'] * 1e3:>9.1f} "
            f"{r['median_s'] * 1e3:>10.1f} {r['best_gbps']:>6.2f}"
        )
    for case, rs in speed.items():
        print(
            f"{case}: ours/raw mooncake = {rs['mooncake/raw']:.3f} (throughput), "
            f"local/memcpy = {rs['local/memcpy']:.3f}"
        )
    return 0


def block_sweep(
    args: argparse.Namespace,
    block_kibs: list[int],
    total_mib: int,
    on_case: Callable[[Case], None] | None = None,
) -> list[dict[str, Any]]:
    """Throughput against block size: `total_mib` MiB moved as blocks of each size in
    `block_kibs`, by every method, over the same memory and one receiver."""
    cases = [
        bulk_case(argparse.Namespace(bulk_mib=total_mib, bulk_block_kib=kib)) for kib in block_kibs
    ]
    return run_cases(cases, args, on_case)
