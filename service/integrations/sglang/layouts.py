"""SGLang's `KVArgs` as kvhandoff stage layouts, and what this backend refuses.

Called once per scheduler rank by the manager (`manager.py`). The KV buffers follow the
layer-id contract as SGLang publishes it: `kv_data_ptrs` group-major, `kv_layer_ids` the global
ids (one per buffer, or the distinct ids; `[]` means SGLang's positional list, whose ids start
at `prefill_start_layer`). SGLang 0.5.23 publishes ids only for hybrid pools, so a plain model's
ranks all send positional lists: each gets its ids from its first layer, on a PP 1 decode too
(0), so a PP prefill's stages pair with it by global id. SGLang's aux (metadata) buffers hold
one row per request, indexed by the request's `aux_index`: they become the layout's aux entries
(paired by position, their row sizes checked), sent at the request's aux row from the last PP
stage only, where SGLang computes them.

SGLang's state components (`state_types`, each with its own buffers, `state_layer_ids` and one
index list per request) become state entries of that component: a MAMBA component's buffers
(tensor-major x layer: every layer's conv tensor, then every layer's temporal tensor) are entries
of kind `mamba.<tensor>` paired by global layer id, moved at the request's one MAMBA index, its
slot of component `mamba`. Components whose per-request indices are not one slot (SWA, DSA and
the other paged or ring components: a list of rows of their own pool, with window semantics
kvhandoff does not carry) are refused here by name before anything is registered. Draft-model
KV entries (speculative decoding) take their ids in SGLang's band above the target's layers.

Memory: SGLang publishes raw pointers. On `--device cuda` (`npu`) its KV and state pools live on
the rank's GPU (NPU), `gpu_id`, and its aux rows in host memory (`MetadataBuffers`); each buffer
becomes a tensor over that memory on its own device (`kvhandoff.transport.pointers.tensor_at`, no
copy; NPU memory through torch_npu, `kvhandoff.transport.npu`), so the decode's commits and the
prefill's gathers run with torch where the pages are. The NPU path is CPU-tested only: it has not
run on Ascend hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.layout import StageLayout, group_layer_ids, layout_from_flat_lists
from kvhandoff.transport.pointers import tensor_at

#: SGLang state components with one index per request (a slot of their own pool): what this
#: backend moves, as the state component of that name.
SLOT_COMPONENTS = frozenset({"mamba"})

#: SGLang's `--device` values whose memory this backend can reach with torch (npu: torch_npu).
DEVICES = ("cpu", "cuda", "npu")


class Unsupported(ValueError):
    """A feature of this SGLang deployment the kvhandoff backend does not carry (yet)."""


@dataclass(frozen=True)
class RankLayout:
    """One rank's layout and its raw buffers, KV, then state, then aux (region i is entry i),
    with the device each buffer lives on."""

    layout: StageLayout
    buffers: list[tuple[int, int]]
    devices: list[str]

    @property
    def has_aux(self) -> bool:
        return bool(self.layout.aux)

    def tensors(self) -> list[Any]:
        """The buffers as flat uint8 tensors over SGLang's memory, each on its own device (no
        copy; SGLang keeps the memory alive for the life of the scheduler)."""
        return [tensor_at(a, n, d) for (a, n), d in zip(self.buffers, self.devices, strict=True)]


def pool_device(device: str, gpu_id: int) -> str:
    """The torch device of a rank's KV and state pools under SGLang's `--device`."""
    return f"{device}:{gpu_id}" if device in ("cuda", "npu") else device


def refuse_unsupported(kv_args: Any, *, device: str, custom_mem_pool: str | None = None) -> None:
    """Raise Unsupported naming the first feature of `kv_args` this backend cannot move.

    `custom_mem_pool` is SGLANG_MOONCAKE_CUSTOM_MEM_POOL: Mooncake's own allocator for the KV
    pools (NVLink, Barex); one of its modes (INTRA_NODE_NVLINK) also puts SGLang's aux rows on
    the GPU, where this backend expects them in host memory."""
    if device not in DEVICES:
        raise Unsupported(
            f"--device {device} is not supported by the kvhandoff backend: it reaches host, "
            "CUDA and NPU memory only"
        )
    if custom_mem_pool:
        raise Unsupported(
            f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL={custom_mem_pool} configures the Mooncake "
            "backend's own allocator; unset it with kvhandoff"
        )
    kinds = state_types(kv_args)
    with_data = [k for i, k in enumerate(kinds) if _component_list(kv_args, "state_data_ptrs", i)]
    paged = [k for k in with_data if k not in SLOT_COMPONENTS]
    if paged:
        raise Unsupported(
            f"state components {paged} are not supported by the kvhandoff backend yet: their "
            "per-request indices are rows of their own pool (a sliding window's pages, a ring), "
            "not one slot per request; kvhandoff moves one slot per component "
            f"({', '.join(sorted(SLOT_COMPONENTS))})"
        )
    for i, kind in enumerate(kinds):
        ptrs = _component_list(kv_args, "state_data_ptrs", i)
        if ptrs and not _component_list(kv_args, "state_layer_ids", i):
            raise Unsupported(
                f"state component {kind!r} publishes no state_layer_ids: its entries cannot be "
                "paired by global layer id"
            )
    if getattr(kv_args, "host_kv_data_ptrs", None):
        raise Unsupported("host KV destinations (HiCache) are not supported by kvhandoff")


@dataclass(frozen=True)
class KVLists:
    """A rank's KV buffers in the layer-id contract's order, with their global ids (one per
    buffer)."""

    ptrs: list[int]
    lens: list[int]
    items: list[int]
    ids: list[int]


def kv_lists(kv_args: Any, *, is_mla: bool, pp_rank: int, pp_size: int) -> KVLists:
    """SGLang's `kv_data_*` lists as layout entries. SGLang appends the draft model's buffers
    (`num_draft_entries`, MTP / EAGLE) after the target's, each part group-major, with draft
    ids in a band above the target's layers (`build_kv_layer_ids`; from `prefill_end_layer`
    for a positional list): here the draft layers join each group after the target's, so the
    whole list is group-major and drafts pair by id like any layer."""
    ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    lens = [int(n) for n in kv_args.kv_data_lens]
    items = [int(n) for n in kv_args.kv_item_lens]
    n = len(ptrs)
    d = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if not 0 <= d <= n:
        raise Unsupported(f"num_draft_entries={d} for {n} KV buffers")
    if d and pp_rank != pp_size - 1:
        raise Unsupported(
            f"draft KV entries on PP stage {pp_rank} of {pp_size}: only the last stage sends "
            "them (another stage's copy would write the same decode entries)"
        )
    target_ids, draft_ids = _entry_ids(kv_args, n, d, groups=1 if is_mla else 2)
    t = n - d
    try:
        layers, target_groups = group_layer_ids(target_ids, t)
        drafts, draft_groups = group_layer_ids(draft_ids, d) if d else ([], target_groups)
    except LayoutError as exc:
        raise Unsupported(f"SGLang's KV lists do not make a kvhandoff layout: {exc}") from exc
    if draft_groups != target_groups:
        raise Unsupported(
            f"the draft model's {d} KV buffers make {draft_groups} groups, the target's "
            f"{t} make {target_groups}"
        )
    clash = sorted(set(layers) & set(drafts))
    if clash:
        raise Unsupported(
            f"draft layer id {clash[0]} is also a target layer id: draft entries need ids in "
            "their own band, above the target model's layers"
        )
    order: list[int] = []
    for g in range(target_groups):
        order += [g * len(layers) + i for i in range(len(layers))]
        order += [t + g * len(drafts) + i for i in range(len(drafts))]
    return KVLists(
        [ptrs[i] for i in order],
        [lens[i] for i in order],
        [items[i] for i in order],
        (layers + drafts) * target_groups,
    )


def _entry_ids(kv_args: Any, n: int, d: int, *, groups: int) -> tuple[list[int], list[int]]:
    """The layer id of each of the `n - d` target and `d` draft KV buffers: as published in
    `kv_layer_ids`, else by position (MHA lists K buffers, then V buffers: `groups` 2) from the
    stage's first layer, the draft's band from `prefill_end_layer`."""
    published = [int(i) for i in (kv_args.kv_layer_ids or [])]
    t = n - d
    if published:
        if len(published) != n:
            raise Unsupported(
                f"kv_layer_ids lists {len(published)} ids for {n} KV buffers ({d} of the draft)"
            )
        return published[:t], published[t:]
    if t % groups or d % groups:
        raise Unsupported(
            f"{t} target and {d} draft KV buffers do not split into {groups} groups (K, V)"
        )
    # A decode's KVArgs has no prefill_start_layer: it holds every layer, from 0.
    start = int(getattr(kv_args, "prefill_start_layer", None) or 0)
    end = int(getattr(kv_args, "prefill_end_layer", None) or start + t // groups)
    return list(range(start, start + t // groups)) * groups, list(
        range(end, end + d // groups)
    ) * groups


def rank_layout(
    kv_args: Any,
    *,
    pp_rank: int,
    pp_size: int,
    is_mla: bool,
    with_aux: bool,
    device: str = "cpu",
) -> RankLayout:
    """The layout of one rank (a prefill PP stage, or the decode with `pp_size` 1): KV and
    state buffers on `device` (`pool_device`), aux rows in host memory."""
    kv = kv_lists(kv_args, is_mla=is_mla, pp_rank=pp_rank, pp_size=pp_size)
    state = state_lists(kv_args)
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
            kv_data_ptrs=kv.ptrs,
            kv_data_lens=kv.lens,
            kv_item_lens=kv.items,
            kv_layer_ids=kv.ids,
            state_data_ptrs=state["state_data_ptrs"],
            state_data_lens=state["state_data_lens"],
            state_item_lens=state["state_item_lens"],
            state_layer_ids=state["state_layer_ids"],
            state_kinds=state["state_kinds"],
            state_components=state["state_components"],
            aux_data_ptrs=[int(p) for p in aux[0]],
            aux_data_lens=[int(n) for n in aux[1]],
            aux_item_lens=[int(n) for n in aux[2]],
        )
    except LayoutError as exc:
        raise Unsupported(f"SGLang's KVArgs do not make a kvhandoff layout: {exc}") from exc
    buffers = list(zip(kv.ptrs, kv.lens))
    buffers += [(e.base, e.nbytes) for e in layout.state]
    on_device = len(buffers)
    buffers += [(a.base, a.nbytes) for a in layout.aux]
    return RankLayout(layout, buffers, [device] * on_device + ["cpu"] * len(layout.aux))


def state_types(kv_args: Any) -> list[str]:
    """SGLang's state component names (`StateType` values), in `state_*` list order."""
    return [str(getattr(t, "value", t)) for t in (getattr(kv_args, "state_types", None) or [])]


