"""What each stage of a landed handoff has committed, cell by cell: the record S4 is decided on.

A cell is one (pairing row, request page position) of a stage's destination: a KV page of one
entry, or a slot row (a state slot or an aux row, position 0). `Landing.commit` claims a
segment's cells before it writes them (`claim`: a cell already claimed or committed is refused,
so no two commits write one cell) and keeps them only when the segment's digest matched; on a
refusal they go back to uncommitted (`refuse`), and the stage cannot arrive until another
commit's matching digest covers them (`complete`). Owned by `Landing` (`decode/landing.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.arena import Extent
from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.messages import RESENDS_PER_SEGMENT
from kvhandoff.pipelines.packing import SMALL_PIECES, Pieces
from kvhandoff.pipelines.pairing import Pairing

I64 = npt.NDArray[np.int64]
Cells = tuple[I64, I64]
#: Up to this many cells (and `SMALL_PIECES` pieces) a segment's cells are listed in Python.
SMALL_CELLS = 64


@dataclass
class StageLanding:
    """What one stage of a handoff has landed and committed."""

    pairing: Pairing
    expected: int  # bytes the stage moves in all
    covered: npt.NDArray[np.bool_]  # [row, page position]: committed, or being committed
    refused: npt.NDArray[np.uint8]  # [row, page position]: refusals of the pieces covering it
    peer: str  # the prefill service that sends it
    committed: int = 0
    # Its prefill named it (a window request or a notice): it has the destination, and may
    # write any window granted to it until it says it stopped.
    heard: bool = False
    grants: dict[int, Extent] = field(default_factory=dict)  # grant id -> its window

    @classmethod
    def of(cls, pairing: Pairing, num_pages: int, peer: str) -> StageLanding:
        """A stage of `num_pages` pages (its slot rows validated: every one has its index)."""
        expected = pairing.kv_bytes_per_page * num_pages + pairing.slot_bytes
        k, rows = pairing.num_kv_pairs, pairing.num_kv_pairs + pairing.num_slot_rows
        # True where nothing is to be sent; each cell to send turns True once committed.
        covered = np.ones((rows, max(num_pages, 1)), dtype=np.bool_)
        covered[:k, :num_pages] = False
        covered[k:, 0] = False  # a slot row has one position: its index
        refused = np.zeros(covered.shape, dtype=np.uint8)
        return cls(pairing, expected, covered, refused, peer)

    @property
    def largest_item(self) -> int:
        p = self.pairing
        return max(int(p.kv_item_len.max(initial=0)), int(p.slot_item_len.max(initial=0)))

    def claim(self, pieces: Pieces, rank: int) -> Cells:
        """The cells of `pieces`, claimed for one commit; raises ConflictError, claiming
        nothing, when any is committed or being committed."""
        cells = piece_cells(self.pairing, pieces)
        if self.covered[cells].any():
            raise ConflictError(
                f"the segment repeats pages of stage {rank} already committed",
                field="rows",
                pp_rank=rank,
            )
        self.covered[cells] = True
        return cells

    def release(self, cells: Cells) -> None:
        """The commit of `cells` did not match (or did not finish): their pages may hold its
        bytes (written in one pass before the digest was final), but they are not committed."""
        self.covered[cells] = False

    def refuse(self, cells: Cells) -> bool:
        """Count one refusal of `cells`; True once a cell's resends are spent."""
        self.refused[cells] += 1
        return int(self.refused[cells].max()) > RESENDS_PER_SEGMENT

    def complete(self) -> bool:
        """Every cell was committed by a matching digest."""
        return self.committed == self.expected and bool(self.covered.all())


@dataclass
class HandoffLanding:
    """A handoff's stages, and whether a commit of it runs (what `Landing.idle` waits for)."""

    stages: dict[int, StageLanding]
    running: int = 0  # commits in progress
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        self.running += 1
        self.idle.clear()

    def end(self) -> None:
        self.running -= 1
        if self.running == 0:
            self.idle.set()


def piece_cells(pairing: Pairing, pieces: Pieces) -> Cells:
    """The (row, page position) cells of `pieces`, as index arrays into `covered`."""
    if len(pieces) <= SMALL_PIECES:  # a page or two: a loop costs less than numpy's steps
        starts, ends = pieces.starts.tolist(), pieces.ends.tolist()
        if sum(ends) - sum(starts) <= SMALL_CELLS:
            rows_of: list[int] = []
            cols_of: list[int] = []
            for row, start, end in zip(pieces.rows.tolist(), starts, ends):
                rows_of += [row] * (end - start)
                cols_of += range(start, end)
            return np.array(rows_of, dtype=np.int64), np.array(cols_of, dtype=np.int64)
    counts = pieces.ends - pieces.starts
    rows = np.repeat(pieces.rows, counts)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    cols = np.repeat(pieces.starts, counts) + offsets
    return rows, cols
