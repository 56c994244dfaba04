"""KVArgs -> layouts, and the features the backend refuses by name (no processes)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvhandoff.pipelines.errors import PairingError
from kvhandoff.pipelines.pairing import pair
from kvhandoff.service.integrations.sglang.layouts import (
    Unsupported,
    component_slots,
    pool_device,
    rank_layout,
    refuse_unsupported,
)
from kvhandoff.transport.errors import PoolError


def kv_args(**changes: Any) -> Any:
    base: dict[str, Any] = {
        "kv_data_ptrs": [4096, 8192, 12288, 16384],
        "kv_data_lens": [640] * 4,
        "kv_item_lens": [64] * 4,
        "kv_layer_ids": [5, 7, 5, 7],
        "kv_cache_dtype_str": "bfloat16",
        "aux_data_ptrs": [65536, 131072],
        "aux_data_lens": [128, 64],
        "aux_item_lens": [16, 8],
        "state_types": [],
        "state_data_ptrs": [],
        "page_size": 4,
        "prefill_start_layer": 4,
        "num_draft_entries": 0,
        "host_kv_data_ptrs": None,
    }
    return SimpleNamespace(**{**base, **changes})


def test_a_hybrid_stage_pairs_by_global_layer_id_and_carries_the_aux_rows() -> None:
    rank = rank_layout(kv_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True)
    kv = [(e.layer_id, e.group, e.base, e.num_items) for e in rank.layout.kv]
    assert kv == [(5, 0, 4096, 10), (7, 0, 8192, 10), (5, 1, 12288, 10), (7, 1, 16384, 10)]
    aux = [(a.item_len, a.num_rows, a.base) for a in rank.layout.aux]
    assert aux == [(16, 8, 65536), (8, 8, 131072)]
    assert rank.layout.state == ()  # aux rows are entries of their own, not state
    assert rank.buffers[-2:] == [(65536, 128), (131072, 64)] and rank.has_aux
    first = rank_layout(kv_args(), pp_rank=0, pp_size=2, is_mla=False, with_aux=False)
    assert first.layout.aux == () and not first.has_aux


def test_aux_rows_pair_by_position_and_a_row_size_mismatch_names_the_aux_entry() -> None:
    last = rank_layout(kv_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True).layout
    decode = rank_layout(
        kv_args(
            kv_layer_ids=[1, 3, 5, 7] * 2,
            kv_data_ptrs=[4096 * k for k in range(1, 9)],
            kv_data_lens=[640] * 8,
            kv_item_lens=[64] * 8,
        ),
        pp_rank=0,
        pp_size=1,
        is_mla=False,
        with_aux=True,
    ).layout
    assert pair(last, decode).num_aux_pairs == 2
    other = rank_layout(
        kv_args(
            kv_layer_ids=[1, 3, 5, 7] * 2,
            kv_data_ptrs=[4096 * k for k in range(1, 9)],
            kv_data_lens=[640] * 8,
            kv_item_lens=[64] * 8,
            aux_item_lens=[16, 16],
            aux_data_lens=[128, 128],
        ),
        pp_rank=0,
        pp_size=1,
        is_mla=False,
        with_aux=True,
    ).layout
    with pytest.raises(PairingError) as err:
        pair(last, other)
    assert err.value.context == {"aux": 1, "pp_rank": 1}
    assert "aux entry 1: source 8 bytes, destination 16" in str(err.value)


def test_a_torn_aux_buffer_is_refused_naming_it() -> None:
    with pytest.raises(Unsupported) as err:
        rank_layout(
            kv_args(aux_data_lens=[128, 60]), pp_rank=1, pp_size=2, is_mla=False, with_aux=True
        )
    assert "aux entry 1" in str(err.value) and "row size 8" in str(err.value)


def test_a_positional_list_takes_its_ids_from_the_rank_s_first_layer_and_pairs_by_id() -> None:
    # SGLang 0.5.23 publishes no ids for a plain model: a PP 2 prefill's second stage (layers
    # 4, 5) and a PP 1 decode (layers 0..5) must still pair by global id, not refuse the mix.
    rank = rank_layout(kv_args(kv_layer_ids=[]), pp_rank=1, pp_size=2, is_mla=False, with_aux=False)
    assert [(e.layer_id, e.group) for e in rank.layout.kv] == [(4, 0), (5, 0), (4, 1), (5, 1)]
    decode_args = kv_args(
        kv_layer_ids=[],
        kv_data_ptrs=[4096 * k for k in range(1, 13)],
        kv_data_lens=[640] * 12,
        kv_item_lens=[64] * 12,
    )
    del decode_args.prefill_start_layer  # a decode's KVArgs has none
    decode = rank_layout(
        decode_args,
        pp_rank=0,
        pp_size=1,
        is_mla=False,
        with_aux=False,
    )
    assert [e.layer_id for e in decode.layout.kv] == list(range(6)) * 2
    assert decode.layout.layer_ids_published
    pairs = pair(rank.layout, decode.layout)
    paired = zip(pairs.kv_layer.tolist(), pairs.kv_group.tolist(), pairs.kv_dst_base.tolist())
    assert sorted(paired) == [  # the decode's K of layers 4, 5 are its buffers 4, 5, V 10, 11
        (4, 0, 4096 * 5),
        (4, 1, 4096 * 11),
        (5, 0, 4096 * 6),
        (5, 1, 4096 * 12),
    ]


@pytest.mark.parametrize(
    ("changes", "device", "named"),
    [
        ({}, "xpu", "--device xpu is not supported by the kvhandoff backend: it reaches host"),
        ({"state_types": ["swa"], "state_data_ptrs": [[1]]}, "cpu", "components ['swa']"),
        ({"state_types": ["mamba", "dsa"], "state_data_ptrs": [[1], [2]]}, "cpu", "['dsa']"),
        ({"state_types": ["mamba"], "state_data_ptrs": [[1]]}, "cpu", "no state_layer_ids"),
        ({"host_kv_data_ptrs": [1]}, "cpu", "host KV destinations"),
    ],
)
def test_unsupported_features_are_refused_by_name(
    changes: dict[str, Any], device: str, named: str
) -> None:
    with pytest.raises(Unsupported) as err:
        refuse_unsupported(kv_args(**changes), device=device)
    assert named in str(err.value)
    refuse_unsupported(kv_args(), device="cpu")  # and the supported cases pass
    refuse_unsupported(kv_args(), device="cuda")
    refuse_unsupported(kv_args(), device="npu")


def test_mooncake_s_own_allocator_is_refused_by_name() -> None:
    with pytest.raises(Unsupported) as err:
        refuse_unsupported(kv_args(), device="cuda", custom_mem_pool="INTRA_NODE_NVLINK")
    assert "SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK" in str(err.value)


def test_kv_and_state_live_on_the_rank_s_gpu_and_aux_rows_in_host_memory() -> None:
    assert pool_device("cuda", 3) == "cuda:3" and pool_device("cpu", 3) == "cpu"
    rank = rank_layout(
        mamba_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True, device="cuda:3"
    )
    kv, state, aux = len(rank.layout.kv), len(rank.layout.state), len(rank.layout.aux)
    assert (kv, state, aux) == (4, 4, 2)
    assert rank.devices == ["cuda:3"] * (kv + state) + ["cpu"] * aux


def test_on_npu_kv_and_state_live_on_the_rank_s_npu_and_aux_rows_in_host_memory() -> None:
    assert pool_device("npu", 5) == "npu:5"
    rank = rank_layout(
        mamba_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True, device="npu:5"
    )
    assert rank.devices == ["npu:5"] * 8 + ["cpu"] * 2


def test_npu_buffers_without_torch_npu_are_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed, whatever this machine has
    rank = rank_layout(kv_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True, device="npu:0")
    with pytest.raises(PoolError) as err:
        rank.tensors()  # what the manager hands its embedded service
    assert "buffers on 'npu:0' needs torch_npu, which is not installed" in err.value.message


def test_a_rank_s_tensors_alias_sglang_s_buffers() -> None:
    memory = [np.zeros(n, dtype=np.uint8) for n in (640, 640, 640, 640, 128, 64)]
    ptrs = [int(m.ctypes.data) for m in memory]
    args = kv_args(kv_data_ptrs=ptrs[:4], aux_data_ptrs=ptrs[4:], aux_data_lens=[128, 64])
    rank = rank_layout(args, pp_rank=1, pp_size=2, is_mla=False, with_aux=True)
    tensors = rank.tensors()
    assert [t.data_ptr() for t in tensors] == ptrs
    assert [t.numel() for t in tensors] == [m.size for m in memory]
    tensors[4][3] = 5  # an aux row byte, written through the tensor
    assert memory[4][3] == 5


def mamba_args(**changes: Any) -> Any:
    # Stage 1 of 2: linear layers 4 and 6, conv (24-byte slots) then temporal (40), 6 slots.
    mamba = {
        "state_types": ["mamba"],
        "state_data_ptrs": [[1 << 20, 2 << 20, 3 << 20, 4 << 20]],
        "state_data_lens": [[144, 144, 240, 240]],
        "state_item_lens": [[24, 24, 40, 40]],
        "state_layer_ids": [[4, 6, 4, 6]],
    }
    return kv_args(**{**mamba, **changes})


def test_a_mamba_component_becomes_state_entries_of_its_own_component() -> None:
    refuse_unsupported(mamba_args(), device="cpu")
    rank = rank_layout(mamba_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=True)
    state = [(s.layer_id, s.kind, s.item_len, s.num_slots, s.component) for s in rank.layout.state]
    assert state == [
        (4, "mamba.0", 24, 6, "mamba"),
        (6, "mamba.0", 24, 6, "mamba"),
        (4, "mamba.1", 40, 6, "mamba"),
        (6, "mamba.1", 40, 6, "mamba"),
    ]
    # Regions in layout order: KV, then the Mamba buffers, then aux.
    assert rank.buffers[4:8] == [(1 << 20, 144), (2 << 20, 144), (3 << 20, 240), (4 << 20, 240)]
    torn = mamba_args(state_layer_ids=[[4, 6, 6, 4]])  # not tensor-major over the same layers
    with pytest.raises(Unsupported) as err:
        rank_layout(torn, pp_rank=1, pp_size=2, is_mla=False, with_aux=True)
    assert "state component 'mamba'" in str(err.value)


def test_state_indices_become_one_slot_per_component() -> None:
    # SGLang's MAMBA payload: a list holding one array of one index.
    assert component_slots(["mamba"], [[np.array([3], dtype=np.int32)]]) == ({"mamba": 3}, None)
    assert component_slots(["mamba"], None) == ({}, None)
    assert component_slots(["mamba", "swa"], [np.array([2]), None]) == ({"mamba": 2}, None)
    slots, refused = component_slots(["mamba"], [np.array([2, 5])])
    assert slots == {} and refused is not None and "2 indices" in refused


def draft_args(**changes: Any) -> Any:
    # Stage 1 of 2: target layers 5, 7 (K, V) and one MTP draft layer, SGLang's id 8 (the band
    # above the target's 8 layers), its K and V appended after the target's buffers.
    draft = {
        "kv_data_ptrs": [4096 * k for k in range(1, 7)],
        "kv_data_lens": [640] * 6,
        "kv_item_lens": [64] * 6,
        "kv_layer_ids": [5, 7, 5, 7, 8, 8],
        "num_draft_entries": 2,
        "prefill_end_layer": 8,
    }
    return kv_args(**{**draft, **changes})


def test_draft_entries_join_each_group_in_their_own_id_band() -> None:
    rank = rank_layout(draft_args(), pp_rank=1, pp_size=2, is_mla=False, with_aux=False)
    kv = [(e.layer_id, e.group, e.base) for e in rank.layout.kv]
    assert kv == [
        (5, 0, 4096),
        (7, 0, 8192),
        (8, 0, 4096 * 5),  # the draft's K after the target's K
        (5, 1, 4096 * 3),
        (7, 1, 4096 * 4),
        (8, 1, 4096 * 6),
    ]
    assert [b for b, _ in rank.buffers] == [e.base for e in rank.layout.kv]  # region i = entry i
    decode = rank_layout(
        draft_args(
            kv_data_ptrs=[4096 * k for k in range(1, 11)],
            kv_data_lens=[640] * 10,
            kv_item_lens=[64] * 10,
            kv_layer_ids=[1, 3, 5, 7, 1, 3, 5, 7, 8, 8],
        ),
        pp_rank=0,
        pp_size=1,
        is_mla=False,
        with_aux=False,
    ).layout
    p = pair(rank.layout, decode)
    assert sorted(zip(p.kv_layer.tolist(), p.kv_group.tolist())) == [
        (5, 0),
        (5, 1),
        (7, 0),
        (7, 1),
        (8, 0),
        (8, 1),
    ]
    # A positional list under PP: the target's ids from the stage's first layer, the draft's
    # from the end of the target's layers.
    positional = rank_layout(
        draft_args(kv_layer_ids=[]), pp_rank=1, pp_size=2, is_mla=False, with_aux=False
    )
    assert [(e.layer_id, e.group) for e in positional.layout.kv] == [
        (4, 0),
        (5, 0),
        (8, 0),
        (4, 1),
        (5, 1),
        (8, 1),
    ]


@pytest.mark.parametrize(
    ("changes", "pp_rank", "named"),
    [
        ({}, 0, "draft KV entries on PP stage 0 of 2"),
        ({"kv_layer_ids": [5, 7, 5, 7, 7, 7]}, 1, "draft layer id 7 is also a target layer id"),
        (
            {
                "num_draft_entries": 1,
                "kv_data_ptrs": [4096 * k for k in range(1, 6)],
                "kv_data_lens": [640] * 5,
                "kv_item_lens": [64] * 5,
                "kv_layer_ids": [5, 7, 5, 7, 8],
            },
            1,
            "the draft model's 1 KV buffers make 1 groups, the target's 4 make 2",
        ),
        ({"kv_layer_ids": [5, 7, 5, 7]}, 1, "4 ids for 6 KV buffers (2 of the draft)"),
    ],
)
def test_draft_entries_that_cannot_pair_by_id_are_refused_by_name(
    changes: dict[str, Any], pp_rank: int, named: str
) -> None:
    with pytest.raises(Unsupported) as err:
        rank_layout(draft_args(**changes), pp_rank=pp_rank, pp_size=2, is_mla=False, with_aux=False)
    assert named in str(err.value)


def _parallel(**changes: Any) -> SimpleNamespace:
    """The fields of SGLang's parallel context the CP check reads: a prefill of CP 2."""
    base = {"attn_cp_size": 2, "enable_dsa_cache_layer_split": False}
    base["enable_cp_tp_group_sharing"] = False
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize(
    ("prefill", "parallel", "env", "named"),
    [
        (False, {}, None, "on the decode"),
        (True, {}, "1", "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"),
        (True, {"enable_dsa_cache_layer_split": True}, None, "DSA cache layer split"),
        (True, {"enable_cp_tp_group_sharing": True}, None, "CP-TP group sharing"),
    ],
)
def test_attention_cp_where_every_rank_sends_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
    prefill: bool,
    parallel: dict[str, Any],
    env: str | None,
    named: str,
) -> None:
    from kvhandoff.service.integrations.sglang.refusals import refuse_context_parallel

    if env is None:
        monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", env)
    with pytest.raises(Unsupported) as err:
        refuse_context_parallel(_parallel(**parallel), kv_args(), prefill=prefill)
    assert named in str(err.value)


def test_attention_cp_with_cp_rank_0_sending_alone_is_carried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvhandoff.service.integrations.sglang.refusals import refuse_context_parallel

    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", raising=False)
    refuse_context_parallel(_parallel(), kv_args(), prefill=True)
    refuse_context_parallel(_parallel(attn_cp_size=1), kv_args(), prefill=False)
    hybrid_mla = kv_args(is_hybrid_mla_backend=True)
    with pytest.raises(Unsupported, match="hybrid MLA"):
        refuse_context_parallel(_parallel(), hybrid_mla, prefill=True)
