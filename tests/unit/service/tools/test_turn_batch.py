"""`TurnBatcher`: what one turn issues leaves as one call, every caller is answered whatever
`send` does (fails, answers too few results), a cancelled caller's item is not sent, and chunks
leave one after another in the order issued."""

from __future__ import annotations

import asyncio

import pytest

from kvhandoff.service.tools.turn_batch import TurnBatcher


async def test_a_send_answering_too_few_results_fails_every_caller_of_that_call() -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    batcher = TurnBatcher(short, 256, expected=(ValueError,))
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True), 2
    )
    assert [type(r) for r in results] == [ValueError] * 3


async def test_a_failed_send_fails_its_callers_and_the_chunks_after_it() -> None:
    calls: list[list[int]] = []

    async def failing(items: list[int]) -> list[int]:
        calls.append(items)
        raise ConnectionError("refused")

    batcher = TurnBatcher(failing, 2, expected=(ConnectionError,))
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit(i) for i in range(5)), return_exceptions=True), 2
    )
    assert [type(r) for r in results] == [ConnectionError] * 5
    assert calls == [[0, 1], [2, 3], [4]]


async def test_a_caller_cancelled_before_the_flush_has_its_item_dropped() -> None:
    sent: list[list[str]] = []

    async def echo(items: list[str]) -> list[str]:
        sent.append(items)
        return items

    batcher = TurnBatcher(echo, 256)
    gone = asyncio.ensure_future(batcher.submit("gone"))
    kept = asyncio.ensure_future(batcher.submit("kept"))
    await asyncio.sleep(0)  # both queued, the flush is due
    gone.cancel()
    assert await asyncio.wait_for(kept, 2) == "kept"
    assert sent == [["kept"]]
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_chunks_leave_one_after_another_in_the_order_issued() -> None:
    in_flight, order = 0, []

    async def send(items: list[int]) -> list[int]:
        nonlocal in_flight
        in_flight += 1
        assert in_flight == 1, "two chunks in flight at once"
        await asyncio.sleep(0.01)
        order.extend(items)
        in_flight -= 1
        return [i * 10 for i in items]

    batcher = TurnBatcher(send, 256)
    results = await asyncio.wait_for(asyncio.gather(*(batcher.submit(i) for i in range(600))), 5)
    assert results == [i * 10 for i in range(600)]
    assert order == list(range(600))
    assert (batcher.batches, batcher.items) == (3, 600)
