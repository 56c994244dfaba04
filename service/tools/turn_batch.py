"""Calls made in the same turn of the event loop, sent as one batch request.

A router admits many requests per tick and an engine finishes a whole forward batch at once:
what they issue together leaves together. `TurnBatcher.submit` queues an item and, once per
turn, every item queued in it goes to `send` in one call (chunks of `max_items`, sent one
after another, in order); each caller gets its own item's result, or the exception of the call
that carried it (a `send` that answers the wrong number of results fails every caller of that
call). A caller cancelled before the flush has its item dropped. Used by
`RouterClient(coalesce=True)` for `POST /v1/handoff-batches` and `POST /v1/stages/ready`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

I = TypeVar("I")  # noqa: E741 - an item, as R is a result
R = TypeVar("R")


class TurnBatcher(Generic[I, R]):
    """`send(items)` answers one result per item, in order. Close it with `close()`."""

    def __init__(
        self,
        send: Callable[[list[I]], Awaitable[list[R]]],
        max_items: int,
        expected: tuple[type[BaseException], ...] = (),
    ) -> None:
        """`expected`: what `send` may raise that its callers handle (a failed request)."""
        self._send, self._max_items, self._expected = send, max_items, expected
        self._pending: list[tuple[I, asyncio.Future[R]]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Batches sent, and items in them (their ratio: the mean batch).
        self.batches = self.items = 0

    async def submit(self, item: I) -> R:
        loop = asyncio.get_running_loop()
        if not self._pending:
            # Runs after every callback already due in this turn: the tasks started together
            # (a gather, a burst of outcomes) have all queued their items by then.
            loop.call_soon(self._flush)
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        return await future

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _flush(self) -> None:
        # A caller cancelled before the flush has left: its item is not sent.
        pending = [(item, future) for item, future in self._pending if not future.done()]
        self._pending = []
        if pending:
            task = asyncio.create_task(self._carry_all(pending))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _carry_all(self, pending: list[tuple[I, asyncio.Future[R]]]) -> None:
        # Chunks leave one after another: the receiver sees the items in the order issued.
        for start in range(0, len(pending), self._max_items):
            try:
                await self._carry(pending[start : start + self._max_items])
            except BaseException as exc:
                _fail(pending[start:], exc)  # the chunks not sent yet never will be
                raise

    async def _carry(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        self.batches += 1
        self.items += len(batch)
        try:
            results = await self._send([item for item, _ in batch])
            if len(results) != len(batch):
                raise ValueError(f"{len(results)} results for a batch of {len(batch)} items")
        except BaseException as exc:
            # Each waiter raises what the call raised (never waits for ever); what the caller
            # does not expect of `send` is raised here too.
            _fail(batch, exc)
            if not isinstance(exc, self._expected):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


def _fail(batch: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException) -> None:
    for _, future in batch:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)
