"""`kvhandoff demo`: a complete hybrid-linear PP handoff deployment, driven and verified.

By default it starts a `service.deployment.LocalDeployment`: one decode service and a PP=4
prefill (hybrid NPU-MLA preset scaled for CPU), one `kvhandoff serve` process per stage, each
with its own Mooncake engine talking TCP on loopback and its pool in a /dev/shm file this process
also maps. It then plays the router and the engines over HTTP for `--requests` concurrent
handoffs with fragmented page lists: fills every source page with bytes that are a function of
(request, layer, group or kind, page ordinal), creates the handoff on the decode service, tells
each stage its pages are ready, long-polls until the handoff is terminal, and checks every byte
landed in the right decode layer, group, page and slot. `--serve` keeps the deployment up
afterwards (its URLs, the dashboard's included, as one JSON line) until SIGINT/SIGTERM.

Two workloads, each in a deployment of its own, so each figure means one thing. First the **data
plane**: `--bulk` handoffs of a model scaled down only `--bulk-scale` times (megabytes per
handoff, a few in flight), reported in GB/s. Then the **control plane**: `--requests` handoffs
of the model scaled `--scale` times (a fraction of a megabyte each, `--concurrency` in flight),
reported in handoffs/s and latency. Both are verified byte for byte. A small-request rate says
nothing about the data plane and a GB/s figure nothing about the control plane; `make bench`
sets both against baselines (BENCHMARKS.md). Requests run in waves of as many as the pools
hold; the clock runs while a wave's handoffs move, not while the demo fills their source pages
(the engine's part) or checks their decode pages (its proof), which cost its one loop as much
as a third of a run.

`--baseline` moves the data plane's bytes block by block in the same topology: the same requests
(same seed) through a deployment whose decode runs `transfer.mode = direct` (the old path: one
block per page, layer and group), and, after the landed run, one raw Mooncake engine per stage
writing the completed handoffs' per-page blocks in parallel.

`--inprocess` runs the same workload against the pipelines linked in this one process (the
embedded mode, with `--transport local|mooncake`): a baseline without HTTP or processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import aiohttp
import msgspec
import numpy as np
import uvloop

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffRequest, HandoffView
from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.pipelines.events import EventBus
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import PoolMemory
from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.models import decode_layout, partition_layers, preset, stage_layout
from kvhandoff.pipelines.prefill import HostedStage, PrefillPipeline
from kvhandoff.service.config import HandoffConfig, TransferConfig, backend_of
from kvhandoff.service.testing.deployment import DeploymentError, LocalDeployment
from kvhandoff.service.testing.raw_engines import StageProcesses
from kvhandoff.service.tools.router_client import TERMINAL, WAIT_S, Outcome, RouterClient
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.pool_base import Pool
from kvhandoff.transport.pools import open_pool

PRESET = "hybrid-npu-mla"
MODEL: dict[str, int | bool] = {"scale": 64, "page_size": 16, "num_layers": 48}
#: The data plane's workload: the preset at full size, as `make bench` moves it, ~48 MB a
#: handoff on average (36 state layers of ~1.1 MB and up to 64 pages of 12 layers). At a quarter
#: of that size the same run moved about half the GB/s, its per-handoff costs showing through;
#: 2 in flight moved no more than 4 (both measured on the shared 2-core machine, load 7-11).
BULK = {"requests": 16, "scale": 1, "concurrency": 4}
DECODE_URL, PREFILL_URL = "inproc://decode", "inproc://prefill"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=_positive, default=200, help="small handoffs to run (control plane)"
    )
    parser.add_argument(
        "--concurrency", type=_positive, default=16, help="handoffs in flight at once"
    )
    parser.add_argument("--pp", type=_positive, default=4, help="prefill pipeline-parallel stages")
    parser.add_argument("--pages", type=_positive, default=64, help="most pages per request")
    parser.add_argument(
        "--scale",
        type=_positive,
        default=MODEL["scale"],
        help="divide the model's per-token and per-slot bytes by this (1: full size)",
    )
    parser.add_argument(
        "--page-size", type=_positive, default=MODEL["page_size"], help="tokens per page"
    )
    parser.add_argument(
        "--bulk",
        type=_non_negative,
        default=BULK["requests"],
        help="large handoffs to run first (data plane; 0: none)",
    )
    parser.add_argument(
        "--bulk-scale",
        type=_positive,
        default=BULK["scale"],
        help="divide the model's bytes by this for the large handoffs",
    )
    parser.add_argument("--verify-digests", action="store_true", help="end-to-end digests too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="afterwards keep the deployment up, print its URLs (the dashboard's too) as one "
        "JSON line, and wait for SIGINT/SIGTERM",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also move the data plane's bytes block by block, in the same topology: the same "
        "large requests through a deployment in direct mode (transfer.mode = direct: one block "
        "per page and layer), and a raw engine per stage writing the completed handoffs' "
        "per-page blocks in parallel; report both and the ratios",
    )
    parser.add_argument(
        "--inprocess", action="store_true", help="link the pipelines in this process instead"
    )
    parser.add_argument(
        "--transport",
        choices=["mooncake", "local"],
        help="with --inprocess: the transport between the pipelines (default mooncake)",
    )


def _model(args: argparse.Namespace) -> dict[str, int | bool]:
    return {**MODEL, "scale": args.scale, "page_size": args.page_size}


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def run(args: argparse.Namespace) -> int:
    layers = int(MODEL["num_layers"])
    if args.pp > layers:
        # Checked before anything starts: each stage must hold at least one layer.
        return _usage(
            f"--pp {args.pp}: the demo's model has {layers} layers, so 1..{layers} stages"
        )
    if args.inprocess and args.serve:
        return _usage("--serve needs the multi-process deployment (drop --inprocess)")
    if args.baseline and not args.bulk:
        return _usage("--baseline compares the data plane's bytes: it needs --bulk 1 or more")
    if not args.inprocess and args.transport:
        # Separate processes can only reach each other through the Transfer Engine.
        return _usage("--transport applies with --inprocess only")
    if args.inprocess:
        args.transport = args.transport or "mooncake"
        return asyncio.run(_inprocess(args))
    return _multiprocess(args)


def _usage(message: str) -> int:
    print(f"kvhandoff demo: {message}", file=sys.stderr)
    return 2


#: What one side's state slots may take to hold a wave (`_drive`) beyond two slots per request in
#: flight: a slot holds every state layer of a request (0.6 MB at the default scale, 40 MB at
#: full size), and the pools are /dev/shm files.
WAVE_SLOT_BYTES = 256 << 20


def _pool_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(pages, slots) per pool: room for a wave of requests, up to 8 times those in flight (or
    WAVE_SLOT_BYTES of slots), with fragmentation."""
    model = preset(PRESET, **_model(args))
    slot_bytes = len(model.linear_layers) * sum(k.slot_bytes for k in model.state_kinds)
    wave = min(args.requests, 8 * args.concurrency, WAVE_SLOT_BYTES // max(slot_bytes, 1))
    return max(4 * args.pages * args.concurrency, 1024), max(2 * args.concurrency, wave)


# ---------------------------------------------------------------------------------------------
# The workload, the same in both modes: allocate, fill, hand off, verify, release.


_TABLE_ROWS = 13  # prime: with the per-row offset below, rows repeat only after 3,328 requests


@functools.cache
def _table(layer: int, which: int, item_len: int) -> np.ndarray:
    """Random rows of one entry (layer, group or kind): the raw material of its patterns."""
    rng = np.random.default_rng([layer, which, item_len])
    return rng.integers(0, 256, (_TABLE_ROWS, item_len), dtype=np.uint8)


def _pattern(
    request: int, layer: int, which: int, ordinal: np.ndarray, item_len: int
) -> np.ndarray:
    """Bytes of pages (or a slot): a deterministic function of (request, layer, group or kind,
    page ordinal). Rows of the entry's own random table plus a per-row byte offset: distinct
    for every ordinal of a request (7 is invertible mod 256), and cheap enough (uint8 adds) that
    filling and checking do not dominate the demo."""
    rows: np.ndarray = _table(layer, which, item_len)[(ordinal + request) % _TABLE_ROWS]
    offset = ((ordinal * 7 + request * 31) % 256).astype(np.uint8)
    out: np.ndarray = rows + offset[:, None]
    return out


def _kind_id(kind: str) -> int:
    return 1000 + sum(map(ord, kind))


class _Side(PoolMemory):
    def kv_rows(self, i: int) -> np.ndarray:
        e = self.layout.kv[i]
        return self.region(i)[: e.nbytes].reshape(e.num_items, e.item_len)

    def slot(self, j: int, slot: int) -> np.ndarray:
        s = self.layout.state[j]
        return self.region(len(self.layout.kv) + j)[slot * s.item_len : (slot + 1) * s.item_len]


@dataclass(frozen=True)
class _Job:
    index: int
    dst_pages: np.ndarray
    dst_slot: int
    src_pages: np.ndarray
    src_slot: int

    @property
    def id(self) -> str:
        return f"req-{self.index}"


Execute = Callable[[_Job], Awaitable[Outcome]]


class _Workload:
    """Free lists of pages and slots on both sides, and the byte pattern of every request."""

    def __init__(self, stages: dict[int, _Side], dec: _Side, args: argparse.Namespace) -> None:
        pages, slots = _pool_sizes(args)
        self.stages, self.dec, self.max_pages = stages, dec, args.pages
        self.rng = np.random.default_rng(args.seed)
        self.free_dst, self.free_dst_slots = list(range(pages)), list(range(slots))
        # Source pages are owned by the request while it is in flight, as in an engine.
        self.free_src, self.free_src_slots = list(range(pages)), list(range(slots))
        self.completed: list[_Job] = []  # for the raw-engine baseline

    def _take(self, free: list[int], n: int) -> np.ndarray:
        picks = sorted(self.rng.choice(len(free), n, replace=False).tolist(), reverse=True)
        return np.array([free.pop(k) for k in picks], dtype=np.int64)  # fragmented, unsorted

    def take(self, index: int) -> _Job | None:
        """A request's pages and slots; None when handoffs in an unknown state hold too many."""
        n = int(self.rng.integers(1, self.max_pages + 1))
        if min(len(self.free_dst), len(self.free_src)) < n or not self.free_dst_slots:
            return None
        dst = self._take(self.free_dst, n)
        src = self._take(self.free_src, n)
        return _Job(index, dst, self.free_dst_slots.pop(), src, self.free_src_slots.pop())

    def fill(self, job: _Job) -> None:
        ordinal = np.arange(job.src_pages.shape[0])
        for side in self.stages.values():
            for k, e in enumerate(side.layout.kv):
                rows = _pattern(job.index, e.layer_id, e.group, ordinal, e.item_len)
                side.kv_rows(k)[job.src_pages] = rows
            for j, s in enumerate(side.layout.state):
                one = _pattern(job.index, s.layer_id, _kind_id(s.kind), ordinal[:1], s.item_len)
                side.slot(j, job.src_slot)[:] = one[0]

    def verify(self, job: _Job) -> bool:
        dec, ordinal = self.dec, np.arange(job.dst_pages.shape[0])
        for k, e in enumerate(dec.layout.kv):
            want = _pattern(job.index, e.layer_id, e.group, ordinal, e.item_len)
            if not np.array_equal(dec.kv_rows(k)[job.dst_pages], want):
                return False
        for j, s in enumerate(dec.layout.state):
            want = _pattern(job.index, s.layer_id, _kind_id(s.kind), ordinal[:1], s.item_len)
            if not np.array_equal(dec.slot(j, job.dst_slot), want[0]):
                return False
        return True

    def wave(self, first: int, most: int) -> list[_Job]:
        """Requests `first`, `first + 1`, ... (at most `most`), as many as the pools hold at
        once: their pages and slots taken."""
        jobs = []
        for index in range(first, first + most):
            job = self.take(index)
            if job is None:
                break
            jobs.append(job)
        return jobs

    def release(self, job: _Job, outcome: Outcome) -> None:
        if outcome.state == "completed":
            self.completed.append(job)
        self.free_src.extend(job.src_pages.tolist())
        self.free_src_slots.append(job.src_slot)
        # A handoff in an unknown state may still hold its decode pages: never hand them out again.
        if outcome.state in TERMINAL or outcome.state == "rejected":
            self.free_dst.extend(job.dst_pages.tolist())
            self.free_dst_slots.append(job.dst_slot)


async def _drive(
    work: _Workload, execute: Execute, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], float]:
    """Run every request, `args.concurrency` at a time, in waves of as many as the pools hold:
    (one result per request, the seconds the handoffs ran). A wave's source pages are filled
    before the clock starts and its decode pages checked after it stops: playing the engine and
    checking every byte cost the demo's loop as much as a third of a run, which the figures
    would otherwise count as the handoffs'."""
    results: list[dict[str, Any]] = []
    wall = 0.0
    while len(results) < args.requests:
        wave = work.wave(len(results), args.requests - len(results))
        if not wave:  # handoffs in an unknown state hold the pages: nothing more can start
            skipped = Outcome("skipped", 0, _EXHAUSTED)
            results += [
                _result(f"req-{i}", skipped, 0.0, False) for i in range(len(results), args.requests)
            ]
            break
        for job in wave:
            work.fill(job)
        start = time.perf_counter()
        timed = await _run_wave(wave, execute, args, done=len(results))
        wall += time.perf_counter() - start
        for job, (outcome, latency) in zip(wave, timed, strict=True):
            ok = outcome.state == "completed" and work.verify(job)
            results.append(_result(job.id, outcome, latency, ok))
            work.release(job, outcome)
    return results, wall


