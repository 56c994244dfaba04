"""Awaiting work that must run to its end: a copy in a thread keeps writing its buffer until it
returns, whatever the task that started it does.

Used where memory another party reuses is written off the event loop: the prefill's gather into
staging (`prefill/landed.py`), the decode's commit into KV pages (`decode/landing.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def finish(awaitable: Awaitable[T]) -> T:
    """Await to the end even if cancelled meanwhile, then re-raise the cancellation; else
    return its result (or raise its error)."""
    task = asyncio.ensure_future(awaitable)
    await drain({task})
    return task.result()


async def drain(tasks: set[asyncio.Task[Any]] | set[asyncio.Future[Any]]) -> None:
    """Wait until every task is done, even if this task is cancelled meanwhile; then re-raise."""
    cancelled = False
    while pending := {t for t in tasks if not t.done()}:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