def _component_list(kv_args: Any, name: str, i: int) -> list[int]:
    lists = getattr(kv_args, name, None) or []
    return [int(x) for x in lists[i]] if i < len(lists) and lists[i] is not None else []


def state_lists(kv_args: Any) -> dict[str, list[Any]]:
    """The `state_*` flat lists of `layout_from_flat_lists` for SGLang's slot components:
    every buffer of a component, kind `<component>.<tensor>` (its tensor-major position over
    the component's distinct layer ids), its global layer id and its component."""
    out: dict[str, list[Any]] = {
        "state_data_ptrs": [],
        "state_data_lens": [],
        "state_item_lens": [],
        "state_layer_ids": [],
        "state_kinds": [],
        "state_components": [],
    }
    for i, component in enumerate(state_types(kv_args)):
        ptrs = _component_list(kv_args, "state_data_ptrs", i)
        if not ptrs or component not in SLOT_COMPONENTS:
            continue  # nothing of it on this rank, or refused by `refuse_unsupported`
        ids = _component_list(kv_args, "state_layer_ids", i)
        try:
            layers, _ = group_layer_ids(ids, len(ptrs))
        except LayoutError as exc:
            raise Unsupported(f"state component {component!r}: {exc.message}") from exc
        for j, ptr in enumerate(ptrs):
            out["state_data_ptrs"].append(ptr)
            out["state_layer_ids"].append(layers[j % len(layers)])
            out["state_kinds"].append(f"{component}.{j // len(layers)}")
            out["state_components"].append(component)
        out["state_data_lens"] += _component_list(kv_args, "state_data_lens", i)
        out["state_item_lens"] += _component_list(kv_args, "state_item_lens", i)
    return out


def component_slots(
    types: Sequence[str], state_indices: Sequence[Any] | None
) -> tuple[dict[str, int], str | None]:
    """SGLang's per-component `state_indices` (parallel to `state_types`) as slots by
    component, or an error naming the component whose indices are not one slot."""
    slots: dict[str, int] = {}
    for component, indices in zip(types, state_indices or []):
        if indices is None or component not in SLOT_COMPONENTS:
            continue
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        if flat.shape[0] != 1:
            return {}, (
                f"state component {component!r} came with {flat.shape[0]} indices; kvhandoff "
                "moves one slot per request of it"
            )
        slots[component] = int(flat[0])
    return slots, None
