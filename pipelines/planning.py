"""Planning: turn one request's page lists and slots into transfer blocks.

Called per request (per stage, per readiness step) by the handoff pipeline, with a cached
`Pairing`. Validation comes first and names the offending index; then runs — maximal stretches
where both page lists step by +1 — are found once and expanded over all pairs with numpy
broadcasting, so the cost grows with runs x pairs in C, not in Python. The result is pair-major
(all runs of pair 0, then pair 1, ...) followed by one block per state pair.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipelines.errors import PlanError
from pipelines.layout import StageLayout
from pipelines.pairing import Pairing
from transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks

I64 = npt.NDArray[np.int64]
PageList = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The blocks of one planning call: KV blocks pair-major, then one block per state pair.

    `kv_rows` / `state_rows` are the pairing rows planned (all, or those of the ready layers);
    `pair_of_block` maps every block back to its row for progress and digests.
    """

    blocks: Blocks
    kv_rows: I64
    state_rows: I64
    num_runs: int
    num_kv_pairs: int

    @property
    def kv_blocks(self) -> int:
        return int(self.kv_rows.shape[0]) * self.num_runs

    @property
    def state_blocks(self) -> int:
        return int(self.state_rows.shape[0])

    @property
    def pair_of_block(self) -> I64:
        """Per block: the KV pair row, or `num_kv_pairs + j` for state pair row j."""
        return np.concatenate(
            (np.repeat(self.kv_rows, self.num_runs), self.state_rows + self.num_kv_pairs)
        )

    @property
    def total_bytes(self) -> int:
        return self.blocks.total_bytes

    def __len__(self) -> int:
        return len(self.blocks)

    def batches(self, max_blocks: int = DEFAULT_MAX_BLOCKS_PER_BATCH) -> Iterator[Blocks]:
        return self.blocks.batches(max_blocks)


def as_pages(pages: PageList, field: str) -> I64:
    """Page indices as a 1-D int64 array; a nested or non-integer list is an error naming it."""
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{field} must be a flat list of page indices", field=field)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"{field} must hold integers, got {arr.dtype}", field=field)
    return arr.astype(np.int64, copy=False)


def find_runs(src: I64, dst: I64) -> tuple[I64, I64, I64]:
    """Maximal runs where both lists step by +1: (src starts, dst starts, lengths in pages)."""
    n = src.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    lengths = np.diff(np.append(starts, n))
    return src[starts], dst[starts], lengths


def _check_range(pages: I64, limits: I64, field: str, pairing: Pairing, side: str) -> None:
    """Every page must lie inside every pool it is used in: check against the smallest."""
    if pages.size == 0 or limits.size == 0:
        return
    k = int(np.argmin(limits))
    limit = int(limits[k])
    if pages.min() >= 0 and pages.max() < limit:  # the common case: two reductions, no mask
        return
    bad = np.flatnonzero((pages < 0) | (pages >= limit))
    if bad.size:
        i = int(bad[0])
        layer, group = int(pairing.kv_layer[k]), int(pairing.kv_group[k])
        raise PlanError(
            f"{field}[{i}] = {int(pages[i])} is outside the {side} pool of layer {layer} "
            f"group {group} (pages 0..{limit - 1})",
            field=f"{field}[{i}]",
            layer_id=layer,
            group=group,
        )


def _check_slot(slot: int | None, limits: I64, field: str, pairing: Pairing) -> int:
    if slot is None:
        raise PlanError(
            f"{field} is required: the layouts pair {pairing.num_state_pairs} state entries",
            field=field,
        )
    k = int(np.argmin(limits))
    limit = int(limits[k])
    if not 0 <= slot < limit:
        layer, kind = int(pairing.state_layer[k]), pairing.state_kind[k]
        raise PlanError(
            f"{field} = {slot} is outside the state pool of layer {layer} kind {kind!r} "
            f"(slots 0..{limit - 1})",
            field=field,
            layer_id=layer,
            kind=kind,
        )
    return slot


def _check_unique(dst: I64) -> None:
    if dst.size > 1 and (np.diff(np.sort(dst)) == 0).any():
        # Only on failure: find the first repeated position to name it.
        order = np.argsort(dst, kind="stable")
        same = np.flatnonzero(dst[order][1:] == dst[order][:-1])
        if same.size:
            i = int(order[same[0] + 1])
            first = int(order[same[0]])
            raise PlanError(
                f"dst_pages[{i}] = {int(dst[i])} repeats dst_pages[{first}]: two source pages "
                "would land on one destination page",
                field=f"dst_pages[{i}]",
            )


def validate_request(
    pairing: Pairing,
    src_pages: PageList,
    dst_pages: PageList,
    src_slot: int | None,
    dst_slot: int | None,
) -> tuple[I64, I64]:
    """Check one request against a pairing before anything is planned or sent."""
    src = as_pages(src_pages, "src_pages")
    dst = as_pages(dst_pages, "dst_pages")
    if src.shape != dst.shape:
        raise PlanError(
            f"src_pages has {src.shape[0]} pages but dst_pages has {dst.shape[0]}",
            field="dst_pages",
        )
    if pairing.num_kv_pairs:
        _check_range(src, pairing.kv_src_items, "src_pages", pairing, "source")
        _check_range(dst, pairing.kv_dst_items, "dst_pages", pairing, "destination")
    _check_unique(dst)
    if pairing.num_state_pairs:
        _check_slot(src_slot, pairing.state_src_slots, "src_slot", pairing)
        _check_slot(dst_slot, pairing.state_dst_slots, "dst_slot", pairing)
    return src, dst


