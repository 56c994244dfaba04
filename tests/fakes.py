"""Test doubles shared by the unit tests. Integration tests never use these: they run the real
Transfer Engine in real processes."""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable

# -- transport ------------------------------------------------------------------------------


class FakeEngine:
    """A fault-injecting stand-in for `mooncake.engine.TransferEngine` (the `Engine` protocol of
    `transport.mooncake`), for unit tests of `MooncakeTransport`.

    Writes are real memmoves within this process, so bytes really land (or do not). Knobs:

    - `rc`: every call returns it (no bytes move when non-zero);
    - `script(*outcomes)`: the next calls, one outcome each, before `rc` applies again: an int
      is that call's rc, an exception instance is raised by that call (no bytes move);
    - `hang`: an Event; calls block until it is set (then run as scripted);
    - `max_blocks`: a call with more blocks fails (rc -1), like the real TCP per-peer queue.

    Synchronisation without sleeps: `wait_entered(n)` blocks until `n` calls have entered,
    `wait_returned(n)` until `n` have returned or raised. Records every call's blocks, bytes and
    target, and the highest number of concurrent calls.
    """

    def __init__(self, *, max_blocks: int = 2048) -> None:
        self.rc = 0
        self.hang: threading.Event | None = None
        self.max_blocks = max_blocks
        self.batch_sizes: list[int] = []
        self.bytes_per_call: list[int] = []
        self.targets: list[str] = []
        #: Per call, in the order calls entered: its destination addresses and lengths.
        self.dst_blocks: list[tuple[list[int], list[int]]] = []
        self.registered: dict[int, int] = {}
        self.active = 0
        self.max_active = 0
        self.entered = 0
        self.returned = 0
        self._script: deque[int | BaseException] = deque()
        self._cv = threading.Condition()

    def script(self, *outcomes: int | BaseException) -> None:
        with self._cv:
            self._script.extend(outcomes)

    def wait_entered(self, n: int, timeout_s: float = 30.0) -> None:
        self._wait(lambda: self.entered >= n, timeout_s, f"{n} calls entered")

    def wait_returned(self, n: int, timeout_s: float = 30.0) -> None:
        self._wait(lambda: self.returned >= n, timeout_s, f"{n} calls returned")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(ready, timeout_s):
                raise AssertionError(f"timed out waiting for {what} (entered {self.entered})")

    def touched(self, lo: int, hi: int, since_call: int = 0) -> bool:
        """Whether a call (from the `since_call`-th to enter on) wrote into [lo, hi)."""
        return any(
            d < hi and lo < d + n
            for dst, lengths in self.dst_blocks[since_call:]
            for d, n in zip(dst, lengths, strict=True)
        )

    def get_rpc_port(self) -> int:
        return 12345

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        if any(a in self.registered for a in addrs):
            return -7
        self.registered.update(zip(addrs, lengths, strict=True))
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        if any(a not in self.registered for a in addrs):
            return -3
        for a in addrs:
            del self.registered[a]
        return 0

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        with self._cv:
            self.active += 1
            self.entered += 1
            self.max_active = max(self.max_active, self.active)
            self.batch_sizes.append(len(src))
            self.bytes_per_call.append(sum(lengths))
            self.targets.append(target)
            self.dst_blocks.append((dst, lengths))
            self._cv.notify_all()
        try:
            if self.hang is not None:
                self.hang.wait()
            with self._cv:
                outcome = self._script.popleft() if self._script else self.rc
            if isinstance(outcome, BaseException):
                raise outcome
            if len(src) > self.max_blocks:
                return -1
            if outcome != 0:
                return outcome
            for s, d, n in zip(src, dst, lengths, strict=True):
                ctypes.memmove(d, s, n)
            return 0
        finally:
            with self._cv:
                self.active -= 1
                self.returned += 1
                self._cv.notify_all()


def threads_named(prefix: str) -> int:
    """Live threads whose name starts with `prefix`."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def wait_until(ready: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll `ready()` until true (for facts no event announces, such as a thread exiting)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)
