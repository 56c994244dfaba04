"""`kvhandoff bench handoff`: whole handoffs through the HTTP services and the landed path's own
costs, each case against a baseline measured in the same run.

- `bulk`: a PP=4 hybrid NPU-MLA prefill at full size (scale 1, 128-token pages, one process per
  stage) into a PP=1 decode, `--bulk-requests` requests of `--bulk-pages` fragmented pages
  (153 MB each at 64), `--bulk-concurrency` at a time: router → decode → every stage → Mooncake
  → commit → done. Run twice, in a landed and a direct deployment of the same shape. Baseline
  in each, interleaved with its runs: raw Mooncake in the same topology — one engine per stage,
  each with its own stage's pool registered, in a process per stage as the services (threads
  of this process with `--bulk-stage-processes one`), all writing at once — moving the same bytes as
  1 MiB blocks, and once the same per-page blocks direct mode plans. Reported: GB/s of each,
  landed/direct, landed/raw and direct/raw, the decode's commit time (its one pass: scatter,
  then digest of the pages written; from `kvhandoff_segment_commit_seconds`) per second of the
  landed runs, and
  the CPU seconds per GB of every process of each run (from /proc, per thread kind too:
  `kvhandoff.service.tools.bench.cpu`), the decode's landed against direct.
- `small`: one-page handoffs of a small dense model (PP=1), `--small-concurrency` at a time.
  Baseline: plain `GET /healthz` round trips to the decode service from the same client at the
  same concurrency — how many plain requests one handoff costs. Reported: handoffs/s, requests/s
  and their ratio.
- `segments`, `planning`, `gather`, `commit`: in this process, no engine
  (`kvhandoff.service.tools.bench.landed`).

Every handoff must complete; the benchmark fails otherwise. With `--json`/`--out` the results
carry the machine and the commit they were measured on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.prefill.staged import BLOCK_BYTES
from kvhandoff.service.config import TransferConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.testing.raw_engines import StageEngines, StageProcesses
from kvhandoff.service.tools.bench import landed as landed_cases
from kvhandoff.service.tools.bench.common import fragmented_pages, large_blocks
from kvhandoff.service.tools.bench.cpu import CpuMeter, cpu_figures, print_cpu, run_meters
from kvhandoff.service.tools.router_client import RouterClient
from kvhandoff.transport.blocks import Blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of: {', '.join(CASES)}",
    )
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
    parser.add_argument("--landing-mb", type=int, default=256, help="bulk: transfer.landing_bytes")
    parser.add_argument("--window-mb", type=int, default=16, help="bulk: transfer.window_bytes")
    parser.add_argument("--staging-mb", type=int, default=64, help="bulk: transfer.staging_bytes")
    parser.add_argument("--small-requests", type=int, default=3000)
    parser.add_argument("--small-concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON results (with machine and commit) here")
    landed_cases.add_arguments(parser)


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


def _bulk_deployment(args: argparse.Namespace, mode: str) -> LocalDeployment:
    # Room to fragment each lane's pages (`fragmented_pages` needs >= 32 pages per run).
    pool_pages = max(2 * args.bulk_concurrency * args.bulk_pages, 512)
    return LocalDeployment(
        preset="hybrid-npu-mla",
        model={"scale": 1, "page_size": 128},
        pp_size=4,
        groups=None if args.bulk_stage_processes == "each" else [[0, 1, 2, 3]],
        num_pages=pool_pages,
        num_slots=max(2, args.bulk_concurrency),
        transfer=TransferConfig(
            mode=mode,  # type: ignore[arg-type]
            landing_bytes=args.landing_mb << 20,
            window_bytes=args.window_mb << 20,
            staging_bytes=args.staging_mb << 20,
        ),
        log_level="warning",
        # Pool memory allocated up front, as an engine's is: see `deployment._preallocate`.
        preallocate=True,
    )


def stage_shares(layout: StageLayout, parts: int) -> list[list[tuple[int, int]]]:
    """The KV entries of `layout` as `parts` disjoint shares of equal bytes ((addr, length)
    regions each): where each stage's raw engine writes its large blocks."""
    regions = [(e.base, e.nbytes) for e in layout.kv]
    each = sum(n for _, n in regions) // parts
    shares: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    k, left = 0, each
    for addr, length in regions:
        off = 0
        while off < length and k < parts:
            n = min(length - off, left)
            shares[k].append((addr + off, n))
            off, left = off + n, left - n
            if left == 0:
                k, left = k + 1, each
    return shares


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    return 0.0


