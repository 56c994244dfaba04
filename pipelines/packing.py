"""Packing: a stage's KV pages, state slots and aux rows as segments of contiguous bytes, and back.

A **segment** is a list of *pieces*: piece i is pairing row `rows[i]` over the request's page
positions `starts[i]:ends[i]` (rows below `num_kv_pairs` are KV pairs; row `num_kv_pairs + j` is
slot row j — a state pair at its component's slot, or an aux pair at the request's aux row —
always positions 0:1, its one index). Packed, piece after piece, each piece's pages
in request order, a segment is `sum(item_len[row] * (end - start))` bytes.

- The prefill **gathers** a segment from its stage memory into a staging buffer (`gather`), one
  local copy per piece; what the next segment holds is
  `kvhandoff.pipelines.stage_packer.StagePacker`'s choice: whatever of the ready layers fits the
  window it was granted.
- The decode **scatters** a landed, digest-checked segment into the handoff's own pages and
  slot (`scatter`); it checks the pieces first (`check_pieces`), so a notice naming rows, pages
  or bytes its destination does not have changes nothing.

Copies run on the memory's own device, one call per piece, never one per page: numpy on host
memory (CPU tensors included, see `HOST_TENSORS_VIA_NUMPY`), torch on a CUDA or NPU pool. An
entry may live on another device than the packed buffer (an engine's host aux rows beside its
device KV): its pieces cross over. `gather` and `scatter` return once a device's copies ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.planning import slot_indices
from kvhandoff.pipelines.slots import SlotsLike, as_slots

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
    if n <= SMALL_PIECES:
        nbytes = _small_sound_bytes(pairing, pieces, num_pages, has_slot)
        if nbytes is not None:
            return nbytes
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


#: Up to this many pieces a sound notice is checked piece by piece in Python: numpy's dozen
#: whole-array steps cost more than the loop for a segment of a page or two.
SMALL_PIECES = 32


def _small_sound_bytes(
    pairing: Pairing, pieces: Pieces, num_pages: int, has_slot: bool
) -> int | None:
    """`check_pieces`'s conditions, piece by piece: the segment's bytes when every piece is
    sound, else None (the whole-array check then names the first bad piece)."""
    k = pairing.num_kv_pairs
    total_rows = k + pairing.num_slot_rows
    item = pairing.row_item_len.tolist()
    total = 0
    for row, start, end in zip(pieces.rows.tolist(), pieces.starts.tolist(), pieces.ends.tolist()):
        if not (0 <= row < total_rows and 0 <= start < end):
            return None
        if (end > num_pages) if row < k else not (has_slot and start == 0 and end == 1):
            return None
        total += item[row] * (end - start)
    return total


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


def host_view(a: Any) -> Any:
    """`a` as the numpy view its copies run on when it is host memory (`_host`), else `a`: for
    a long-lived buffer converted once rather than per copy."""
    found = _host(a)
    return a if found is None else found


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
        if _gather_host(pairing, src, pieces, packed):
            return
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


def _gather_host(pairing: Pairing, src: Side, pieces: Pieces, packed: Any) -> bool:
    """`gather` when the packed buffer and every region it reads are host memory (False, having
    copied nothing, otherwise): a one-page piece is one slice copy, not `piece_views`' row
    views and a `np.take` over one index, which cost more than copying its few KiB."""
    out = _host(packed)
    if out is None:
        return False
    k = pairing.num_kv_pairs
    item = pairing.row_item_len.tolist()
    rows = pieces.rows.tolist()
    where = src.kv_index.tolist() + src.slot_region.tolist()  # row -> its region here
    regions = [_host(src.memory.array(where[r])) for r in rows]
    if any(region is None for region in regions):
        return False
    off = 0
    for row, start, end, region in zip(rows, pieces.starts.tolist(), pieces.ends.tolist(), regions):
        length = item[row]
        idx = src.pages[start:end] if row < k else src.slots[row - k : row - k + 1]
        nbytes = (end - start) * length
        if end - start == 1:
            # The index was validated against every pool (see `gather`): the slice is whole.
            at = int(idx[0]) * length
            out[off : off + length] = region[at : at + length]
        else:
            usable = region.shape[0] // length * length
            np.take(
                region[:usable].reshape(-1, length),
                idx,
                axis=0,
                out=out[off : off + nbytes].reshape(-1, length),
                mode="clip",
            )
        off += nbytes
    return True


def scatter(pairing: Pairing, dst: Side, pieces: Pieces, packed: Any) -> None:
    """Copy `packed` into the destination entries' pages and slot the pieces name; on a
    device, returns once the copies are done (also when a piece raised: a lease released after
    a failed commit must find no copy still writing its pages)."""
    scatter_views(piece_views(pairing, dst, pieces, packed))


def scatter_views(views: Iterable[tuple[Any, Any, Any]]) -> None:
    """`scatter` of the pieces' views (`piece_views`), made by a caller that reads them again
    (the commit digests the same pages next). On the host a piece whose pages are one run is
    one slice copy (a segment of a page or two: cheaper than an indexed one)."""
    touched: dict[str, Any] = {}
    try:
        for rows, idx, data in views:
            if _is_torch(rows):
                touched.setdefault(str(rows.device), rows)
                # A device snapshot into an engine's host rows (SGLang's aux) crosses devices.
                moved = data if data.device == rows.device else data.to(rows.device)
                rows.index_copy_(0, idx, moved)
                continue
            spans = runs(idx.tolist())
            if len(spans) == 1:
                first, last = spans[0]
                rows[first : last + 1] = data
            else:
                rows[idx] = data
    finally:
        for rows in touched.values():
            settle(rows)


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive values in `ids`, as (first, last) pairs, in order."""
    out: list[tuple[int, int]] = []
    first = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            out.append((ids[first], ids[j - 1]))
            first = j
    return out


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
