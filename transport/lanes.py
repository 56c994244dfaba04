"""The per-write, per-batch and per-peer state of `kvhandoff.transport.mooncake`'s write path.

Data, plus the one derived fact a lane answers (`PeerLane.stuck`) and the admission rule of its
in-flight bound (`InflightBound`, loop only). `MooncakeTransport` is the only user; its module
docstring states the rules this state serves, and which code (and lock) writes each field is said
field by field here.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.errors import TransportError


class Write:
    """What the batches of one `write` call share: whether that write has given up.

    Set on the loop when the write is cancelled or one of its batches timed out, and by the
    worker when one of its batches failed; read by the worker, under the lane lock, right before
    an engine call. It decides only this write's batches that have not started (they fail with
    their own error); it never changes the outcome of a batch that started.
    """

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class Batch:
    """One submitted batch of a write (several may share one engine call).

    `outcome` is the batch's one result: `None` (every byte landed) or its own `TransportError`.
    It is written once, by whoever takes the batch off its lane's queue — the worker thread
    (after the engine call, or when it drops the batch before one), or the loop under the lane
    lock (the lane got stuck, or the transport closed) — and read once, on the loop, by
    `MooncakeTransport._settle`, which hands it to `verdict`. `verdict` is what the write awaits:
    the outcome, or a `TransportTimeout` if the batch's call outlived `transfer_timeout_s`
    first. It carries errors as values, so nothing but the caller's own cancellation can make
    `write` raise `CancelledError`.
    """

    __slots__ = ("blocks", "call", "outcome", "slot_held", "start_by", "timer", "verdict", "write")

    def __init__(
        self,
        blocks: Blocks,
        write: Write,
        verdict: asyncio.Future[TransportError | None],
        start_by: float | None,
    ) -> None:
        self.blocks = blocks
        self.write = write
        self.verdict = verdict
        self.start_by = start_by
        self.outcome: TransportError | None = None
        #: Id of the engine call that carries it (0 until one starts; set under the lane lock).
        self.call = 0
        self.timer: asyncio.TimerHandle | None = None
        self.slot_held = True


class InflightBound:
    """Loop only: how many batches, and how many bytes, one peer has submitted and not settled.

    A batch is admitted while fewer than `max_batches` are in flight and its bytes fit under
    `max_bytes` beside theirs; one batch larger than `max_bytes` is admitted alone (nothing else
    in flight), so no batch size is refused. Waiters are served first come, first served: a
    large batch waiting for room is not overtaken by a stream of small ones, and a small one
    behind it waits at most for the bytes ahead of it (the byte bound is what keeps that short).
    """

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.batches = 0
        self.bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, nbytes: int) -> bool:
        if self.batches >= self.max_batches:
            return False
        return self.batches == 0 or self.bytes + nbytes <= self.max_bytes

    async def acquire(self, nbytes: int) -> None:
        """Wait until a batch of `nbytes` may be submitted, and count it in flight."""
        if not self._waiters and self._fits(nbytes):
            self.batches += 1
            self.bytes += nbytes
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(nbytes)  # admitted, then cancelled before it ran: give it back
            else:
                with contextlib.suppress(ValueError):  # `_admit` may have dropped it already
                    self._waiters.remove((nbytes, fut))
                self._admit()  # it may have been the head that held the others back
            raise

    def release(self, nbytes: int) -> None:
        """A batch of `nbytes` settled (or gave its room back): admit the waiters that fit now."""
        self.batches -= 1
        self.bytes -= nbytes
        self._admit()

    def _admit(self) -> None:
        while self._waiters:
            nbytes, fut = self._waiters[0]
            if fut.done():  # cancelled; its task has not run its handler yet
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self.batches += 1
            self.bytes += nbytes
            fut.set_result(None)


class PeerLane:
    """One peer's queue, in-flight bound and call accounting.

    The lock guards `pending`, `scheduled`, `calls_started`, `calls_ended`, `in_call`,
    `orphans` and each batch's `call`; the rest is touched on the loop only.
    """

    def __init__(self, peer: str, max_batches: int, max_bytes: int) -> None:
        self.peer = peer
        self.lock = threading.Lock()
        #: Loop only: batches submitted and not settled, by count and bytes.
        self.bound = InflightBound(max_batches, max_bytes)
        #: Batches submitted and not yet taken by a worker, oldest first. The worker merges
        #: those that fit into one engine call (see `MooncakeTransport._take`).
        self.pending: deque[Batch] = deque()
        #: A drain task for this lane is queued or running (at most one: one call per peer).
        self.scheduled = False
        self.calls_started = 0
        self.calls_ended = 0
        #: Id of the engine call running now, 0 if none.
        self.in_call = 0
        #: Id of a call that outlived `transfer_timeout_s`; the lane is stuck while it runs.
        self.stuck_call = 0
        #: Engine batch ids of polled calls that gave up while they still ran (the engine
        #: cannot cancel a write); each leaves once it reports an end. The lane is stuck, and
        #: `quiesce` waits, while any is here.
        self.orphans: set[int] = set()
        #: Loop only: the next check of `orphans`.
        self.orphan_timer: asyncio.TimerHandle | None = None
        #: Loop only: batches submitted and not settled; `quiesce` waiters (calls_started
        #: target, future); the timer that reclaims the lane once idle.
        self.inflight = 0
        #: Loop only: `write` calls using this lane now (it is not reclaimed under them).
        self.users = 0
        self.quiescers: list[tuple[int, asyncio.Future[None]]] = []
        self.reaper: asyncio.TimerHandle | None = None

    def stuck(self) -> bool:
        """A call that timed out is still inside the engine, or one of its batches still runs
        there after it gave up (the truth, not a cached flag)."""
        with self.lock:
            return (self.stuck_call != 0 and self.in_call == self.stuck_call) or bool(self.orphans)


class Counters:
    """The cumulative counters behind `stats()`; updated on the loop and by workers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submitted = self.succeeded = self.failed = self.timed_out = 0
        self.bytes = self.blocks = self.calls = self.exceptions = 0
        self.by_rc: dict[int, int] = {}
