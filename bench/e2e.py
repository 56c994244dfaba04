"""End-to-end handoffs against raw Mooncake in the same process topology, for `make bench`.

- `sizes`: for each PP size, a landed and a direct deployment of the same shape (hybrid NPU-MLA
  at full size, 128-token pages, one prefill process per stage, a PP=1 decode), up at once;
  for each request size, `concurrency` handoffs at a time over HTTP (router → decode → every
  stage → Mooncake → done; landed: → commit), and raw Mooncake in the same topology: one engine
  per stage, each in a process of its own with only its stage's pool registered
  (`StageProcesses`), all writing at once into the direct decode's KV memory, the same bytes —
  as 1 MiB blocks (`raw_large`, how a landed stage packs them; `raw_sleeping`, the same blocks
  with the engine's async calls and a sleeping wait, as a landed stage's transport waits, so
  the sync call's spin is not what puts landed ahead) and as the same per-page blocks direct
  mode plans (`raw_pages`). Runs are interleaved (raw, landed, direct, ...), best of
  `repeat`. Beside the rates, the CPU seconds per GB of every process of each run
  (`kvhandoff.service.tools.bench.cpu`: the raw writers and the decode they write into over the
  1 MiB runs; each deployment's decode and prefills over its own), per thread kind too
  (`cpu_threads`), and the cores each kept busy: on a host with fewer cores than busy
  threads, what limits one mode against another.
- `segments`: the landed deployment of the largest PP, one request size, each stage signalled
  once (all layers, all pages), layer by layer (one ready per layer), or in page chunks (one
  ready per chunk of pages, as chunked prefill sends them): handoffs/s and GB/s, as ratios to
  the single signal.

Every handoff must complete and move the planned bytes; the benchmark fails otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np

from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.prefill.staged import BLOCK_BYTES
from kvhandoff.service.config import HandoffConfig, TransferConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.testing.raw_engines import StageProcesses
from kvhandoff.service.tools.bench.common import fragmented_pages, large_blocks
from kvhandoff.service.tools.bench.cpu import CpuMeter, cpu_figures, run_meters
from kvhandoff.service.tools.bench.handoff import Request, run_lanes, stage_shares
from kvhandoff.service.tools.router_client import RouterClient

Note = Callable[[str], None]


def _noop(_: str) -> None:
    pass


def deployment(pp: int, mode: str, pool_pages: int, slots: int, args: Any) -> LocalDeployment:
    return LocalDeployment(
        preset="hybrid-npu-mla",
        model={"scale": 1, "page_size": 128},
        pp_size=pp,
        num_pages=pool_pages,
        num_slots=max(2, slots),
        transfer=TransferConfig(
            mode=mode,  # type: ignore[arg-type]
            landing_bytes=args.landing_mb << 20,
            window_bytes=args.window_mb << 20,
            staging_bytes=args.staging_mb << 20,
        ),
        handoff=HandoffConfig(max_concurrent=max(256, 4 * slots)),
        log_level="warning",
        preallocate=True,
    )


def pool_pages_for(concurrency: int, max_pages: int) -> int:
    """Pages per pool: room for `concurrency` fragmented lanes of `max_pages` (runs of up to 32
    pages spread over the pool, `fragmented_pages` needs 32 pages per run)."""
    return max(64, 3 * concurrency * max_pages)


def lanes_for(dep: LocalDeployment, pages: int, concurrency: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    pool = dep.decode_layout.kv[0].num_items
    dst = fragmented_pages(concurrency * pages, pool, rng)
    src = fragmented_pages(pages, dep.stage_layouts[0].kv[0].num_items, rng)
    return [
        Request(src.tolist(), dst[k * pages : (k + 1) * pages].tolist(), 0, k)
        for k in range(concurrency)
    ]


class Checked:
    """Handoffs through `client` that must complete and move `expect` bytes each."""

    def __init__(self, client: RouterClient, expect: int | None = None) -> None:
        self.client, self.expect = client, expect

    async def __call__(self, hid: str, req: Request) -> int:
        out = await self.client.handoff(
            hid, req.src_pages, req.dst_pages, req.src_slot, req.dst_slot
        )
        if out.state != "completed":
            raise RuntimeError(f"handoff {hid} ended {out.state}: {out.error}")
        if self.expect is not None and out.bytes != self.expect:
            raise RuntimeError(f"handoff {hid} moved {out.bytes} bytes, not {self.expect}")
        return out.bytes


@contextlib.contextmanager
def _pair(pp: int, pool_pages: int, slots: int, args: Any) -> Iterator[dict[str, LocalDeployment]]:
    with contextlib.ExitStack() as stack:
        yield {
            m: stack.enter_context(deployment(pp, m, pool_pages, slots, args))
            for m in ("landed", "direct")
        }


async def _layout(http: aiohttp.ClientSession, dep: LocalDeployment) -> LayoutInfo:
    async with http.get(f"{dep.decode_url}/v1/layout") as resp:
        return msgspec.json.decode(await resp.read(), type=LayoutInfo)


def _requests_for(bytes_per_request: int, concurrency: int, target_bytes: int) -> int:
    """Requests per timed run: at least two rounds of the lanes and about `target_bytes`."""
    want = -(-target_bytes // max(1, bytes_per_request))
    rounds = max(2, -(-want // concurrency))
    return min(rounds, 16) * concurrency


async def sizes(args: Any, note: Note = _noop) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    conc = args.e2e_concurrency
    pool = pool_pages_for(conc, max(args.e2e_pages))
    for pp in args.e2e_pp:
        note(f"PP={pp}: starting a landed and a direct deployment")
        with _pair(pp, pool, conc, args) as deps:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                rows += await _sizes_one_pp(http, deps, args, note)
    return rows


async def _sizes_one_pp(
    http: aiohttp.ClientSession, deps: dict[str, LocalDeployment], args: Any, note: Note
) -> list[dict[str, Any]]:
    direct = deps["direct"]
    pp, conc = direct.pp_size, args.e2e_concurrency
    info = await _layout(http, direct)
    decode = info.stages[0].layout
    shares = stage_shares(decode, pp)
    rows = []
    pools = [direct.stage_pool(r) for r in range(pp)]
    with contextlib.closing(StageProcesses(pools)) as engines:
        for pages in args.e2e_pages:
            note(f"PP={pp}, {pages} pages per request")
            lanes = {m: lanes_for(d, pages, conc, args.seed) for m, d in deps.items()}
            moves = [(x.src_pages, x.dst_pages, x.src_slot, x.dst_slot) for x in lanes["direct"]]
            per_stage = direct.stage_blocks(decode, moves)  # one round of the lanes
            per_request = sum(b.total_bytes for b in per_stage) // conc
            count = _requests_for(per_request, conc, args.e2e_target_mb << 20)
            rounds = count // conc
            large = [
                large_blocks(
                    b.total_bytes * rounds,
                    [(g.addr, g.length) for g in direct.stage_pool(r).regions],
                    shares[r],
                    BLOCK_BYTES,
                )
                for r, b in enumerate(per_stage)
            ]
            pages_rounds = [_repeat(b, rounds) for b in per_stage]
            drivers = {m: Checked(RouterClient(http, d), per_request) for m, d in deps.items()}
            # Warm-up: connections, first touches, pairing caches.
            await asyncio.to_thread(engines.seconds, info.target, large)
            for m in deps:
                await run_lanes(conc, lanes[m], drivers[m], f"w{pp}-{pages}-{m}")
            meters = run_meters(deps, engines.pids)
            # The same writers and decode, waiting by sleeping (`raw_write_sleeping`).
            meters["raw_sleeping"] = CpuMeter(dict(meters["raw"].pids))
            walls, lat = await _rounds(
                args,
                engines,
                info.target,
                (large, pages_rounds),
                lanes,
                drivers,
                meters,
                (pp, pages, count),
            )
            total = per_request * count
            gbs = {k: total / min(v) / 1e9 for k, v in walls.items()}
            rows.append(
                {
                    "pp": pp,
                    "pages": pages,
                    "bytes_per_request": per_request,
                    "blocks_per_request": sum(len(b) for b in per_stage) // conc,
                    "requests": count,
                    "concurrency": conc,
                    **{f"{k}_gb_s": v for k, v in gbs.items()},
                    "landed_p50_ms": float(np.percentile(lat["landed"], 50) * 1e3),
                    "direct_p50_ms": float(np.percentile(lat["direct"], 50) * 1e3),
                    # A raw run moves `rounds` rounds of the lanes at once: per round.
                    "raw_large_round_ms": min(walls["raw_large"]) / rounds * 1e3,
                    "landed_vs_direct": gbs["landed"] / gbs["direct"],
                    "landed_vs_raw": gbs["landed"] / gbs["raw_large"],
                    # The same 1 MiB blocks with the engine's async calls and a sleeping wait
                    # (as a landed stage's transport waits): the sync call's spin is not in it.
                    "landed_vs_raw_sleeping": gbs["landed"] / gbs["raw_sleeping"],
                    "landed_vs_best_raw": gbs["landed"]
                    / max(gbs["raw_large"], gbs["raw_sleeping"]),
                    "direct_vs_raw": gbs["direct"] / gbs["raw_large"],
                    "direct_vs_raw_pages": gbs["direct"] / gbs["raw_pages"],
                    # CPU seconds per GB of every process of each run, and per thread kind
                    # (`kvhandoff.service.tools.bench.cpu`); raw: its 1 MiB runs.
                    **cpu_figures(meters, dict.fromkeys(meters, total), args.repeat),
                }
            )
    return rows


async def _rounds(
    args: Any,
    engines: StageProcesses,
    target: str,
    raw: tuple[Any, Any],
    lanes: dict[str, list[Request]],
    drivers: dict[str, Checked],
    meters: dict[str, CpuMeter],
    tag: tuple[int, int, int],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`args.repeat` rounds of raw 1 MiB blocks (`raw[0]`, CPU metered), raw per-page blocks
    (`raw[1]`) and each mode's `count` handoffs (metered), interleaved: the wall seconds of
    each, and each mode's latencies in its fastest round."""
    pp, pages, count = tag
    walls: dict[str, list[float]] = {
        k: [] for k in ("raw_large", "raw_sleeping", "raw_pages", *drivers)
    }
    lat: dict[str, list[float]] = {m: [] for m in drivers}
    for rep in range(args.repeat):
        meters["raw"].start()
        walls["raw_large"].append(await asyncio.to_thread(engines.seconds, target, raw[0]))
        meters["raw"].stop()
        meters["raw_sleeping"].start()
        walls["raw_sleeping"].append(
            await asyncio.to_thread(engines.seconds, target, raw[0], sleeping=True)
        )
        meters["raw_sleeping"].stop()
        walls["raw_pages"].append(await asyncio.to_thread(engines.seconds, target, raw[1]))
        for m in drivers:
            meters[m].start()
            wall, lats, _ = await run_lanes(count, lanes[m], drivers[m], f"{m}{pp}-{pages}-{rep}")
            meters[m].stop()
            walls[m].append(wall)
            if wall <= min(walls[m]):
                lat[m] = lats
    return walls, lat