COMMIT_SUM = "kvhandoff_segment_commit_seconds_sum"


@dataclass
class _Bulk:
    """What `bulk` moves and measured: the direct plan's blocks per stage (`per_stage`, for
    the `moves` lanes at once), the same bytes as large blocks per stage (`large`), and the
    wall seconds of each run by what ran it ("raw", "landed", "direct"), and each decode's CPU
    seconds over its own timed runs (`cpu`)."""

    moves: int
    per_stage: list[Blocks]
    per_request: int
    large: list[Blocks]
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"raw": [], "landed": [], "direct": []}
    )
    cpu: dict[str, CpuMeter] = field(default_factory=dict)
    commit_s: float = 0.0
    pages_s: float = 0.0


async def bulk(args: argparse.Namespace) -> dict[str, Any]:
    """A landed and a direct deployment of the same shape, up at once, and raw Mooncake from
    this process (one engine per stage, in parallel, into the direct decode's KV memory: a
    landed decode registers only its landing arena), interleaved run by run."""
    with contextlib.ExitStack() as stack:
        deps = {m: stack.enter_context(_bulk_deployment(args, m)) for m in ("landed", "direct")}
        async with aiohttp.ClientSession() as http:
            lanes = {mode: bulk_lanes(dep, args) for mode, dep in deps.items()}
            routers = {mode: Driver(http, dep).handoff for mode, dep in deps.items()}
            dep = deps["direct"]
            async with http.get(f"{dep.decode_url}/v1/layout") as resp:
                info = msgspec.json.decode(await resp.read(), type=LayoutInfo)
            work = _bulk_work(dep, info.stages[0].layout, lanes["direct"], args)
            # The services' topology: a process per stage (`each`), or all stages in one.
            pools = [dep.stage_pool(r) for r in range(dep.pp_size)]
            raw = StageProcesses if args.bulk_stage_processes == "each" else StageEngines
            engines = stack.enter_context(contextlib.closing(raw(pools)))
            work.cpu = run_meters(deps, engines.pids)
            await asyncio.to_thread(engines.seconds, info.target, work.large)  # warm-up
            for mode in deps:
                await run_lanes(work.moves, lanes[mode], routers[mode], f"warm-{mode}")
            commit_before = await _metric(http, deps["landed"].decode_url, COMMIT_SUM)
            for rep in range(args.repeat):
                work.cpu["raw"].start()
                raw_s = await asyncio.to_thread(engines.seconds, info.target, work.large)
                work.cpu["raw"].stop()
                work.times["raw"].append(raw_s)
                for mode in deps:
                    await _bulk_run(
                        args, work, deps[mode], mode, lanes[mode], routers[mode], f"{mode}{rep}"
                    )
            commit_s = await _metric(http, deps["landed"].decode_url, COMMIT_SUM)
            work.commit_s = commit_s - commit_before
            work.pages_s = await asyncio.to_thread(engines.seconds, info.target, work.per_stage)
    return _bulk_result(args, work)


def _bulk_work(
    dep: LocalDeployment, decode: StageLayout, lanes: list[Request], args: argparse.Namespace
) -> _Bulk:
    """The direct plan of every lane's request, and each stage's bytes of `bulk_requests`
    requests as large blocks into its own share of the decode's entries (the raw baseline)."""
    moves = [(x.src_pages, x.dst_pages, x.src_slot, x.dst_slot) for x in lanes]
    per_stage = dep.stage_blocks(decode, moves)
    rounds = args.bulk_requests / len(moves)
    shares = stage_shares(decode, dep.pp_size)
    large = [
        large_blocks(
            int(b.total_bytes * rounds),
            [(g.addr, g.length) for g in dep.stage_pool(r).regions],
            shares[r],
            BLOCK_BYTES,
        )
        for r, b in enumerate(per_stage)
    ]
    per_request = sum(b.total_bytes for b in per_stage) // len(moves)
    return _Bulk(len(moves), per_stage, per_request, large)


