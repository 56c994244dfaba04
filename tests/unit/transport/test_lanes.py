"""`PeerLane.stuck`: derived from which call is running, so it cannot go stale; `InflightBound`:
batches admitted by count and bytes, first come first served, cancellation giving room back."""

from __future__ import annotations

import asyncio

import pytest

from kvhandoff.transport.lanes import InflightBound, PeerLane


async def test_a_lane_is_stuck_only_while_the_call_that_timed_out_runs() -> None:
    lane = PeerLane("peer:1", 4, 1 << 20)
    assert not lane.stuck()
    lane.in_call = lane.stuck_call = 7
    assert lane.stuck()
    lane.in_call = 0  # the call returned: no flag to clear
    assert not lane.stuck()
    lane.in_call = 8  # a later call runs: not the one that timed out
    assert not lane.stuck()


async def waiting(bound: InflightBound, nbytes: int) -> asyncio.Task[None]:
    """An `acquire` started and run until it either got room or waits for it."""
    task = asyncio.create_task(bound.acquire(nbytes))
    await asyncio.sleep(0)
    return task


async def test_batches_are_admitted_by_count_and_by_bytes() -> None:
    bound = InflightBound(max_batches=3, max_bytes=100)
    for _ in range(3):
        await bound.acquire(10)
    by_count = await waiting(bound, 10)
    assert not by_count.done()  # 30 bytes of 100, but three batches already
    bound.release(10)
    await by_count
    bound.release(10)
    by_bytes = await waiting(bound, 81)  # two batches of 10 in flight: 20 + 81 > 100
    assert not by_bytes.done()
    bound.release(10)
    await by_bytes
    assert (bound.batches, bound.bytes) == (2, 91)


async def test_a_batch_larger_than_the_byte_bound_goes_alone() -> None:
    bound = InflightBound(max_batches=8, max_bytes=100)
    await bound.acquire(1)
    big = await waiting(bound, 1000)
    assert not big.done()
    bound.release(1)
    await big
    small = await waiting(bound, 1)
    assert not small.done()  # nothing beside the oversized batch
    bound.release(1000)
    await small


async def test_small_batches_do_not_overtake_a_waiting_large_one() -> None:
    bound = InflightBound(max_batches=8, max_bytes=100)
    await bound.acquire(60)
    large = await waiting(bound, 60)
    small = await waiting(bound, 1)
    assert not large.done() and not small.done()  # 1 byte fits, but it came after the 60
    bound.release(60)
    await asyncio.gather(large, small)
    assert (bound.batches, bound.bytes) == (2, 61)


async def test_a_cancelled_waiter_leaves_and_lets_the_next_one_in() -> None:
    bound = InflightBound(max_batches=8, max_bytes=100)
    await bound.acquire(60)
    large = await waiting(bound, 60)
    small = await waiting(bound, 1)
    large.cancel()
    await small  # it waited only behind the large one
    with pytest.raises(asyncio.CancelledError):
        await large
    assert (bound.batches, bound.bytes) == (2, 61)


async def test_room_granted_to_a_cancelled_waiter_is_given_back() -> None:
    bound = InflightBound(max_batches=1, max_bytes=100)
    await bound.acquire(10)
    task = await waiting(bound, 10)
    bound.release(10)  # grants `task` its room before it runs again
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (bound.batches, bound.bytes) == (0, 0)


async def test_room_freed_while_a_cancelled_waiter_has_not_run_goes_to_the_next() -> None:
    bound = InflightBound(max_batches=1, max_bytes=100)
    await bound.acquire(10)
    cancelled = await waiting(bound, 10)
    after = await waiting(bound, 10)
    cancelled.cancel()  # its future is cancelled now; its handler runs on its next turn
    bound.release(10)
    await after
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert (bound.batches, bound.bytes) == (1, 10)
