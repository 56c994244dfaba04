"""Packing: a stage's KV pages, state slots and aux rows as segments of contiguous bytes, and back.

A **segment** is a list of *pieces*: piece i is pairing row `rows[i]` over the request's page
positions `starts[i]:ends[i]` (rows below `num_kv_pairs` are KV pairs; row `num_kv_pairs + j` is
slot row j — a state pair at its component's slot, or an aux pair at the request's aux row —
always positions 0:1, its one index). Packed, piece after piece, each piece's pages
in request order, a segment is `sum(item_len[row] * (end - start))` bytes.

- The prefill **gathers** a segment from its stage memory into a staging buffer (`gather`), one
  local copy per piece, and decides what the next segment holds (`StagePacker`): whatever of
  the ready layers fits the window it was granted.
- The decode **scatters** a landed, digest-checked segment into the handoff's own pages and
  slot (`scatter`); it checks the pieces first (`check_pieces`), so a notice naming rows, pages
  or bytes its destination does not have changes nothing.

Copies run on the memory's own device, one call per piece, never one per page: numpy on host
memory (CPU tensors included, see `HOST_TENSORS_VIA_NUMPY`), torch on a CUDA or NPU pool. An
entry may live on another device than the packed buffer (an engine's host aux rows beside its
device KV): its pieces cross over. `gather` and `scatter` return once a device's copies ran.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pipelines.errors import InvalidInput
from pipelines.pairing import Pairing
from pipelines.planning import slot_indices
from pipelines.slots import SlotsLike, as_slots

I64 = npt.NDArray[np.int64]


class ByteRegions(Protocol):
    def array(self, index: int) -> Any:
        """Region `index` as a 1-D uint8 array on its own device (numpy, or a torch tensor)."""
        ...


@dataclass(frozen=True, slots=True)
class Pieces:
    """One segment's pieces (see the module docstring), as parallel int64 arrays."""

    rows: I64
    starts: I64
    ends: I64

    @staticmethod
    def of(rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> Pieces:
        return Pieces(
            np.asarray(rows, dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
            np.asarray(ends, dtype=np.int64),
        )

    def __len__(self) -> int:
        return int(self.rows.shape[0])


def piece_bytes(pairing: Pairing, pieces: Pieces) -> I64:
    return pairing.row_item_len[pieces.rows] * (pieces.ends - pieces.starts)


def check_pieces(
    pairing: Pairing, pieces: Pieces, num_pages: int, has_slot: bool, *, pp_rank: int
) -> int:
    """The pieces name only rows of this pairing, page positions of this request and the slot
    rows when it has its slots. Returns the segment's byte count; raises InvalidInput naming
    the piece."""
    n = len(pieces)
    if not (pieces.starts.shape[0] == n and pieces.ends.shape[0] == n):
        raise InvalidInput("rows, starts and ends differ in length", field="rows", pp_rank=pp_rank)
    k = pairing.num_kv_pairs
    total_rows = k + pairing.num_slot_rows
    rows, starts, ends = pieces.rows, pieces.starts, pieces.ends
    kv = rows < k
    # One pass for the common case (a sound notice), per segment; the named check on failure.
    sound = (rows >= 0) & (rows < total_rows) & (starts >= 0) & (ends > starts)
    sound &= np.where(kv, ends <= num_pages, has_slot & (starts == 0) & (ends == 1))
    if not sound.all():
        for name, bad in (
            ("rows", (rows < 0) | (rows >= total_rows)),
            ("starts", starts < 0),
            ("ends", ends <= starts),
            ("ends", kv & (ends > num_pages)),
            ("starts", ~kv & ((starts != 0) | (ends != 1))),
            ("rows", ~kv & (not has_slot)),
        ):
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidInput(
                    f"piece {i} (row {int(rows[i])}, pages {int(starts[i])}:"
                    f"{int(ends[i])}) is not part of this stage's destination "
                    f"({k} KV rows x {num_pages} pages, {pairing.num_slot_rows} slot rows)",
                    field=f"{name}[{i}]",
                    pp_rank=pp_rank,
                )
    return int(piece_bytes(pairing, pieces).sum())


def layer_range(pairing: Pairing, rows: Iterable[int]) -> str:
    """The layers `rows` cover, for errors: `"layers 3-9"`, `"layer 4"`, `"layer 4 and aux"`."""
    k = pairing.num_kv_pairs
    ids = {int(pairing.kv_layer[r]) if r < k else int(pairing.slot_layer[r - k]) for r in rows}
    aux = -1 in ids
    layers = sorted(ids - {-1})
    if not layers:
        return "aux rows" if aux else "no layers"
    text = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
    return f"{text} and aux rows" if aux else text


# ------------------------------------------------------------------------- copies


def _is_torch(a: Any) -> bool:
    return not isinstance(a, np.ndarray)


#: Host memory goes through numpy even when it comes as a CPU tensor (a torch pool on `cpu`,
#: an embedded engine's tensors): numpy's row copies run ~10x faster than torch's CPU index
#: kernels (`index_copy_` 0.34 GB/s, numpy 4.5 GB/s at 36 KiB rows here) and a small torch copy
#: pays for its thread pool. Tests turn it off to run the device path's torch kernels on CPU
#: tensors, since no GPU runs in CI.
HOST_TENSORS_VIA_NUMPY = True


def _host(a: Any) -> Any:
    """`a` as a numpy view when it is host memory that copies through numpy, else None."""
    if isinstance(a, np.ndarray):
        return a
    if HOST_TENSORS_VIA_NUMPY and a.device.type == "cpu":
        return a.numpy()
    return None


def _common(*arrays: Any) -> list[Any]:
    """All torch, for the device path (a numpy array beside a tensor is wrapped, no copy)."""
    import torch

    return [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in arrays]


def _rows_of(region: Any, item: int) -> Any:
    usable = region.shape[0] // item * item
    return (
        region[:usable].reshape(-1, item)
        if not _is_torch(region)
        else region[:usable].view(-1, item)
    )


def _index(idx: I64, like: Any) -> Any:
    if not _is_torch(like):
        return idx
    import torch

    return torch.from_numpy(np.ascontiguousarray(idx)).to(like.device)


@dataclass(frozen=True)
class Side:
    """One side's memory for a pairing: the regions of its entries, its pages and the index
    each slot row moves (its component's slot or the aux row; zeros while not known yet)."""

    memory: ByteRegions
    pages: I64
    slots: I64  # slot row -> index in its entry
    kv_index: I64  # pairing row -> region index of the KV entry on this side
    slot_region: I64  # slot row -> region index of the state or aux entry on this side


def _indices(pairing: Pairing, slots: SlotsLike, side: str) -> I64:
    if as_slots(slots).empty:
        return np.zeros(pairing.num_slot_rows, dtype=np.int64)  # no slot row is cut yet
    return slot_indices(pairing, slots, side)


def source_side(pairing: Pairing, memory: ByteRegions, pages: I64, slots: SlotsLike) -> Side:
    indices = _indices(pairing, slots, "source")
    return Side(memory, pages, indices, pairing.kv_src_index, pairing.slot_src_region)


def destination_side(pairing: Pairing, memory: ByteRegions, pages: I64, slots: SlotsLike) -> Side:
    indices = _indices(pairing, slots, "destination")
    return Side(memory, pages, indices, pairing.kv_dst_index, pairing.slot_dst_region)


def piece_views(
    pairing: Pairing, side: Side, pieces: Pieces, packed: Any
) -> Iterable[tuple[Any, Any, Any]]:
    """Per piece: (this side's rows of the entry, the row indices, the packed bytes as rows),
    numpy views for host memory, torch tensors on a device. Per-piece work is kept to a few
    views: a demo-sized segment is dozens of pieces of a few KiB each."""
    item = pairing.row_item_len.tolist()
    k = pairing.num_kv_pairs
    kv_index, slot_region = side.kv_index.tolist(), side.slot_region.tolist()
    packed_host = _host(packed)
    off = 0
    for row, start, end in zip(pieces.rows.tolist(), pieces.starts.tolist(), pieces.ends.tolist()):
        length = item[row]
        count = end - start
        if row < k:
            region = side.memory.array(kv_index[row])
            idx = side.pages[start:end]
        else:
            region = side.memory.array(slot_region[row - k])
            idx = side.slots[row - k : row - k + 1]
        nbytes = count * length
        region_host = _host(region) if packed_host is not None else None
        if region_host is not None:
            usable = region_host.shape[0] // length * length
            yield (
                region_host[:usable].reshape(-1, length),
                idx,
                packed_host[off : off + nbytes].reshape(-1, length),
            )
        else:
            region, chunk = _common(region, packed[off : off + nbytes])
            rows = _rows_of(region, length)
            yield rows, _index(idx, rows), _rows_of(chunk, length)
        off += nbytes


def gather(pairing: Pairing, src: Side, pieces: Pieces, packed: Any) -> None:
    """Copy the pieces from the source entries into `packed` (1-D uint8, at least the
    segment's bytes long), piece after piece; on a device, returns once the copies are done
    (also when a piece raised: no copy queued before it may still run)."""
    try:
        for rows, idx, out in piece_views(pairing, src, pieces, packed):
            if _is_torch(rows):
                import torch

                if rows.device == out.device:
                    torch.index_select(rows, 0, idx, out=out)
                else:  # an engine's host rows (SGLang's aux) into a device staging buffer
                    out.copy_(torch.index_select(rows, 0, idx))
            else:
                # mode="clip": the pages were validated against every pool before any segment
                # over them was cut (by page range: each range when it was signalled), and the
                # default ("raise") buffers the output, copying every byte twice.
                np.take(rows, idx, axis=0, out=out, mode="clip")
    finally:
        settle(packed)


def scatter(pairing: Pairing, dst: Side, pieces: Pieces, packed: Any) -> None:
    """Copy `packed` into the destination entries' pages and slot the pieces name; on a
    device, returns once the copies are done (also when a piece raised: a lease released after
    a failed commit must find no copy still writing its pages)."""
    touched: dict[str, Any] = {}
    try:
        for rows, idx, data in piece_views(pairing, dst, pieces, packed):
            if _is_torch(rows):
                touched.setdefault(str(rows.device), rows)
                # A device snapshot into an engine's host rows (SGLang's aux) crosses devices.
                moved = data if data.device == rows.device else data.to(rows.device)
                rows.index_copy_(0, idx, moved)
            else:
                rows[idx] = data
    finally:
        for rows in touched.values():
            settle(rows)


def settle(tensor: Any) -> None:
    """Wait until the copies this thread queued on `tensor`'s device have run.

    Torch queues device copies on the thread's current stream and returns at once. The engine
    reads the pages on streams of its own, and the transport reads a staging buffer through
    its own engine: neither is ordered after this thread's stream. So a commit is only a
    commit, and a staged segment only sendable, once its copies have run.
    """
    if not _is_torch(tensor) or tensor.device.type == "cpu":
        return
    import torch

    torch.get_device_module(tensor.device).current_stream(tensor.device).synchronize()


def copy_out(region: Any, offset: int, length: int, scratch: Any = None) -> Any:
    """A private copy of `length` bytes of `region` at `offset`, on its device: what the decode
    digests and commits, so a write landing in the window meanwhile cannot reach the pages.
    Into `scratch` (a buffer of at least `length` bytes on the same device) when given: a fresh
    buffer per commit costs a page fault per page, more than the copy itself."""
    part = region[offset : offset + length]
    if scratch is None:
        return part.copy() if not _is_torch(part) else part.clone()
    out = scratch[:length]
    part_host, out_host = _host(part), _host(out)
    if part_host is not None and out_host is not None:
        # Not torch's `copy_` on host tensors: below ~1 MiB its thread pool's wake-up costs
        # more than the copy (8 ms for 189 KiB on a busy 2-core machine, numpy ~20 us).
        np.copyto(out_host, part_host)
    elif _is_torch(out):
        out.copy_(part if _is_torch(part) else _common(part)[0])
    else:
        np.copyto(out, part.cpu().numpy())
    return out


# ------------------------------------------------------------------------- the prefill's plan


@dataclass
class StagePacker:
    """What of one stage is still to be packed, cell by cell: each row's page positions
    `[0, ready_end)` are ready, `[0, next)` already packed. `next_segment(budget)` takes as much
    of the ready cells as fits, rows in the order they became ready.

    Readiness comes two ways, never mixed in one stage (the pipeline refuses it):

    - by layer (`make_ready`): a row becomes ready over all its pages at once;
    - by page range (`ranged=True`, `make_pages_ready`): the request's pages up to a position
      become ready for every KV row; the slot rows (state slots, aux rows) only with the last
      range.

    Aux rows belong to no layer: by layer, they become ready once every layer's rows are.

    Pieces stay (row, start, end) over request page positions either way, so the decode's
    checks and commits do not depend on how the stage was signalled.
    """

    pairing: Pairing
    num_pages: int
    has_slot: bool
    ranged: bool = False
    # Per row, as Python lists: a segment touches a few rows at a time, and numpy's per-element
    # access costs more than the arithmetic (61 one-layer segments measured 1.6x slower).
    _item: list[int] = field(init=False)
    _final_end: list[int] = field(init=False)  # the end of what the row sends (0: nothing)
    _ready_end: list[int] = field(init=False)
    _next: list[int] = field(init=False)
    _queued: list[bool] = field(init=False)
    _queue: deque[int] = field(init=False)  # rows with ready cells not packed, in ready order
    _rows_of_layer: dict[int, list[int]] = field(init=False)
    _ready_bytes: int = field(init=False, default=0)
    _unpacked: int = field(init=False, default=0)  # cells still to pack, ready or not
    _pages_ready: int = field(init=False, default=0)  # ranged: pages ready so far
    _ended: bool = field(init=False)  # every range was signalled (always, by layer)

    def __post_init__(self) -> None:
        p = self.pairing
        k = p.num_kv_pairs
        self._item = p.row_item_len.tolist()
        self._final_end = [self.num_pages] * k + [1 if self.has_slot else 0] * p.num_slot_rows
        rows = len(self._final_end)
        self._ready_end = [0] * rows
        self._next = [0] * rows
        self._queued = [False] * rows
        self._queue = deque()
        self._rows_of_layer = {}
        for r, layer in enumerate([*p.kv_layer.tolist(), *p.slot_layer.tolist()]):
            if r < k + p.num_state_pairs:  # aux rows (layer -1) follow the layers (`make_ready`)
                self._rows_of_layer.setdefault(int(layer), []).append(r)
        self._unpacked = sum(self._final_end)
        self._ended = not self.ranged

    @property
    def total_bytes(self) -> int:
        kv = int(self.pairing.kv_item_len.sum()) * self.num_pages
        return kv + (self.pairing.slot_bytes if self.has_slot else 0)

    @property
    def largest_item(self) -> int:
        return max(self._item, default=0)

    @property
    def done(self) -> bool:
        """Every cell was made ready and packed: by page range, only once the last range (and
        with it the state) was signalled."""
        return self._ended and self._unpacked == 0

    @property
    def ready_bytes(self) -> int:
        return self._ready_bytes

    def make_ready(self, layers: Iterable[int] | None) -> None:
        """Rows of `layers` (None: all) become packable over all their pages; KV rows before
        state rows; the aux rows once every layer's rows are."""
        if layers is None:
            rows = list(range(len(self._final_end)))
        else:
            rows = sorted(r for layer in set(layers) for r in self._rows_of_layer.get(layer, ()))
            first_aux = self.pairing.num_kv_pairs + self.pairing.num_state_pairs
            end, final = self._ready_end, self._final_end
            covered = set(rows)
            if all(r in covered or end[r] >= final[r] for r in range(first_aux)):
                rows += list(range(first_aux, len(final)))
        self._extend(rows, [self._final_end[r] for r in rows])

    def make_pages_ready(self, end: int, *, last: bool, pp_rank: int = 0) -> None:
        """Request pages `[pages ready so far, end)` become packable for every KV row; with
        `last`, the range is the request's last and the state rows become packable too. Raises
        InvalidInput (changing nothing) for a range past the destination's pages, a last range
        short of them, or a range after the last."""
        if not self.ranged:
            raise InvalidInput(
                "this stage is signalled by layer, not by page range",
                field="pages_from",
                pp_rank=pp_rank,
            )
        if self._ended:
            raise InvalidInput(
                "the stage's last page range was already signalled",
                field="pages_from",
                pp_rank=pp_rank,
            )
        if end < self._pages_ready or end > self.num_pages:
            raise InvalidInput(
                f"the page range ends at request position {end}; the decode has "
                f"{self.num_pages} pages for it and {self._pages_ready} are ready",
                field="src_pages",
                pp_rank=pp_rank,
            )
        if last and end != self.num_pages:
            raise InvalidInput(
                f"the last page range ends at request position {end}, but the decode has "
                f"{self.num_pages} pages for the request",
                field="last_pages",
                pp_rank=pp_rank,
            )
        k = self.pairing.num_kv_pairs
        self._pages_ready = end
        self._extend(list(range(k)), [end] * k)
        if last:
            state = list(range(k, len(self._final_end)))
            self._extend(state, [self._final_end[r] for r in state])
            self._ended = True

    def _extend(self, rows: list[int], ends: list[int]) -> None:
        ready_end, nxt, queued, item = self._ready_end, self._next, self._queued, self._item
        for r, e in zip(rows, ends):
            if e > ready_end[r]:
                self._ready_bytes += item[r] * (e - ready_end[r])
                ready_end[r] = e
            # A row already queued keeps its place and its piece grows: fewer, larger pieces.
            if not queued[r] and nxt[r] < ready_end[r]:
                queued[r] = True
                self._queue.append(r)

    def next_segment(self, budget_bytes: int) -> Pieces | None:
        """The next pieces that fit `budget_bytes`, or None when nothing ready fits."""
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        left = budget_bytes
        while self._queue:
            row = self._queue[0]
            start, end_all = self._next[row], self._ready_end[row]
            item = self._item[row]
            take = min(end_all - start, left // item)
            if take <= 0:
                break
            rows.append(row)
            starts.append(start)
            ends.append(start + take)
            left -= take * item
            self._next[row] = start + take
            self._ready_bytes -= take * item
            self._unpacked -= take
            if start + take == end_all:
                self._queue.popleft()
                self._queued[row] = False
        return Pieces.of(rows, starts, ends) if rows else None
