"""One pass over a segment's bytes: the prefill's gather and the decode's commit, chunk by chunk.

A segment is cut into chunks of whole items (`chunks`), each at most `CHUNK_BYTES` (an item
larger than that is a chunk of its own), so a chunk stays in the core's cache while it is
digested and copied on:

- the prefill (`gather_digest`): gather the chunk's pieces from its own pages into a private
  chunk, feed the digest that chunk, copy it into the segment's staging extent;
- the decode (`scatter_digest`): scatter the chunk from the landed window into the handoff's
  pages, then feed the digest *those pages*, while they are still in cache.

The prefill's digest is of a private chunk, and the decode's of its own pages: neither is of
registered memory, so a write landing in the staging buffer or the window changes what is
sent or landed, never what the digest vouches for. The decode's pages are not registered, are
leased to this handoff and their cells are claimed by this one commit: between the scatter and
the digest nothing else writes them, so the digest is of what the engine will read. A window
changed during the commit changes what lands, and then the pages' digest differs from the
sender's (SAFETY.md S1; the cells stay uncommitted, the pages dirty, and the stage cannot
arrive on them: S4). Each landed byte is read from the window once and from the pages once,
both in cache: no copy out of the window into a private chunk.

Device memory (CUDA, NPU) is one chunk per segment: its copies are not cache-bound, and a
chunk costs a stream synchronisation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvhandoff.pipelines.digest import Digester
from kvhandoff.pipelines.packing import (
    Pieces,
    Side,
    copy_out,
    gather,
    piece_bytes,
    piece_views,
    runs,
    scatter_views,
    settle,
)
from kvhandoff.pipelines.pairing import Pairing

#: A chunk's bytes: small enough that the private chunk is still in cache when it is digested
#: and scattered, large enough that the per-chunk work (its pieces, a view per piece) is small
#: beside the copy. 1-2 MiB measured fastest of 64 KiB-4 MiB on the development machine (2 MiB
#: L2 and 32 MiB L3 in all; below 256 KiB the per-chunk work dominates): `kvhandoff bench
#: handoff --cases commit,gather`.
CHUNK_BYTES = 1 << 20


def chunk_bytes_for(buf: Any) -> int:
    """The chunk size for a segment in `buf`'s memory: `CHUNK_BYTES` on the host, a whole
    segment on a device."""
    on_host = isinstance(buf, np.ndarray) or buf.device.type == "cpu"
    return CHUNK_BYTES if on_host else 1 << 62


def chunks(pairing: Pairing, pieces: Pieces, chunk_bytes: int) -> Iterator[tuple[int, int, Pieces]]:
    """The segment `pieces` as consecutive chunks of whole items: (offset in the packed
    segment, bytes, the chunk's own pieces), in packed order."""
    items = pairing.row_item_len[pieces.rows].tolist()
    rows: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    offset = size = 0
    for row, start, end, item in zip(
        pieces.rows.tolist(), pieces.starts.tolist(), pieces.ends.tolist(), items
    ):
        while start < end:
            take = min(end - start, (chunk_bytes - size) // item)
            if take <= 0:
                if size:  # the chunk is full: the next item starts the next one
                    yield offset, size, Pieces.of(rows, starts, ends)
                    offset, size, rows, starts, ends = offset + size, 0, [], [], []
                    continue
                take = 1  # an item larger than a chunk is a chunk of its own
            rows.append(row)
            starts.append(start)
            ends.append(start + take)
            size += take * item
            start += take
    if size:
        yield offset, size, Pieces.of(rows, starts, ends)


class Scratch:
    """Per-thread private chunk buffers (unregistered: no transfer-engine client reaches them),
    on the memory's device, grown to the largest chunk asked for and reused: one pass runs
    start to end in one thread, and a fresh buffer per segment costs a page fault per page."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, like: Any, nbytes: int) -> Any:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < nbytes:
            size = max(nbytes, CHUNK_BYTES)
            buf = np.empty(size, np.uint8) if isinstance(like, np.ndarray) else like.new_empty(size)
            self._local.buf = buf
        return buf


def gather_digest(
    pairing: Pairing,
    src: Side,
    pieces: Pieces,
    packed: Any,
    digester: Digester,
    scratch: Scratch,
) -> str:
    """Gather `pieces` into `packed` (their staging extent) chunk by chunk through a private
    chunk, digesting each private chunk: the digest is of what this process read from its own
    pages, whatever a transfer-engine client writes into the registered staging buffer."""
    step = chunk_bytes_for(packed)
    total = int(piece_bytes(pairing, pieces).sum())
    # A segment that fits one chunk is that chunk, pieces and all (what `chunks` would yield,
    # without cutting it piece by piece in Python): the common small segment.
    parts = [(0, total, pieces)] if total <= step else chunks(pairing, pieces, step)
    try:
        for offset, nbytes, part in parts:
            private = scratch.get(packed, nbytes)[:nbytes]
            gather(pairing, src, part, private)
            digester.update(private)
            copy_out(private, 0, nbytes, packed[offset : offset + nbytes])
    finally:
        settle(packed)  # the transport reads the extent through its own engine
    return digester.hexdigest()


def scatter_digest(
    window: Any,
    offset: int,
    pairing: Pairing,
    dst: Side,
    pieces: Pieces,
    digester: Digester,
    nbytes: int | None = None,
) -> str:
    """Commit the segment landed at `window[offset:]` into `dst` chunk by chunk: scatter the
    chunk from the window into the pages, then digest *those pages* (still in cache), in the
    segment's packed order. Returns the digest of what the pages hold; the caller counts the
    pieces only if it matches (SAFETY.md S1). Every chunk is scattered whatever the digest
    turns out to be. `nbytes`, the segment's checked size (`check_pieces`), when known: a
    segment of one chunk is then committed as it is, not cut first (most control-plane
    segments are a page or two, where cutting costs more than the copy)."""
    step = chunk_bytes_for(window)
    if nbytes is not None and nbytes <= step:
        parts: Iterable[tuple[int, int, Pieces]] = ((0, nbytes, pieces),)  # what `chunks` cuts
    else:
        parts = chunks(pairing, pieces, step)
    for at, size, part in parts:
        landed = window[offset + at : offset + at + size]
        # The chunk's views, made once for both steps (views: nothing is read yet). Every
        # piece of the chunk is scattered before any page is digested, so a cell two pieces
        # name is digested as the pages finally hold it.
        views = list(piece_views(pairing, dst, part, landed))
        scatter_views(views)
        _digest_views(views, digester)
    return digester.hexdigest()


def _digest_views(views: Iterable[tuple[Any, Any, Any]], digester: Digester) -> None:
    """Feed `digester` the pages and slots of `piece_views`, in packed order. On the host, runs
    of consecutive pages are fed as one view, nothing copied; on a device each piece's rows
    are gathered first (one kernel, not one per page)."""
    for rows, idx, _ in views:
        if not isinstance(rows, np.ndarray):  # the device path (torch kernels)
            digester.update(rows.index_select(0, idx).reshape(-1))
            continue
        for first, last in runs(idx.tolist()):
            digester.update(rows[first : last + 1].reshape(-1))
