"""Pairing: map every source entry to exactly one destination entry by global layer id.

Called once per (source layout, destination layout) pair — by the handoff pipeline through
`PairingCache` — never per request. What pairs with what, and every reason it cannot, is
`kvhandoff.pipelines.pairing_problems` (the dry-run report over all stages is
`kvhandoff.pipelines.pairing_report`); `pair` raises on any problem and binds the pairs found into
the arrays planning reads.

A pairing's rows: KV pairs first, then its **slot rows** — the state pairs, then the aux pairs —
each moving one row of a per-request index (`kvhandoff.pipelines.slots`): a state pair its
component's slot, an aux pair the request's aux row.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.errors import PairingError
from kvhandoff.pipelines.layout import AuxEntry, StageLayout, StateEntry
from kvhandoff.pipelines.pairing_problems import Pairs, find_problems
from kvhandoff.pipelines.slots import AUX, Space

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


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


def _bind(
    src: StageLayout, dst: StageLayout, kv_pairs: Pairs, st_pairs: Pairs, aux_pairs: list[int]
) -> Pairing:
    """The pairs found, as the columns planning and packing read."""
    ks = np.array([i for i, _ in kv_pairs], dtype=np.int64)
    kd = np.array([j for _, j in kv_pairs], dtype=np.int64)
    ss = np.array([i for i, _ in st_pairs], dtype=np.int64)
    sd = np.array([j for _, j in st_pairs], dtype=np.int64)
    aux = np.array(aux_pairs, dtype=np.int64)
    kv = _kv_columns(src, dst, ks, kd)
    slots = _slot_columns(src, dst, ss, sd, aux)
    return Pairing(
        src=src,
        dst=dst,
        **kv,
        **_state_columns(src, dst, ss, sd),
        aux_src_index=aux,
        aux_dst_index=aux.copy(),
        **slots,
        row_item_len=np.concatenate((kv["kv_item_len"], slots["slot_item_len"])).astype(np.int64),
    )


def _kv_columns(src: StageLayout, dst: StageLayout, ks: I64, kd: I64) -> dict[str, Any]:
    """The `kv_*` columns of the pairs (source entry `ks[i]`, destination entry `kd[i]`)."""
    return {
        "kv_src_index": ks,
        "kv_dst_index": kd,
        "kv_layer": np.array([src.kv[i].layer_id for i in ks], dtype=np.int64),
        "kv_group": np.array([src.kv[i].group for i in ks], dtype=np.int64),
        "kv_src_base": np.array([src.kv[i].base for i in ks], dtype=np.uint64),
        "kv_dst_base": np.array([dst.kv[j].base for j in kd], dtype=np.uint64),
        "kv_item_len": np.array([src.kv[i].item_len for i in ks], dtype=np.uint64),
        "kv_src_items": np.array([src.kv[i].num_items for i in ks], dtype=np.int64),
        "kv_dst_items": np.array([dst.kv[j].num_items for j in kd], dtype=np.int64),
    }


def _state_columns(src: StageLayout, dst: StageLayout, ss: I64, sd: I64) -> dict[str, Any]:
    """The `state_*` columns of the state pairs."""
    return {
        "state_src_index": ss,
        "state_dst_index": sd,
        "state_layer": np.array([src.state[i].layer_id for i in ss], dtype=np.int64),
        "state_kind": tuple(src.state[i].kind for i in ss),
        "state_src_base": np.array([src.state[i].base for i in ss], dtype=np.uint64),
        "state_dst_base": np.array([dst.state[j].base for j in sd], dtype=np.uint64),
        "state_item_len": np.array([src.state[i].item_len for i in ss], dtype=np.uint64),
        "state_src_slots": np.array([src.state[i].num_slots for i in ss], dtype=np.int64),
        "state_dst_slots": np.array([dst.state[j].num_slots for j in sd], dtype=np.int64),
    }


def _slot_columns(src: StageLayout, dst: StageLayout, ss: I64, sd: I64, aux: I64) -> dict[str, Any]:
    """The `slot_*` columns: the state pairs' rows, then the aux pairs' (one row each)."""
    src_rows = [src.state[i] for i in ss] + [src.aux[i] for i in aux]
    dst_rows = [dst.state[j] for j in sd] + [dst.aux[i] for i in aux]
    n_aux = len(aux)
    space: tuple[Space, ...] = tuple(src.state[i].component for i in ss) + (AUX,) * n_aux
    return {
        "slot_space": space,
        "slot_layer": np.array([src.state[i].layer_id for i in ss] + [-1] * n_aux, np.int64),
        "slot_src_region": np.concatenate(
            (ss + len(src.kv), aux + len(src.kv) + len(src.state))
        ).astype(np.int64),
        "slot_dst_region": np.concatenate(
            (sd + len(dst.kv), aux + len(dst.kv) + len(dst.state))
        ).astype(np.int64),
        "slot_src_base": np.array([e.base for e in src_rows], np.uint64),
        "slot_dst_base": np.array([e.base for e in dst_rows], np.uint64),
        "slot_item_len": np.array([e.item_len for e in src_rows], dtype=np.uint64),
        "slot_src_limit": np.array([_rows(e) for e in src_rows], np.int64),
        "slot_dst_limit": np.array([_rows(e) for e in dst_rows], np.int64),
        "slot_groups": _groups(space),
    }


def _rows(entry: StateEntry | AuxEntry) -> int:
    """Rows in the entry's pool: a state pool's slots, an aux pool's rows."""
    return entry.num_slots if isinstance(entry, StateEntry) else entry.num_rows


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
