"""SGLang's `KVArgs` as kvhandoff stage layouts, and what this backend refuses.

Called once per scheduler rank by the manager (`backend.py`). The KV buffers follow the
layer-id contract as SGLang publishes it: `kv_data_ptrs` group-major, `kv_layer_ids` the global
ids (one per buffer, or the distinct ids; `[]` means SGLang's positional list, whose ids start
at `prefill_start_layer`). SGLang's aux (metadata) buffers hold one row per request, indexed by
the request's `aux_index`: they become state entries of a reserved layer id, one kind per aux
buffer, so they pair by (id, kind) and travel in the request's slot — from the last PP stage
only, where SGLang computes them.

One index space per request is what a handoff carries today (its slot), so a request whose state
lives at another index than its aux row (SGLang's MAMBA, SWA, DSA ... components) and draft
entries are refused here, naming what is unsupported, before anything is registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipelines.layout import StageLayout, StateEntry, layout_from_flat_lists

#: The layer id of the aux rows: far above any model's layers (draft bands included).
AUX_LAYER_ID = 1 << 20
AUX_KIND = "sglang_aux_{}"


class Unsupported(ValueError):
    """A feature of this SGLang deployment the kvhandoff backend does not carry (yet)."""


@dataclass(frozen=True)
class RankLayout:
    """One rank's layout and its raw buffers, KV entries first (region i is entry i)."""

    layout: StageLayout
    buffers: list[tuple[int, int]]
    has_aux: bool


def refuse_unsupported(kv_args: Any, *, device: str) -> None:
    """Raise Unsupported naming the first feature of `kv_args` this backend cannot move."""
    if device != "cpu":
        raise Unsupported(
            f"the kvhandoff SGLang backend registers host memory only in this version; "
            f"--device {device} buffers are not supported yet"
        )
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if num_draft:
        raise Unsupported(
            f"speculative-decoding draft KV entries (num_draft_entries={num_draft}) are not "
            "supported by the kvhandoff backend yet"
        )
    kinds = [str(getattr(t, "value", t)) for t in (getattr(kv_args, "state_types", None) or [])]
    with_data = [k for k, ptrs in zip(kinds, kv_args.state_data_ptrs or []) if ptrs]
    if with_data:
        raise Unsupported(
            f"state components {with_data} (a per-request index apart from the aux row) are not "
            "supported by the kvhandoff backend yet: a handoff carries one slot per request"
        )
    if getattr(kv_args, "host_kv_data_ptrs", None):
        raise Unsupported("host KV destinations (HiCache) are not supported by kvhandoff")


def kv_layer_ids(kv_args: Any, *, is_mla: bool, pp_size: int) -> list[int] | None:
    """The global layer ids of the KV buffers; None for a legacy positional PP=1 list."""
    ids = [int(i) for i in (kv_args.kv_layer_ids or [])]
    if ids:
        return ids
    if pp_size == 1:
        return None
    groups = 1 if is_mla else 2  # SGLang's MHA lists K buffers, then V buffers
    n = len(kv_args.kv_data_ptrs)
    if n % groups:
        raise Unsupported(f"{n} KV buffers do not split into {groups} groups (K, V)")
    start = int(kv_args.prefill_start_layer or 0)
    return list(range(start, start + n // groups))


def rank_layout(
    kv_args: Any,
    *,
    pp_rank: int,
    pp_size: int,
    is_mla: bool,
    with_aux: bool,
) -> RankLayout:
    """The layout of one rank (a prefill PP stage, or the decode with `pp_size` 1)."""
    ids = kv_layer_ids(kv_args, is_mla=is_mla, pp_size=pp_size)
    layout = layout_from_flat_lists(
        pp_rank=pp_rank,
        pp_size=pp_size,
        page_size=int(kv_args.page_size),
        dtype=str(kv_args.kv_cache_dtype_str),
        kv_data_ptrs=kv_args.kv_data_ptrs,
        kv_data_lens=kv_args.kv_data_lens,
        kv_item_lens=kv_args.kv_item_lens,
        kv_layer_ids=ids,
    )
    aux = aux_entries(kv_args) if with_aux else []
    buffers = [(int(p), int(n)) for p, n in zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens)]
    buffers += [(e.base, e.nbytes) for e in aux]
    placed = StageLayout(
        pp_rank=layout.pp_rank,
        pp_size=layout.pp_size,
        page_size=layout.page_size,
        dtype=layout.dtype,
        kv=layout.kv,
        state=tuple(aux),
        layer_ids_published=layout.layer_ids_published,
    )
    return RankLayout(placed, buffers, bool(aux))


def aux_entries(kv_args: Any) -> list[StateEntry]:
    ptrs: Sequence[int] = kv_args.aux_data_ptrs or []
    lens: Sequence[int] = kv_args.aux_data_lens or []
    items: Sequence[int] = kv_args.aux_item_lens or []
    out = []
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items)):
        if item <= 0 or length % item:
            raise Unsupported(
                f"aux buffer {i}: {length} bytes is not a whole number of {item}-byte rows"
            )
        out.append(
            StateEntry(AUX_LAYER_ID, AUX_KIND.format(i), int(item), length // item, int(ptr))
        )
    return out
