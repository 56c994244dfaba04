"""The connector's layouts from KV caches as vLLM itself views them (`create_kv_cache_views`
over a `KVCacheTensor`'s geometry, vLLM's config classes): the CPU backend's layer-compact
pages, a hybrid model's Mamba pages overlaying attention memory, PP stages named by global
index, and each refusal by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvhandoff.service.integrations.vllm.layouts import (
    Unsupported,
    check_groups,
    layer_index,
    rank_layout,
    state_component,
)

BLOCKS, BLOCK, HEADS, HEAD = 8, 32, 2, 32


def attn_spec(block_size: int = BLOCK, **extra: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, **extra
    )


def config(groups: list[tuple[list[str], Any]], tensors: list[KVCacheTensor]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names, spec) for layer_names, spec in groups],
    )


def views(
    names: list[str],
    spec: Any,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    raw: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], KVCacheTensor]:
    """The layers' caches over one allocation (`raw`: another group's, overlaid), as vLLM's
    runner views them in `layout`."""
    page = spec.page_size_bytes
    compact = layout.is_layer_compact
    geometry = KVCacheTensor(
        size=page * BLOCKS * len(names),
        layers=names,
        layer_stride=page * BLOCKS if compact else page,
        block_stride=page if compact else page * len(names),
    )
    if raw is None:
        raw = torch.zeros(geometry.size, dtype=torch.int8)
    caches = create_kv_cache_views(raw, spec, BLOCKS, layout, geometry)
    return dict(zip(names, caches, strict=True)), geometry


def test_layer_index_is_the_one_integer_of_the_name() -> None:
    assert layer_index("model.layers.7.self_attn.attn") == 7
    with pytest.raises(Unsupported, match="0 integer parts"):
        layer_index("model.lm_head")
    with pytest.raises(Unsupported, match="2 integer parts"):
        layer_index("model.layers.3.experts.1.attn")


def test_cpu_llama_layers_are_one_page_per_block() -> None:
    spec = attn_spec()
    names = [f"model.layers.{i}.self_attn.attn" for i in (1, 0, 3, 2)]  # not in id order
    caches, geometry = views(names, spec)
    rank = rank_layout(caches, config([(names, spec)], [geometry]))
    layout = rank.layout
    assert layout.page_size == BLOCK and layout.num_groups == 1
    assert layout.kv_layer_ids == [0, 1, 2, 3]
    for entry in layout.kv:
        cache = caches[f"model.layers.{entry.layer_id}.self_attn.attn"]
        assert entry.base == cache.data_ptr()
        assert entry.item_len == spec.page_size_bytes == BLOCK * HEADS * 2 * HEAD * 2
        assert entry.num_items == BLOCKS
    # Page 3 of layer 2 through the layout's own tensor is vLLM's block 3 of that layer, and
    # nothing else.
    item = layout.kv[2].item_len
    rank.tensors()[2][3 * item : 4 * item] = 7
    cache = caches["model.layers.2.self_attn.attn"]
    assert bool((cache[3].view(torch.int8) == 7).all())
    total = sum(int(c.view(torch.int8).count_nonzero()) for c in caches.values())
    assert total == item


def test_hybrid_mamba_pages_overlay_attention_memory() -> None:
    attn = ["model.layers.2.self_attn.attn"]
    ssm = ["model.layers.0.mixer", "model.layers.1.mixer"]
    spec = attn_spec(BLOCK * 4)
    mamba = MambaSpec(
        block_size=BLOCK * 4,
        shapes=((3, 96), (4, 32, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=spec.page_size_bytes,  # vLLM pads Mamba pages to the attention page
    )
    raw = torch.zeros(mamba.page_size_bytes * BLOCKS * len(ssm), dtype=torch.int8)
    m, m_geometry = views(ssm, mamba, raw=raw)
    # vLLM overlays the groups on one allocation: the attention layer on the first Mamba's.
    a, _ = views(attn, spec, raw=raw)
    assert a[attn[0]].data_ptr() == m[ssm[0]].data_ptr()
    rank = rank_layout({**a, **m}, config([(attn, spec), (ssm, mamba)], [m_geometry]))
    layout = rank.layout
    assert layout.kv_layer_ids == [2]
    assert [(s.layer_id, s.component) for s in layout.state] == [
        (0, state_component(1)),
        (1, state_component(1)),
    ]
    second = layout.state[1]
    assert second.base == m[ssm[1]].data_ptr() and second.item_len == spec.page_size_bytes
    assert second.num_slots == BLOCKS
    # Slot 5 of layer 1 is that layer's block 5 (both states), no other block or layer.
    rank.tensors()[2][5 * second.item_len : 6 * second.item_len] = 1
    assert bool((m[ssm[1]][5] == 1).all())
    assert int(raw.count_nonzero()) == second.item_len
    assert int(m[ssm[0]].count_nonzero()) == int(a[attn[0]].count_nonzero()) == 0


def test_pp_stage_pairs_by_global_layer_ids() -> None:
    spec = attn_spec()
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]
    caches, geometry = views(names, spec)
    layout = rank_layout(caches, config([(names, spec)], [geometry]), pp_rank=1, pp_size=2).layout
    assert (layout.pp_rank, layout.pp_size, layout.kv_layer_ids) == (1, 2, [2, 3])


def test_a_block_outermost_layout_is_refused_naming_the_layer() -> None:
    spec = attn_spec()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    caches, geometry = views(names, spec, KVCacheLayout.BLHNC)
    with pytest.raises(Unsupported, match=r"'model.layers.0.self_attn.attn'.*layer-compact"):
        rank_layout(caches, config([(names, spec)], [geometry]))


def test_a_sliding_window_group_is_refused_by_name() -> None:
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16,
        sliding_window=64,
    )  # fmt: skip
    with pytest.raises(Unsupported, match=r"group 0 \(SlidingWindowSpec"):
        check_groups(config([(["model.layers.0.attn"], window)], []))


def test_attention_groups_of_two_block_sizes_are_refused() -> None:
    groups = [(["model.layers.0.attn"], attn_spec(32)), (["model.layers.1.attn"], attn_spec(64))]
    with pytest.raises(Unsupported, match=r"block sizes \[32, 64\]"):
        check_groups(config(groups, []))


def test_two_layers_with_one_id_are_refused() -> None:
    names = ["model.layers.0.attn", "draft.layers.0.attn"]
    with pytest.raises(Unsupported, match="share global layer id 0"):
        check_groups(config([(names, attn_spec())], []))


def test_a_layer_without_a_cache_is_refused() -> None:
    spec = attn_spec()
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    caches, geometry = views(names[:1], spec)
    with pytest.raises(Unsupported, match=r"no cache for layer 'model.layers.1.attn'"):
        rank_layout(caches, config([(names, spec)], [geometry]))
