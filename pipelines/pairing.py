"""Pairing: map every source entry to exactly one destination entry by global layer id.

Called once per (source layout, destination layout) pair — by the handoff pipeline through
`PairingCache`, and by the service's dry-run `validate` endpoint through `pairing_report` — never
per request. KV entries pair by `(layer_id, group)`, state entries by `(layer_id, kind)` (and
must agree on their component), aux entries by position (the last PP stage's aux entry i with
the decode's aux entry i, of equal row size). Positional pairing of KV and state is allowed only
for legacy layouts that publish no layer ids on either side with PP = 1. Every problem found is
collected (the report lists them all); `pair` raises on the first set.

A pairing's rows: KV pairs first, then its **slot rows** — the state pairs, then the aux pairs —
each moving one row of a per-request index (`pipelines.slots`): a state pair its component's
slot, an aux pair the request's aux row.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from msgspec import Struct

from pipelines.errors import LayoutError, PairingError
from pipelines.layout import AuxEntry, KVEntry, StageLayout, StateEntry, group_layer_ids
from pipelines.slots import AUX, Space

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


class Problem(Struct, frozen=True, omit_defaults=True):
    """One reason two layouts cannot be paired, naming where it is."""

    code: str  # e.g. "missing_destination", "item_len_mismatch", "slot_size_mismatch"
    message: str
    pp_rank: int | None = None
    layer_id: int | None = None
    group: int | None = None
    kind: str | None = None
    aux: int | None = None  # the aux entry's position


@dataclass(frozen=True, slots=True)
class Pairing:
    """Source→destination entry pairs of one layout pair, as arrays ready for planning.

    Row i of the `kv_*` arrays is one KV pair; row j of the `state_*` arrays one state pair,
    row j of the `aux_*` arrays one aux pair. The `slot_*` arrays are the slot rows (state
    pairs, then aux pairs) as planning and packing read them: row `num_kv_pairs + j` of the
    pairing is slot row j.
    """

    src: StageLayout
    dst: StageLayout
    kv_src_index: I64
    kv_dst_index: I64
    kv_layer: I64
    kv_group: I64
    kv_src_base: U64
    kv_dst_base: U64
    kv_item_len: U64
    kv_src_items: I64
    kv_dst_items: I64
    state_src_index: I64
    state_dst_index: I64
    state_layer: I64
    state_kind: tuple[str, ...]
    state_src_base: U64
    state_dst_base: U64
    state_item_len: U64
    state_src_slots: I64
    state_dst_slots: I64
    aux_src_index: I64
    aux_dst_index: I64
    # Slot rows: state pairs, then aux pairs.
    slot_space: tuple[Space, ...]  # the state entry's component, or AUX
    slot_layer: I64  # the state entry's layer id; -1 for an aux row
    slot_src_region: I64  # region index of the entry (KV, state, aux order) on each side
    slot_dst_region: I64
    slot_src_base: U64
    slot_dst_base: U64
    slot_item_len: U64
    slot_src_limit: I64  # slots (rows) in each side's pool
    slot_dst_limit: I64
    slot_groups: tuple[tuple[Space, I64], ...]  # each index space and its slot rows
    # Bytes per page of every row: KV pairs, then slot rows (one index each). What packing
    # sizes pieces with, per segment: kept here so no segment rebuilds it.
    row_item_len: I64

    @property
    def num_kv_pairs(self) -> int:
        return int(self.kv_src_index.shape[0])

    @property
    def num_state_pairs(self) -> int:
        return int(self.state_src_index.shape[0])

    @property
    def num_aux_pairs(self) -> int:
        return int(self.aux_src_index.shape[0])

    @property
    def num_slot_rows(self) -> int:
        return len(self.slot_space)

    @property
    def kv_bytes_per_page(self) -> int:
        return int(self.kv_item_len.sum())

    @property
    def state_bytes_per_slot(self) -> int:
        return int(self.state_item_len.sum())

    @property
    def slot_bytes(self) -> int:
        """Bytes one request's indices move: every state pair's slot and every aux row."""
        return int(self.slot_item_len.sum())

    def slot_name(self, j: int) -> tuple[str, dict[str, Any]]:
        """How errors name slot row j: text and the fields an HTTP error carries."""
        if self.slot_space[j] is AUX:
            i = int(self.aux_src_index[j - self.num_state_pairs])
            return f"aux entry {i}", {"aux": i}
        layer, kind = int(self.slot_layer[j]), self.state_kind[j]
        return f"state pool of layer {layer} kind {kind!r}", {"layer_id": layer, "kind": kind}


def _layout_problems(layout: StageLayout, side: str) -> list[Problem]:
    """Contract checks on one layout: ids repeat once per group, groups in group-major order."""
    problems: list[Problem] = []
    rank = layout.pp_rank if side == "source" else None
    if layout.kv and layout.layer_ids_published:
        try:
            layers, groups = group_layer_ids(layout.kv_layer_ids, len(layout.kv))
        except LayoutError as exc:
            problems.append(Problem("layout_error", f"{side} layout: {exc.message}", pp_rank=rank))
        else:
            for i, e in enumerate(layout.kv):
                if e.group != i // len(layers):
                    problems.append(
                        Problem(
                            "layout_error",
                            f"{side} KV entry {i} (layer {e.layer_id}) has group {e.group}, but "
                            f"group-major order over {groups} group(s) puts group "
                            f"{i // len(layers)} there",
                            pp_rank=rank,
                            layer_id=e.layer_id,
                            group=e.group,
                        )
                    )
                    break
    seen: set[tuple[int, str]] = set()
    for s in layout.state:
        if (s.layer_id, s.kind) in seen:
            problems.append(
                Problem(
                    "layout_error",
                    f"{side} layout lists state of layer {s.layer_id} kind {s.kind!r} twice",
                    pp_rank=rank,
                    layer_id=s.layer_id,
                    kind=s.kind,
                )
            )
        seen.add((s.layer_id, s.kind))
    return problems


def _match(
    src_keys: Sequence[Hashable], dst_keys: Sequence[Hashable]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """Return (pairs, duplicates as (src index, count), src indices with no match)."""
    where: dict[Hashable, list[int]] = defaultdict(list)
    for j, key in enumerate(dst_keys):
        where[key].append(j)
    pairs, dups, missing = [], [], []
    for i, key in enumerate(src_keys):
        hits = where.get(key, [])
        if not hits:
            missing.append(i)
        elif len(hits) > 1:
            dups.append((i, len(hits)))
        else:
            pairs.append((i, hits[0]))
    return pairs, dups, missing


def _where(entry: KVEntry | StateEntry, index: int = 0) -> tuple[str, dict[str, Any]]:
    """How a problem names an entry: text and the structured fields an HTTP error carries
    (an aux entry by its position `index`)."""
    if isinstance(entry, AuxEntry):
        return f"aux entry {index}", {"aux": index}
    if isinstance(entry, KVEntry):
        return f"layer {entry.layer_id} group {entry.group}", {
            "layer_id": entry.layer_id,
            "group": entry.group,
        }
    return f"layer {entry.layer_id} kind {entry.kind!r}", {
        "layer_id": entry.layer_id,
        "kind": entry.kind,
    }


def _entry_problems(
    problems: list[Problem],
    rank: int,
    src_entries: Sequence[KVEntry] | Sequence[StateEntry],
    dst_entries: Sequence[KVEntry] | Sequence[StateEntry],
    src_keys: Sequence[Hashable],
    dst_keys: Sequence[Hashable],
    *,
    noun: str,
    size_code: str,
    size_text: str,
    unit: str,
) -> list[tuple[int, int]]:
    """Match one kind of entry (KV or state), appending every problem; returns the pairs."""
    pairs, dups, missing = _match(src_keys, dst_keys)
    for i in missing:
        text, fields = _where(src_entries[i])
        problems.append(
            Problem(
                "missing_destination",
                f"destination has no {noun} entry for {text}",
                pp_rank=rank,
                **fields,
            )
        )
    for i, count in dups:
        text, fields = _where(src_entries[i])
        problems.append(
            Problem(
                "duplicate_destination",
                f"destination has {count} {noun} entries for {text}",
                pp_rank=rank,
                **fields,
            )
        )
    for i, j in pairs:
        a, b = src_entries[i], dst_entries[j]
        if isinstance(a, StateEntry) and isinstance(b, StateEntry) and a.component != b.component:
            text, fields = _where(a)
            problems.append(
                Problem(
                    "component_mismatch",
                    f"state of {text} is of component {a.component!r} on the source and "
                    f"{b.component!r} on the destination: their slots would not agree",
                    pp_rank=rank,
                    **fields,
                )
            )
        if a.item_len != b.item_len:
            text, fields = _where(a)
            problems.append(
                Problem(
                    size_code,
                    f"{size_text} differs for {text}: source {a.item_len} {unit}, "
                    f"destination {b.item_len}",
                    pp_rank=rank,
                    **fields,
                )
            )
    return pairs


def _aux_problems(problems: list[Problem], src: StageLayout, dst: StageLayout) -> list[int]:
    """Pair aux entries by position: the last stage's must match the decode's one for one, of
    equal row size; other stages have none (the layout refuses them). Returns the positions."""
    rank = src.pp_rank
    if src.pp_rank != src.pp_size - 1 and not src.aux:
        return []
    for i in range(len(src.aux), len(dst.aux)):
        problems.append(
            Problem(
                "missing_source",
                f"the last stage has no aux entry {i} for the destination's aux entry {i} "
                f"({len(src.aux)} aux entries, destination {len(dst.aux)})",
                pp_rank=rank,
                aux=i,
            )
        )
    for i in range(len(dst.aux), len(src.aux)):
        problems.append(
            Problem(
                "missing_destination",
                f"destination has no aux entry {i} ({len(dst.aux)} aux entries, source "
                f"{len(src.aux)})",
                pp_rank=rank,
                aux=i,
            )
        )
    pairs = list(range(min(len(src.aux), len(dst.aux))))
    for i in pairs:
        a, b = src.aux[i], dst.aux[i]
        if a.item_len != b.item_len:
            problems.append(
                Problem(
                    "aux_size_mismatch",
                    f"aux row size differs for aux entry {i}: source {a.item_len} bytes, "
                    f"destination {b.item_len}",
                    pp_rank=rank,
                    aux=i,
                )
            )
    return pairs


def find_problems(
    src: StageLayout, dst: StageLayout
) -> tuple[list[Problem], list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """All problems of pairing `src` with `dst`, plus the KV and state index pairs and the aux
    positions found."""
    rank = src.pp_rank
    problems = _layout_problems(src, "source") + _layout_problems(dst, "destination")
    if src.page_size != dst.page_size:
        problems.append(
            Problem(
                "page_size_mismatch",
                f"page size differs: source {src.page_size} tokens, destination {dst.page_size}",
                pp_rank=rank,
            )
        )
    if src.dtype != dst.dtype:
        problems.append(
            Problem(
                "dtype_mismatch",
                f"dtype differs: source {src.dtype}, destination {dst.dtype}",
                pp_rank=rank,
            )
        )

    positional = not src.layer_ids_published and not dst.layer_ids_published
    if src.layer_ids_published != dst.layer_ids_published:
        side = "source" if not src.layer_ids_published else "destination"
        problems.append(
            Problem(
                "layer_ids_missing",
                f"the {side} layout publishes no layer ids, so its entries cannot be paired by id",
                pp_rank=rank,
            )
        )
        return problems, [], [], []
    if positional:
        if src.pp_size != 1 or dst.pp_size != 1:
            problems.append(
                Problem(
                    "positional_not_allowed",
                    "neither layout publishes layer ids; positional pairing is only safe with "
                    f"PP = 1 on both sides (source pp_size {src.pp_size}, destination "
                    f"pp_size {dst.pp_size})",
                    pp_rank=rank,
                )
            )
            return problems, [], [], []
        src_kv_keys: list[Hashable] = list(range(len(src.kv)))
        dst_kv_keys: list[Hashable] = list(range(len(dst.kv)))
        src_st_keys: list[Hashable] = list(range(len(src.state)))
        dst_st_keys: list[Hashable] = list(range(len(dst.state)))
    else:
        src_kv_keys = [(e.layer_id, e.group) for e in src.kv]
        dst_kv_keys = [(e.layer_id, e.group) for e in dst.kv]
        src_st_keys = [(s.layer_id, s.kind) for s in src.state]
        dst_st_keys = [(s.layer_id, s.kind) for s in dst.state]

    kv_pairs = _entry_problems(
        problems,
        rank,
        src.kv,
        dst.kv,
        src_kv_keys,
        dst_kv_keys,
        noun="KV",
        size_code="item_len_mismatch",
        size_text="KV item length",
        unit="bytes per page",
    )
    st_pairs = _entry_problems(
        problems,
        rank,
        src.state,
        dst.state,
        src_st_keys,
        dst_st_keys,
        noun="state",
        size_code="slot_size_mismatch",
        size_text="state slot size",
        unit="bytes",
    )
    aux_pairs = _aux_problems(problems, src, dst)
    return problems, kv_pairs, st_pairs, aux_pairs


def _bind(
    src: StageLayout,
    dst: StageLayout,
    kv_pairs: list[tuple[int, int]],
    st_pairs: list[tuple[int, int]],
    aux_pairs: list[int],
) -> Pairing:
    ks = np.array([i for i, _ in kv_pairs], dtype=np.int64)
    kd = np.array([j for _, j in kv_pairs], dtype=np.int64)
    ss = np.array([i for i, _ in st_pairs], dtype=np.int64)
    sd = np.array([j for _, j in st_pairs], dtype=np.int64)
    aux = np.array(aux_pairs, dtype=np.int64)
    kv_item_len = np.array([src.kv[i].item_len for i in ks], dtype=np.uint64)
    state_item_len = np.array([src.state[i].item_len for i in ss], dtype=np.uint64)
    src_state = [src.state[i] for i in ss]
    dst_state = [dst.state[j] for j in sd]
    src_aux = [src.aux[i] for i in aux]
    dst_aux = [dst.aux[i] for i in aux]
    slot_item_len = np.array(
        [e.item_len for e in src_state] + [a.item_len for a in src_aux], dtype=np.uint64
    )
    slot_space: tuple[Space, ...] = tuple(e.component for e in src_state) + (AUX,) * len(src_aux)
    return Pairing(
        src=src,
        dst=dst,
        kv_src_index=ks,
        kv_dst_index=kd,
        kv_layer=np.array([src.kv[i].layer_id for i in ks], dtype=np.int64),
        kv_group=np.array([src.kv[i].group for i in ks], dtype=np.int64),
        kv_src_base=np.array([src.kv[i].base for i in ks], dtype=np.uint64),
        kv_dst_base=np.array([dst.kv[j].base for j in kd], dtype=np.uint64),
        kv_item_len=kv_item_len,
        kv_src_items=np.array([src.kv[i].num_items for i in ks], dtype=np.int64),
        kv_dst_items=np.array([dst.kv[j].num_items for j in kd], dtype=np.int64),
        state_src_index=ss,
        state_dst_index=sd,
        state_layer=np.array([src.state[i].layer_id for i in ss], dtype=np.int64),
        state_kind=tuple(src.state[i].kind for i in ss),
        state_src_base=np.array([src.state[i].base for i in ss], dtype=np.uint64),
        state_dst_base=np.array([dst.state[j].base for j in sd], dtype=np.uint64),
        state_item_len=state_item_len,
        state_src_slots=np.array([src.state[i].num_slots for i in ss], dtype=np.int64),
        state_dst_slots=np.array([dst.state[j].num_slots for j in sd], dtype=np.int64),
        aux_src_index=aux,
        aux_dst_index=aux.copy(),
        slot_space=slot_space,
        slot_layer=np.array([e.layer_id for e in src_state] + [-1] * len(src_aux), np.int64),
        slot_src_region=np.concatenate(
            (ss + len(src.kv), aux + len(src.kv) + len(src.state))
        ).astype(np.int64),
        slot_dst_region=np.concatenate(
            (sd + len(dst.kv), aux + len(dst.kv) + len(dst.state))
        ).astype(np.int64),
        slot_src_base=np.array([e.base for e in src_state] + [a.base for a in src_aux], np.uint64),
        slot_dst_base=np.array([e.base for e in dst_state] + [a.base for a in dst_aux], np.uint64),
        slot_item_len=slot_item_len,
        slot_src_limit=np.array(
            [e.num_slots for e in src_state] + [a.num_rows for a in src_aux], np.int64
        ),
        slot_dst_limit=np.array(
            [e.num_slots for e in dst_state] + [a.num_rows for a in dst_aux], np.int64
        ),
        slot_groups=_groups(slot_space),
        row_item_len=np.concatenate((kv_item_len, slot_item_len)).astype(np.int64),
    )


def _groups(spaces: tuple[Space, ...]) -> tuple[tuple[Space, I64], ...]:
    rows: dict[Space, list[int]] = {}
    for j, space in enumerate(spaces):
        rows.setdefault(space, []).append(j)
    return tuple((space, np.array(r, dtype=np.int64)) for space, r in rows.items())


def pair(src: StageLayout, dst: StageLayout) -> Pairing:
    """Pair a source stage layout with a destination layout, or raise `PairingError`."""
    problems, kv_pairs, st_pairs, aux_pairs = find_problems(src, dst)
    if problems:
        raise PairingError(list(problems))
    return _bind(src, dst, kv_pairs, st_pairs, aux_pairs)


class PairingCache:
    """Pairings keyed by both layouts' fingerprints and addresses; bounded, least recent evicted.

    Layouts are exchanged once per peer and change rarely, so a handoff looks its pairing up here
    instead of re-pairing per request. A failed pairing is cached too (as its error).
    """

    def __init__(self, max_entries: int = 256) -> None:
        self._max = max_entries
        self._items: OrderedDict[tuple[str, str, str, str], Pairing | PairingError] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, src: StageLayout, dst: StageLayout) -> Pairing:
        key = (src.fingerprint, src.address_key, dst.fingerprint, dst.address_key)
        found = self._items.get(key)
        if found is None:
            self.misses += 1
            try:
                found = pair(src, dst)
            except PairingError as exc:
                found = exc
            self._items[key] = found
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        else:
            self.hits += 1
            self._items.move_to_end(key)
        if isinstance(found, PairingError):
            raise PairingError(list(found.problems))
        return found

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------------------------------------
# The dry-run report


class StageReport(Struct, frozen=True):
    pp_rank: int
    ok: bool
    kv_pairs: int
    state_pairs: int
    kv_bytes_per_page: int  # bytes one page of this stage moves, over all its KV pairs
    state_bytes_per_slot: int  # bytes one request slot of this stage moves, over its state pairs
    layers: list[int]  # global layer ids this stage sends
    aux_pairs: int = 0  # aux entries this stage sends (the last stage only)
    aux_bytes_per_row: int = 0  # bytes of one request's aux rows


class PairingReport(Struct, frozen=True):
    ok: bool
    problems: list[Problem]
    stages: list[StageReport]
    destination_fingerprint: str


def pairing_report(sources: Sequence[StageLayout], dst: StageLayout) -> PairingReport:
    """Pair every prefill stage with the decode layout and list *all* problems found.

    Beyond per-stage pairing this checks coverage: each destination entry must be written by
    exactly one stage, or the decode side would read a layer nobody sent (or two stages race).
    """
    problems: list[Problem] = []
    stages: list[StageReport] = []
    ranks = [s.pp_rank for s in sources]
    if len(set(ranks)) != len(ranks):
        problems.append(Problem("duplicate_stage", f"PP ranks {ranks} list a stage twice"))
    kv_writers: dict[int, list[int]] = defaultdict(list)
    st_writers: dict[int, list[int]] = defaultdict(list)
    aux_writers: dict[int, list[int]] = defaultdict(list)
    for src in sources:
        found, kv_pairs, st_pairs, aux_pairs = find_problems(src, dst)
        problems.extend(found)
        for _, j in kv_pairs:
            kv_writers[j].append(src.pp_rank)
        for _, j in st_pairs:
            st_writers[j].append(src.pp_rank)
        for j in aux_pairs:
            aux_writers[j].append(src.pp_rank)
        stages.append(
            StageReport(
                pp_rank=src.pp_rank,
                ok=not found,
                kv_pairs=len(kv_pairs),
                state_pairs=len(st_pairs),
                kv_bytes_per_page=sum(src.kv[i].item_len for i, _ in kv_pairs),
                state_bytes_per_slot=sum(src.state[i].item_len for i, _ in st_pairs),
                layers=sorted(
                    {src.kv[i].layer_id for i, _ in kv_pairs}
                    | {src.state[i].layer_id for i, _ in st_pairs}
                ),
                aux_pairs=len(aux_pairs),
                aux_bytes_per_row=sum(src.aux[i].item_len for i in aux_pairs),
            )
        )
    pp_sizes = {s.pp_size for s in sources}
    complete = len(pp_sizes) == 1 and len(sources) == next(iter(pp_sizes))
    if len(pp_sizes) > 1:
        problems.append(
            Problem("pp_size_mismatch", f"stages disagree on pp_size: {sorted(pp_sizes)}")
        )
    for j, entry in enumerate(dst.kv):
        writers = kv_writers.get(j, [])
        if len(writers) > 1:
            problems.append(
                Problem(
                    "duplicate_writer",
                    f"stages {writers} all write layer {entry.layer_id} group {entry.group}",
                    layer_id=entry.layer_id,
                    group=entry.group,
                )
            )
        elif not writers and complete:
            problems.append(
                Problem(
                    "unfilled_destination",
                    f"no prefill stage sends layer {entry.layer_id} group {entry.group}",
                    layer_id=entry.layer_id,
                    group=entry.group,
                )
            )
    for j, sentry in enumerate(dst.state):
        writers = st_writers.get(j, [])
        if len(writers) > 1:
            problems.append(
                Problem(
                    "duplicate_writer",
                    f"stages {writers} all write state of layer {sentry.layer_id} kind "
                    f"{sentry.kind!r}",
                    layer_id=sentry.layer_id,
                    kind=sentry.kind,
                )
            )
        elif not writers and complete:
            problems.append(
                Problem(
                    "unfilled_destination",
                    f"no prefill stage sends state of layer {sentry.layer_id} kind {sentry.kind!r}",
                    layer_id=sentry.layer_id,
                    kind=sentry.kind,
                )
            )
    for j in range(len(dst.aux)):
        writers = aux_writers.get(j, [])
        if not writers and complete:
            problems.append(
                Problem("unfilled_destination", f"no prefill stage sends aux entry {j}", aux=j)
            )
    return PairingReport(
        ok=not problems,
        problems=problems,
        stages=stages,
        destination_fingerprint=dst.fingerprint,
    )
