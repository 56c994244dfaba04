import msgspec
import pytest

from kvhandoff.pipelines.errors import PairingError
from kvhandoff.pipelines.layout import StageLayout, layout_from_flat_lists
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.pairing import PairingCache, pair
from kvhandoff.pipelines.pairing_report import pairing_report
from kvhandoff.pipelines.planning import plan
from tests.unit.pipelines.helpers import place

M = 0x100000  # stride between placed entries
D, S1, S3 = 0x1000_0000, 0x2000_0000, 0x4000_0000

# 16 layers, full attention at 3, 7, 11, 15; PP = 4 gives each stage layers [4k, 4k + 4).
MODEL = hybrid_npu_mla(num_layers=16, scale=64, page_size=16)
C_KV, K_ROPE = 16 * 16, 16 * 2  # item_len: page_size x bytes per token (1024/64, 128/64)
CONV, TEMPORAL = 49152 // 64, 1048576 // 64  # slot bytes
PART = partition_layers(16, 4)


def decode() -> StageLayout:
    # KV (group-major): 0:3g0 1:7g0 2:11g0 3:15g0 4:3g1 5:7g1 6:11g1 7:15g1
    # state (kind-major over linear layers 0,1,2,4,5,6,8,9,10,12,13,14):
    #   conv at entries 8..19, temporal at 20..31
    return place(decode_layout(MODEL, num_pages=64, num_slots=8), D)


def stage(rank: int, base: int) -> StageLayout:
    return place(stage_layout(MODEL, PART, rank, num_pages=64, num_slots=8), base)


def blocks_of(layout: StageLayout, dst: StageLayout) -> list[tuple[int, int, int]]:
    p = plan(pair(layout, dst), [2, 3, 9], [10, 11, 4], 1, 3)
    b = p.blocks
    return list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.length.tolist()))


def test_pp4_hybrid_npu_mla_stage1_pairs_by_layer_id_with_hand_computed_addresses() -> None:
    # Runs of ([2, 3, 9] -> [10, 11, 4]): (src 2, dst 10, 2 pages) and (src 9, dst 4, 1 page).
    expected = [
        # layer 7 group 0 (c_kv): stage entry 0 -> decode entry 1
        (S1 + 2 * C_KV, D + 1 * M + 10 * C_KV, 2 * C_KV),
        (S1 + 9 * C_KV, D + 1 * M + 4 * C_KV, C_KV),
        # layer 7 group 1 (k_rope): stage entry 1 -> decode entry 5
        (S1 + M + 2 * K_ROPE, D + 5 * M + 10 * K_ROPE, 2 * K_ROPE),
        (S1 + M + 9 * K_ROPE, D + 5 * M + 4 * K_ROPE, K_ROPE),
        # conv of layers 4, 5, 6: stage entries 2..4 -> decode entries 11..13, slot 1 -> 3
        (S1 + 2 * M + 1 * CONV, D + 11 * M + 3 * CONV, CONV),
        (S1 + 3 * M + 1 * CONV, D + 12 * M + 3 * CONV, CONV),
        (S1 + 4 * M + 1 * CONV, D + 13 * M + 3 * CONV, CONV),
        # temporal of layers 4, 5, 6: stage entries 5..7 -> decode entries 23..25
        (S1 + 5 * M + 1 * TEMPORAL, D + 23 * M + 3 * TEMPORAL, TEMPORAL),
        (S1 + 6 * M + 1 * TEMPORAL, D + 24 * M + 3 * TEMPORAL, TEMPORAL),
        (S1 + 7 * M + 1 * TEMPORAL, D + 25 * M + 3 * TEMPORAL, TEMPORAL),
    ]
    assert blocks_of(stage(1, S1), decode()) == expected


def test_pp4_hybrid_npu_mla_stage3_pairs_by_layer_id_with_hand_computed_addresses() -> None:
    expected = [
        # layer 15 group 0 -> decode entry 3; group 1 -> decode entry 7
        (S3 + 2 * C_KV, D + 3 * M + 10 * C_KV, 2 * C_KV),
        (S3 + 9 * C_KV, D + 3 * M + 4 * C_KV, C_KV),
        (S3 + M + 2 * K_ROPE, D + 7 * M + 10 * K_ROPE, 2 * K_ROPE),
        (S3 + M + 9 * K_ROPE, D + 7 * M + 4 * K_ROPE, K_ROPE),
        # conv of layers 12, 13, 14 -> decode entries 17..19; temporal -> 29..31
        (S3 + 2 * M + CONV, D + 17 * M + 3 * CONV, CONV),
        (S3 + 3 * M + CONV, D + 18 * M + 3 * CONV, CONV),
        (S3 + 4 * M + CONV, D + 19 * M + 3 * CONV, CONV),
        (S3 + 5 * M + TEMPORAL, D + 29 * M + 3 * TEMPORAL, TEMPORAL),
        (S3 + 6 * M + TEMPORAL, D + 30 * M + 3 * TEMPORAL, TEMPORAL),
        (S3 + 7 * M + TEMPORAL, D + 31 * M + 3 * TEMPORAL, TEMPORAL),
    ]
    assert blocks_of(stage(3, S3), decode()) == expected


