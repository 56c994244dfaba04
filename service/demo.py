"""`kvhandoff demo`: a complete hybrid-linear PP handoff deployment, driven and verified.

Starts a decode pipeline and a PP=4 prefill (hybrid NPU-MLA preset scaled for CPU) in this
process, each with its own pools and its own Mooncake engine talking TCP on loopback (or the local
transport), linked in-process (the embedded mode). It then plays router and engines for
`--requests` concurrent handoffs with fragmented page lists, fills every source page with bytes
that are a function of (request, layer, group or kind, page ordinal), and after each completion
reads the decode pools and checks every byte landed in the right layer, group and page.

Still to come (issue #4): the multi-process deployment over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from pipelines.decode import DecodePipeline, HandoffRequest, HandoffState
from pipelines.events import TERMINAL_EVENTS, Event, EventBus
from pipelines.inprocess import InProcessLink
from pipelines.memory import PoolMemory
from pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from pipelines.prefill import HostedStage, PrefillPipeline
from transport.config import MooncakeConfig
from transport.local import LocalTransport
from transport.mooncake import MooncakeTransport
from transport.pools import Pool, open_pool

DECODE_URL, PREFILL_URL = "inproc://decode", "inproc://prefill"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="handoffs to run")
    parser.add_argument("--concurrency", type=int, default=16, help="handoffs in flight at once")
    parser.add_argument("--pp", type=int, default=4, help="prefill pipeline-parallel stages")
    parser.add_argument("--pages", type=int, default=64, help="most pages per request")
    parser.add_argument("--transport", choices=["mooncake", "local"], default="mooncake")
    parser.add_argument("--verify-digests", action="store_true", help="end-to-end digests too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _pattern(
    request: int, layer: int, which: int, ordinal: np.ndarray, item_len: int
) -> np.ndarray:
    """Bytes of one page (or slot): a deterministic function of what it belongs to."""
    seed = request * 1_000_003 + layer * 7_919 + which * 104_729
    rows = (seed + ordinal[:, None] * 31 + np.arange(item_len)[None, :]) % 251
    return rows.astype(np.uint8)


class _Side(PoolMemory):
    def kv_rows(self, i: int) -> np.ndarray:
        e = self.layout.kv[i]
        return self.region(i)[: e.nbytes].reshape(e.num_items, e.item_len)

    def slot(self, j: int, slot: int) -> np.ndarray:
        s = self.layout.state[j]
        return self.region(len(self.layout.kv) + j)[slot * s.item_len : (slot + 1) * s.item_len]


def _kind_id(kind: str) -> int:
    return 1000 + sum(map(ord, kind))


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    model = hybrid_npu_mla(scale=64, page_size=16)
    part = partition_layers(model.num_layers, args.pp)
    pool_pages = max(4 * args.pages * args.concurrency, 1024)
    slots = args.concurrency * 2
    transports: list[Any] = []

    def transport() -> Any:
        t = (
            LocalTransport()
            if args.transport == "local"
            else MooncakeTransport.start(MooncakeConfig())
        )
        transports.append(t)
        return t

    pools: list[Pool] = []
    dec_t = transport()
    pre_t = dec_t if args.transport == "local" else transport()
    dec_layout = decode_layout(model, num_pages=pool_pages, num_slots=slots)
    dec_pool = open_pool("torch:cpu", dec_layout.region_sizes)
    pools.append(dec_pool)
    dec_pool.register(dec_t)
    dec = _Side(dec_layout, dec_pool)
    stages: dict[int, _Side] = {}
    for r in range(args.pp):
        lay = stage_layout(model, part, r, num_pages=pool_pages, num_slots=slots)
        pool = open_pool("torch:cpu", lay.region_sizes)
        pool.register(pre_t)
        pools.append(pool)
        stages[r] = _Side(lay, pool)

    bus = EventBus()
    link = InProcessLink()
    decode = DecodePipeline(dec.layout, dec_t.local_target, DECODE_URL, link, bus, memory=dec)
    prefill = PrefillPipeline(
        {r: HostedStage(s.layout, s) for r, s in stages.items()}, pre_t, link, bus
    )
    link.decode = decode
    link.add_prefill(PREFILL_URL, prefill, pre_t.local_target)
    done: dict[str, asyncio.Future[Event]] = {}

    def on_event(event: Event) -> None:
        if isinstance(event, TERMINAL_EVENTS) and event.role == "decode":
            fut = done.get(event.handoff_id)
            if fut is not None and not fut.done():
                fut.set_result(event)

    bus.add_listener(on_event)
    rng = np.random.default_rng(args.seed)
    free_pages = list(range(pool_pages))
    free_slots = list(range(slots))
    free_src, free_src_slots = list(range(pool_pages)), list(range(slots))
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    async def one(i: int) -> None:
        async with sem:
            n = int(rng.integers(1, args.pages + 1))
            take = sorted(rng.choice(len(free_pages), n, replace=False).tolist(), reverse=True)
            dst_pages = np.array([free_pages.pop(k) for k in take], dtype=np.int64)
            dst_slot = free_slots.pop()
            # Source pages are owned by the request while it is in flight, as in an engine.
            take = sorted(rng.choice(len(free_src), n, replace=False).tolist(), reverse=True)
            src_pages = np.array([free_src.pop(k) for k in take], dtype=np.int64)
            src_slot = free_src_slots.pop()
            ordinal = np.arange(n)
            for side in stages.values():
                for k, e in enumerate(side.layout.kv):
                    side.kv_rows(k)[src_pages] = _pattern(
                        i, e.layer_id, e.group, ordinal, e.item_len
                    )
                for j, s in enumerate(side.layout.state):
                    side.slot(j, src_slot)[:] = _pattern(
                        i, s.layer_id, _kind_id(s.kind), np.zeros(1, np.int64), s.item_len
                    )[0]
            hid = f"req-{i}"
            done[hid] = asyncio.get_running_loop().create_future()
            t0 = time.perf_counter()
            await decode.create(
                HandoffRequest(
                    id=hid,
                    prefill=[PREFILL_URL],
                    dst_pages=dst_pages.tolist(),
                    dst_slot=dst_slot,
                    verify=args.verify_digests,
                )
            )
            for r in stages:
                prefill.ready(hid, r, src_pages, src_slot)
            event = await done[hid]
            latency = time.perf_counter() - t0
            view = decode.get(hid)
            ok = view.state == HandoffState.COMPLETED and _verify(dec, i, dst_pages, dst_slot)
            results.append(
                {
                    "id": hid,
                    "state": view.state.value,
                    "verified": ok,
                    "bytes": view.bytes,
                    "latency_s": latency,
                    "error": getattr(event, "reason", None),
                }
            )
            free_pages.extend(dst_pages.tolist())
            free_src.extend(src_pages.tolist())
            free_src_slots.append(src_slot)
            free_slots.append(dst_slot)
            _progress(len(results), args.requests, args.json)

    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(args.requests):
                tg.create_task(one(i))
    finally:
        await prefill.close()
        await decode.close()
        for pool in pools:
            pool.close()
        for t in transports:
            t.close()
    wall = time.perf_counter() - t_start
    return _summary(results, wall, args)


def _verify(dec: _Side, request: int, dst_pages: np.ndarray, dst_slot: int) -> bool:
    ordinal = np.arange(dst_pages.shape[0])
    for k, e in enumerate(dec.layout.kv):
        want = _pattern(request, e.layer_id, e.group, ordinal, e.item_len)
        if not np.array_equal(dec.kv_rows(k)[dst_pages], want):
            return False
    for j, s in enumerate(dec.layout.state):
        want = _pattern(request, s.layer_id, _kind_id(s.kind), np.zeros(1, np.int64), s.item_len)[0]
        if not np.array_equal(dec.slot(j, dst_slot), want):
            return False
    return True


def _progress(done: int, total: int, quiet: bool) -> None:
    if quiet or not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _summary(results: list[dict[str, Any]], wall: float, args: argparse.Namespace) -> int:
    completed = sum(r["state"] == "completed" for r in results)
    verified = sum(r["verified"] for r in results)
    failed = len(results) - completed
    total_bytes = sum(r["bytes"] for r in results)
    lat = np.array([r["latency_s"] for r in results]) if results else np.zeros(1)
    summary = {
        "requests": args.requests,
        "completed": completed,
        "failed": failed,
        "verified": verified,
        "bytes": total_bytes,
        "seconds": wall,
        "gb_per_s": total_bytes / wall / 1e9 if wall else 0.0,
        "handoffs_per_s": len(results) / wall if wall else 0.0,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "transport": args.transport,
        "pp": args.pp,
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"kvhandoff demo: PP={args.pp} hybrid NPU-MLA -> decode over {args.transport}")
        for key in ("requests", "completed", "failed", "verified"):
            print(f"  {key:<14}{summary[key]:>12}")
        print(f"  {'bytes':<14}{total_bytes:>12,}")
        print(f"  {'throughput':<14}{summary['gb_per_s']:>9.3f} GB/s")
        print(f"  {'handoffs/s':<14}{summary['handoffs_per_s']:>12.1f}")
        print(f"  {'p50 latency':<14}{summary['p50_ms']:>9.2f} ms")
        print(f"  {'p99 latency':<14}{summary['p99_ms']:>9.2f} ms")
        for err in summary["errors"]:
            print(f"  error: {err}")
    return 0 if verified == args.requests else 1
