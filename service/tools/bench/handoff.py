"""`kvhandoff bench handoff`: whole handoffs through the HTTP services, each case against a
baseline measured in the same run on the same deployment.

- `bulk`: a PP=4 hybrid NPU-MLA prefill at full size (scale 1, 128-token pages, one process per
  stage) into a PP=1 decode, `--bulk-requests` requests of `--bulk-pages` fragmented pages,
  `--bulk-concurrency` at a time: router → decode → every stage → Mooncake → arrival → done.
  Baseline: the raw engine (`batch_transfer_sync_write` from this process, 2,048-block batches)
  writing exactly the same blocks — planned with the same pairing, from the same source files,
  into the decode service's own registered memory. Reported: GB/s of both and their ratio.
- `small`: one-page handoffs of a small dense model (PP=1), `--small-concurrency` at a time.
  Baseline: plain `GET /healthz` round trips to the decode service from the same client at the
  same concurrency — how many plain requests one handoff costs. Reported: handoffs/s, requests/s
  and their ratio.

Every handoff must complete; the benchmark fails otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import numpy as np

from pipelines.messages import LayoutInfo
from service.tools.bench.common import RawEngine, fragmented_pages
from service.tools.deployment import LocalDeployment
from service.tools.router_client import RouterClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default="bulk,small", help="comma-separated: bulk, small")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (best)")
    parser.add_argument("--bulk-requests", type=int, default=8)
    parser.add_argument("--bulk-pages", type=int, default=64)
    parser.add_argument("--bulk-concurrency", type=int, default=4)
    parser.add_argument(
        "--bulk-stage-processes",
        choices=["each", "one"],
        default="each",
        help="one prefill process per stage (each) or all four in one",
    )
    parser.add_argument("--small-requests", type=int, default=3000)
    parser.add_argument("--small-concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Request:
    src_pages: list[int]
    dst_pages: list[int]
    src_slot: int | None
    dst_slot: int | None


class Driver:
    """A `RouterClient` whose handoffs must complete: returns the bytes moved, raises otherwise."""

    def __init__(self, http: aiohttp.ClientSession, dep: LocalDeployment) -> None:
        self.client = RouterClient(http, dep)

    async def handoff(self, hid: str, req: Request) -> int:
        outcome = await self.client.handoff(
            hid, req.src_pages, req.dst_pages, req.src_slot, req.dst_slot
        )
        if outcome.state != "completed":
            raise RuntimeError(f"handoff {hid} ended {outcome.state}: {outcome.error}")
        return outcome.bytes


async def run_lanes(
    count: int, lanes: list[Request], job: Any, prefix: str
) -> tuple[float, list[float], int]:
    """Run `count` jobs, each on a free lane (disjoint destination pages): wall seconds,
    per-job latencies, summed job results."""
    free: asyncio.Queue[Request] = asyncio.Queue()
    for lane in lanes:
        free.put_nowait(lane)
    latencies: list[float] = []
    total = 0

    async def one(i: int) -> None:
        nonlocal total
        lane = await free.get()
        t0 = time.perf_counter()
        try:
            moved = await job(f"{prefix}-{i}", lane)  # not `total += await`: that reads first
            total += moved
        finally:
            latencies.append(time.perf_counter() - t0)
            free.put_nowait(lane)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(count):
            tg.create_task(one(i))
    return time.perf_counter() - t0, latencies, total


# -- bulk ---------------------------------------------------------------------------------------


def bulk_lanes(dep: LocalDeployment, args: argparse.Namespace) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    pool_pages = dep.decode_layout.kv[0].num_items
    dst = fragmented_pages(args.bulk_concurrency * args.bulk_pages, pool_pages, rng)
    src = fragmented_pages(args.bulk_pages, dep.stage_layouts[0].kv[0].num_items, rng)
    return [
        Request(
            src_pages=src.tolist(),
            dst_pages=dst[k * args.bulk_pages : (k + 1) * args.bulk_pages].tolist(),
            src_slot=0,
            dst_slot=k,
        )
        for k in range(args.bulk_concurrency)
    ]


async def bulk(args: argparse.Namespace) -> dict[str, Any]:
    pool_pages = (3 * args.bulk_concurrency + 2) * args.bulk_pages  # room to fragment
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model={"scale": 1, "page_size": 128},
        pp_size=4,
        groups=None if args.bulk_stage_processes == "each" else [[0, 1, 2, 3]],
        num_pages=max(pool_pages, 2 * args.bulk_pages),
        num_slots=max(2, args.bulk_concurrency),
        log_level="warning",
    ) as dep:
        lanes = bulk_lanes(dep, args)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{dep.decode_url}/v1/layout") as resp:
                info = msgspec.json.decode(await resp.read(), type=LayoutInfo)
            decode = info.stages[0].layout
            router = Driver(http, dep)
            moves = [(x.src_pages, x.dst_pages, x.src_slot, x.dst_slot) for x in lanes]
            blocks = dep.planned_blocks(decode, moves)
            per_request = blocks.total_bytes // len(lanes)
            engine = RawEngine([dep.stage_pool(r) for r in range(dep.pp_size)])

            def raw() -> float:
                return engine.seconds(info.target, blocks)

            raw()  # warm-up: connections, page faults
            await run_lanes(len(lanes), lanes, router.handoff, "warm")
            raw_times, ours_times = [], []
            for rep in range(args.repeat):
                raw_times.append(raw())
                wall, _, moved = await run_lanes(
                    args.bulk_requests, lanes, router.handoff, f"bulk{rep}"
                )
                if moved != per_request * args.bulk_requests:
                    raise RuntimeError(f"moved {moved} bytes, expected {per_request} a request")
                ours_times.append(wall)
            raw_gbs = blocks.total_bytes / min(raw_times) / 1e9
            ours_gbs = per_request * args.bulk_requests / min(ours_times) / 1e9
            return {
                "case": "bulk",
                "model": "hybrid-npu-mla scale 1, 128-token pages, PP=4 -> PP=1",
                "stage_processes": 4 if args.bulk_stage_processes == "each" else 1,
                "requests": args.bulk_requests,
                "pages_per_request": args.bulk_pages,
                "concurrency": args.bulk_concurrency,
                "bytes_per_request": per_request,
                "blocks_per_request": len(blocks) // len(lanes),
                "raw_mooncake_gb_s": raw_gbs,
                "handoff_gb_s": ours_gbs,
                "ratio": ours_gbs / raw_gbs,
            }


# -- small --------------------------------------------------------------------------------------


async def small(args: argparse.Namespace) -> dict[str, Any]:
    lanes = [Request([k], [k], None, None) for k in range(args.small_concurrency)]
    with LocalDeployment(
        preset="dense-mha",
        model={"scale": 64, "num_layers": 4},
        pp_size=1,
        num_pages=max(64, args.small_concurrency),
        log_level="warning",
    ) as dep:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            router = Driver(http, dep)
            health = f"{dep.decode_url}/healthz"

            async def ping(_: str, __: Request) -> int:
                async with http.get(health) as resp:
                    await resp.read()
                return 0

            await run_lanes(200, lanes, router.handoff, "warm")
            ping_best = ours_best = float("inf")
            lat: list[float] = []
            for rep in range(args.repeat):
                wall, _, _ = await run_lanes(args.small_requests, lanes, ping, f"p{rep}")
                ping_best = min(ping_best, wall)
                wall, lats, _ = await run_lanes(
                    args.small_requests, lanes, router.handoff, f"s{rep}"
                )
                if wall < ours_best:
                    ours_best, lat = wall, lats
            rate = args.small_requests / ours_best
            ping_rate = args.small_requests / ping_best
            return {
                "case": "small",
                "model": "dense-mha 4 layers, 1 page, PP=1",
                "requests": args.small_requests,
                "concurrency": args.small_concurrency,
                "handoffs_per_s": rate,
                "healthz_per_s": ping_rate,
                "ratio": rate / ping_rate,
                "p50_ms": float(np.percentile(lat, 50) * 1e3),
                "p99_ms": float(np.percentile(lat, 99) * 1e3),
            }


def run(args: argparse.Namespace) -> int:
    import uvloop

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"bulk", "small"}
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from bulk, small")
    results = [uvloop.run({"bulk": bulk, "small": small}[c](args)) for c in cases]
    if args.json:
        print(json.dumps({"handoff": results}))
        return 0
    for r in results:
        print(f"{r['case']}: {r['model']}")
        if r["case"] == "bulk":
            print(
                f"  {r['requests']} x {r['bytes_per_request'] / 1e6:.1f} MB "
                f"({r['blocks_per_request']} blocks) at concurrency {r['concurrency']}"
            )
            print(f"  raw Mooncake, same blocks  {r['raw_mooncake_gb_s']:8.2f} GB/s")
            print(
                f"  handoffs over HTTP         {r['handoff_gb_s']:8.2f} GB/s  ({r['ratio']:.2f}x)"
            )
        else:
            print(f"  {r['requests']} one-page handoffs at concurrency {r['concurrency']}")
            print(f"  GET /healthz round trips   {r['healthz_per_s']:8.0f} /s")
            print(
                f"  handoffs over HTTP         {r['handoffs_per_s']:8.0f} /s  ({r['ratio']:.2f}x)"
                f"  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms"
            )
    return 0