async def _run_wave(
    wave: list[_Job], execute: Execute, args: argparse.Namespace, *, done: int
) -> list[tuple[Outcome, float]]:
    """The wave's handoffs, `args.concurrency` at a time: (outcome, latency) of each, in order."""
    sem = asyncio.Semaphore(args.concurrency)
    finished = done

    async def one(job: _Job) -> tuple[Outcome, float]:
        nonlocal finished
        async with sem:
            t0 = time.perf_counter()
            outcome = await execute(job)
            latency = time.perf_counter() - t0
        finished += 1
        _progress(finished, args.requests, args.json)
        return outcome, latency

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(job)) for job in wave]
    return [t.result() for t in tasks]


_EXHAUSTED = "no free decode pages or slot: earlier handoffs in an unknown state hold them"


def _result(handoff_id: str, outcome: Outcome, latency_s: float, ok: bool) -> dict[str, Any]:
    return {
        "id": handoff_id,
        "state": outcome.state,
        "verified": ok,
        "bytes": outcome.bytes,
        "latency_s": latency_s,
        "error": outcome.error,
    }


def _outcome(view: HandoffView) -> Outcome:
    error = f"{view.error.code}: {view.error.reason}" if view.error else None
    return Outcome(view.state.value, view.bytes, error)


# ---------------------------------------------------------------------------------------------
# Default: separate processes, driven over HTTP.


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _deployment(
    args: argparse.Namespace, transfer: TransferConfig | None = None
) -> LocalDeployment:
    pages, slots = _pool_sizes(args)
    return LocalDeployment(
        preset=PRESET,
        model=_model(args),
        pp_size=args.pp,
        num_pages=pages,
        num_slots=slots,
        handoff=HandoffConfig(max_concurrent=max(256, args.concurrency)),
        transfer=transfer,
    )