async def _bulk_run(
    args: argparse.Namespace,
    work: _Bulk,
    dep: LocalDeployment,
    mode: str,
    lanes: list[Request],
    job: Any,
    prefix: str,
) -> None:
    """One timed run of `bulk_requests` handoffs on `mode`'s deployment `dep`, with its
    processes' CPU seconds; every byte must have moved."""
    work.cpu[mode].start()
    wall, _, moved = await run_lanes(args.bulk_requests, lanes, job, prefix)
    work.cpu[mode].stop()
    if moved != work.per_request * args.bulk_requests:
        raise RuntimeError(f"{mode}: moved {moved} bytes, not {work.per_request} each")
    work.times[mode].append(wall)


def _bulk_result(args: argparse.Namespace, work: _Bulk) -> dict[str, Any]:
    total = work.per_request * args.bulk_requests
    gbs = {k: total / min(v) / 1e9 for k, v in work.times.items()}
    gbs["raw"] = sum(b.total_bytes for b in work.large) / min(work.times["raw"]) / 1e9
    raw_total = sum(b.total_bytes for b in work.large)
    cpu = cpu_figures(work.cpu, {"raw": raw_total, "landed": total, "direct": total}, args.repeat)
    return {
        "case": "bulk",
        "model": "hybrid-npu-mla scale 1, 128-token pages, PP=4 -> PP=1",
        "stage_processes": 4 if args.bulk_stage_processes == "each" else 1,
        "requests": args.bulk_requests,
        "pages_per_request": args.bulk_pages,
        "concurrency": args.bulk_concurrency,
        "bytes_per_request": work.per_request,
        "blocks_per_request": sum(len(b) for b in work.per_stage) // work.moves,
        "landing_mb": args.landing_mb,
        "window_mb": args.window_mb,
        "staging_mb": args.staging_mb,
        "landed_gb_s": gbs["landed"],
        "direct_gb_s": gbs["direct"],
        "raw_large_gb_s": gbs["raw"],
        "raw_pages_gb_s": sum(b.total_bytes for b in work.per_stage) / work.pages_s / 1e9,
        "landed_vs_direct": gbs["landed"] / gbs["direct"],
        "landed_vs_raw": gbs["landed"] / gbs["raw"],
        "direct_vs_raw": gbs["direct"] / gbs["raw"],
        # The decode's commits (scatter, digest of the pages), summed, per second of the landed
        # runs' wall time; commits of parallel stages overlap, so this can pass 1.
        "commit_share": work.commit_s / sum(work.times["landed"]),
        # The decode's CPU seconds per GB landed (or written directly), over the timed runs.
        "decode_cpu_s_per_gb_landed": cpu["landed_decode_cpu_s_per_gb"],
        "decode_cpu_s_per_gb_direct": cpu["direct_decode_cpu_s_per_gb"],
        "decode_cpu_landed_vs_direct": cpu["decode_cpu_landed_vs_direct"],
        **cpu,
        "targets": "landed_vs_direct >= 1, landed_vs_raw >= 0.9, commit_share <= 0.15, "
        "decode_cpu_landed_vs_direct <= 1.5",
        # As before: the landed handoffs and their ratio to raw.
        "handoff_gb_s": gbs["landed"],
        "raw_mooncake_gb_s": gbs["raw"],
        "ratio": gbs["landed"] / gbs["raw"],
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


CASES = ("bulk", "small", "segments", "planning", "gather", "commit")


def machine() -> dict[str, Any]:
    """Where and at what commit the numbers were taken."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit + ("-dirty" if dirty else ""),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run(args: argparse.Namespace) -> int:
    import uvloop

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    local = {
        "segments": landed_cases.segments,
        "planning": landed_cases.planning,
        "gather": landed_cases.gather_case,
        "commit": landed_cases.commit_case,
    }
    results = []
    for c in cases:
        if c in local:
            results.append(local[c](args))
        else:
            results.append(uvloop.run({"bulk": bulk, "small": small}[c](args)))
    doc = {"machine": machine(), "handoff": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))
        return 0
    for r in results:
        _print(r)
    return 0


def _print(r: dict[str, Any]) -> None:
    _PRINTERS[r["case"]](r)


def _print_bulk(r: dict[str, Any]) -> None:
    print(f"bulk: {r['model']}")
    print(
        f"  {r['requests']} x {r['bytes_per_request'] / 1e6:.1f} MB "
        f"({r['blocks_per_request']} per-page blocks) at concurrency {r['concurrency']}"
    )
    print(
        f"  landed {r['landed_gb_s']:6.2f} GB/s   direct {r['direct_gb_s']:6.2f} GB/s   "
        f"raw Mooncake, one engine per stage: 1 MiB blocks {r['raw_large_gb_s']:6.2f} GB/s, "
        f"per-page blocks {r['raw_pages_gb_s']:6.2f} GB/s"
    )
    print(
        f"  landed/direct {r['landed_vs_direct']:.2f}x   landed/raw {r['landed_vs_raw']:.2f}x"
        f"   direct/raw {r['direct_vs_raw']:.2f}x   decode commit time per wall second "
        f"{r['commit_share']:.1%}"
    )
    print(
        f"  decode CPU per GB: landed {r['decode_cpu_s_per_gb_landed']:.3f} s, direct "
        f"{r['decode_cpu_s_per_gb_direct']:.3f} s ({r['decode_cpu_landed_vs_direct']:.2f}x)"
    )
    print_cpu(r)


def _print_small(r: dict[str, Any]) -> None:
    print(f"small: {r['model']}")
    print(f"  {r['requests']} one-page handoffs at concurrency {r['concurrency']}")
    print(f"  GET /healthz round trips   {r['healthz_per_s']:8.0f} /s")
    print(
        f"  handoffs over HTTP         {r['handoffs_per_s']:8.0f} /s  ({r['ratio']:.2f}x)"
        f"  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms"
    )


def _print_segments(r: dict[str, Any]) -> None:
    print(f"segments: {r['layers']} layers x {r['pages']} pages, planning and bookkeeping")
    print(
        f"  one segment {r['one_segment_ms']:.2f} ms   {r['one_layer_segments']} one-layer "
        f"segments {r['one_layer_segments_ms']:.2f} ms   ({r['ratio']:.2f}x)"
    )


def _print_planning(r: dict[str, Any]) -> None:
    print(f"planning: {r['layers']} layers, per request before the engine call")
    for p in r["by_pages"]:
        print(
            f"  {p['pages']:>5} pages  landed {p['landed_ms']:.3f} ms "
            f"({p['landed_blocks']} blocks)   direct {p['direct_ms']:.3f} ms "
            f"({p['direct_blocks']} blocks)   direct/landed {p['direct_over_landed']:.1f}x"
        )


def _print_gather(r: dict[str, Any]) -> None:
    print(f"gather: {r['bytes'] / 1e6:.0f} MB in {r['segments']} segments, {r['pieces']} pieces")
    print(
        f"  gather {r['gather_gb_s']:.2f} GB/s   memcpy {r['memcpy_gb_s']:.2f} GB/s   "
        f"({r['ratio']:.2f}x)"
    )
    print(
        f"  with np.take(mode='clip') {r['gather_unbuffered_gb_s']:.2f} GB/s "
        f"({r['unbuffered_ratio']:.2f}x)"
    )
    print(
        f"  staged with its digest: one pass {r['stage_one_pass_gb_s']:.2f} GB/s, three "
        f"passes {r['stage_three_pass_gb_s']:.2f} GB/s ({r['stage_one_pass_speedup']:.2f}x)"
    )


def _print_commit(r: dict[str, Any]) -> None:
    print(f"commit: {r['bytes'] / 1e6:.0f} MB in {r['segments']} segments (decode, host)")
    print(
        f"  one pass {r['commit_gb_s']:.2f} GB/s ({r['one_pass_speedup']:.2f}x of three "
        f"passes: copy out + xxh3-128 + scatter {r['three_pass_gb_s']:.2f} GB/s; copy out "
        f"{r['copy_out_gb_s']:.2f}, digest {r['digest_gb_s']:.2f}, scatter "
        f"{r['scatter_gb_s']:.2f} GB/s)"
    )


#: How each case's result is printed, by its `case`.
_PRINTERS = {
    "bulk": _print_bulk,
    "small": _print_small,
    "segments": _print_segments,
    "planning": _print_planning,
    "gather": _print_gather,
    "commit": _print_commit,
}
