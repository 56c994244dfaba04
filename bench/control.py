"""The control plane against concurrency, for `make bench`: one-page handoffs of a small dense
model (every step over HTTP: create on the decode and ready on every stage at once, the outcome
from the decode's event stream; records, outbox and signed peer messages on, as deployed) beside
plain `GET /healthz` round trips to the same decode from the same client at the same concurrency,
interleaved, best of `repeat`.

Two router shapes, each a row (`"router"`): `per-request` (one create and one ready per stage
per handoff) at every concurrency, and `coalesced` (the creates, and each prefill service's
readies, issued in one turn of the loop as one batch request) at `--control-coalesced` only.
The ratio handoffs/s ÷ healthz/s says how many plain requests one handoff costs; the latencies
are create → completed as the router sees them.

Beside the rates, every row carries the CPU budget of the same interleaved runs (`cpu_us`): CPU
µs per handoff of each process (`router`, this process; `decode`; each `prefill-k`), from
/proc, summed over every run of the shape at that point, the cores those processes kept busy,
and the same for one `GET /healthz`. On a host whose cores are all busy the rate is about
cores ÷ CPU per handoff, so these figures say what a ratio can reach and which process spends it.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.tools.bench.cpu import CpuMeter, deployment_pids
from kvhandoff.service.tools.bench.handoff import Request, run_lanes
from kvhandoff.service.tools.router_client import RouterClient


class Counted:
    """One-page handoffs through `client`; the ones that do not complete are counted by error
    (a sweep records them beside its figures instead of stopping)."""

    def __init__(self, client: RouterClient) -> None:
        self.client = client
        self.errors: Counter[str] = Counter()

    async def __call__(self, hid: str, req: Request) -> int:
        out = await self.client.handoff(
            hid, req.src_pages, req.dst_pages, req.src_slot, req.dst_slot
        )
        if out.state != "completed":
            self.errors[f"{out.state}: {(out.error or '')[:120]}"] += 1
        return out.bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-pp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4]
    )
    parser.add_argument(
        "--control-concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 64, 256],
    )
    parser.add_argument(
        "--control-coalesced",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[1, 64],
        help="concurrencies at which the coalesced router shape runs too",
    )
    parser.add_argument(
        "--control-seconds", type=float, default=1.5, help="about how long each timed run lasts"
    )


async def concurrency_sweep(
    args: Any, note: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    rows = []
    top = max(args.control_concurrency)
    for pp in args.control_pp:
        note(f"PP={pp}: starting the deployment")
        with LocalDeployment(
            preset="dense-mha",
            model={"scale": 64, "num_layers": 4},
            pp_size=pp,
            num_pages=max(64, top),
            handoff=HandoffConfig(max_concurrent=top + 64),
            log_level="warning",
        ) as dep:
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
                RouterClient(http, dep) as client,
            ):
                rows += await _sweep(args, dep, http, client, note)
    return rows


async def _sweep(
    args: Any,
    dep: LocalDeployment,
    http: aiohttp.ClientSession,
    client: RouterClient,
    note: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every concurrency point of one deployment: its rows."""
    handoff = Counted(client)
    health = f"{dep.decode_url}/healthz"

    async def ping(_: str, __: Request) -> int:
        async with http.get(health) as resp:
            await resp.read()
        return 0

    top = max(args.control_concurrency)
    lanes = [Request([k], [k], None, None) for k in range(top)]
    await run_lanes(min(200, 4 * top), lanes[:64], handoff, f"warm{dep.pp_size}")
    # A first guess of the rates, to size each run to about `control_seconds`.
    wall, _, _ = await run_lanes(64, lanes[:8], handoff, f"guess{dep.pp_size}")
    guess = 64 / wall
    rows = []
    for conc in args.control_concurrency:
        note(f"PP={dep.pp_size}, concurrency {conc}")
        shapes = ["per-request"] + (["coalesced"] if conc in args.control_coalesced else [])
        point = Point(args, handoff, ping, lanes[:conc], f"{dep.pp_size}-{conc}", guess)
        point.meter_processes({"router": os.getpid(), **deployment_pids(dep)})
        best = await point.run(shapes)
        guess = max(guess, best["per-request"].rate)
        rows += [point.row(dep.pp_size, shape, best[shape], best["healthz"]) for shape in shapes]
    return rows


