"""The control plane against concurrency, for `make bench`: one-page handoffs of a small dense
model (every step over HTTP: create on the decode, ready on every stage, long-poll to the end;
records, outbox and signed peer messages on, as deployed) beside plain `GET /healthz` round trips
to the same decode from the same client at the same concurrency, interleaved, best of `repeat`.

The ratio handoffs/s ÷ healthz/s says how many plain requests one handoff costs; the latencies
are create → completed as the router sees them.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np

from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import LocalDeployment
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
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                handoff = Counted(RouterClient(http, dep))
                health = f"{dep.decode_url}/healthz"

                async def ping(_: str, __: Request, health: str = health) -> int:
                    async with http.get(health) as resp:
                        await resp.read()
                    return 0

                lanes = [Request([k], [k], None, None) for k in range(top)]
                await run_lanes(min(200, 4 * top), lanes[:64], handoff, f"warm{pp}")
                # A first guess of the rates, to size each run to about `control_seconds`.
                wall, _, _ = await run_lanes(64, lanes[:8], handoff, f"guess{pp}")
                guess = 64 / wall
                for conc in args.control_concurrency:
                    note(f"PP={pp}, concurrency {conc}")
                    handoff.errors.clear()
                    mine = lanes[:conc]
                    # Each run sized to about `control_seconds` from the last rate seen.
                    want_h = guess * min(1.0, conc / 8)
                    want_p = 10 * want_h
                    best: dict[str, tuple[float, list[float], int]] = {}
                    for rep in range(args.repeat):
                        for name, job, want in (("p", ping, want_p), ("h", handoff, want_h)):
                            n = max(4 * conc, int(want * args.control_seconds))
                            bad = sum(handoff.errors.values())
                            wall, lats, _ = await run_lanes(
                                n, mine, job, f"{name}{pp}-{conc}-{rep}"
                            )
                            # Handoffs/s counts the completed ones only.
                            rate = (n - sum(handoff.errors.values()) + bad) / wall
                            if name not in best or rate > best[name][0]:
                                best[name] = (rate, lats, n)
                            if name == "p":
                                want_p = rate
                            else:
                                want_h = rate
                    guess = max(guess, best["h"][0])
                    (rate_h, lat_h, n_h), (rate_p, lat_p, _) = best["h"], best["p"]
                    rows.append(
                        {
                            "pp": pp,
                            "concurrency": conc,
                            "handoffs": n_h,
                            "handoffs_per_s": rate_h,
                            "healthz_per_s": rate_p,
                            "ratio": rate_h / rate_p,
                            "p50_ms": float(np.percentile(lat_h, 50) * 1e3),
                            "p99_ms": float(np.percentile(lat_h, 99) * 1e3),
                            "healthz_p50_ms": float(np.percentile(lat_p, 50) * 1e3),
                            "healthz_p99_ms": float(np.percentile(lat_p, 99) * 1e3),
                            # Handoffs of this point's runs that did not complete, by error.
                            "failed": sum(handoff.errors.values()),
                            "errors": dict(handoff.errors.most_common(3)),
                        }
                    )
    return rows