def _repeat(blocks: Any, times: int) -> Any:
    from kvhandoff.transport.blocks import Blocks

    return Blocks.concat([blocks] * times)


# -- segments ---------------------------------------------------------------------------------


def stage_layers(dep: LocalDeployment) -> list[list[int]]:
    """The layer ids each stage owns entries of (KV or state), by PP rank."""
    return [
        sorted({e.layer_id for e in layout.kv} | {e.layer_id for e in layout.state})
        for _, layout in sorted(dep.stage_layouts.items())
    ]


class SignalClient(RouterClient):
    """A router whose engine signals each stage in pieces: `"layers"` (one ready per layer of
    the stage, the pages and slot with the first) or `"pages:K"` (K page ranges, the slot with
    the last); `"one"` is `RouterClient` itself."""

    def __init__(self, http: aiohttp.ClientSession, dep: LocalDeployment, how: str) -> None:
        super().__init__(http, dep)
        self.how = how
        self.stage_layers = stage_layers(dep)

    async def signal_stages(
        self, handoff_id: str, src_pages: Sequence[int], src_slot: int | None
    ) -> list[str]:
        if self.how == "one":
            return await super().signal_stages(handoff_id, src_pages, src_slot)
        stages = (
            self._one_stage(handoff_id, r, list(src_pages), src_slot)
            for r in range(len(self.stage_layers))
        )
        return [p for refused in await asyncio.gather(*stages) for p in refused]

    async def _one_stage(
        self, handoff_id: str, rank: int, pages: list[int], slot: int | None
    ) -> list[str]:
        bodies: list[dict[str, Any]] = []
        if self.how == "layers":
            for i, layer in enumerate(self.stage_layers[rank]):
                body: dict[str, Any] = {"layers": [layer]}
                if i == 0:
                    body["src_pages"] = pages
                    if slot is not None:
                        body["src_slot"] = slot
                bodies.append(body)
        else:
            chunks = int(self.how.split(":", 1)[1])
            cuts = np.linspace(0, len(pages), chunks + 1).astype(int).tolist()
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                last = i == chunks - 1
                body = {"src_pages": pages[a:b], "pages_from": a, "last_pages": last}
                if last and slot is not None:
                    body["src_slot"] = slot
                bodies.append(body)
        refused = []
        for body in bodies:  # in order, as an engine sends them
            problem = await self._ready(handoff_id, rank, body)
            if problem:
                refused.append(problem)
        return refused


