"""An arena: one registered region handed out in extents, with waiting, as credits.

Used on both sides of a landed handoff: the decode's landing arena (each extent a window a
prefill stage may write one segment into) and a prefill's staging buffer (each extent holds one
packed segment until its transfer ended). Extents are first-fit over a sorted free list and
coalesce when given back; a taker that does not fit waits in FIFO order (the head is served
first, so a large request is not starved by small ones), bounded by its deadline. Extents of an
owner that ended without its writers confirmed stopped are *quarantined* until a given instant
before they are free again: a late write then rarely hits a reused window, and when it does the
window's digest catches it (`docs/concepts/safety.md`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.pipelines.errors import CapacityExceeded


@dataclass(frozen=True, slots=True)
class Extent:
    """`length` bytes at `offset` in the arena, taken by `owner`."""

    offset: int
    length: int
    owner: str


@dataclass
class _Waiter:
    length: int
    owner: str
    future: asyncio.Future[Extent]


@dataclass
class ArenaStats:
    capacity_bytes: int
    used_bytes: int = 0
    quarantined_bytes: int = 0
    waiting: int = 0
    waits: int = 0  # takers that had to wait, ever
    taken: int = 0


@dataclass(frozen=True, slots=True)
class ArenaUse:
    """One arena's use at one instant (`Arena.use`): what metrics and the dashboard read, a
    copy, so a reader never holds the counters the arena keeps changing."""

    arena: str  # its role: `landing` (decode) or `staging` (prefill)
    capacity_bytes: int
    used_bytes: int
    quarantined_bytes: int
    waiting: int  # takers waiting for room now
    waits: int  # takers that had to wait, ever


@dataclass
class Arena:
    """`capacity_bytes` of registered memory at `base_addr`, in units of `unit_bytes`."""

    base_addr: int
    capacity_bytes: int
    unit_bytes: int = 4096
    monotonic: Callable[[], float] = time.monotonic
    _free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted
    _taken: dict[int, Extent] = field(default_factory=dict)  # by offset
    # The same extents by owner (insertion order): `owned_by` is asked per handoff, and a scan
    # of every extent taken grew with the windows in flight (3% of a loaded decode's loop).
    _by_owner: dict[str, dict[int, Extent]] = field(default_factory=dict)
    _quarantine: dict[int, float] = field(default_factory=dict)  # offset -> free again at
    # Whose use each taken extent counts towards (`tag`) and the bytes each tag holds: a share
    # is checked per window asked for, and a scan of every extent taken grew with the windows
    # in flight (4% of a decode's loop at PP=4).
    _tags: dict[int, str] = field(default_factory=dict)  # offset -> tag of the extent there
    _tag_bytes: dict[str, int] = field(default_factory=dict)
    _waiters: deque[_Waiter] = field(default_factory=deque)
    _timer: asyncio.TimerHandle | None = None
    _freed: asyncio.Event | None = None  # set (and dropped) at the next give-back
    stats: ArenaStats = field(init=False)

    def __post_init__(self) -> None:
        usable = self.capacity_bytes // self.unit_bytes * self.unit_bytes
        if usable <= 0:
            raise ValueError(f"an arena needs at least {self.unit_bytes} bytes")
        self.capacity_bytes = usable
        self._free = [(0, usable)]
        self.stats = ArenaStats(capacity_bytes=usable)

    def use(self, name: str) -> ArenaUse:
        st = self.stats
        return ArenaUse(
            name, st.capacity_bytes, st.used_bytes, st.quarantined_bytes, st.waiting, st.waits
        )

    def rounded(self, length: int) -> int:
        return -(-length // self.unit_bytes) * self.unit_bytes

    def addr(self, extent: Extent) -> int:
        return self.base_addr + extent.offset

    def try_take(self, length: int, owner: str) -> Extent | None:
        """An extent of at least `length` bytes now, or None (nobody waiting ahead of it)."""
        if self._waiters:
            return None  # FIFO: those already waiting go first
        return self._take_free(self.rounded(length), owner)

    async def take(self, length: int, owner: str, *, until_mono: float) -> Extent:
        """An extent of at least `length` bytes, waiting (FIFO) while the arena is full; raises
        TimeoutError at `until_mono` (on `monotonic`'s clock) and CapacityExceeded at once for a
        request the whole arena could never hold."""
        size = self.rounded(length)
        if size > self.capacity_bytes:
            raise CapacityExceeded(
                f"{length} bytes do not fit an arena of {self.capacity_bytes} bytes",
                field="landing_bytes",
            )
        got = self.try_take(length, owner)
        if got is not None:
            return got
        loop = asyncio.get_running_loop()
        waiter = _Waiter(size, owner, loop.create_future())
        self._waiters.append(waiter)
        self.stats.waits += 1
        self.stats.waiting = len(self._waiters)
        try:
            async with asyncio.timeout(max(0.0, until_mono - self.monotonic())):
                return await asyncio.shield(waiter.future)
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.give_back(waiter.future.result())  # served as we gave up: not lost
            else:
                waiter.future.cancel()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.stats.waiting = len(self._waiters)
            self._serve()

    def give_back(self, extent: Extent) -> None:
        """Free `extent` now (its writer is done with it). Unknown extents are ignored, and so
        is a stale one: the very extent taken, not another taken since at its offset (a caller
        holding an old extent must not free the window its next owner writes)."""
        if not self.holds(extent):
            return
        taken = self._taken.pop(extent.offset)
        owned = self._by_owner.get(taken.owner)
        if owned is not None:
            owned.pop(taken.offset, None)
            if not owned:
                del self._by_owner[taken.owner]
        if self._quarantine.pop(extent.offset, None) is not None:
            self.stats.quarantined_bytes -= extent.length
        tag = self._tags.pop(extent.offset, None)
        if tag is not None:
            left = self._tag_bytes[tag] - extent.length
            if left:
                self._tag_bytes[tag] = left
            else:
                del self._tag_bytes[tag]
        self.stats.used_bytes -= extent.length
        self._insert_free(extent.offset, extent.length)
        if self._freed is not None:
            self._freed.set()
            self._freed = None
        self._serve()

    async def freed(self, until_mono: float) -> bool:
        """Wait until some extent is given back (True) or `until_mono` passes (False): for a
        taker whose own limit, not the free list, keeps it waiting."""
        if self._freed is None:
            self._freed = asyncio.Event()
        event = self._freed
        try:
            async with asyncio.timeout(max(0.0, until_mono - self.monotonic())):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def holds(self, extent: Extent) -> bool:
        """Whether `extent` itself is taken now (not given back, even if its offset was taken
        again since)."""
        return self._taken.get(extent.offset) is extent

    def tag(self, extent: Extent, tag: str) -> None:
        """Count `extent` (taken now, untagged) towards `tag` until it is given back, quarantine
        included (the decode's landing: the prefill peer a window was granted to)."""
        if self.holds(extent) and extent.offset not in self._tags:
            self._tags[extent.offset] = tag
            self._tag_bytes[tag] = self._tag_bytes.get(tag, 0) + extent.length

    def tagged_bytes(self, tag: str) -> int:
        """Bytes of the extents tagged `tag` that are taken now (quarantined ones included)."""
        return self._tag_bytes.get(tag, 0)

    def taken(self) -> list[Extent]:
        """Every extent taken now (quarantined ones included)."""
        return list(self._taken.values())

    def owned_by(self, owner: str) -> list[Extent]:
        return list(self._by_owner.get(owner, {}).values())

    def give_back_owner(self, owner: str) -> None:
        for extent in self.owned_by(owner):
            self.give_back(extent)

    def quarantine(self, extent: Extent, until_mono: float) -> None:
        """Keep `extent` taken until `until_mono`, then free it (a writer may still write it)."""
        if not self.holds(extent):
            return  # unknown, or stale: another owner's window now (`give_back`)
        if extent.offset not in self._quarantine:
            self.stats.quarantined_bytes += extent.length
        self._quarantine[extent.offset] = until_mono
        self._arm()

    def quarantine_owner(self, owner: str, until_mono: float) -> int:
        """Quarantine every extent `owner` still holds; returns how many."""
        held = self.owned_by(owner)
        for extent in held:
            self.quarantine(extent, until_mono)
        return len(held)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for w in self._waiters:
            w.future.cancel()

    # ----------------------------------------------------------------- internals

    def _take_free(self, size: int, owner: str) -> Extent | None:
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                extent = Extent(offset, size, owner)
                self._taken[offset] = extent
                self._by_owner.setdefault(owner, {})[offset] = extent
                self.stats.used_bytes += size
                self.stats.taken += 1
                return extent
        return None

    def _insert_free(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (offset, 0))
        # Coalesce with the neighbour after, then before.
        if i < len(self._free) and self._free[i][0] == offset + length:
            length += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, length))

    def _serve(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            extent = self._take_free(head.length, head.owner)
            if extent is None:
                return
            self._waiters.popleft()
            head.future.set_result(extent)
        self.stats.waiting = len(self._waiters)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        finite = [u for u in self._quarantine.values() if u != float("inf")]
        if not finite:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, min(finite) - self.monotonic())
        self._timer = loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self.monotonic()
        for offset, until in list(self._quarantine.items()):
            extent = self._taken.get(offset)
            if until <= now and extent is not None:
                self.give_back(extent)
        self._arm()
