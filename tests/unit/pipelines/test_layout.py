import msgspec
import pytest

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.layout import (
    AuxEntry,
    KVEntry,
    StageLayout,
    StateEntry,
    group_layer_ids,
    layout_from_flat_lists,
    publish_kv_layer_ids,
)
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_published_ids_repeat_once_per_group_and_match_buffer_count(groups: int) -> None:
    model = hybrid_npu_mla(num_layers=16, scale=64, indexer=groups == 3)
    if groups == 1:
        model = msgspec.structs.replace(model, kv_groups=model.kv_groups[:1])
    layout = stage_layout(model, partition_layers(16, 2), 1, num_pages=8, num_slots=2)
    full = [11, 15]
    assert layout.kv_layer_ids == full * groups
    assert layout.kv_layer_ids == publish_kv_layer_ids(full, groups)
    assert len(layout.kv_layer_ids) == len(layout.kv)
    assert [e.group for e in layout.kv] == [g for g in range(groups) for _ in full]
    assert group_layer_ids(layout.kv_layer_ids, len(layout.kv)) == (full, groups)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_flat_lists_round_trip(groups: int) -> None:
    ids = [3, 7, 11]
    n = len(ids) * groups
    item_lens = [64 * (1 + k // len(ids)) for k in range(n)]
    layout = layout_from_flat_lists(
        pp_rank=0,
        pp_size=1,
        page_size=16,
        dtype="bfloat16",
        kv_data_ptrs=[0x1000 * (k + 1) for k in range(n)],
        kv_data_lens=[il * 10 for il in item_lens],
        kv_item_lens=item_lens,
        kv_layer_ids=publish_kv_layer_ids(ids, groups),
    )
    assert [(e.layer_id, e.group) for e in layout.kv] == [
        (i, g) for g in range(groups) for i in ids
    ]
    assert all(e.num_items == 10 for e in layout.kv)
    # The distinct-id form gives the same layout.
    again = layout_from_flat_lists(
        pp_rank=0,
        pp_size=1,
        page_size=16,
        dtype="bfloat16",
        kv_data_ptrs=[0x1000 * (k + 1) for k in range(n)],
        kv_data_lens=[il * 10 for il in item_lens],
        kv_item_lens=item_lens,
        kv_layer_ids=ids,
    )
    assert again == layout


def test_non_divisible_buffer_count_is_an_error_naming_both_numbers() -> None:
    with pytest.raises(LayoutError) as err:
        layout_from_flat_lists(
            pp_rank=0,
            pp_size=1,
            page_size=16,
            dtype="bfloat16",
            kv_data_ptrs=[1, 2, 3, 4, 5],
            kv_data_lens=[64] * 5,
            kv_item_lens=[64] * 5,
            kv_layer_ids=[3, 7],
        )
    assert "5 KV buffers" in str(err.value) and "2 layer ids" in str(err.value)
    assert err.value.context["num_buffers"] == 5
    assert err.value.context["num_layers"] == 2


def test_badly_repeated_ids_are_rejected() -> None:
    with pytest.raises(LayoutError, match="repeated once per buffer group"):
        group_layer_ids([3, 7, 7, 3], 4)


def test_data_len_must_be_a_multiple_of_item_len() -> None:
    with pytest.raises(LayoutError) as err:
        layout_from_flat_lists(
            pp_rank=0,
            pp_size=1,
            page_size=16,
            dtype="bfloat16",
            kv_data_ptrs=[1],
            kv_data_lens=[100],
            kv_item_lens=[64],
            kv_layer_ids=[5],
        )
    assert err.value.context == {"field": "kv_item_lens[0]", "layer_id": 5, "group": 0}


def test_legacy_layout_without_ids_is_marked_positional() -> None:
    layout = layout_from_flat_lists(
        pp_rank=0,
        pp_size=1,
        page_size=16,
        dtype="bfloat16",
        kv_data_ptrs=[1, 2],
        kv_data_lens=[64, 64],
        kv_item_lens=[32, 32],
    )
    assert not layout.layer_ids_published


def test_fingerprint_ignores_addresses_but_not_shape() -> None:
    model = hybrid_npu_mla(num_layers=8, scale=64)
    a = decode_layout(model, num_pages=8, num_slots=2)
    moved = a.with_bases([k + 100 for k in range(len(a.kv))], [7] * len(a.state))
    assert moved.fingerprint == a.fingerprint
    assert moved.address_key != a.address_key
    bigger = decode_layout(model, num_pages=9, num_slots=2)
    assert bigger.fingerprint != a.fingerprint


def test_layout_survives_the_wire() -> None:
    layout = decode_layout(hybrid_npu_mla(num_layers=8, scale=64), num_pages=4, num_slots=2)
    back = msgspec.json.decode(msgspec.json.encode(layout), type=StageLayout)
    assert back == layout and back.fingerprint == layout.fingerprint


def test_wire_constraints_name_the_path() -> None:
    bad = b'{"layer_id": -1, "group": 0, "item_len": 8, "num_items": 1, "base": 0}'
    with pytest.raises(msgspec.ValidationError, match=r"\$.layer_id"):
        msgspec.json.decode(bad, type=KVEntry)


def test_pp_rank_must_be_below_pp_size() -> None:
    with pytest.raises(LayoutError, match="pp_rank 2"):
        StageLayout(pp_rank=2, pp_size=2, page_size=16, dtype="bfloat16")


def test_aux_entries_are_refused_on_a_stage_other_than_the_last() -> None:
    aux = (AuxEntry(16, 4, 0),)
    with pytest.raises(LayoutError) as err:
        StageLayout(pp_rank=0, pp_size=2, page_size=4, dtype="bfloat16", aux=aux)
    assert err.value.context == {"field": "aux", "pp_rank": 0}
    assert "only the last PP stage (1) sends aux rows" in err.value.message
    last = StageLayout(pp_rank=1, pp_size=2, page_size=4, dtype="bfloat16", aux=aux)
    assert last.region_sizes == [64]


def test_flat_lists_make_aux_entries_after_state_and_refuse_a_torn_row() -> None:
    layout = layout_from_flat_lists(
        pp_rank=0,
        pp_size=1,
        page_size=4,
        dtype="bfloat16",
        kv_data_ptrs=[4096],
        kv_data_lens=[640],
        kv_item_lens=[64],
        kv_layer_ids=[3],
        aux_data_ptrs=[1 << 20, 2 << 20],
        aux_data_lens=[128, 64],
        aux_item_lens=[16, 8],
    )
    assert [(a.item_len, a.num_rows, a.base) for a in layout.aux] == [
        (16, 8, 1 << 20),
        (8, 8, 2 << 20),
    ]
    assert layout.region_sizes == [640, 128, 64]
    assert layout.place([1, 2, 3]).aux[1].base == 3
    wider = msgspec.structs.replace(layout, aux=(layout.aux[0], AuxEntry(16, 8, 2 << 20)))
    assert wider.fingerprint != layout.fingerprint  # peers re-pair when an aux row grows
    with pytest.raises(LayoutError) as err:
        layout_from_flat_lists(
            pp_rank=0,
            pp_size=1,
            page_size=4,
            dtype="bfloat16",
            kv_data_ptrs=[],
            kv_data_lens=[],
            kv_item_lens=[],
            aux_data_ptrs=[1 << 20],
            aux_data_lens=[100],
            aux_item_lens=[16],
        )
    assert err.value.context == {"field": "aux_item_lens[0]", "aux": 0}


def test_cached_bounds_name_the_smallest_pool_of_each_kind() -> None:
    kv = (
        KVEntry(layer_id=0, group=0, item_len=8, num_items=9, base=0),
        KVEntry(layer_id=1, group=0, item_len=8, num_items=7, base=0),
        KVEntry(layer_id=0, group=1, item_len=8, num_items=7, base=0),
    )
    state = (
        StateEntry(layer_id=2, kind="conv", item_len=4, num_slots=5, base=0, component="mamba"),
        StateEntry(layer_id=2, kind="ssm", item_len=4, num_slots=3, base=0, component="mamba"),
        StateEntry(layer_id=3, kind="kv", item_len=4, num_slots=6, base=0, component="swa"),
    )
    aux = (AuxEntry(item_len=4, num_rows=5, base=0), AuxEntry(item_len=4, num_rows=2, base=0))
    layout = StageLayout(
        pp_rank=0, pp_size=1, page_size=16, dtype="bf16", kv=kv, state=state, aux=aux
    )
    assert layout.page_bound is kv[1]  # the first of the smallest
    assert [(b.component, b.num_entries, b.smallest) for b in layout.slot_bounds] == [
        ("mamba", 2, state[1]),
        ("swa", 1, state[2]),
    ]
    assert layout.components == ["mamba", "swa"]
    assert layout.aux_bound == 1
    assert not layout.has_addresses
    assert msgspec.structs.replace(
        layout, aux=(AuxEntry(item_len=4, num_rows=2, base=1),)
    ).has_addresses
    empty = StageLayout(pp_rank=0, pp_size=1, page_size=16, dtype="bf16")
    assert (empty.page_bound, empty.slot_bounds, empty.aux_bound) == (None, (), None)