class Budget:
    """CPU of the metered processes over every run of one shape at one point, and the jobs
    those runs did: the CPU µs one job costs per process and the cores the runs kept busy."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.meter = CpuMeter(pids)
        self.jobs = 0

    def figures(self) -> dict[str, Any]:
        """CPU µs per job by process (`cpu_us`) and in all, and the cores kept busy."""
        per = {name: s / self.jobs * 1e6 for name, s in self.meter.seconds.items()}
        busy = self.meter.total() / self.meter.wall_s if self.meter.wall_s else 0.0
        return {"cpu_us": per, "cpu_us_all": sum(per.values()), "cores_busy": busy}


@dataclass
class Best:
    rate: float = 0.0
    latencies: list[float] = field(default_factory=list)
    count: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    fallbacks: int = 0  # outcomes looked up by GET: the stream could not tell them


class Point:
    """One concurrency point: healthz and each router shape, interleaved (A B C A B C ...),
    each run sized to about `control_seconds` from the last rate seen; best of `repeat`."""

    def __init__(
        self,
        args: Any,
        handoff: Counted,
        ping: Any,
        lanes: list[Request],
        name: str,
        guess: float,
    ) -> None:
        self.args, self.handoff, self.ping, self.lanes, self.name = args, handoff, ping, lanes, name
        conc = len(lanes)
        want_h = guess * min(1.0, conc / 8)
        self.want = {"healthz": 10 * want_h, "per-request": want_h, "coalesced": want_h}
        self.budgets: dict[str, Budget] = {}
        self.cpus = len(os.sched_getaffinity(0))

    def meter_processes(self, pids: dict[str, int]) -> None:
        """Meter the CPU of `pids` (name → pid) over every run of each shape."""
        self.budgets = {shape: Budget(pids) for shape in self.want}

    async def run(self, shapes: list[str]) -> dict[str, Best]:
        best: dict[str, Best] = {}
        failed: dict[str, Counter[str]] = {shape: Counter() for shape in shapes}
        for rep in range(self.args.repeat):
            for shape in ["healthz", *shapes]:
                result = await self._once(shape, rep)
                if shape not in best or result.rate > best[shape].rate:
                    best[shape] = result
                self.want[shape] = result.rate
                failed.get(shape, Counter()).update(result.errors)
        for shape in shapes:  # a row counts what failed in any of its runs
            best[shape].errors = failed[shape]
        return best

    async def _once(self, shape: str, rep: int) -> Best:
        n = max(4 * len(self.lanes), int(self.want[shape] * self.args.control_seconds))
        client = self.handoff.client
        client.coalesce = shape == "coalesced"
        self.handoff.errors = Counter()
        job = self.ping if shape == "healthz" else self.handoff
        before = client.fallbacks
        budget = self.budgets.get(shape)
        if budget is not None:
            budget.meter.start()
        wall, lats, _ = await run_lanes(n, self.lanes, job, f"{shape[0]}{self.name}-{rep}")
        if budget is not None:
            budget.meter.stop()
            budget.jobs += n
        errors = self.handoff.errors
        # Handoffs/s counts the completed ones only.
        return Best((n - sum(errors.values())) / wall, lats, n, errors, client.fallbacks - before)

    def row(self, pp: int, shape: str, h: Best, p: Best) -> dict[str, Any]:
        return {
            "pp": pp,
            "concurrency": len(self.lanes),
            "router": shape,
            "handoffs": h.count,
            "handoffs_per_s": h.rate,
            "healthz_per_s": p.rate,
            "ratio": h.rate / p.rate,
            "p50_ms": float(np.percentile(h.latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(h.latencies, 99) * 1e3),
            "healthz_p50_ms": float(np.percentile(p.latencies, 50) * 1e3),
            "healthz_p99_ms": float(np.percentile(p.latencies, 99) * 1e3),
            # Handoffs of this point's runs of this shape that did not complete, by error.
            "failed": sum(h.errors.values()),
            "errors": dict(h.errors.most_common(3)),
            # Outcomes of the best run that the event stream did not tell (looked up by GET).
            "fallbacks": h.fallbacks,
            **self._budget(shape),
        }

    def _budget(self, shape: str) -> dict[str, Any]:
        """The CPU budget of `shape`'s runs beside healthz's (empty when nothing was metered):
        `cpu_ratio`, healthz's CPU per request ÷ a handoff's, is the ratio the two rates have
        when both keep the same cores busy; `cpu_ceiling_per_s` is the handoffs/s every core of
        this host would carry at this CPU per handoff."""
        if shape not in self.budgets or not self.budgets[shape].jobs:
            return {}
        out = self.budgets[shape].figures()
        healthz = self.budgets["healthz"].figures()
        out["healthz_cpu_us_all"] = healthz["cpu_us_all"]
        out["healthz_cores_busy"] = healthz["cores_busy"]
        out["cpus"] = self.cpus
        out["cpu_ratio"] = out["healthz_cpu_us_all"] / out["cpu_us_all"]
        out["cpu_ceiling_per_s"] = self.cpus / out["cpu_us_all"] * 1e6
        return out
