"""The demo's arguments, its clock (handoffs timed in waves, without the demo's own filling
and checking of bytes), and its raw-Mooncake baseline into a landed decode: blocks laid into
the arena's slice."""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import pytest

from kvhandoff.service.tools import demo
from kvhandoff.service.tools.demo import into_span
from kvhandoff.service.tools.router_client import Outcome
from kvhandoff.transport.blocks import Blocks


def test_blocks_are_laid_end_to_end_and_start_over_inside_the_span() -> None:
    lengths = np.array([40, 24, 40, 16, 40], dtype=np.uint64)
    blocks = Blocks.of(np.arange(5) * 100, np.zeros(5), lengths)
    out = into_span(blocks, 1000, 100)
    assert out.src_addr.tolist() == blocks.src_addr.tolist()
    assert out.length.tolist() == lengths.tolist()
    # Offsets 0, 40, 64, 104 -> 43 (mod 61), 120 -> 59: never past the span's end.
    assert out.dst_addr.tolist() == [1000, 1040, 1003, 1043, 1059]
    assert all(d + n <= 1100 for d, n in zip(out.dst_addr.tolist(), lengths.tolist()))


def test_a_block_longer_than_the_span_is_refused() -> None:
    blocks = Blocks.of([0], [0], [200])
    with pytest.raises(ValueError, match="200 bytes"):
        into_span(blocks, 0, 100)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_baseline_without_a_data_plane_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.run(_args("--baseline", "--bulk", "0")) == 2
    assert "--baseline compares the data plane's bytes" in capsys.readouterr().err


def test_the_data_plane_runs_at_its_own_scale_and_at_most_four_in_flight() -> None:
    bulk = demo.bulk_args(_args("--bulk", "5", "--bulk-scale", "2", "--concurrency", "16"))
    assert (bulk.requests, bulk.scale, bulk.concurrency) == (5, 2, 4)
    assert demo.bulk_args(_args("--concurrency", "2")).concurrency == 2


class _Workload:
    """Stands in for the demo's workload: pools that hold `room` requests at a time, a fill
    and a check as slow as `cost_s` each, and a log of the order things happened in."""

    def __init__(self, room: int, cost_s: float) -> None:
        self.room, self.cost_s, self.held, self.log = room, cost_s, 0, []

    def wave(self, first: int, most: int) -> list[demo._Job]:
        n = min(most, self.room - self.held)
        self.held += n
        empty = np.zeros(0, dtype=np.int64)
        return [demo._Job(i, empty, 0, empty, 0) for i in range(first, first + n)]

    def fill(self, job: demo._Job) -> None:
        self.log.append(f"fill {job.index}")
        time.sleep(self.cost_s)

    def verify(self, job: demo._Job) -> bool:
        self.log.append(f"verify {job.index}")
        time.sleep(self.cost_s)
        return True

    def release(self, job: demo._Job, outcome: Outcome) -> None:
        self.held -= 1


async def test_the_clock_runs_while_handoffs_move_not_while_the_demo_fills_or_checks() -> None:
    work = _Workload(room=4, cost_s=0.05)

    async def execute(job: demo._Job) -> Outcome:
        work.log.append(f"handoff {job.index}")
        await asyncio.sleep(0.01)
        return Outcome("completed", 100, None)

    args = _args("--requests", "10", "--concurrency", "2", "--json")
    results, wall = await demo._drive(work, execute, args)  # type: ignore[arg-type]
    assert [r["id"] for r in results] == [f"req-{i}" for i in range(10)]
    assert all(r["verified"] and r["state"] == "completed" for r in results)
    # 20 fills and checks of 50 ms ran, outside the clock: it saw 3 waves (4, 4, 2) of 10 ms
    # handoffs, 2 at a time.
    assert 0.05 <= wall < 0.5
    assert work.log[:5] == ["fill 0", "fill 1", "fill 2", "fill 3", "handoff 0"]
    assert work.log.index("verify 3") < work.log.index("fill 4")


async def test_requests_the_pools_cannot_hold_are_skipped_not_waited_for() -> None:
    work = _Workload(room=0, cost_s=0.0)

    async def execute(job: demo._Job) -> Outcome:
        raise AssertionError("nothing fits: nothing runs")

    results, wall = await demo._drive(work, execute, _args("--requests", "3", "--json"))  # type: ignore[arg-type]
    assert [r["state"] for r in results] == ["skipped"] * 3 and wall == 0.0
    assert "unknown state hold them" in results[0]["error"]


def test_the_pools_hold_a_wave_of_requests_a_small_multiple_of_those_in_flight() -> None:
    assert demo._pool_sizes(_args()) == (4096, 128)  # 200 requests, 16 in flight: 8x
    # The large requests at full size: 6 slots of 40 MB fit the bound, 2 per request in flight
    # are kept.
    assert demo._pool_sizes(demo.bulk_args(_args())) == (1024, 8)
    assert demo._pool_sizes(demo.bulk_args(_args("--bulk-scale", "4"))) == (1024, 16)
    assert demo._pool_sizes(_args("--requests", "3", "--concurrency", "4")) == (1024, 8)
    # At full size a slot is 40 MB: the wave's slots stay within WAVE_SLOT_BYTES, and never
    # below two per request in flight.
    assert demo._pool_sizes(_args("--scale", "1", "--concurrency", "2")) == (1024, 6)
    assert demo._pool_sizes(_args("--scale", "1")) == (4096, 32)
