"""One landed segment staged for its transfer: gathered and digested in one pass into this
process's staging buffer, checked against the window it goes to, and cut into blocks.

Called by the landed sender (`landed.py`) once per segment and per resend. The digest is taken
of the private chunks the gather went through (`pipelines/chunked.py`), never of the staging
buffer: that buffer is registered, and the Mooncake handshake hands its address to any client of
the port. A client writing over it can only make the bytes sent differ from the digest (a
refused segment), never choose both.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvhandoff.pipelines.awaiting import finish
from kvhandoff.pipelines.chunked import Scratch, gather_digest
from kvhandoff.pipelines.digest import Algorithm, Digester
from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.messages import ArenaSpan, Grant
from kvhandoff.pipelines.packing import Pieces, Side
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.transport.blocks import Blocks

#: Segments travel in blocks of this size: Mooncake TCP's throughput peaks near 256 KiB-1 MiB
#: blocks here, and a segment of a few large blocks costs a few per-block overheads, not one
#: per page.
BLOCK_BYTES = 1 << 20
#: Below this many bytes a gather and its digest run on the event loop: a thread hop costs
#: more than the copy.
INLINE_BYTES = 256 * 1024


async def gather_segment(
    pairing: Pairing,
    src: Side,
    pieces: Pieces,
    packed: Any,
    algorithm: Algorithm,
    seed: int,
    scratch: Scratch,
) -> str:
    """Gather `pieces` into `packed` (their staging extent) and return their digest under
    `seed`: on the loop when small, else in a thread (awaited to its end even if cancelled: the
    extent is given back only once nothing writes it)."""
    args = (pairing, src, pieces, packed, Digester(algorithm, seed=seed), scratch)
    if int(packed.shape[0]) <= INLINE_BYTES:
        return gather_digest(*args)
    return await finish(asyncio.to_thread(gather_digest, *args))


def check_grant(grant: Grant, arena: ArenaSpan, rank: int, nbytes: int = 0) -> None:
    """Refuse (naming the grant) a window of another stage, or one not wholly inside the landing
    arena its decode published, or too small for `nbytes`: no destination or answer can make
    this prefill write elsewhere in the decode's memory."""
    end = arena.addr + arena.length
    if grant.pp_rank != rank:
        raise ConflictError(
            f"grant {grant.grant_id} is for stage {grant.pp_rank}, not {rank}",
            field="grants",
            pp_rank=rank,
        )
    if not (arena.addr <= grant.addr and grant.addr + max(grant.length, nbytes) <= end):
        raise ConflictError(
            f"grant {grant.grant_id} ({grant.length} bytes at {grant.addr:#x}) does not lie "
            f"inside the decode's landing arena ({arena.length} bytes at {arena.addr:#x})",
            field="grants",
            pp_rank=rank,
        )
    if nbytes > grant.length:
        raise ConflictError(
            f"grant {grant.grant_id} holds {grant.length} bytes, the segment {nbytes}",
            field="grants",
            pp_rank=rank,
        )


def staged_blocks(src_addr: int, dst_addr: int, nbytes: int) -> Blocks:
    """A staged segment of `nbytes` as `BLOCK_BYTES` blocks from its extent into its window;
    none for an empty one (a zero-length block is no write, and `write` returns at once for
    no blocks)."""
    if nbytes <= 0:
        return Blocks.empty()
    if nbytes <= BLOCK_BYTES:  # one block: no arange/minimum for it
        return Blocks(
            np.array([src_addr], np.uint64),
            np.array([dst_addr], np.uint64),
            np.array([nbytes], np.uint64),
        )
    starts = np.arange(0, nbytes, BLOCK_BYTES, dtype=np.uint64)
    lengths = np.minimum(np.uint64(nbytes) - starts, np.uint64(BLOCK_BYTES))
    return Blocks(starts + np.uint64(src_addr), starts + np.uint64(dst_addr), lengths)
