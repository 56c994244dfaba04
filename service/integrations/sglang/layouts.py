"""SGLang's `KVArgs` as kvhandoff stage layouts, and what this backend refuses.

Called once per scheduler rank by the manager (`backend.py`). The KV buffers follow the
layer-id contract as SGLang publishes it: `kv_data_ptrs` group-major, `kv_layer_ids` the global
ids (one per buffer, or the distinct ids; `[]` means SGLang's positional list, whose ids start
at `prefill_start_layer`). SGLang's aux (metadata) buffers hold one row per request, indexed by
the request's `aux_index`: they become the layout's aux entries (paired by position, their row
sizes checked), sent at the request's aux row from the last PP stage only, where SGLang
computes them.

One index space per request is what a handoff carries today (its slot), so a request whose state
lives at another index than its aux row (SGLang's MAMBA, SWA, DSA ... components) and draft
entries are refused here, naming what is unsupported, before anything is registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipelines.errors import LayoutError
from pipelines.layout import StageLayout, layout_from_flat_lists


class Unsupported(ValueError):
    """A feature of this SGLang deployment the kvhandoff backend does not carry (yet)."""


@dataclass(frozen=True)
class RankLayout:
    """One rank's layout and its raw buffers, KV, then state, then aux (region i is entry i)."""

    layout: StageLayout
    buffers: list[tuple[int, int]]

    @property
    def has_aux(self) -> bool:
        return bool(self.layout.aux)


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
    aux: list[Sequence[int]] = (
        [kv_args.aux_data_ptrs or [], kv_args.aux_data_lens or [], kv_args.aux_item_lens or []]
        if with_aux
        else [[], [], []]
    )
    try:
        layout = layout_from_flat_lists(
            pp_rank=pp_rank,
            pp_size=pp_size,
            page_size=int(kv_args.page_size),
            dtype=str(kv_args.kv_cache_dtype_str),
            kv_data_ptrs=kv_args.kv_data_ptrs,
            kv_data_lens=kv_args.kv_data_lens,
            kv_item_lens=kv_args.kv_item_lens,
            kv_layer_ids=ids,
            aux_data_ptrs=[int(p) for p in aux[0]],
            aux_data_lens=[int(n) for n in aux[1]],
            aux_item_lens=[int(n) for n in aux[2]],
        )
    except LayoutError as exc:
        raise Unsupported(f"SGLang's KVArgs do not make a kvhandoff layout: {exc}") from exc
    buffers = [(int(p), int(n)) for p, n in zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens)]
    buffers += [(a.base, a.nbytes) for a in layout.aux]
    return RankLayout(layout, buffers)
