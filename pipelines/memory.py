"""Reading registered entries for verification, and the digests both sides compare.

`EntryMemory` is the one thing `pipelines` needs from a pool: a byte view of every entry of a
layout, KV entries first, then state entries, then aux entries (the order pools allocate
regions in). The sender
digests what it sent, the decode side digests what landed, and a mismatch names the entry.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.planning import slot_indices
from kvhandoff.pipelines.slots import SlotsLike, as_slots
from kvhandoff.transport.pool_base import Pool

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class EntryMemory(Protocol):
    def region(self, index: int) -> U8:
        """A uint8 view of region `index` (KV entries first, then state, then aux entries)."""
        ...


def kv_key(layer: int, group: int) -> str:
    return f"kv:{layer}:{group}"


def state_key(layer: int, kind: str) -> str:
    return f"state:{layer}:{kind}"


def aux_key(index: int) -> str:
    return f"aux:{index}"


def _pages_digest(view: U8, item_len: int, pages: I64) -> str:
    rows = view[: (view.shape[0] // item_len) * item_len].reshape(-1, item_len)
    return hashlib.blake2b(np.ascontiguousarray(rows[pages]).data, digest_size=16).hexdigest()


def _slot_digest(view: U8, item_len: int, slot: int) -> str:
    data = view[slot * item_len : (slot + 1) * item_len]
    return hashlib.blake2b(np.ascontiguousarray(data).data, digest_size=16).hexdigest()


def source_digests(
    pairing: Pairing,
    memory: EntryMemory,
    pages: I64,
    slots: SlotsLike,
    kv_rows: I64,
    slot_rows: I64,
) -> dict[str, str]:
    """Digests of the source bytes of the given pairing rows, keyed by layer and group/kind
    (aux rows by their entry's position)."""
    src = pairing.src
    out: dict[str, str] = {}
    for row in kv_rows.tolist():
        i = int(pairing.kv_src_index[row])
        e = src.kv[i]
        out[kv_key(e.layer_id, e.group)] = _pages_digest(memory.region(i), e.item_len, pages)
    indices = slot_indices(pairing, slots, "source") if slot_rows.size else slot_rows
    for row in slot_rows.tolist():
        view = memory.region(int(pairing.slot_src_region[row]))
        item, at = int(pairing.slot_item_len[row]), int(indices[row])
        if row < pairing.num_state_pairs:
            s = src.state[int(pairing.state_src_index[row])]
            out[state_key(s.layer_id, s.kind)] = _slot_digest(view, item, at)
        else:
            aux = int(pairing.aux_src_index[row - pairing.num_state_pairs])
            out[aux_key(aux)] = _slot_digest(view, item, at)
    return out


def destination_digests(
    layout: StageLayout, memory: EntryMemory, keys: set[str], pages: I64, slots: SlotsLike
) -> dict[str, str]:
    """Digests of what landed in the destination entries named by `keys`."""
    given = as_slots(slots)
    out: dict[str, str] = {}
    for i, e in enumerate(layout.kv):
        key = kv_key(e.layer_id, e.group)
        if key in keys:
            out[key] = _pages_digest(memory.region(i), e.item_len, pages)
    for j, s in enumerate(layout.state):
        key = state_key(s.layer_id, s.kind)
        slot = given.of(s.component)
        if key in keys and slot is not None:
            out[key] = _slot_digest(memory.region(len(layout.kv) + j), s.item_len, slot)
    first_aux = len(layout.kv) + len(layout.state)
    for a, entry in enumerate(layout.aux):
        key = aux_key(a)
        if key in keys and given.aux is not None:
            out[key] = _slot_digest(memory.region(first_aux + a), entry.item_len, given.aux)
    return out


class PoolMemory:
    """A layout placed in a pool: pool region i is entry i (KV entries first, then state, aux).

    Places the layout at the pool's addresses and serves `region` views for digests and checks.
    """

    def __init__(self, layout: StageLayout, pool: Pool) -> None:
        self.layout = layout.place(pool.bases)
        self.pool = pool

    def region(self, index: int) -> U8:
        return self.pool.view(index)

    def array(self, index: int) -> Any:
        """Region `index` on its own device: a torch tensor for torch pools (and embedded
        tensors), else a numpy view of host memory. What packing copies run on (host tensors
        through numpy: `kvhandoff.pipelines.packing.HOST_TENSORS_VIA_NUMPY`)."""
        return pool_array(self.pool, index)


def pool_array(pool: Pool, index: int) -> Any:
    tensor = getattr(pool, "tensor", None)
    found = tensor(index) if tensor is not None else None
    return found if found is not None else pool.view(index)