def test_positional_pairing_picks_the_wrong_decode_entries_for_the_same_case() -> None:
    """The reference bug: 'stage k owns decode entries [k*n, (k+1)*n)' by position."""
    dec = decode()
    for rank, base in ((1, S1), (3, S3)):
        src = stage(rank, base)
        n = len(src.kv)
        positional = [(e.layer_id, e.group) for e in dec.kv[rank * n : (rank + 1) * n]]
        by_id = [
            (dec.kv[j].layer_id, dec.kv[j].group) for j in pair(src, dec).kv_dst_index.tolist()
        ]
        assert by_id == [(e.layer_id, e.group) for e in src.kv]
        assert positional != by_id
    # Stage 1 would have written layer 7's c_kv into layer 11 and its k_rope into layer 15.
    assert [(e.layer_id, e.group) for e in dec.kv[2:4]] == [(11, 0), (15, 0)]


def test_state_pairs_use_their_own_slot_sizes() -> None:
    p = pair(stage(1, S1), decode())
    assert p.state_item_len.tolist() == [CONV] * 3 + [TEMPORAL] * 3
    assert p.state_kind == ("conv",) * 3 + ("temporal",) * 3


def test_slot_size_mismatch_is_rejected_before_any_block() -> None:
    src = stage(1, S1)
    wrong = msgspec.structs.replace(src.state[2], item_len=CONV * 2)  # conv of layer 6
    bad = msgspec.structs.replace(src, state=(*src.state[:2], wrong, *src.state[3:]))
    with pytest.raises(PairingError) as err:
        pair(bad, decode())
    assert err.value.problems[0].code == "slot_size_mismatch"  # type: ignore[attr-defined]
    assert err.value.context == {"layer_id": 6, "kind": "conv", "pp_rank": 1}
    assert "slot size differs for layer 6 kind 'conv'" in str(err.value)


def test_kv_item_len_mismatch_names_layer_and_group() -> None:
    src = stage(1, S1)
    wrong = msgspec.structs.replace(src.kv[1], item_len=K_ROPE * 2)
    with pytest.raises(PairingError) as err:
        pair(msgspec.structs.replace(src, kv=(src.kv[0], wrong)), decode())
    assert err.value.context == {"layer_id": 7, "group": 1, "pp_rank": 1}


def test_missing_and_duplicate_destinations() -> None:
    dec = decode()
    missing = msgspec.structs.replace(dec, kv=tuple(e for e in dec.kv if e.layer_id != 7))
    with pytest.raises(PairingError) as err:
        pair(stage(1, S1), missing)
    codes = [p.code for p in err.value.problems]  # type: ignore[attr-defined]
    assert codes == ["missing_destination", "missing_destination"]
    assert [(p.layer_id, p.group) for p in err.value.problems] == [(7, 0), (7, 1)]  # type: ignore[attr-defined]
    twice = msgspec.structs.replace(dec, state=(*dec.state, dec.state[3]))  # conv of layer 4
    with pytest.raises(PairingError) as err:
        pair(stage(1, S1), twice)
    assert "2 state entries for layer 4 kind 'conv'" in str(
        [p.message for p in err.value.problems]  # type: ignore[attr-defined]
    )


def test_page_size_and_dtype_must_match() -> None:
    dec = decode()
    with pytest.raises(PairingError) as err:
        pair(stage(1, S1), msgspec.structs.replace(dec, page_size=32, dtype="float16"))
    assert [p.code for p in err.value.problems] == ["page_size_mismatch", "dtype_mismatch"]  # type: ignore[attr-defined]


def _legacy(pp_size: int, rank: int = 0) -> StageLayout:
    return layout_from_flat_lists(
        pp_rank=rank,
        pp_size=pp_size,
        page_size=16,
        dtype="bfloat16",
        kv_data_ptrs=[0x1000, 0x2000],
        kv_data_lens=[0x800, 0x800],
        kv_item_lens=[0x80, 0x80],
    )


def test_positional_pairing_only_without_ids_and_pp1() -> None:
    p = pair(_legacy(1), _legacy(1))
    assert p.kv_dst_index.tolist() == [0, 1]
    with pytest.raises(PairingError, match="positional pairing is only safe with PP = 1"):
        pair(_legacy(2, 1), _legacy(1))
    with pytest.raises(PairingError, match="publishes no layer ids"):
        pair(_legacy(1), decode())


