"""`python -m bench.events`: SSE fan-out of a decode service to many readers, in one run.

A decode service runs in this process (`serve()`, local transport). A second process opens
`--subscribers` streams on `GET /v1/events`, says when all are open, and reports when every
stream has received `--events` frames. This process publishes `--events` `stage.transferred`
events on the service's bus and times from the first publish to that report: the fan-out rate
is frames delivered per second over all readers. The baseline, measured in the same run, is the
bus publishing the same events with no reader at all; the ratio says what serving the readers
costs the publisher's process. Readers dropped for falling behind are reported (the run uses a
queue deep enough that none should be).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from kvhandoff.pipelines.events import EventBus, StageTransferred
from kvhandoff.service.config import load_config
from kvhandoff.service.observability.streams import STREAMS
from kvhandoff.service.runtime.roles import RUNTIME
from kvhandoff.service.serve import install_service, serve

#: Events published between two yields to the loop (lets the stream handlers write).
CHUNK = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subscribers", type=int, default=10, help="SSE readers")
    parser.add_argument("--events", type=int, default=20_000, help="events published")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _event(i: int) -> StageTransferred:
    return StageTransferred(
        handoff_id=f"bench-{i // 4}",
        role="decode",
        pp_rank=i % 4,
        blocks=32,
        bytes=1 << 20,
        batches=1,
        seconds=0.001,
        final=i % 4 == 3,
    )


def _baseline(n: int) -> float:
    """Events per second the bus publishes with no subscriber (best of three)."""
    events = [_event(i) for i in range(n)]
    best = float("inf")
    for _ in range(3):
        bus = EventBus(replay=4096)
        t0 = time.perf_counter()
        for e in events:
            bus.publish(e)
        best = min(best, time.perf_counter() - t0)
    return n / best


async def _fanout(subscribers: int, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as state:
        config = load_config(
            None,
            {},
            {
                "role": "decode",
                "server": {"port": 0, "state_dir": state},
                "transport": {"backend": "local"},
                "model": {"preset": "dense-mha", "scale": 64, "num_layers": 4},
                "stages": [{"num_pages": 16}],
                "handoff": {"sse_queue": n + 16, "sse_buffer": 4096},
            },
        )
        extensions = [install_service]
        async with serve(config, extensions) as server:
            bus = server.app[RUNTIME].bus
            reader = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.events",
                "--reader",
                f"{server.url}/v1/events",
                str(subscribers),
                str(n),
                stdout=asyncio.subprocess.PIPE,
                # `-m bench.events` imports from the repository, wherever the run started.
                cwd=Path(__file__).resolve().parents[1],
            )
            assert reader.stdout is not None
            try:
                assert (await reader.stdout.readline()).strip() == b"open"
                events = [_event(i) for i in range(n)]
                t0 = time.perf_counter()
                for i in range(0, n, CHUNK):
                    for e in events[i : i + CHUNK]:
                        bus.publish(e)
                    await asyncio.sleep(0)
                publish_s = time.perf_counter() - t0
                done = json.loads(await reader.stdout.readline())
                seconds = time.perf_counter() - t0
            finally:
                if reader.returncode is None:
                    reader.kill()
                await reader.wait()
            dropped = server.app[STREAMS].dropped_total
    return {
        "frames": done["frames"],
        "seconds": seconds,
        "publish_s": publish_s,
        "dropped": dropped,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The fan-out and its baseline, as `run` reports them (`ok`: every frame, none dropped)."""
    baseline = _baseline(args.events)
    fan = uvloop.run(_fanout(args.subscribers, args.events))
    total = fan["frames"] / fan["seconds"]
    return {
        "subscribers": args.subscribers,
        "events": args.events,
        "frames_delivered": fan["frames"],
        "fanout_events_per_s_total": round(total),
        "publish_with_readers_events_per_s": round(args.events / fan["publish_s"]),
        "bus_only_events_per_s": round(baseline),
        "fanout_vs_bus_only": round(total / baseline, 3),
        "dropped": fan["dropped"],
        "target_events_per_s_total": 20_000,
        "ok": fan["frames"] == args.events * args.subscribers and fan["dropped"] == 0,
    }


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36s} {value}")
    return 0 if result["ok"] else 1


# ---------------------------------------------------------------------------------------------
# The reader process: `python -m bench.events --reader URL SUBSCRIBERS EVENTS`


async def _read(url: str, subscribers: int, n: int) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        responses = [await http.get(url) for _ in range(subscribers)]
        print("open", flush=True)

        async def drain(resp: aiohttp.ClientResponse) -> int:
            # Every frame starts a line with its id (the stream opens with a comment line); a
            # tail one byte shorter than the marker carries a split marker over, never a whole.
            marker, frames, tail = b"\nid: ", 0, b""
            async for chunk in resp.content.iter_any():
                data = tail + chunk
                frames += data.count(marker)
                tail = data[-(len(marker) - 1) :]
                if frames >= n:
                    break
            resp.close()
            return frames

        counts = await asyncio.gather(*(drain(r) for r in responses))
    print(json.dumps({"frames": sum(counts)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reader"]:
        uvloop.run(_read(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        from bench.command import main

        sys.exit(main(__doc__, add_arguments, run))
