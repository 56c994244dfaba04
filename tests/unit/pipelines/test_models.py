import pytest

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.models import (
    ModelSpec,
    decode_layout,
    dense_mha,
    dense_mla,
    every_nth,
    hybrid_mha,
    hybrid_npu_mla,
    partition_layers,
    preset,
    stage_layout,
)


def test_even_partition_gives_the_remainder_to_the_last_stages() -> None:
    assert partition_layers(10, 4).bounds == (0, 2, 4, 7, 10)
    assert partition_layers(48, 4).bounds == (0, 12, 24, 36, 48)


def test_uneven_and_explicit_partitions() -> None:
    assert partition_layers(10, 3, counts=[2, 5, 3]).bounds == (0, 2, 7, 10)
    assert partition_layers(10, 3, boundaries=[4, 6]).bounds == (0, 4, 6, 10)
    assert list(partition_layers(10, 3, boundaries=[4, 6]).layers(1)) == [4, 5]


@pytest.mark.parametrize(
    "kwargs",
    [{"counts": [5, 6]}, {"counts": [10, 0]}, {"boundaries": [6, 4]}, {"boundaries": [12]}],
)
def test_bad_partitions_are_rejected(kwargs: dict[str, list[int]]) -> None:
    with pytest.raises(LayoutError):
        partition_layers(
            10, len(kwargs.get("counts", [])) or len(kwargs["boundaries"]) + 1, **kwargs
        )  # type: ignore[arg-type]


def test_every_nth_is_three_linear_to_one_full() -> None:
    assert every_nth(12, 4) == (3, 7, 11)


def test_hybrid_stage_holds_only_its_layers() -> None:
    model = hybrid_npu_mla(num_layers=16, scale=64)
    part = partition_layers(16, 4)
    layout = stage_layout(model, part, 2, num_pages=8, num_slots=2)
    assert layout.full_attention_layers == [11]
    assert {(s.layer_id, s.kind) for s in layout.state} == {
        (layer, kind) for layer in (8, 9, 10) for kind in ("conv", "temporal")
    }
    # page_size 128: c_kv 1024/64 = 16 bytes per token, k_rope 128/64 = 2
    assert [e.item_len for e in layout.kv] == [128 * 16, 128 * 2]


def test_npu_mla_groups_have_different_item_lengths_and_optional_indexer() -> None:
    model = hybrid_npu_mla(scale=1)
    assert [model.item_len(g) for g in range(2)] == [128 * 1024, 128 * 128]
    assert len(hybrid_npu_mla(indexer=True).kv_groups) == 3


def test_decode_layout_holds_every_layer_and_draft_layers_use_the_reserved_band() -> None:
    model = dense_mla(num_layers=6, scale=16)
    dec = decode_layout(model, num_pages=4, num_slots=1)
    assert dec.full_attention_layers == [0, 1, 2, 3, 4, 5, 6]
    last = stage_layout(model, partition_layers(6, 2), 1, num_pages=4, num_slots=1)
    assert last.full_attention_layers == [3, 4, 5, 6]


def test_dense_presets_have_no_state() -> None:
    assert decode_layout(dense_mha(num_layers=4), num_pages=2, num_slots=1).state == ()
    assert len(decode_layout(hybrid_mha(num_layers=8), num_pages=2, num_slots=1).state) == 12


def test_model_rejects_out_of_range_layers() -> None:
    with pytest.raises(LayoutError, match="layer 9"):
        ModelSpec(
            name="x",
            num_layers=4,
            full_attention_layers=(9,),
            attention=dense_mha().attention,
            kv_groups=dense_mha().kv_groups,
        )


def test_preset_by_name() -> None:
    assert preset("hybrid-npu-mla", scale=64).name == "hybrid-npu-mla"
    with pytest.raises(LayoutError, match="unknown model preset"):
        preset("nope")
