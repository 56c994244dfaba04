"""The owner of a component's background tasks, in the nursery style of trio and anyio.

A long-lived component of the service (the heartbeats, the notice coalescer, the webhook
dispatcher, the persistence chores) starts its tasks with `spawn` and stops them all with
`close`, instead of keeping its own set and cancelling it by hand. The owner keeps each task
until it ends (so none is garbage-collected while running), logs one that fails (one child's bug
never goes unseen, and never stops its siblings: these are independent chores, not parts of one
computation, so a `TaskGroup` that cancels them all would be wrong here), and refuses new work
once closing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("kvhandoff.tasks")
T = TypeVar("T")


class TaskOwner:
    """Spawns named tasks and closes them with a bound. Use on the event loop's thread only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def spawn(self, work: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `work` in a task owned here; raises RuntimeError once `close` has begun."""
        if self._closing:
            work.close()
            raise RuntimeError(f"{self.name} is closing: it starts no new task")
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    @property
    def closing(self) -> bool:
        """Whether `close` has begun (no new task starts)."""
        return self._closing

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The tasks still running."""
        return frozenset(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout_s: float | None = None) -> None:
        """Cancel every task and wait until each has ended, at most `timeout_s` (None: as long
        as they take); a task still running past it is logged and left cancelled. Idempotent.
        A caller cancelled meanwhile is cancelled once the tasks have been told to stop."""
        self._closing = True
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if pending:
            log.warning(
                "%s: %d task(s) did not end within %g s of being cancelled: %s",
                self.name,
                len(pending),
                timeout_s,
                ", ".join(sorted(t.get_name() for t in pending)[:8]),
            )

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: %s failed", self.name, task.get_name(), exc_info=task.exception())
