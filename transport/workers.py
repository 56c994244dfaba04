"""A bounded pool of worker threads that exit when idle: where Mooncake engine calls run.

Called by `kvhandoff.transport.mooncake` only. `ThreadPoolExecutor` keeps every thread it ever
started until shutdown, so a thread per peer would mean 200 threads for 200 peers, forever. Here at
most `max_threads` threads run tasks, a thread exits after `idle_s` without one, and `close` waits
for the queued tasks and joins every thread. Tasks are callables that report through their own
channels; one that raises is a bug in the caller, and the exception propagates out of the
thread (Python prints it) after the thread has left the pool's accounting.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class Workers:
    """At most `max_threads` threads taking tasks first in, first out."""

    def __init__(
        self,
        max_threads: int,
        idle_s: float,
        *,
        name: str,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self._max = max_threads
        self._idle_s = idle_s
        self._name = name
        self._initializer = initializer
        self._cond = threading.Condition()
        self._tasks: deque[Callable[[], None]] = deque()
        self._threads: set[threading.Thread] = set()
        #: Threads waiting for a task (counted under `_cond`, so `_idle - len(_tasks)` is the
        #: number of waiting threads no queued task has claimed yet).
        self._idle = 0
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads alive now."""
        with self._cond:
            return len(self._threads)

    def submit(self, task: Callable[[], None]) -> None:
        """Queue `task`; start a thread for it if none is free and the cap allows.

        After `close` began, tasks are still accepted from tasks already running (a worker
        re-queueing its own follow-up) and run before the threads exit; new threads no longer
        start, so the queue drains on the threads left.
        """
        with self._cond:
            if self._closed and not self._threads:
                raise RuntimeError("workers are closed")
            self._tasks.append(task)
            if self._idle >= len(self._tasks):
                self._cond.notify()
            elif len(self._threads) < self._max and not self._closed:
                thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._threads.add(thread)
                thread.start()

    def close(self) -> None:
        """Run what is queued, then stop and join every thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def _loop(self) -> None:
        if self._initializer is not None:
            self._initializer()
        me = threading.current_thread()
        with self._cond:
            while True:
                deadline = time.monotonic() + self._idle_s
                self._idle += 1
                while not self._tasks and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._idle -= 1
                if not self._tasks:  # idle too long, or closed with nothing left to run
                    self._threads.discard(me)
                    return
                task = self._tasks.popleft()
                self._cond.release()
                try:
                    task()
                except BaseException:
                    self._cond.acquire()
                    self._threads.discard(me)
                    raise
                self._cond.acquire()