def validate_destination(pairing: Pairing, dst_pages: PageList, dst_slot: int | None) -> I64:
    """The destination half of `validate_request`, once per stage signalled by page range:
    every page inside the decode's pools, none listed twice, the slot inside its pools. Each
    range's source pages were checked against this stage's pools when it was signalled."""
    dst = as_pages(dst_pages, "dst_pages")
    if pairing.num_kv_pairs:
        _check_range(dst, pairing.kv_dst_items, "dst_pages", pairing, "destination")
    _check_unique(dst)
    if pairing.num_state_pairs:
        _check_slot(dst_slot, pairing.state_dst_slots, "dst_slot", pairing)
    return dst


def plan(
    pairing: Pairing,
    src_pages: PageList,
    dst_pages: PageList,
    src_slot: int | None = None,
    dst_slot: int | None = None,
    *,
    layers: Collection[int] | None = None,
    include_state: bool = True,
) -> TransferPlan:
    """Validate one request and plan its blocks.

    `layers` restricts the plan to those global layer ids (layer-by-layer readiness);
    `include_state=False` leaves the state slot out (e.g. when it is sent in a later step).
    """
    src, dst = validate_request(pairing, src_pages, dst_pages, src_slot, dst_slot)
    s0, d0, run_pages = find_runs(src, dst)

    kv_rows = np.arange(pairing.num_kv_pairs, dtype=np.int64)
    st_rows = np.arange(pairing.num_state_pairs, dtype=np.int64)
    if layers is not None:
        wanted = np.fromiter(layers, dtype=np.int64)
        kv_rows = kv_rows[np.isin(pairing.kv_layer[kv_rows], wanted)]
        st_rows = st_rows[np.isin(pairing.state_layer[st_rows], wanted)]
    if not include_state:
        st_rows = st_rows[:0]

    # One allocation for all three arrays, filled in place: fresh large temporaries cost more
    # in page faults than the arithmetic itself (measured: ~7x slower for 61 x 472 blocks).
    num_runs, num_kv, num_st = int(s0.shape[0]), int(kv_rows.shape[0]), int(st_rows.shape[0])
    kv_end = num_kv * num_runs
    out = np.empty((3, kv_end + num_st), dtype=np.uint64)
    src_addr, dst_addr, length = out[0], out[1], out[2]
    if kv_end:
        item = pairing.kv_item_len[kv_rows][:, None]
        grid = (num_kv, num_runs)
        for target, starts, bases in (
            (src_addr, s0, pairing.kv_src_base),
            (dst_addr, d0, pairing.kv_dst_base),
            (length, run_pages, None),
        ):
            view = target[:kv_end].reshape(grid)
            np.multiply(starts.astype(np.uint64)[None, :], item, out=view)
            if bases is not None:
                np.add(view, bases[kv_rows][:, None], out=view)
    if num_st:
        # Slots were validated above whenever state pairs exist.
        st_item = pairing.state_item_len[st_rows]
        src_addr[kv_end:] = pairing.state_src_base[st_rows] + np.uint64(src_slot or 0) * st_item
        dst_addr[kv_end:] = pairing.state_dst_base[st_rows] + np.uint64(dst_slot or 0) * st_item
        length[kv_end:] = st_item
    return TransferPlan(
        blocks=Blocks(src_addr, dst_addr, length),
        kv_rows=kv_rows,
        state_rows=st_rows,
        num_runs=num_runs,
        num_kv_pairs=pairing.num_kv_pairs,
    )


def validate_pages_for_layout(
    layout: StageLayout,
    pages: PageList,
    slot: int | None,
    *,
    side: str,
    unique: bool,
    with_slot: bool = True,
) -> I64:
    """Check one side's page list and slot against a layout alone (before any pairing exists):
    every page inside every KV pool, the slot inside every state pool, and — for destinations —
    no page listed twice. Names the offending index like `validate_request`. `with_slot=False`:
    the slot is not part of this check (a page range before the last one)."""
    prefix = "src" if side == "source" else "dst"
    field = f"{prefix}_pages"
    arr = as_pages(pages, field)
    if layout.kv and arr.size:
        k = min(range(len(layout.kv)), key=lambda i: layout.kv[i].num_items)
        limit = layout.kv[k].num_items
        if arr.min() < 0 or arr.max() >= limit:
            i = int(np.flatnonzero((arr < 0) | (arr >= limit))[0])
            e = layout.kv[k]
            raise PlanError(
                f"{field}[{i}] = {int(arr[i])} is outside the {side} pool of layer {e.layer_id} "
                f"group {e.group} (pages 0..{limit - 1})",
                field=f"{field}[{i}]",
                layer_id=e.layer_id,
                group=e.group,
            )
    if unique and arr.size > 1 and (np.diff(np.sort(arr)) == 0).any():
        order = np.argsort(arr, kind="stable")
        same = np.flatnonzero(arr[order][1:] == arr[order][:-1])
        i, first = int(order[same[0] + 1]), int(order[same[0]])
        raise PlanError(
            f"{field}[{i}] = {int(arr[i])} repeats {field}[{first}]", field=f"{field}[{i}]"
        )
    if layout.state and with_slot:
        slot_field = f"{prefix}_slot"
        if slot is None:
            raise PlanError(
                f"{slot_field} is required: the {side} layout has "
                f"{len(layout.state)} state entries",
                field=slot_field,
            )
        j = min(range(len(layout.state)), key=lambda i: layout.state[i].num_slots)
        s = layout.state[j]
        if not 0 <= slot < s.num_slots:
            raise PlanError(
                f"{slot_field} = {slot} is outside the state pool of layer {s.layer_id} kind "
                f"{s.kind!r} (slots 0..{s.num_slots - 1})",
                field=slot_field,
                layer_id=s.layer_id,
                kind=s.kind,
            )
    return arr
