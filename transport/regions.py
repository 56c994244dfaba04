"""Registered memory regions and the vectorised "does every block lie inside one?" check.

Transports keep one `RegionTable` per side they must police: the local transport checks sources
and destinations (it owns both), the Mooncake transport checks sources, because its TCP transport
happily reads *unregistered* local memory (measured: a write from past the end of a registered
buffer returned rc 0) while the receiving side does reject unregistered destinations.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from kvhandoff.transport.blocks import U64
from kvhandoff.transport.errors import TransportError

#: Block lists up to this long are checked on Python ints (`RegionTable.outside`).
_FEW_BLOCKS = 8


class Region(msgspec.Struct, frozen=True):
    """`length` bytes of memory starting at address `addr`."""

    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length


class RegionTable:
    """A set of non-overlapping regions, kept sorted so a block list is checked with one
    `searchsorted` instead of a Python loop per block."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._starts: U64 = np.zeros(0, dtype=np.uint64)
        self._ends: U64 = np.zeros(0, dtype=np.uint64)
        # The same bounds as Python ints, for a few blocks (see `outside`).
        self._start_list: list[int] = []
        self._end_list: list[int] = []

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, region: object) -> bool:
        return isinstance(region, Region) and self._regions.get(region.addr) == region

    @property
    def regions(self) -> list[Region]:
        return sorted(self._regions.values(), key=lambda r: r.addr)

    def overlapping(self, new: Sequence[Region]) -> Region | None:
        """The first of `new` that overlaps a known region or another of `new`, if any."""
        merged = sorted([*self._regions.values(), *new], key=lambda r: r.addr)
        for prev, cur in itertools.pairwise(merged):
            if cur.addr < prev.end:
                return cur if cur in new else prev
        return None

    def add(self, regions: Iterable[Region]) -> None:
        for r in regions:
            if r.length <= 0 or r.addr <= 0:
                raise TransportError(f"invalid region {r!r}: address and length must be positive")
            self._regions[r.addr] = r
        self._rebuild()

    def remove(self, regions: Iterable[Region]) -> list[Region]:
        """Forget `regions`; returns the ones that were known (the rest are ignored)."""
        gone = [r for r in regions if self._regions.get(r.addr) == r]
        for r in gone:
            del self._regions[r.addr]
        self._rebuild()
        return gone

    def _rebuild(self) -> None:
        ordered = self.regions
        self._starts = np.array([r.addr for r in ordered], dtype=np.uint64)
        self._ends = np.array([r.end for r in ordered], dtype=np.uint64)
        self._start_list = [r.addr for r in ordered]
        self._end_list = [r.end for r in ordered]

    def outside(self, addr: U64, length: U64) -> int | None:
        """Index of the first block `[addr, addr+length)` not inside one region, or None."""
        if addr.shape[0] == 0:
            return None
        if self._starts.shape[0] == 0:
            return 0
        if addr.shape[0] <= _FEW_BLOCKS:
            # A segment's block or two: bisect on Python ints costs less than the numpy calls.
            starts, ends = self._start_list, self._end_list
            for i, (a, n) in enumerate(zip(addr.tolist(), length.tolist())):
                j = bisect.bisect_right(starts, a) - 1
                if j < 0 or a + n > ends[j]:
                    return i
            return None
        idx = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        inside = idx >= 0
        safe = np.maximum(idx, 0)
        end = self._ends[safe]
        inside &= addr >= self._starts[safe]
        # Room left after `addr`, not `addr + length`: that sum wraps in uint64 (a huge length
        # would come back below the end). Where `addr` is past the end the difference wraps
        # too, but `addr <= end` has already refused that block.
        inside &= addr <= end
        inside &= length <= end - addr
        if bool(inside.all()):
            return None
        return int(np.argmin(inside))

    def check(self, addr: U64, length: U64, *, side: str, peer: str | None = None) -> None:
        """Raise `TransportError` naming the first block that leaves every registered region."""
        bad = self.outside(addr, length)
        if bad is not None:
            raise TransportError(
                f"block {bad} {side} [{int(addr[bad]):#x}, +{int(length[bad])}) is not inside "
                f"a registered region",
                peer=peer,
            )
