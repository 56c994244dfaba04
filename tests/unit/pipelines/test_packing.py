"""Packing: pieces checked against the destination, segments cut to fit a budget, gather and
scatter on numpy and torch memory alike."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.pipelines import packing
from kvhandoff.pipelines.digest import ALGORITHMS, Algorithm, digest, segment_seed
from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.packing import (
    Pieces,
    check_pieces,
    destination_side,
    gather,
    piece_bytes,
    scatter,
    source_side,
)
from kvhandoff.pipelines.pairing import pair
from kvhandoff.pipelines.stage_packer import StagePacker

MODEL = hybrid_npu_mla(num_layers=8, scale=64, page_size=4)
PART = partition_layers(8, 2)


def pairing_of_stage(rank: int = 1):  # type: ignore[no-untyped-def]
    src = stage_layout(MODEL, PART, rank, num_pages=16, num_slots=4)
    dst = decode_layout(MODEL, num_pages=16, num_slots=4)
    return pair(src, dst)


def test_pieces_outside_the_destination_are_refused_naming_the_piece() -> None:
    p = pairing_of_stage()
    k = p.num_kv_pairs
    assert check_pieces(p, Pieces.of([0], [0], [3]), 3, True, pp_rank=1) == 3 * int(
        p.kv_item_len[0]
    )
    for pieces, field in (
        (Pieces.of([0], [0], [4]), "ends[0]"),  # past the request's 3 pages
        (Pieces.of([0, 0], [1, 1], [1, 2]), "ends[0]"),  # an empty piece
        (Pieces.of([k + p.num_state_pairs], [0], [1]), "rows[0]"),  # no such row
        (Pieces.of([k], [0], [2]), "starts[0]"),  # a state row has one position
    ):
        with pytest.raises(InvalidInput) as err:
            check_pieces(p, pieces, 3, True, pp_rank=1)
        assert err.value.context["field"] == field
    with pytest.raises(InvalidInput):  # state without a slot in the destination
        check_pieces(p, Pieces.of([k], [0], [1]), 3, False, pp_rank=1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(-1, 40), st.integers(-1, 5), st.integers(-1, 6)), max_size=40),
    st.integers(1, 5),
    st.booleans(),
)
def test_the_small_segment_check_agrees_with_the_whole_array_check(
    triples: list[tuple[int, int, int]], num_pages: int, has_slot: bool
) -> None:
    """A few pieces are checked in a Python loop, many with numpy: the same bytes for a sound
    notice and the same named refusal for an unsound one, whichever path runs."""
    p = pairing_of_stage()
    pieces = Pieces.of(*zip(*triples)) if triples else Pieces.of([], [], [])

    def outcome(small: int) -> tuple[str, object]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(packing, "SMALL_PIECES", small)
            try:
                return "bytes", check_pieces(p, pieces, num_pages, has_slot, pp_rank=0)
            except InvalidInput as err:
                return "refused", err.context["field"]

    assert outcome(64) == outcome(-1)


def test_the_packer_cuts_ready_rows_to_the_budget_and_covers_everything_once() -> None:
    p = pairing_of_stage()
    packer = StagePacker(p, num_pages=5, has_slot=True)
    packer.make_ready([7])  # one layer first
    item = int(p.kv_item_len[int(np.flatnonzero(p.kv_layer == 7)[0])])
    seg = packer.next_segment(2 * item)  # two pages of the first row of layer 7 fit
    assert seg is not None and seg.ends.tolist() == [2] and seg.starts.tolist() == [0]
    packer.make_ready(None)
    covered: set[tuple[int, int]] = set()
    total = int(piece_bytes(p, seg).sum())
    for r, s, e in zip(seg.rows.tolist(), seg.starts.tolist(), seg.ends.tolist()):
        covered |= {(r, x) for x in range(s, e)}
    while not packer.done:
        seg = packer.next_segment(64 * 1024)
        assert seg is not None and int(piece_bytes(p, seg).sum()) <= 64 * 1024
        total += int(piece_bytes(p, seg).sum())
        for r, s, e in zip(seg.rows.tolist(), seg.starts.tolist(), seg.ends.tolist()):
            cells = {(r, x) for x in range(s, e)}
            assert not cells & covered
            covered |= cells
    assert total == packer.total_bytes
    assert len(covered) == p.num_kv_pairs * 5 + p.num_state_pairs


def cells_of(seg: Pieces) -> set[tuple[int, int]]:
    return {
        (r, x)
        for r, s, e in zip(seg.rows.tolist(), seg.starts.tolist(), seg.ends.tolist())
        for x in range(s, e)
    }


def test_page_ranges_are_cut_as_they_come_and_the_state_only_with_the_last() -> None:
    p = pairing_of_stage()
    k = p.num_kv_pairs
    packer = StagePacker(p, num_pages=6, has_slot=True, ranged=True)
    assert packer.ready_bytes == 0 and not packer.done
    packer.make_pages_ready(2, last=False)  # pages 0:2 of every KV row, no state yet
    assert packer.ready_bytes == int(p.kv_item_len.sum()) * 2
    seg = packer.next_segment(1 << 30)
    assert seg is not None and (seg.rows < k).all()
    assert cells_of(seg) == {(r, x) for r in range(k) for x in (0, 1)}
    assert packer.next_segment(1 << 30) is None and not packer.done
    covered = cells_of(seg)
    total = int(piece_bytes(p, seg).sum())
    packer.make_pages_ready(5, last=False)
    item = int(p.kv_item_len[0])
    seg = packer.next_segment(item)  # one page of the first row: a piece from position 2
    assert seg is not None and (seg.rows.tolist(), seg.starts.tolist(), seg.ends.tolist()) == (
        [0],
        [2],
        [3],
    )
    packer.make_pages_ready(6, last=True)  # the last range brings the slot
    while (nxt := packer.next_segment(16 * 1024)) is not None or seg is not None:
        if seg is not None:
            assert not cells_of(seg) & covered
            covered |= cells_of(seg)
            total += int(piece_bytes(p, seg).sum())
        seg = nxt
    assert packer.done and packer.ready_bytes == 0
    assert total == packer.total_bytes
    assert covered == {(r, x) for r in range(k) for x in range(6)} | {
        (k + j, 0) for j in range(p.num_state_pairs)
    }


def test_ranges_signalled_before_packing_grow_one_piece_per_row() -> None:
    p = pairing_of_stage()
    packer = StagePacker(p, num_pages=4, has_slot=False, ranged=True)
    packer.make_pages_ready(1, last=False)
    packer.make_pages_ready(3, last=False)
    seg = packer.next_segment(1 << 30)
    assert seg is not None and len(seg) == p.num_kv_pairs
    assert set(seg.starts.tolist()) == {0} and set(seg.ends.tolist()) == {3}


def test_a_ranged_stage_is_done_only_once_its_last_range_was_signalled() -> None:
    # Every page packed is not the end: a zero-page last range (SGLang's last chunk may hold
    # none) still has to come, so the stage's last notice waits for it.
    p = pairing_of_stage()
    packer = StagePacker(p, num_pages=3, has_slot=False, ranged=True)
    packer.make_pages_ready(3, last=False)
    assert packer.next_segment(1 << 30) is not None
    assert packer.ready_bytes == 0 and not packer.done
    packer.make_pages_ready(3, last=True)
    assert packer.done and packer.next_segment(1 << 30) is None


def test_bad_page_ranges_are_refused_naming_the_field_and_change_nothing() -> None:
    p = pairing_of_stage()
    packer = StagePacker(p, num_pages=4, has_slot=True, ranged=True)
    packer.make_pages_ready(2, last=False)
    for end, last, field in (
        (5, False, "src_pages"),  # past the decode's 4 pages
        (1, False, "src_pages"),  # behind what is ready already
        (3, True, "last_pages"),  # a last range short of the decode's pages
    ):
        with pytest.raises(InvalidInput) as err:
            packer.make_pages_ready(end, last=last, pp_rank=1)
        assert err.value.context["field"] == field
        assert packer.ready_bytes == int(p.kv_item_len.sum()) * 2 and not packer.done
    packer.make_pages_ready(4, last=True)
    with pytest.raises(InvalidInput) as err:  # nothing after the last range
        packer.make_pages_ready(4, last=True)
    assert err.value.context["field"] == "pages_from"
    by_layer = StagePacker(p, num_pages=4, has_slot=True)
    with pytest.raises(InvalidInput) as err:
        by_layer.make_pages_ready(2, last=False)
    assert err.value.context["field"] == "pages_from"


def test_aux_rows_become_ready_with_the_last_layer_or_the_last_range() -> None:
    model = msgspec.structs.replace(MODEL, aux_row_bytes=(16, 24))
    src = stage_layout(model, PART, 1, num_pages=16, num_slots=4)
    p = pair(src, decode_layout(model, num_pages=16, num_slots=4))
    k, aux_rows = p.num_kv_pairs, {p.num_kv_pairs + p.num_state_pairs + i for i in (0, 1)}

    def rows_of(packer: StagePacker) -> set[int]:
        cut = packer.next_segment(1 << 30)
        return set() if cut is None else set(cut.rows.tolist())

    by_layer = StagePacker(p, num_pages=2, has_slot=True)
    by_layer.make_ready([7])  # the full-attention layer: not yet every layer
    assert not rows_of(by_layer) & aux_rows
    by_layer.make_ready([4, 5, 6])  # the last layers: the aux rows with them
    assert aux_rows <= rows_of(by_layer) and by_layer.done
    ranged = StagePacker(p, num_pages=2, has_slot=True, ranged=True)
    ranged.make_pages_ready(1, last=False)
    assert rows_of(ranged) == set(range(k))
    ranged.make_pages_ready(2, last=True)
    assert aux_rows <= rows_of(ranged) and ranged.done
    assert ranged.total_bytes == 2 * p.kv_bytes_per_page + p.state_bytes_per_slot + 40
    with pytest.raises(InvalidInput) as err:  # an aux row has one position: 0:1
        check_pieces(p, Pieces.of([min(aux_rows)], [0], [2]), 2, True, pp_rank=1)
    assert err.value.context["field"] == "starts[0]"


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch-kernels"])
def test_gather_then_scatter_moves_exactly_the_pieces(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "torch": CPU tensors, copied through numpy views; "torch-kernels": the same tensors
    # through torch's own index kernels, the path a GPU/NPU pool takes.
    monkeypatch.setattr(packing, "HOST_TENSORS_VIA_NUMPY", kind != "torch-kernels")
    p = pairing_of_stage()
    rng = np.random.default_rng(1)

    class Regions:
        def __init__(self, sizes: list[int]) -> None:
            self.arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]

        def array(self, i: int):  # type: ignore[no-untyped-def]
            a = self.arrays[i]
            return a if kind == "numpy" else torch.from_numpy(a)

    src, dst = Regions(p.src.region_sizes), Regions(p.dst.region_sizes)
    before = [a.copy() for a in dst.arrays]
    src_pages, dst_pages = np.array([3, 9, 4]), np.array([10, 2, 11])
    pieces = Pieces.of(list(range(p.num_kv_pairs + p.num_state_pairs)), [0] * 99, [3] * 99)
    pieces = Pieces(
        pieces.rows,
        np.zeros_like(pieces.rows),
        np.where(pieces.rows < p.num_kv_pairs, 3, 1),
    )
    n = int(piece_bytes(p, pieces).sum())
    packed = np.zeros(n, dtype=np.uint8)
    buf = packed if kind == "numpy" else torch.from_numpy(packed)
    gather(p, source_side(p, src, src_pages, 1), pieces, buf)
    scatter(p, destination_side(p, dst, dst_pages, 2), pieces, buf)
    for row in range(p.num_kv_pairs):
        item = int(p.kv_item_len[row])
        s = src.arrays[int(p.kv_src_index[row])].reshape(-1, item)
        d = dst.arrays[int(p.kv_dst_index[row])].reshape(-1, item)
        assert np.array_equal(s[src_pages], d[dst_pages])
        untouched = np.setdiff1d(np.arange(d.shape[0]), dst_pages)
        assert np.array_equal(
            d[untouched], before[int(p.kv_dst_index[row])].reshape(-1, item)[untouched]
        )
    assert digest(packed, "xxh3_128", seed=5) == digest(
        torch.from_numpy(packed), "xxh3_128", seed=5
    )


@pytest.mark.parametrize("pages", [[7], [3, 9, 4], [5, 6]])
def test_host_gather_copies_what_the_index_kernels_copy(
    pages: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host path (one slice per one-page piece, np.take otherwise) against the general
    # path's index kernels, over KV pieces of one or more pages, part pieces and slot rows.
    p = pairing_of_stage()
    rng = np.random.default_rng(len(pages))
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in p.src.region_sizes]

    class Regions:
        def __init__(self, as_torch: bool) -> None:
            self.as_torch = as_torch

        def array(self, i: int):  # type: ignore[no-untyped-def]
            return torch.from_numpy(arrays[i]) if self.as_torch else arrays[i]

    k, n_pages = p.num_kv_pairs, len(pages)
    rows = list(range(k + p.num_state_pairs))
    starts = [r % n_pages if r < k else 0 for r in rows]  # later rows: part of the pages
    ends = [n_pages if r < k else 1 for r in rows]
    pieces = Pieces.of(rows, starts, ends)
    size = int(piece_bytes(p, pieces).sum())
    host = np.zeros(size, dtype=np.uint8)
    gather(p, source_side(p, Regions(False), np.array(pages), 2), pieces, host)
    monkeypatch.setattr(packing, "HOST_TENSORS_VIA_NUMPY", False)
    kernels = torch.zeros(size, dtype=torch.uint8)
    gather(p, source_side(p, Regions(True), np.array(pages), 2), pieces, kernels)
    assert np.array_equal(host, kernels.numpy()) and host.any()
    # A host buffer with a region the host path cannot read (a device's; here a CPU tensor
    # with numpy views off) takes the general path for the whole segment.
    mixed = np.zeros(size, dtype=np.uint8)
    gather(p, source_side(p, Regions(True), np.array(pages), 2), pieces, mixed)
    assert np.array_equal(mixed, host)


def accelerators() -> list[str]:
    """The devices of this machine the device cases run on (none in CI: they are skipped). An
    Ascend machine's torch_npu is imported here, as kvhandoff's own pools would."""
    found = ["cuda:0"] if torch.cuda.is_available() else []
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError):
        return found
    return [*found, "npu:0"] if torch.npu.is_available() else found


@pytest.mark.parametrize("device", accelerators())
def test_device_pages_and_host_slots_cross_a_device_segment_both_ways(device: str) -> None:
    # SGLang on a GPU or an NPU: KV pages on the device, the aux rows (here the state slots) in
    # host memory, the staging buffer and the landing arena on the device.
    p = pairing_of_stage()
    rng = np.random.default_rng(2)
    k = p.num_kv_pairs

    class Regions:
        def __init__(self, sizes: list[int], kv_regions: set[int]) -> None:
            self.tensors = [
                torch.from_numpy(rng.integers(0, 255, n, dtype=np.uint8)).to(
                    device if i in kv_regions else "cpu"
                )
                for i, n in enumerate(sizes)
            ]

        def array(self, i: int):  # type: ignore[no-untyped-def]
            return self.tensors[i]

    src = Regions(p.src.region_sizes, set(p.kv_src_index.tolist()))
    dst = Regions(p.dst.region_sizes, set(p.kv_dst_index.tolist()))
    src_pages, dst_pages = np.array([3, 9, 4]), np.array([10, 2, 11])
    rows = np.arange(k + p.num_state_pairs)
    pieces = Pieces(rows, np.zeros_like(rows), np.where(rows < k, 3, 1))
    packed = torch.zeros(int(piece_bytes(p, pieces).sum()), dtype=torch.uint8, device=device)
    streams = torch.get_device_module(device)
    gather(p, source_side(p, src, src_pages, 1), pieces, packed)
    assert streams.current_stream().query()  # returned once the device ran the copies
    scatter(p, destination_side(p, dst, dst_pages, 2), pieces, packed)
    assert streams.current_stream().query()
    for row in range(k):
        item = int(p.kv_item_len[row])
        s = src.tensors[int(p.kv_src_index[row])].cpu().numpy().reshape(-1, item)
        d = dst.tensors[int(p.kv_dst_index[row])].cpu().numpy().reshape(-1, item)
        assert np.array_equal(s[src_pages], d[dst_pages])
    for j in range(p.num_state_pairs):
        item = int(p.slot_item_len[j])
        s = src.tensors[int(p.slot_src_region[j])].numpy()[item : 2 * item]
        d = dst.tensors[int(p.slot_dst_region[j])].numpy()[2 * item : 3 * item]
        assert np.array_equal(s, d)
    assert digest(packed, "mix64", seed=5) == digest(packed.cpu().numpy(), "mix64", seed=5)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_both_digests_see_a_flipped_or_moved_byte(algo: Algorithm) -> None:
    data = np.random.default_rng(0).integers(0, 255, 100_003, dtype=np.uint8)
    base = digest(data, algo, seed=1)
    flipped = data.copy()
    flipped[77_777] ^= 1
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16].copy(), data[:8].copy()
    assert digest(flipped, algo, seed=1) != base and digest(swapped, algo, seed=1) != base
    assert digest(torch.from_numpy(data.copy()), algo, seed=1) == base


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_paired_sign_bit_flips_are_refused(algo: Algorithm) -> None:
    """Bit 63 flipped in two 64-bit words (the sign of a bf16/fp16 lane in each) adds 2**64 to
    any sum of words, weighted or not: a linear digest (the earlier wsum64) passed it."""
    data = np.random.default_rng(3).integers(0, 255, 1 << 16, dtype=np.uint8)
    base = digest(data, algo, seed=9)
    for i, j in [(0, 1), (5, 900), (17, 8191)]:
        corrupt = data.copy()
        words = corrupt.view(np.uint64)
        words[[i, j]] ^= np.uint64(1 << 63)
        assert digest(corrupt, algo, seed=9) != base, (i, j)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_the_seed_binds_the_grant_the_handoff_and_the_pieces(algo: Algorithm) -> None:
    data = np.random.default_rng(4).integers(0, 255, 4099, dtype=np.uint8)
    seeds = {
        segment_seed("d", "h", 0, 1, [0], [0], [2]),
        segment_seed("d", "h", 0, 2, [0], [0], [2]),  # another grant
        segment_seed("d", "g", 0, 1, [0], [0], [2]),  # another handoff
        segment_seed("d", "h", 1, 1, [0], [0], [2]),  # another stage
        segment_seed("d", "h", 0, 1, [0], [1], [3]),  # other pieces
        segment_seed("e", "h", 0, 1, [0], [0], [2]),  # another decode life
    }
    assert len(seeds) == 6
    assert len({digest(data, algo, seed=s) for s in seeds}) == 6
    # A buffer shorter than one word is bound to its seed too.
    assert digest(data[:3], algo, seed=1) != digest(data[:3], algo, seed=2)


def test_mix64_digests_empty_and_unaligned_buffers() -> None:
    """A segment of no bytes, or a view starting off an 8-byte boundary, is digested (the int64
    view used to raise: a 500 instead of a refused segment), as an aligned copy of it is."""
    import torch

    data = torch.arange(40, dtype=torch.uint8)
    for view in (data[3:27], data[1:2], data[5:5]):
        assert digest(view, "mix64", seed=5) == digest(view.clone(), "mix64", seed=5)
    assert digest(np.zeros(0, np.uint8), "mix64", seed=1) != digest(data[:0], "mix64", seed=2)
