"""TaskOwner: spawn, failures logged without stopping siblings, close with a bound."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvhandoff.service.tasks import TaskOwner


async def test_close_cancels_every_task_and_waits_for_them() -> None:
    owner = TaskOwner("t")
    stopped: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(name)

    tasks = [owner.spawn(forever(n), n) for n in ("a", "b")]
    await asyncio.sleep(0)
    assert len(owner) == 2
    await owner.close()
    assert sorted(stopped) == ["a", "b"] and all(t.cancelled() for t in tasks)
    assert len(owner) == 0


async def test_a_failing_task_is_logged_and_its_siblings_run_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner("t")
    sibling_done = asyncio.Event()

    async def fails() -> None:
        raise ValueError("a bug")

    async def sibling() -> None:
        await asyncio.sleep(0.01)
        sibling_done.set()

    with caplog.at_level(logging.ERROR, logger="kvhandoff.tasks"):
        owner.spawn(fails(), "failing")
        owner.spawn(sibling(), "sibling")
        await asyncio.wait_for(sibling_done.wait(), 5)
    assert any("failing failed" in r.getMessage() for r in caplog.records)
    assert len(owner) == 0
    await owner.close()


async def test_close_is_bounded_and_logs_a_task_that_will_not_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner("t")
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # refuses to stop (a bug): close must not hang on it

    task = owner.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvhandoff.tasks"):
        await asyncio.wait_for(owner.close(timeout_s=0.05), 5)
    assert not task.done()
    assert any("stubborn" in r.getMessage() for r in caplog.records)
    release.set()
    await task


async def test_a_closing_owner_starts_nothing_new() -> None:
    owner = TaskOwner("t")
    await owner.close()

    async def work() -> None:
        pass

    with pytest.raises(RuntimeError, match="closing"):
        owner.spawn(work(), "late")