def test_report_lists_all_problems_and_per_stage_numbers() -> None:
    dec = decode()
    stages = [stage(r, 0x2000_0000 * (r + 1)) for r in range(4)]
    good = pairing_report(stages, dec)
    assert good.ok and not good.problems
    assert [s.kv_pairs for s in good.stages] == [2, 2, 2, 2]
    assert [s.state_pairs for s in good.stages] == [6, 6, 6, 6]
    assert good.stages[1].kv_bytes_per_page == C_KV + K_ROPE
    assert good.stages[1].state_bytes_per_slot == 3 * (CONV + TEMPORAL)
    assert good.stages[1].layers == [4, 5, 6, 7]

    s1 = stages[1]
    bad1 = msgspec.structs.replace(
        s1, state=(msgspec.structs.replace(s1.state[0], item_len=1), *s1.state[1:])
    )
    bad3 = msgspec.structs.replace(stages[3], kv=stages[3].kv[:1])  # drops layer 15 group 1
    report = pairing_report([stages[0], bad1, stages[2], bad3], dec)
    assert not report.ok
    found = {(p.code, p.pp_rank, p.layer_id, p.group, p.kind) for p in report.problems}
    assert ("slot_size_mismatch", 1, 4, None, "conv") in found
    assert ("unfilled_destination", None, 15, 1, None) in found
    assert [s.ok for s in report.stages] == [True, False, True, True]


def test_report_flags_two_stages_writing_one_entry() -> None:
    dec = decode()
    s1 = stage(1, S1)
    report = pairing_report([s1, msgspec.structs.replace(s1, pp_rank=2)], dec)
    assert any(p.code == "duplicate_writer" and p.layer_id == 7 for p in report.problems)


def test_cache_pairs_once_per_layout_pair() -> None:
    cache = PairingCache(max_entries=2)
    src, dec = stage(1, S1), decode()
    first = cache.get(src, dec)
    assert cache.get(src, dec) is first
    assert (cache.hits, cache.misses) == (1, 1)
    moved = place(stage_layout(MODEL, PART, 1, num_pages=64, num_slots=8), S3)
    assert cache.get(moved, dec).kv_src_base[0] == S3  # same shape, new addresses: rebound
    bad = msgspec.structs.replace(dec, page_size=8)
    for _ in range(2):
        with pytest.raises(PairingError):
            cache.get(src, bad)
    assert len(cache) == 2


# ---------------------------------------------------------------------------------------------
# Aux entries: per-request metadata rows, from the last stage only, paired by position

AUX_MODEL = msgspec.structs.replace(MODEL, aux_row_bytes=(16, 24))


def test_aux_entries_pair_by_position_from_the_last_stage_only() -> None:
    dst = place(decode_layout(AUX_MODEL, num_pages=64, num_slots=8), D)
    last = place(stage_layout(AUX_MODEL, PART, 3, num_pages=64, num_slots=8), S3)
    first = place(stage_layout(AUX_MODEL, PART, 0, num_pages=64, num_slots=8), S1)
    assert first.aux == () and len(last.aux) == 2
    p = pair(last, dst)
    assert p.num_aux_pairs == 2 and pair(first, dst).num_aux_pairs == 0
    # The aux rows are the last slot rows: after the 6 state pairs of stage 3's linear layers.
    assert p.slot_space[-2:] == (None, None) and p.num_slot_rows == p.num_state_pairs + 2
    n = len(dst.kv) + len(dst.state)
    assert p.slot_dst_region[-2:].tolist() == [n, n + 1]
    assert p.slot_dst_base[-2:].tolist() == [D + n * M, D + (n + 1) * M]
    report = pairing_report(
        [
            place(stage_layout(AUX_MODEL, PART, r, num_pages=64, num_slots=8), S1 + r * 0x100_0000)
            for r in range(4)
        ],
        dst,
    )
    assert report.ok, report.problems
    assert [s.aux_pairs for s in report.stages] == [0, 0, 0, 2]
    assert report.stages[3].aux_bytes_per_row == 40


def test_an_aux_row_size_or_count_mismatch_names_the_aux_entry() -> None:
    last = place(stage_layout(AUX_MODEL, PART, 3, num_pages=64, num_slots=8), S3)
    wider = msgspec.structs.replace(AUX_MODEL, aux_row_bytes=(16, 32))
    with pytest.raises(PairingError) as err:
        pair(last, place(decode_layout(wider, num_pages=64, num_slots=8), D))
    assert err.value.context == {"aux": 1, "pp_rank": 3}
    assert "aux entry 1: source 24 bytes, destination 32" in err.value.message
    more = msgspec.structs.replace(AUX_MODEL, aux_row_bytes=(16, 24, 8))
    with pytest.raises(PairingError) as err:
        pair(last, place(decode_layout(more, num_pages=64, num_slots=8), D))
    assert err.value.problems[0].code == "missing_source"  # type: ignore[attr-defined]
    assert err.value.context["aux"] == 2
    with pytest.raises(PairingError) as err:
        pair(last, decode())  # a decode without aux entries
    assert err.value.context["aux"] == 0 and "destination has no aux entry 0" in err.value.message


def test_the_report_names_an_aux_entry_no_stage_sends() -> None:
    dst = place(decode_layout(AUX_MODEL, num_pages=64, num_slots=8), D)
    sources = [stage(r, S1 + r * 0x100_0000) for r in range(4)]  # no aux on the last stage
    report = pairing_report(sources, dst)
    codes = {(p.code, p.aux) for p in report.problems}
    assert ("missing_source", 0) in codes and ("unfilled_destination", 1) in codes