def _multiprocess(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the processes and /dev/shm files are cleaned up either way.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        data = _data_plane(args) if args.bulk else None
        with _deployment(args) as deployment:
            try:
                return uvloop.run(_over_http(deployment, args, data))
            finally:
                signal.signal(signal.SIGTERM, _interrupt)  # the loop reset it to the default
    except DeploymentError as exc:
        print(f"kvhandoff demo: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Interrupted):
        print("kvhandoff demo: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived while handoffs ran: stop, clean up, exit 130."""


def bulk_args(args: argparse.Namespace) -> argparse.Namespace:
    """The data plane's workload as the demo's arguments (its pool sizes follow from them); no
    progress bar of its own: it takes seconds."""
    concurrency = min(args.concurrency, BULK["concurrency"])
    return argparse.Namespace(
        **{**vars(args), "requests": args.bulk, "scale": args.bulk_scale, "json": True}
        | {"concurrency": concurrency}
    )


def _data_plane(args: argparse.Namespace) -> dict[str, Any]:
    """The large handoffs in a deployment of their own (and, with --baseline, the same requests
    in direct mode and through raw engines): the data plane's figures."""
    bulk = bulk_args(args)
    direct = None
    if args.baseline:
        # The block-by-block path first, in its own deployment of the same shape (the mode is
        # the decode's choice, so it takes a decode configured for it).
        small = {"landing_bytes": 32 << 20, "window_bytes": 4 << 20, "staging_bytes": 16 << 20}
        with _deployment(bulk, TransferConfig(mode="direct", **small)) as dep:
            try:
                direct = uvloop.run(_direct_baseline(dep, bulk))
            finally:
                signal.signal(signal.SIGTERM, _interrupt)
    with _deployment(bulk) as dep:
        try:
            return uvloop.run(_bulk_over_http(dep, bulk, direct))
        finally:
            signal.signal(signal.SIGTERM, _interrupt)


def _stop_event() -> asyncio.Event:
    """An event SIGINT and SIGTERM set, on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _router_session(dep: LocalDeployment) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {dep.token}"} if dep.token else None
    return aiohttp.ClientSession(headers=headers)


async def _landed(
    dep: LocalDeployment, args: argparse.Namespace, http: aiohttp.ClientSession, stop: asyncio.Event
) -> tuple[list[dict[str, Any]], float, _Workload]:
    """`args`' workload through the deployment, as a router and the engines drive it; raises
    _Interrupted when `stop` is set first."""
    stages = {r: _Side(dep.stage_layouts[r], dep.stage_pool(r)) for r in range(dep.pp_size)}
    work = _Workload(stages, _Side(dep.decode_layout, dep.decode_pool), args)
    client = RouterClient(http, dep, verify=args.verify_digests)

    async def router(job: _Job) -> Outcome:
        src, dst = job.src_pages.tolist(), job.dst_pages.tolist()
        return await client.handoff(job.id, src, dst, job.src_slot, job.dst_slot)

    running = asyncio.create_task(_drive(work, router, args))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
    # A signal wins even if the run ended meanwhile: a terminal's Ctrl-C also stops the
    # services, which can fail the last requests first.
    if stop.is_set() or not running.done():
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        raise _Interrupted
    stopped.cancel()
    results, wall = running.result()
    return results, wall, work


async def _direct_baseline(dep: LocalDeployment, args: argparse.Namespace) -> dict[str, float]:
    """The same requests (same seed: same pages, same bytes) in direct mode: GB/s, verified."""
    async with _router_session(dep) as http:
        results, wall, _ = await _landed(dep, args, http, _stop_event())
    moved = sum(r["bytes"] for r in results)
    verified = sum(r["verified"] for r in results)
    if verified != len(results):
        raise DeploymentError(f"direct mode: {len(results) - verified} handoffs not verified")
    return {"direct_gb_per_s": moved / wall / 1e9 if wall else 0.0, "direct_bytes": float(moved)}


async def _bulk_over_http(
    dep: LocalDeployment, args: argparse.Namespace, direct: dict[str, float] | None
) -> dict[str, Any]:
    async with _router_session(dep) as http:
        results, wall, work = await _landed(dep, args, http, _stop_event())
        raw = await _baseline(http, dep, work) if args.baseline else None
    return _data_figures(results, wall, args, raw=raw, direct=direct)


async def _over_http(
    dep: LocalDeployment, args: argparse.Namespace, data: dict[str, Any] | None
) -> int:
    stop = _stop_event()
    async with _router_session(dep) as http:
        results, wall, _ = await _landed(dep, args, http, stop)
    status = _summary(
        results, wall, args, mode="multiprocess", transport=backend_of(dep.transport), data=data
    )
    if args.serve:
        info = _serve_info(dep)
        print(json.dumps(info), flush=True)
        print(f"kvhandoff demo: dashboard at {info['dashboard']} (Ctrl-C stops)", file=sys.stderr)
        await stop.wait()
    return status


async def _baseline(
    http: aiohttp.ClientSession, dep: LocalDeployment, work: _Workload
) -> dict[str, float] | None:
    """Raw Mooncake writing the completed handoffs' blocks (one per page, layer and group, as
    direct mode plans them) into the decode service's registered memory: one engine per stage,
    each in a process of its own with its stage's blocks, all at once (best of two) — the same
    process topology, no kvhandoff. A landed decode registers only its landing arena (its KV
    pools are unreachable by design), so there the same blocks go into the arena, each stage
    its own slice of it."""
    async with http.get(f"{dep.decode_url}/v1/layout") as resp:
        info = msgspec.json.decode(await resp.read(), type=LayoutInfo)
    moves = [(j.src_pages, j.dst_pages, j.src_slot, j.dst_slot) for j in work.completed]
    per_stage = dep.stage_blocks(info.stages[0].layout, moves)
    if info.arena is not None:
        part = info.arena.length // len(per_stage)
        per_stage = [
            into_span(b, info.arena.addr + r * part, part) for r, b in enumerate(per_stage)
        ]
    blocks = sum(len(b) for b in per_stage)
    if not blocks:
        return None  # nothing completed: nothing to compare with
    total = sum(b.total_bytes for b in per_stage)
    # A process per stage, as the deployment runs them (threads of one process would share
    # its cores and starve each other's busy-waiting engine calls).
    engines = StageProcesses([dep.stage_pool(r) for r in range(dep.pp_size)])
    try:
        runs = [await asyncio.to_thread(engines.seconds, info.target, per_stage) for _ in "ab"]
    finally:
        engines.close()
    return {"raw_blocks": float(blocks), "raw_gb_per_s": total / min(runs) / 1e9}


def into_span(blocks: Blocks, addr: int, length: int) -> Blocks:
    """`blocks` with their destinations laid end to end from `addr`, starting over at `addr`
    where the next would run past `addr + length` (same sources and lengths)."""
    if not len(blocks):
        return blocks
    longest = int(blocks.length.max())
    if longest > length:
        raise ValueError(f"a block of {longest} bytes does not fit a span of {length}")
    starts = np.cumsum(blocks.length, dtype=np.uint64) - blocks.length
    dst = np.uint64(addr) + starts % np.uint64(length - longest + 1)
    return Blocks.of(blocks.src_addr, dst, blocks.length)


def _serve_info(dep: LocalDeployment) -> dict[str, Any]:
    return {
        "decode": dep.decode_url,
        "prefill": dep.prefill_urls,
        "stages": {str(r): dep.url_of_stage(r) for r in range(dep.pp_size)},
        "openapi": f"{dep.decode_url}/openapi.json",
        "dashboard": f"{dep.decode_url}/",
        "metrics": f"{dep.decode_url}/metrics",
    }


# ---------------------------------------------------------------------------------------------
# --inprocess: the pipelines linked in this process (the embedded mode).


async def _inprocess(args: argparse.Namespace) -> int:
    data = None
    if args.bulk:
        bulk = bulk_args(args)
        data = _data_figures(*await _inprocess_run(bulk), bulk)
    results, wall = await _inprocess_run(args)
    return _summary(results, wall, args, mode="inprocess", transport=args.transport, data=data)


async def _inprocess_run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """`args`' workload through pipelines built for it in this process, torn down after."""
    model = preset(PRESET, **_model(args))
    part = partition_layers(model.num_layers, args.pp)
    pool_pages, slots = _pool_sizes(args)
    res = _Resources()
    dec_t = res.transport(args.transport)
    pre_t = dec_t if args.transport == "local" else res.transport(args.transport)
    dec = res.side(decode_layout(model, num_pages=pool_pages, num_slots=slots), dec_t)
    stages = {
        r: res.side(stage_layout(model, part, r, num_pages=pool_pages, num_slots=slots), pre_t)
        for r in range(args.pp)
    }
    link = InProcessLink()
    bus = EventBus()
    decode = DecodePipeline(dec.layout, dec_t.local_target, DECODE_URL, link, bus, memory=dec)
    prefill = PrefillPipeline(
        {r: HostedStage(s.layout, s) for r, s in stages.items()}, pre_t, link, bus
    )
    link.decode = decode
    link.add_prefill(PREFILL_URL, prefill, pre_t.local_target)
    execute = functools.partial(_execute, decode, prefill, list(stages), args.verify_digests)
    try:
        results, wall = await _drive(_Workload(stages, dec, args), execute, args)
    finally:
        await prefill.close()
        await decode.close()
        res.close()
    return results, wall


@dataclass
class _Resources:
    """The transports and pools an in-process run opened, closed together after it."""

    transports: list[Any] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)

    def transport(self, backend: str) -> Any:
        t = LocalTransport() if backend == "local" else MooncakeTransport.start(MooncakeConfig())
        self.transports.append(t)
        return t

    def side(self, layout: StageLayout, transport: Any) -> _Side:
        pool = open_pool("torch:cpu", layout.region_sizes)
        self.pools.append(pool)
        pool.register(transport)
        return _Side(layout, pool)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        for t in self.transports:
            t.close()


async def _execute(
    decode: DecodePipeline, prefill: PrefillPipeline, ranks: list[int], verify: bool, job: _Job
) -> Outcome:
    """One handoff through the in-process pipelines, as a router and the engine would drive it."""
    request = HandoffRequest(
        id=job.id,
        prefill=[PREFILL_URL],
        dst_pages=job.dst_pages.tolist(),
        dst_slot=job.dst_slot,
        verify=verify,
    )
    try:
        await decode.create(request)
    except KVHandoffError as exc:
        return Outcome("rejected", 0, f"{exc.code}: {exc}")
    for r in ranks:
        prefill.ready(job.id, r, job.src_pages, job.src_slot)
    view = await decode.wait(job.id, WAIT_S)
    while not view.state.terminal:
        view = await decode.wait(job.id, WAIT_S)
    return _outcome(view)


# ---------------------------------------------------------------------------------------------
# Reporting


def _progress(done: int, total: int, quiet: bool) -> None:
    if quiet or not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _figures(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """What one workload's handoffs add up to."""
    completed = sum(r["state"] == "completed" for r in results)
    total_bytes = sum(r["bytes"] for r in results)
    lat = np.array([r["latency_s"] for r in results]) if results else np.zeros(1)
    return {
        "completed": completed,
        "failed": len(results) - completed,
        "verified": sum(r["verified"] for r in results),
        "bytes": total_bytes,
        "bytes_per_handoff": total_bytes / completed if completed else 0.0,
        "seconds": wall,
        "gb_per_s": total_bytes / wall / 1e9 if wall else 0.0,
        "handoffs_per_s": len(results) / wall if wall else 0.0,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def _data_figures(
    results: list[dict[str, Any]],
    wall: float,
    args: argparse.Namespace,
    *,
    raw: dict[str, float] | None = None,
    direct: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The data plane's figures, and the baselines' beside them when they ran."""
    data = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "scale": args.scale,
        **_figures(results, wall),
    }
    if raw is not None:
        data["raw_mooncake_gb_per_s"] = raw["raw_gb_per_s"]
        data["raw_blocks"] = int(raw["raw_blocks"])
        data["vs_raw"] = data["gb_per_s"] / raw["raw_gb_per_s"]
    if direct is not None:
        data["direct_gb_per_s"] = direct["direct_gb_per_s"]
        data["vs_direct"] = data["gb_per_s"] / direct["direct_gb_per_s"]
    return data


def _summary(
    results: list[dict[str, Any]],
    wall: float,
    args: argparse.Namespace,
    *,
    mode: str,
    transport: str,
    data: dict[str, Any] | None,
) -> int:
    """Print the summary (lines for a person, or one JSON object with --json): the data plane's
    figures first, the control plane's beside them; the exit status."""
    summary = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "scale": args.scale,
        **_figures(results, wall),
        "mode": mode,
        "transport": transport,
        "pp": args.pp,
        "data_plane": data,
    }
    runs = [summary] if data is None else [data, summary]
    ok = all(run["verified"] == run["requests"] for run in runs)
    if args.json:
        print(json.dumps(summary), flush=True)
        return 0 if ok else 1
    where = "multiprocess, landed" if mode == "multiprocess" else "in one process"
    print(f"kvhandoff demo: PP={args.pp} hybrid NPU-MLA -> decode over {transport} ({where})")
    if data is not None:
        _print_data_plane(data)
    print(
        f"  {'control plane':<15}{summary['handoffs_per_s']:>8.1f} handoffs/s  "
        f"{args.requests} handoffs of {summary['bytes_per_handoff'] / 1e6:.2f} MB on average, "
        f"{args.concurrency} in flight (model bytes / {args.scale}); p50 "
        f"{summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms"
    )
    handoffs = sum(run["requests"] for run in runs)
    verified = sum(run["verified"] for run in runs)
    print(
        f"  {'verified':<15}{verified:>8} of {handoffs} handoffs, every byte in its layer, "
        "group, page and slot"
    )
    for run in runs:
        for err in run["errors"]:
            print(f"  error: {err}")
    print("  make bench sets these against raw Mooncake, direct mode and HTTP's own floor.")
    sys.stdout.flush()
    return 0 if ok else 1


def _print_data_plane(data: dict[str, Any]) -> None:
    """The multiprocess run's data-plane lines, with the baselines it measured."""
    print(
        f"  {'data plane':<15}{data['gb_per_s']:>8.3f} GB/s        {data['requests']} "
        f"handoffs of {data['bytes_per_handoff'] / 1e6:.1f} MB on average, "
        f"{data['concurrency']} in flight (model bytes / {data['scale']})"
    )
    if "raw_mooncake_gb_per_s" in data:
        print(
            f"  {'raw Mooncake':<15}{data['raw_mooncake_gb_per_s']:>8.3f} GB/s        the "
            f"same {data['raw_blocks']:,} per-page blocks, one engine per stage (landed "
            f"at {data['vs_raw']:.2f}x)"
        )
    if "direct_gb_per_s" in data:
        print(
            f"  {'direct mode':<15}{data['direct_gb_per_s']:>8.3f} GB/s        the same "
            f"requests, block by block (landed at {data['vs_direct']:.2f}x)"
        )
