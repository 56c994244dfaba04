"""`python -m bench.webhooks`: the webhook outbox's throughput and what it costs a handoff, each
against a baseline measured in the same run.

- `deliveries`: `--events` events (of `--handoffs` handoffs, interleaved) published on an
  `EventBus` whose listener commits each to the outbox (SQLite on disk, WAL) while the
  dispatcher delivers them, signed, to a receiver in another process. Reported: deliveries/s
  from the first publish until the last delivery is committed as delivered. Baseline: plain
  POSTs of the same bodies to the same receiver at the same concurrency, no outbox, no
  signature. Also the publish-side cost (µs per event committed).
- `handoffs`: one-page handoffs (the `bench handoff` small case: PP=1, every step over HTTP)
  on four deployments up at once: `records.persist = false`; records only; records and an
  endpoint for the outcome (`handoff.completed|failed|aborted`: one webhook a handoff); records
  and an endpoint for every `handoff.` event (two). Rounds run each back to back in rotating
  order. Reported: handoffs/s, the median over rounds of each one's ratio to records off, and
  the decode process's CPU time per handoff (steadier than rates on a shared machine).
- `backlog`: what a backlog to a dead endpoint (a port that refuses connections) costs each new
  event. `--backlog` deliveries (4 events per handoff) that already failed once and wait an hour
  are in the outbox and loaded by the dispatcher; then `--backlog-events` events of new handoffs
  are published (committed by the bus listener) and the run ends when each new delivery has
  been attempted once. Baseline: the same with no backlog, in the same round. Reported: events/s
  of both and their ratio (the median over rounds), and the publish-side cost per event; and
  the publish-side cost when the backlog exceeds `webhooks.max_held`, so that the new events
  wait in the outbox (they are not attempted in the run), with how many deliveries were held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop

from kvhandoff.pipelines.events import EventBus, HandoffCreated, StageArrived
from kvhandoff.service.config import RecordsConfig, WebhooksConfig
from kvhandoff.service.storage import FILE_NAME, Database
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.tools.bench.handoff import Driver, Request, run_lanes
from kvhandoff.service.webhooks.dispatch import Dispatcher
from kvhandoff.service.webhooks.outbox import Outbox, webhook_body

TERMINAL = ("handoff.completed", "handoff.failed", "handoff.aborted")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases", default="deliveries,handoffs,backlog", help="deliveries, handoffs, backlog"
    )
    parser.add_argument("--events", type=int, default=5000, help="deliveries case: events")
    parser.add_argument("--handoffs", type=int, default=1000, help="deliveries case: handoffs")
    parser.add_argument("--concurrency", type=int, default=16, help="deliveries per endpoint")
    parser.add_argument("--backlog", type=int, default=20000, help="backlog case: deliveries")
    parser.add_argument("--backlog-events", type=int, default=1000, help="backlog case: events")
    parser.add_argument("--small-requests", type=int, default=1000)
    parser.add_argument("--small-concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (rounds) per method")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- the receiver (its own process) -------------------------------------------------------------


def _receiver_main(sock: socket.socket) -> None:
    from aiohttp import web

    async def hook(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=204)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/hook", hook)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()

    uvloop.run(main())


class Receiver:
    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/hook"
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=_receiver_main, args=(self._sock,), daemon=True)

    def __enter__(self) -> Receiver:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.join(5)
        self._sock.close()


# -- deliveries ---------------------------------------------------------------------------------


def _events(count: int, handoffs: int) -> list[Any]:
    out: list[Any] = []
    for i in range(count):
        hid = f"h{i % handoffs}"
        if i < handoffs:
            out.append(HandoffCreated(handoff_id=hid, role="decode", num_pages=1, pp_size=1))
        else:
            out.append(
                StageArrived(
                    handoff_id=hid, role="decode", pp_rank=0, bytes=1, arrived=1, expected=1
                )
            )
    return out


async def _raw_posts(url: str, bodies: list[bytes], concurrency: int) -> float:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                async with http.post(url, data=body) as resp:
                    await resp.read()
                    if resp.status >= 300:
                        raise RuntimeError(f"receiver answered {resp.status}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def _journaled_bus(db: Database, outbox: Outbox, dispatcher: Dispatcher) -> EventBus:
    """A bus whose every event is committed to the outbox, then handed to the dispatcher (as the
    decode service's records listener does)."""
    bus = EventBus(replay=16)

    def journal(event: Any) -> None:
        with db.transaction() as tx:
            deliveries = outbox.enqueue(tx, event, None)
        dispatcher.add(deliveries)

    bus.add_listener(journal)
    return bus


async def _outbox_run(
    url: str, events: list[Any], concurrency: int, work: Path
) -> tuple[float, float]:
    """(seconds until every delivery was committed delivered, publish-side seconds)."""
    db = Database(work / FILE_NAME)
    try:
        outbox = Outbox(db, None, [])
        outbox.create_endpoint(url, [], None, "", time.time())
        settings = WebhooksConfig(allow_private=True, concurrency=concurrency)
        dispatcher = Dispatcher(outbox, settings, rng=random.Random(0))
        bus = _journaled_bus(db, outbox, dispatcher)
        await dispatcher.start()
        publish_s = 0.0
        t0 = time.perf_counter()
        for i, event in enumerate(events):
            p0 = time.perf_counter()
            bus.publish(event)
            publish_s += time.perf_counter() - p0
            if i % 50 == 49:
                await asyncio.sleep(0)  # let the dispatcher run, as a live service would
        while dispatcher.pending_count:
            await asyncio.sleep(0.002)
        wall = time.perf_counter() - t0
        await dispatcher.close()
        outbox.flush()
        delivered = db.conn.execute(
            "SELECT COUNT(*) FROM deliveries WHERE state = 'delivered'"
        ).fetchone()[0]
        if delivered != len(events):
            raise RuntimeError(f"{delivered} of {len(events)} deliveries delivered")
        return wall, publish_s
    finally:
        db.close()


async def deliveries(args: argparse.Namespace) -> dict[str, Any]:
    events = _events(args.events, args.handoffs)
    stamped = EventBus(replay=1)
    bodies = [webhook_body(stamped.publish(e)) for e in events]
    with Receiver() as receiver, tempfile.TemporaryDirectory(prefix="kvh-bench-") as tmp:
        await _wait_up(receiver.url)
        await _raw_posts(receiver.url, bodies[:500], args.concurrency)  # warm-up
        raw_best = ours_best = publish_best = float("inf")
        for rep in range(args.repeat):
            raw_best = min(raw_best, await _raw_posts(receiver.url, bodies, args.concurrency))
            work = Path(tmp) / f"run{rep}"
            work.mkdir()
            wall, publish_s = await _outbox_run(receiver.url, events, args.concurrency, work)
            ours_best, publish_best = min(ours_best, wall), min(publish_best, publish_s)
    raw_rate, ours_rate = len(events) / raw_best, len(events) / ours_best
    return {
        "case": "deliveries",
        "events": len(events),
        "handoffs": args.handoffs,
        "concurrency": args.concurrency,
        "raw_posts_per_s": raw_rate,
        "deliveries_per_s": ours_rate,
        "ratio": ours_rate / raw_rate,
        "publish_us_per_event": publish_best / len(events) * 1e6,
    }


# -- backlog ------------------------------------------------------------------------------------


def _seed_backlog(db: Database, outbox: Outbox, count: int, now: float) -> None:
    """`count` deliveries (4 events per handoff) that failed once and are due in an hour."""
    bus = EventBus(replay=1)
    with db.transaction() as tx:
        seeded = [
            d
            for e in _events(count, max(1, count // 4))
            for d in outbox.enqueue(tx, bus.publish(e), None)
        ]
    for d in seeded:
        outbox.record_attempt(d, now, 0.001, None, "refused", "pending", now + 3600.0)
    outbox.flush()


async def _backlog_run(
    url: str, backlog: int, count: int, work: Path, max_held: int
) -> tuple[float, float, int]:
    """(seconds until each of `count` new deliveries was attempted once — or, when they wait
    beyond `max_held` in the outbox, until published —, publish-side seconds, deliveries held)."""
    db = Database(work / FILE_NAME)
    try:
        outbox = Outbox(db, None, [])
        outbox.create_endpoint(url, [], None, "", time.time())
        _seed_backlog(db, outbox, backlog, time.time())
        # Retries an hour out: within the run, each new delivery is attempted exactly once.
        settings = WebhooksConfig(
            allow_private=True, backoff_base_s=3600.0, backoff_max_s=3600.0, max_held=max_held
        )
        dispatcher = Dispatcher(outbox, settings, rng=random.Random(0))
        bus = _journaled_bus(db, outbox, dispatcher)
        await dispatcher.start()
        events = [
            HandoffCreated(handoff_id=f"new{i}", role="decode", num_pages=1, pp_size=1)
            for i in range(count)
        ]
        publish_s = 0.0
        t0 = time.perf_counter()
        for i, event in enumerate(events):
            p0 = time.perf_counter()
            bus.publish(event)
            publish_s += time.perf_counter() - p0
            if i % 50 == 49:
                await asyncio.sleep(0)  # let the dispatcher run, as a live service would
        if backlog + count <= max_held:
            while dispatcher.stats.attempts < count:
                await asyncio.sleep(0.002)
        wall = time.perf_counter() - t0
        held = dispatcher.held_count
        if dispatcher.pending_count != backlog + count:
            raise RuntimeError(f"{dispatcher.pending_count} pending, not {backlog + count}")
        await dispatcher.close()
        return wall, publish_s, held
    finally:
        db.close()


async def backlog(args: argparse.Namespace) -> dict[str, Any]:
    n: int = args.backlog_events
    size: int = args.backlog
    cap = WebhooksConfig().max_held
    # (backlog, max_held): none; all held in memory; beyond the default cap (in the outbox).
    arms = {"empty": (0, cap), "held": (size, size + n), "capped": (size, cap)}
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    publish: dict[str, list[float]] = {arm: [] for arm in arms}
    held: dict[str, int] = {}
    # Bound, never listening: every connection to it is refused at once (a receiver that is down).
    with socket.socket() as dead, tempfile.TemporaryDirectory(prefix="kvh-bench-") as tmp:
        dead.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{dead.getsockname()[1]}/hook"
        for rep in range(args.repeat):
            names = list(arms)[rep % 3 :] + list(arms)[: rep % 3]
            for arm in names:
                work = Path(tmp) / f"run{rep}-{arm}"
                work.mkdir()
                size_of, cap_of = arms[arm]
                wall, publish_s, held[arm] = await _backlog_run(url, size_of, n, work, cap_of)
                walls[arm].append(wall)
                publish[arm].append(publish_s)

    def us(arm: str) -> float:
        return min(publish[arm]) / n * 1e6

    return {
        "case": "backlog",
        "backlog": size,
        "events": n,
        "max_held": cap,
        "empty_per_s": n / min(walls["empty"]),
        "backlog_per_s": n / min(walls["held"]),
        "ratio": float(np.median([e / b for e, b in zip(walls["empty"], walls["held"])])),
        "empty_publish_us_per_event": us("empty"),
        "backlog_publish_us_per_event": us("held"),
        "capped_publish_us_per_event": us("capped"),
        "capped_publish_ratio": float(
            np.median([e / c for e, c in zip(publish["empty"], publish["capped"])])
        ),
        "capped_held": held["capped"],
        "rounds": args.repeat,
    }


async def _wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.post(url, data=b"{}") as resp:
                    await resp.read()
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"the receiver at {url} did not come up")


# -- handoffs -----------------------------------------------------------------------------------


def _decode_pid(dep: LocalDeployment) -> int:
    popen = dep.process("decode").popen
    assert popen is not None
    return popen.pid


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def handoffs(args: argparse.Namespace) -> dict[str, Any]:
    lanes = [Request([k], [k], None, None) for k in range(args.small_concurrency)]
    common: dict[str, Any] = {
        "preset": "dense-mha",
        "model": {"scale": 64, "num_layers": 4},
        "pp_size": 1,
        "num_pages": max(64, args.small_concurrency),
        "log_level": "warning",
        "webhooks": WebhooksConfig(allow_private=True),
    }
    with (
        Receiver() as receiver,
        LocalDeployment(records=RecordsConfig(persist=False), **common) as off,
        LocalDeployment(**common) as records,
        LocalDeployment(**common) as outcome,
        LocalDeployment(**common) as on,
    ):
        await _wait_up(receiver.url)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            for dep, types in ((outcome, list(TERMINAL)), (on, ["handoff."])):
                async with http.post(
                    f"{dep.decode_url}/v1/webhooks", json={"url": receiver.url, "types": types}
                ) as resp:
                    if resp.status != 201:
                        raise RuntimeError(f"registering the endpoint: {await resp.text()}")
            drivers = {
                "off": Driver(http, off),
                "records": Driver(http, records),
                "outcome": Driver(http, outcome),
                "on": Driver(http, on),
            }
            walls: dict[str, list[float]] = {name: [] for name in drivers}
            cpu = dict.fromkeys(drivers, 0.0)
            pids = {name: _decode_pid(d.client.dep) for name, d in drivers.items()}
            for name, driver in drivers.items():
                await run_lanes(200, lanes, driver.handoff, f"warm-{name}")
            for rep in range(args.repeat):
                # Back to back, in a rotating order: each round's ratios see the same load.
                names = list(drivers)[rep % 4 :] + list(drivers)[: rep % 4]
                for name in names:
                    cpu0 = _cpu_seconds(pids[name])
                    wall, _, _ = await run_lanes(
                        args.small_requests, lanes, drivers[name].handoff, f"{name}{rep}"
                    )
                    walls[name].append(wall)
                    cpu[name] += _cpu_seconds(pids[name]) - cpu0
    rate = {name: args.small_requests / min(w) for name, w in walls.items()}

    def paired(name: str) -> float:  # the median over rounds of (off time / this time)
        return float(np.median([o / w for o, w in zip(walls["off"], walls[name])]))

    return {
        "case": "handoffs",
        "model": "dense-mha 4 layers, 1 page, PP=1",
        "requests": args.small_requests,
        "concurrency": args.small_concurrency,
        "records_off_per_s": rate["off"],
        "records_per_s": rate["records"],
        "records_outcome_webhook_per_s": rate["outcome"],
        "records_webhooks_per_s": rate["on"],
        "records_ratio": paired("records"),
        "outcome_webhook_ratio": paired("outcome"),
        "webhooks_ratio": paired("on"),
        "rounds": args.repeat,
        # CPU time of the decode process per handoff: robust to other load on the machine.
        "decode_cpu_us": {
            name: seconds / (args.repeat * args.small_requests) * 1e6
            for name, seconds in cpu.items()
        },
    }


def run(args: argparse.Namespace) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {"deliveries": deliveries, "handoffs": handoffs, "backlog": backlog}
    unknown = set(cases) - set(known)
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(known)}")
    results = [uvloop.run(known[c](args)) for c in cases]
    if args.json:
        print(json.dumps({"webhooks": results}))
        return 0
    for r in results:
        if r["case"] == "deliveries":
            print(
                f"deliveries: {r['events']} events of {r['handoffs']} handoffs, "
                f"concurrency {r['concurrency']}, outbox on disk"
            )
            print(f"  plain POSTs, no outbox     {r['raw_posts_per_s']:8.0f} /s")
            print(
                f"  signed outbox deliveries   {r['deliveries_per_s']:8.0f} /s  ({r['ratio']:.2f}x)"
                f"  publish {r['publish_us_per_event']:.0f} us/event"
            )
        elif r["case"] == "backlog":
            print(
                f"backlog: {r['events']} new events to a dead endpoint, best of {r['rounds']} "
                f"rounds (ratio: median of the rounds' ratios)"
            )
            print(
                f"  no backlog                          {r['empty_per_s']:8.0f} /s"
                f"          publish {r['empty_publish_us_per_event']:.0f} us/event"
            )
            print(
                f"  {r['backlog']:6,} waiting, all held in memory  {r['backlog_per_s']:8.0f} /s"
                f"  ({r['ratio']:.2f}x)  publish {r['backlog_publish_us_per_event']:.0f} us/event"
            )
            print(
                f"  {r['backlog']:6,} waiting, beyond max_held   {'':8}    "
                f"          publish {r['capped_publish_us_per_event']:.0f} us/event"
                f" ({r['capped_publish_ratio']:.2f}x)"
            )
            print(
                f"    (max_held {r['max_held']:,}: {r['capped_held']:,} held, the rest and the new"
                " events wait in the outbox)"
            )
        else:
            print(
                f"handoffs: {r['requests']} one-page handoffs at concurrency {r['concurrency']}, "
                f"best of {r['rounds']} rounds (ratio: median of the rounds' ratios)"
            )
            us = r["decode_cpu_us"]
            print(
                f"  records off                    {r['records_off_per_s']:8.0f} /s"
                f"          decode CPU {us['off']:5.0f} us/handoff"
            )
            print(
                f"  records (SQLite, no endpoint)  {r['records_per_s']:8.0f} /s  "
                f"({r['records_ratio']:.2f}x)  decode CPU {us['records']:5.0f} us/handoff"
            )
            print(
                f"  records + 1 webhook/handoff    {r['records_outcome_webhook_per_s']:8.0f} /s  "
                f"({r['outcome_webhook_ratio']:.2f}x)  decode CPU {us['outcome']:5.0f} us/handoff"
            )
            print(
                f"  records + 2 webhooks/handoff   {r['records_webhooks_per_s']:8.0f} /s  "
                f"({r['webhooks_ratio']:.2f}x)  decode CPU {us['on']:5.0f} us/handoff"
            )
    return 0


if __name__ == "__main__":
    from bench.command import main

    sys.exit(main(__doc__, add_arguments, run))
