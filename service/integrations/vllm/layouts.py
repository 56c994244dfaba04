"""vLLM's KV caches as a kvhandoff stage layout, entries paired by global layer id.

Called once per worker by the connector's worker half, at `register_kv_caches`, with the dict
vLLM passes (layer name -> that layer's cache) and the `KVCacheConfig` the connector was built
with; the scheduler half calls `check_groups` on the same config at start-up. Nothing here
imports vLLM: its classes are read by their attributes, and a spec is known by its class name,
so a new spec type vLLM adds is refused by name until it is understood.

What vLLM gives, and what it becomes:

- an attention layer (a `FullAttentionSpec` / `MLAAttentionSpec` group) has one `[B, H, N, C]`
  view over `num_blocks` blocks (`create_kv_cache_views`; K and V side by side in C, on CPU
  `head_size` K then V values per token). With a layer-compact layout (LBHNC, the CPU
  backend's) a block is one contiguous page: one KV entry (group 0) per layer, a block a
  kvhandoff page, the attention groups' `block_size` the layout's page size. Block-outermost
  layouts, whose blocks interleave the layers' pages, are refused by name.
- a Mamba layer (a `MambaSpec` group) has its page's bytes (or, given state by state, views
  with one row per block inside the page): `page_size_bytes` is padded to the attention page
  in a hybrid model, whose groups overlay the same memory. The whole page is one state entry
  of kind `mamba` and of its group's component (`state_component`: each Mamba group gives a
  request a block of its own), its slot the request's block id in that group: a block of the
  pool belongs to one group at a time, so the page holds nothing of another layer while the
  request owns it. One attention group only: a kvhandoff request has one page list.

The global id of a layer is the one integer in its name (`model.layers.7.self_attn.attn`), as
vLLM's own `extract_layer_index` reads it; with pipeline parallelism every stage names its
layers by their global index, so stages pair with the decode by id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.layout import layout_from_flat_lists
from kvhandoff.service.integrations.sglang.layouts import RankLayout

#: vLLM KV cache spec classes whose blocks are pages of a request's attention KV.
ATTENTION_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
#: Spec classes whose blocks hold a request's recurrent state (one page per layer).
STATE_SPECS = frozenset({"MambaSpec"})
#: The state kind of Mamba pages (pairing is by layer id and kind).
MAMBA_COMPONENT = "mamba"


def state_component(group: int) -> str:
    """The state component of the Mamba layers of transfer group `group`: their slot is the
    request's block in that group."""
    return f"{MAMBA_COMPONENT}.g{int(group)}"


class Unsupported(ValueError):
    """A feature of this vLLM deployment the kvhandoff connector does not carry (yet)."""


