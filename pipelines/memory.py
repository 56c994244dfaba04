"""Reading registered entries for verification, and the digests both sides compare.

`EntryMemory` is the one thing `pipelines` needs from a pool: a byte view of every entry of a
layout, KV entries first then state entries (the order pools allocate regions in). The sender
digests what it sent, the decode side digests what landed, and a mismatch names the entry.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pipelines.layout import StageLayout
from pipelines.pairing import Pairing
from transport.pool_base import Pool

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class EntryMemory(Protocol):
    def region(self, index: int) -> U8:
        """A uint8 view of region `index` (KV entries first, then state entries)."""
        ...


def kv_key(layer: int, group: int) -> str:
    return f"kv:{layer}:{group}"


def state_key(layer: int, kind: str) -> str:
    return f"state:{layer}:{kind}"


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
    slot: int | None,
    kv_rows: I64,
    state_rows: I64,
) -> dict[str, str]:
    """Digests of the source bytes of the given pairing rows, keyed by layer and group/kind."""
    src = pairing.src
    out: dict[str, str] = {}
    for row in kv_rows.tolist():
        i = int(pairing.kv_src_index[row])
        e = src.kv[i]
        out[kv_key(e.layer_id, e.group)] = _pages_digest(memory.region(i), e.item_len, pages)
    for row in state_rows.tolist():
        j = int(pairing.state_src_index[row])
        s = src.state[j]
        assert slot is not None
        view = memory.region(len(src.kv) + j)
        out[state_key(s.layer_id, s.kind)] = _slot_digest(view, s.item_len, slot)
    return out


def destination_digests(
    layout: StageLayout, memory: EntryMemory, keys: set[str], pages: I64, slot: int | None
) -> dict[str, str]:
    """Digests of what landed in the destination entries named by `keys`."""
    out: dict[str, str] = {}
    for i, e in enumerate(layout.kv):
        key = kv_key(e.layer_id, e.group)
        if key in keys:
            out[key] = _pages_digest(memory.region(i), e.item_len, pages)
    for j, s in enumerate(layout.state):
        key = state_key(s.layer_id, s.kind)
        if key in keys and slot is not None:
            out[key] = _slot_digest(memory.region(len(layout.kv) + j), s.item_len, slot)
    return out


class PoolMemory:
    """A layout placed in a pool: pool region i is entry i (KV entries first, then state).

    Places the layout at the pool's addresses and serves `region` views for digests and checks.
    """

    def __init__(self, layout: StageLayout, pool: Pool) -> None:
        n = len(layout.kv)
        self.layout = layout.with_bases(pool.bases[:n], pool.bases[n:])
        self.pool = pool

    def region(self, index: int) -> U8:
        return self.pool.view(index)

    def array(self, index: int) -> Any:
        """Region `index` on its own device: a torch tensor for torch pools (and embedded
        tensors), else a numpy view of host memory. What packing copies run on (host tensors
        through numpy: `pipelines.packing.HOST_TENSORS_VIA_NUMPY`)."""
        return pool_array(self.pool, index)


def pool_array(pool: Pool, index: int) -> Any:
    tensor = getattr(pool, "tensor", None)
    found = tensor(index) if tensor is not None else None
    return found if found is not None else pool.view(index)