async def segments(args: Any, note: Note = _noop) -> dict[str, Any]:
    pp, pages, conc = max(args.e2e_pp), args.segment_pages, args.e2e_concurrency
    pool = pool_pages_for(conc, pages)
    ways = ["one", "layers", f"pages:{args.segment_chunks}"]
    note(f"PP={pp} landed deployment, {pages} pages per request")
    with deployment(pp, "landed", pool, conc, args) as dep:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            lanes = lanes_for(dep, pages, conc, args.seed)
            drivers = {w: Checked(SignalClient(http, dep, w)) for w in ways}
            for w in ways:
                await run_lanes(conc, lanes, drivers[w], f"warm-{w}")
            count = max(2 * conc, args.segment_requests)
            walls: dict[str, list[float]] = {w: [] for w in ways}
            moved: dict[str, int] = {}
            for rep in range(args.repeat):
                for w in ways:
                    note(f"{w}, round {rep + 1}")
                    wall, _, total = await run_lanes(count, lanes, drivers[w], f"{w}-{rep}")
                    walls[w].append(wall)
                    moved[w] = total
    if len(set(moved.values())) != 1:
        raise RuntimeError(f"the signal variants moved different bytes: {moved}")
    rate = {w: count / min(v) for w, v in walls.items()}
    return {
        "case": "segments_e2e",
        "model": f"hybrid-npu-mla scale 1, 128-token pages, PP={pp}, landed",
        "pages": pages,
        "concurrency": conc,
        "requests": count,
        "layers_per_stage": [len(x) for x in stage_layers(dep)],
        "chunks": args.segment_chunks,
        "bytes_per_request": next(iter(moved.values())) // count,
        "handoffs_per_s": rate,
        "gb_s": {w: moved[w] / min(walls[w]) / 1e9 for w in ways},
        "ratios": {w: rate[w] / rate["one"] for w in ways if w != "one"},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--e2e-pp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument(
        "--e2e-pages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 8, 32]
    )
    parser.add_argument("--e2e-concurrency", type=int, default=2)
    parser.add_argument("--e2e-target-mb", type=int, default=192, help="bytes per timed run")
    parser.add_argument("--segment-pages", type=int, default=16)
    parser.add_argument("--segment-chunks", type=int, default=4)
    parser.add_argument("--segment-requests", type=int, default=24)


async def _main(args: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "sizes": await sizes(args, print),
        "segments": await segments(args, print),
    }
    out["wall_s"] = time.perf_counter() - t0
    return out
