"""Transfer blocks: the only thing the transport is asked to move.

A `Blocks` value is three parallel numpy arrays (uint64): source address, destination address
and length in bytes. The planner in `pipelines` builds them; transports consume them, splitting
them into batches no larger than what the engine accepts. Nothing here knows about layers or
requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

#: Mooncake's TCP transport rejects a batch above about 2,100 requests to one peer with default
#: settings (and then often cannot reach that peer again), so batches stay at or below this.
DEFAULT_MAX_BLOCKS_PER_BATCH = 2048


@dataclass(frozen=True, slots=True)
class Blocks:
    """Parallel arrays of (src_addr, dst_addr, length_bytes); all uint64, all the same length."""

    src_addr: U64
    dst_addr: U64
    length: U64

    def __post_init__(self) -> None:
        n = self.src_addr.shape[0]
        if self.dst_addr.shape != (n,) or self.length.shape != (n,) or self.src_addr.ndim != 1:
            raise ValueError("Blocks arrays must be one-dimensional and of equal length")

    @staticmethod
    def empty() -> Blocks:
        z = np.zeros(0, dtype=np.uint64)
        return Blocks(z, z, z)

    @staticmethod
    def of(src_addr: object, dst_addr: object, length: object) -> Blocks:
        """Build from any array-likes, converting to contiguous uint64."""
        return Blocks(
            np.ascontiguousarray(src_addr, dtype=np.uint64),
            np.ascontiguousarray(dst_addr, dtype=np.uint64),
            np.ascontiguousarray(length, dtype=np.uint64),
        )

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        if not parts:
            return Blocks.empty()
        return Blocks(
            np.concatenate([p.src_addr for p in parts]),
            np.concatenate([p.dst_addr for p in parts]),
            np.concatenate([p.length for p in parts]),
        )

    def __len__(self) -> int:
        return int(self.src_addr.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=np.uint64))

    def __getitem__(self, index: slice) -> Blocks:
        return Blocks(self.src_addr[index], self.dst_addr[index], self.length[index])

    def split(self, max_bytes: int) -> Blocks:
        """The same bytes, with every block longer than `max_bytes` cut into consecutive pieces
        of at most `max_bytes` (`self` itself when none is)."""
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if len(self) == 0 or int(self.length.max()) <= max_bytes:
            return self
        cap = np.uint64(max_bytes)
        pieces = np.maximum((self.length + cap - np.uint64(1)) // cap, np.uint64(1))
        owner = np.repeat(np.arange(len(self)), pieces.astype(np.int64))
        # Index of each piece within its block: 0, 1, ... restarting at every block.
        first = np.cumsum(pieces) - pieces
        k = np.arange(owner.shape[0], dtype=np.uint64) - first[owner]
        offset = k * cap
        length = np.minimum(self.length[owner] - offset, cap)
        return Blocks(self.src_addr[owner] + offset, self.dst_addr[owner] + offset, length)

    def batches(
        self, max_blocks: int = DEFAULT_MAX_BLOCKS_PER_BATCH, max_bytes: int | None = None
    ) -> Iterator[Blocks]:
        """Yield consecutive batches of at most `max_blocks` blocks and `max_bytes` bytes.

        Without `max_bytes` the batches are views; with it, blocks longer than `max_bytes` are
        first cut (`split`) and each batch is the longest run of whole blocks under both caps.
        """
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        if max_bytes is None:
            for start in range(0, len(self), max_blocks):
                yield self[start : start + max_blocks]
            return
        if 0 < len(self) <= min(max_blocks, 8) and sum(self.length.tolist()) <= max_bytes:
            # One batch (no block is longer than the cap either): what the loop below yields,
            # without its numpy calls (a segment's one block, every handoff).
            yield self
            return
        blocks = self.split(max_bytes)
        ends = np.cumsum(blocks.length, dtype=np.uint64)  # bytes up to and including block i
        start, n, before = 0, len(blocks), 0
        while start < n:
            fit = int(np.searchsorted(ends, before + max_bytes, side="right"))
            stop = min(start + max_blocks, max(fit, start + 1))
            yield blocks[start:stop]
            before = int(ends[stop - 1])
            start = stop