def layer_index(name: str) -> int:
    """The global layer id in a vLLM layer name: its one all-digit dotted part."""
    ints = [int(part) for part in name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise Unsupported(
            f"layer {name!r} has {len(ints)} integer parts in its name; the kvhandoff connector "
            "pairs layers by the one global layer index vLLM names them with"
        )
    return ints[0]


def transfer_groups(kv_cache_config: Any) -> list[Any]:
    """The groups whose blocks move between engines: vLLM rebuilds the others (replicas it
    marks `enable_kv_transfer=False`) after a load."""
    return [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]


def check_groups(kv_cache_config: Any) -> int:
    """Refuse, naming the group, a KV cache config this connector cannot move; return the
    page size (tokens per block of the attention groups)."""
    groups = transfer_groups(kv_cache_config)
    sizes: set[int] = set()
    seen: dict[int, str] = {}
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind not in ATTENTION_SPECS | STATE_SPECS:
            raise Unsupported(
                f"KV cache group {g} ({kind}, layers {list(group.layer_names)[:3]}...) is not "
                "supported by the kvhandoff connector: it moves full attention "
                f"({', '.join(sorted(ATTENTION_SPECS))}) and Mamba state "
                f"({', '.join(sorted(STATE_SPECS))}) blocks"
            )
        if kind in ATTENTION_SPECS:
            sizes.add(int(spec.block_size))
        for name in group.layer_names:
            layer = layer_index(name)
            if layer in seen:
                raise Unsupported(
                    f"layers {seen[layer]!r} and {name!r} share global layer id {layer}: "
                    "the kvhandoff connector pairs entries by layer id"
                )
            seen[layer] = name
    if len(sizes) > 1:
        raise Unsupported(
            f"attention groups with block sizes {sorted(sizes)}: a kvhandoff layout has one "
            "page size"
        )
    if not sizes:
        raise Unsupported("no attention group: the kvhandoff connector needs one page size")
    attention = [
        g for g, group in enumerate(groups) if type(group.kv_cache_spec).__name__ in ATTENTION_SPECS
    ]
    if len(attention) > 1:
        raise Unsupported(
            f"KV cache groups {attention} all hold attention layers, each with blocks of its "
            "own per request: a kvhandoff request has one page list"
        )
    return sizes.pop()


def attention_group(kv_cache_config: Any) -> int:
    """The index (among the transfer groups) of the one attention group."""
    for g, group in enumerate(transfer_groups(kv_cache_config)):
        if type(group.kv_cache_spec).__name__ in ATTENTION_SPECS:
            return g
    raise Unsupported("no attention group")


def state_groups(kv_cache_config: Any) -> list[int]:
    """The indices (among the transfer groups) of the Mamba groups."""
    return [
        g
        for g, group in enumerate(transfer_groups(kv_cache_config))
        if type(group.kv_cache_spec).__name__ in STATE_SPECS
    ]


def rank_layout(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    device: str = "cpu",
) -> RankLayout:
    """The layout of one worker (a PP stage of the prefill, or the decode with `pp_size` 1)
    over the caches vLLM registers: KV entries group-major by layer id, then one Mamba page
    entry per state layer. Unsupported names the layer whose cache does not fit."""
    page_size = check_groups(kv_cache_config)
    pages = _layer_pages(kv_caches, kv_cache_config)
    layers = list(pages.kv)
    flat = [pages.kv[layer] for layer in layers]
    state = pages.state
    try:
        layout = layout_from_flat_lists(
            pp_rank=pp_rank,
            pp_size=pp_size,
            page_size=page_size,
            dtype=pages.dtype,
            kv_data_ptrs=[p for p, _, _ in flat],
            kv_data_lens=[n for _, n, _ in flat],
            kv_item_lens=[i for _, _, i in flat],
            kv_layer_ids=layers,
            state_data_ptrs=[p for _, p, _, _ in state],
            state_data_lens=[n for _, _, n, _ in state],
            state_item_lens=[i for _, _, _, i in state],
            state_layer_ids=[layer for layer, _, _, _ in state],
            state_kinds=[MAMBA_COMPONENT] * len(state),
            state_components=pages.components,
        )
    except LayoutError as exc:
        raise Unsupported(f"vLLM's KV caches do not make a kvhandoff layout: {exc}") from exc
    buffers = [(p, n) for p, n, _ in flat] + [(p, n) for _, p, n, _ in state]
    return RankLayout(layout, buffers, [device] * len(buffers))


class _LayerPages(NamedTuple):
    """Each transferred layer's blocks, as `_layer_pages` found them in vLLM's caches."""

    #: attention layer id -> (address, bytes, page bytes), in layer order
    kv: dict[int, tuple[int, int, int]]
    #: (layer id, address, bytes, page bytes) of each Mamba layer, in layer order
    state: list[tuple[int, int, int, int]]
    #: each Mamba layer's state component (its group's, `state_component`)
    components: list[str]
    #: the attention layers' one dtype ("" without attention layers)
    dtype: str


def _layer_pages(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> _LayerPages:
    """The blocks of every layer of the transfer groups, in layer order. Unsupported names a
    layer vLLM gave no cache for, or attention layers of several dtypes."""
    num_blocks = int(kv_cache_config.num_blocks)
    groups = transfer_groups(kv_cache_config)
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    missing = sorted(set(group_of) - set(kv_caches))
    if missing:
        raise Unsupported(f"register_kv_caches gave no cache for layer {missing[0]!r}")
    out = _LayerPages({}, [], [], "")
    dtypes: set[str] = set()
    for name in sorted(group_of, key=layer_index):
        spec = groups[group_of[name]].kv_cache_spec
        pages = _pages(name, kv_caches[name], spec, num_blocks)
        if type(spec).__name__ in ATTENTION_SPECS:
            out.kv[layer_index(name)] = pages
            dtypes.add(str(spec.dtype))
        else:
            out.state.append((layer_index(name), *pages))
            out.components.append(state_component(group_of[name]))
    if len(dtypes) > 1:
        raise Unsupported(f"attention layers of dtypes {sorted(dtypes)}: a layout has one dtype")
    return out._replace(dtype=dtypes.pop() if dtypes else "")


def _pages(name: str, cache: Any, spec: Any, num_blocks: int) -> tuple[int, int, int]:
    """(address, bytes, page bytes) of one layer's blocks: every tensor of the layer (its
    `[B, H, N, C]` view; a Mamba layer's states, if given one by one) has one contiguous row
    per block, rows a page apart, all inside the page that starts at the lowest address."""
    tensors: Sequence[Any] = cache if isinstance(cache, (list, tuple)) else [cache]
    page = int(spec.page_size_bytes)
    if not tensors:
        raise Unsupported(f"layer {name!r}: no cache tensors")
    base = min(int(t.data_ptr()) for t in tensors)
    for i, t in enumerate(tensors):
        size = t.element_size()
        ok = t.dim() >= 1 and t.shape[0] == num_blocks
        if ok and int(t.stride(0)) * size != page:
            raise Unsupported(
                f"layer {name!r}: its blocks are {int(t.stride(0)) * size} bytes apart, its "
                f"pages {page} bytes (a block-outermost KV cache layout interleaves the layers' "
                "pages); the kvhandoff connector needs a layer-compact layout "
                "(VLLM_KV_CACHE_LAYOUT, e.g. LBHNC)"
            )
        if not (
            ok
            and t[0].is_contiguous()
            and int(t.data_ptr()) - base + int(t[0].numel()) * size <= page
        ):
            raise Unsupported(
                f"layer {name!r}: cache tensor {i} {tuple(t.shape)} (strides "
                f"{tuple(t.stride())}) is not one contiguous row per block inside a page of "
                f"{page} bytes"
            )
    return base, page * num_blocks, page
