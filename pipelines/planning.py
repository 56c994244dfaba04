"""Planning: turn one request's page lists and slots (and aux row) into transfer blocks.

Called per request (per stage, per readiness step) by the handoff pipeline, with a cached
`Pairing`. Validation comes first and names the offending index; then runs — maximal stretches
where both page lists step by +1 — are found once and expanded over all pairs with numpy
broadcasting, so the cost grows with runs x pairs in C, not in Python. The result is pair-major
(all runs of pair 0, then pair 1, ...) followed by one block per slot row (state pairs, each at
its component's slot, then aux pairs at the request's aux row: `kvhandoff.pipelines.slots`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.errors import PlanError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.slots import RequestSlots, SlotsLike, as_slots, space_name
from kvhandoff.transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks

I64 = npt.NDArray[np.int64]
#: Page lists up to this long are checked on Python ints (range, repeats): below it a numpy
#: call costs more than the whole check.
_SMALL_PAGES = 16
PageList = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The blocks of one planning call: KV blocks pair-major, then one block per slot row.

    `kv_rows` / `slot_rows` are the pairing rows planned (all, or those of the ready layers);
    `pair_of_block` maps every block back to its row for progress and digests.
    """

    blocks: Blocks
    kv_rows: I64
    slot_rows: I64
    num_runs: int
    num_kv_pairs: int

    @property
    def kv_blocks(self) -> int:
        return int(self.kv_rows.shape[0]) * self.num_runs

    @property
    def slot_blocks(self) -> int:
        return int(self.slot_rows.shape[0])

    @property
    def pair_of_block(self) -> I64:
        """Per block: the KV pair row, or `num_kv_pairs + j` for slot row j."""
        return np.concatenate(
            (np.repeat(self.kv_rows, self.num_runs), self.slot_rows + self.num_kv_pairs)
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
    if arr.size and arr.dtype.kind not in "iu":  # np.integer's kinds (issubdtype costs µs)
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
    if pages.size <= _SMALL_PAGES:
        small = pages.tolist()  # as in `validate_pages_for_layout`: Python ints cost less
        if min(small) >= 0 and max(small) < int(limits.min()):
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


def slot_indices(pairing: Pairing, slots: SlotsLike, side: str) -> I64:
    """Per slot row of the pairing: the index it moves (its component's slot, or the aux row),
    each checked against the smallest pool it is used in. Raises PlanError naming the field
    (`dst_slot`, `dst_slots.<component>`, `dst_aux`) and the entry."""
    given = as_slots(slots)
    prefix = "src" if side == "source" else "dst"
    limits = pairing.slot_src_limit if side == "source" else pairing.slot_dst_limit
    out = np.zeros(pairing.num_slot_rows, dtype=np.int64)
    for space, rows in pairing.slot_groups:
        field = given.field_of(space, prefix)
        index = given.of(space)
        if index is None:
            raise PlanError(
                f"{field} is required: the layouts pair {rows.shape[0]} entries of "
                f"{space_name(space)}",
                field=field,
            )
        j = int(rows[np.argmin(limits[rows])])
        limit = int(limits[j])
        if not 0 <= index < limit:
            text, where = pairing.slot_name(j)
            unit = "rows" if "aux" in where else "slots"
            raise PlanError(
                f"{field} = {index} is outside the {text} on the {side} side "
                f"({unit} 0..{limit - 1})",
                field=field,
                **where,
            )
        out[rows] = index
    return out


def _check_unique(dst: I64) -> None:
    if dst.size <= 1 or (dst.size <= _SMALL_PAGES and len(set(dst.tolist())) == dst.size):
        return
    if (np.diff(np.sort(dst)) == 0).any():
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
    src_slots: SlotsLike,
    dst_slots: SlotsLike,
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
    if pairing.num_slot_rows:
        slot_indices(pairing, src_slots, "source")
        slot_indices(pairing, dst_slots, "destination")
    return src, dst


def plan(
    pairing: Pairing,
    src_pages: PageList,
    dst_pages: PageList,
    src_slots: SlotsLike = None,
    dst_slots: SlotsLike = None,
    *,
    layers: Collection[int] | None = None,
    include_state: bool = True,
    include_aux: bool | None = None,
) -> TransferPlan:
    """Validate one request and plan its blocks.

    `layers` restricts the plan to those global layer ids (layer-by-layer readiness);
    `include_state=False` leaves the state slots and aux rows out (e.g. when they are sent in a
    later step). Aux rows belong to no layer: they are planned with the whole stage (`layers`
    None), or alone with `include_aux=True`.
    """
    src, dst = validate_request(pairing, src_pages, dst_pages, src_slots, dst_slots)
    s0, d0, run_pages = find_runs(src, dst)
    if include_aux is None:
        include_aux = include_state and layers is None
    kv_rows, st_rows = _planned_rows(pairing, layers, include_state, include_aux)

    # One allocation for all three arrays, filled in place: fresh large temporaries cost more
    # in page faults than the arithmetic itself (measured: ~7x slower for 61 x 472 blocks).
    num_runs, num_kv, num_st = int(s0.shape[0]), int(kv_rows.shape[0]), int(st_rows.shape[0])
    kv_end = num_kv * num_runs
    out = np.empty((3, kv_end + num_st), dtype=np.uint64)
    if kv_end:
        _fill_kv(pairing, kv_rows, (s0, d0, run_pages), out[:, :kv_end])
    if num_st:
        # Slots were validated above whenever slot rows exist.
        st_item = pairing.slot_item_len[st_rows]
        src_at = slot_indices(pairing, src_slots, "source")[st_rows].astype(np.uint64)
        dst_at = slot_indices(pairing, dst_slots, "destination")[st_rows].astype(np.uint64)
        out[0, kv_end:] = pairing.slot_src_base[st_rows] + src_at * st_item
        out[1, kv_end:] = pairing.slot_dst_base[st_rows] + dst_at * st_item
        out[2, kv_end:] = st_item
    return TransferPlan(
        blocks=Blocks(out[0], out[1], out[2]),
        kv_rows=kv_rows,
        slot_rows=st_rows,
        num_runs=num_runs,
        num_kv_pairs=pairing.num_kv_pairs,
    )


def _planned_rows(
    pairing: Pairing, layers: Collection[int] | None, include_state: bool, include_aux: bool
) -> tuple[I64, I64]:
    """The KV rows and slot rows a plan moves: those of `layers` (None: all), the state rows
    with `include_state`, the aux rows (no layer) with `include_aux`."""
    kv_rows = np.arange(pairing.num_kv_pairs, dtype=np.int64)
    st_rows = np.arange(pairing.num_slot_rows, dtype=np.int64)
    is_aux = st_rows >= pairing.num_state_pairs
    if layers is not None:
        wanted = np.fromiter(layers, dtype=np.int64)
        kv_rows = kv_rows[np.isin(pairing.kv_layer[kv_rows], wanted)]
        keep = np.isin(pairing.slot_layer, wanted) & ~is_aux
    else:
        keep = ~is_aux
    return kv_rows, st_rows[(keep & include_state) | (is_aux & include_aux)]


def _fill_kv(
    pairing: Pairing, kv_rows: I64, runs: tuple[I64, I64, I64], out: npt.NDArray[np.uint64]
) -> None:
    """One block per (KV row, run), row-major, into `out` (source addresses, destination
    addresses, lengths): `base + start * item_len` and `pages * item_len`."""
    s0, d0, run_pages = runs
    item = pairing.kv_item_len[kv_rows][:, None]
    grid = (int(kv_rows.shape[0]), int(s0.shape[0]))
    for target, starts, bases in (
        (out[0], s0, pairing.kv_src_base),
        (out[1], d0, pairing.kv_dst_base),
        (out[2], run_pages, None),
    ):
        view = target.reshape(grid)
        np.multiply(starts.astype(np.uint64)[None, :], item, out=view)
        if bases is not None:
            np.add(view, bases[kv_rows][:, None], out=view)


def validate_pages_for_layout(
    layout: StageLayout,
    pages: PageList,
    slots: SlotsLike,
    *,
    side: str,
    unique: bool,
    with_slot: bool = True,
) -> I64:
    """Check one side's page list and slots against a layout alone (before any pairing exists):
    every page inside every KV pool, each component's slot inside its state pools, the aux row
    inside the aux pools (none given where the layout has no aux entries), and — for
    destinations — no page listed twice and no slot for a component the layout does not have
    (a prefill stage may lack components of the model).
    Names the offending index like `validate_request`. `with_slot=False`: the slots and aux row
    are not part of this check (a page range before the last one)."""
    prefix = "src" if side == "source" else "dst"
    field = f"{prefix}_pages"
    arr = as_pages(pages, field)
    # A short list (a handoff of a few pages, the common case) is checked on Python ints: the
    # numpy reductions below cost microseconds each however few pages there are.
    small = arr.tolist() if arr.size <= _SMALL_PAGES else None
    e = layout.page_bound
    if e is not None and arr.size:
        limit = e.num_items
        if small is not None:
            outside = min(small) < 0 or max(small) >= limit
        else:
            outside = bool(arr.min() < 0 or arr.max() >= limit)
        if outside:
            i = int(np.flatnonzero((arr < 0) | (arr >= limit))[0])
            raise PlanError(
                f"{field}[{i}] = {int(arr[i])} is outside the {side} pool of layer {e.layer_id} "
                f"group {e.group} (pages 0..{limit - 1})",
                field=f"{field}[{i}]",
                layer_id=e.layer_id,
                group=e.group,
            )
    if unique and arr.size > 1:
        if small is not None:
            repeats = len(set(small)) != len(small)
        else:
            repeats = bool((np.diff(np.sort(arr)) == 0).any())
        if repeats:
            order = np.argsort(arr, kind="stable")
            same = np.flatnonzero(arr[order][1:] == arr[order][:-1])
            i, first = int(order[same[0] + 1]), int(order[same[0]])
            raise PlanError(
                f"{field}[{i}] = {int(arr[i])} repeats {field}[{first}]", field=f"{field}[{i}]"
            )
    if with_slot:
        _check_layout_slots(layout, as_slots(slots), prefix, side)
    return arr


def _check_layout_slots(layout: StageLayout, given: RequestSlots, prefix: str, side: str) -> None:
    bounds = layout.slot_bounds
    if side == "destination" and given.by_component:
        unknown = sorted(set(given.by_component) - {b.component for b in bounds})
        if unknown:
            raise PlanError(
                f"{prefix}_slots names component {unknown[0]!r}, which the {side} layout does "
                f"not have (components: {layout.components})",
                field=f"{prefix}_slots.{unknown[0]}",
            )
    for component, num_entries, s in bounds:
        slot = given.of(component)
        if slot is None:
            slot_field = given.field_of(component, prefix)
            raise PlanError(
                f"{slot_field} is required: the {side} layout has {num_entries} state entries "
                f"of component {component!r}",
                field=slot_field,
            )
        if not 0 <= slot < s.num_slots:
            slot_field = given.field_of(component, prefix)
            raise PlanError(
                f"{slot_field} = {slot} is outside the state pool of layer {s.layer_id} kind "
                f"{s.kind!r} (slots 0..{s.num_slots - 1})",
                field=slot_field,
                layer_id=s.layer_id,
                kind=s.kind,
            )
    aux_field = f"{prefix}_aux"
    if given.aux is not None and not layout.aux:
        raise PlanError(
            f"{aux_field} = {given.aux}, but the {side} layout has no aux entries (only the "
            "last PP stage of a model with aux entries sends aux rows)",
            field=aux_field,
        )
    if layout.aux:
        if given.aux is None:
            raise PlanError(
                f"{aux_field} is required: the {side} layout has {len(layout.aux)} aux entries",
                field=aux_field,
            )
        j = layout.aux_bound
        assert j is not None  # the layout has aux entries
        rows = layout.aux[j].num_rows
        if not 0 <= given.aux < rows:
            raise PlanError(
                f"{aux_field} = {given.aux} is outside aux entry {j} (rows 0..{rows - 1})",
                field=aux_field,
                aux=j,
            )
