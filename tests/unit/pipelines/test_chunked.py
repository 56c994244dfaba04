"""The one-pass gather and commit (`pipelines/chunked.py`): chunks of whole items that cover a
segment once, a streamed digest equal to the one-shot one however the bytes are cut, and the
order that SAFETY.md S1 rests on — the decode digests the pages it just wrote, after the
scatter, never the window."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.pipelines import chunked, packing
from kvhandoff.pipelines.chunked import Scratch, chunks, gather_digest, scatter_digest
from kvhandoff.pipelines.digest import ALGORITHMS, Algorithm, Digester, digest
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.packing import Pieces, destination_side, gather, piece_bytes, source_side
from kvhandoff.pipelines.pairing import Pairing, pair

MODEL = hybrid_npu_mla(num_layers=8, scale=64, page_size=4)
PART = partition_layers(8, 2)


def pairing_of_stage(rank: int = 1) -> Pairing:
    src = stage_layout(MODEL, PART, rank, num_pages=16, num_slots=4)
    dst = decode_layout(MODEL, num_pages=16, num_slots=4)
    return pair(src, dst)


class Regions:
    def __init__(self, sizes: list[int], seed: int, torch_views: bool = False) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
        self.torch_views = torch_views

    def array(self, i: int) -> Any:
        a = self.arrays[i]
        return torch.from_numpy(a) if self.torch_views else a


def every_row(p: Pairing, pages: int) -> Pieces:
    rows = np.arange(p.num_kv_pairs + p.num_state_pairs, dtype=np.int64)
    return Pieces(rows, np.zeros_like(rows), np.where(rows < p.num_kv_pairs, pages, 1))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 12), st.integers(1, 4), st.data())
def test_chunks_cover_the_segment_once_in_order_in_whole_items(
    items_per_chunk: int, pages: int, data: st.DataObject
) -> None:
    p = pairing_of_stage()
    whole = every_row(p, pages)
    keep = data.draw(st.lists(st.booleans(), min_size=len(whole), max_size=len(whole)))
    mask = np.asarray(keep, dtype=bool) | (np.arange(len(whole)) == 0)
    pieces = Pieces(whole.rows[mask], whole.starts[mask], whole.ends[mask])
    step = items_per_chunk * int(p.kv_item_len[0])
    cells, offset = [], 0
    for at, nbytes, part in chunks(p, pieces, step):
        assert at == offset and nbytes == int(piece_bytes(p, part).sum())
        assert nbytes <= step or (len(part) == 1 and int(part.ends[0] - part.starts[0]) == 1)
        cells += [(r, x) for r, s, e in zip(part.rows, part.starts, part.ends) for x in range(s, e)]
        offset += nbytes
    want = [(r, x) for r, s, e in zip(pieces.rows, pieces.starts, pieces.ends) for x in range(s, e)]
    assert cells == want and offset == int(piece_bytes(p, pieces).sum())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_digest_streamed_in_parts_of_any_size_equals_the_one_shot_digest(
    algorithm: Algorithm,
) -> None:
    rng, cuts = np.random.default_rng(3), random.Random(4)
    for n in (0, 1, 7, 8, 13, 4096, 70_001):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = digest(data, algorithm, seed=n)
        for _ in range(4):
            d, at = Digester(algorithm, seed=n), 0
            while at < n:  # parts of 1..n/3 bytes: words cut anywhere
                step = cuts.randint(1, max(1, n // 3))
                part = data[at : at + step]
                d.update(part if cuts.random() < 0.5 else torch.from_numpy(part))
                at += step
            assert d.hexdigest() == want
        assert digest(data, algorithm, seed=n + 1) != want  # the seed is bound in


@pytest.mark.parametrize("kind", ["numpy", "torch-kernels"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dst_pages", [[10, 2, 11], [4, 5, 6], [12, 13, 1]])  # runs, or none
@pytest.mark.parametrize("chunk_bytes", [3 * 1024 + 8, 1 << 20])  # several chunks, words cut; one
def test_one_pass_gather_and_commit_move_the_segment_and_agree_on_its_digest(
    kind: str,
    algorithm: Algorithm,
    dst_pages: list[int],
    chunk_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "HOST_TENSORS_VIA_NUMPY", kind == "numpy")
    monkeypatch.setattr(chunked, "CHUNK_BYTES", chunk_bytes)
    p = pairing_of_stage()
    src = Regions(p.src.region_sizes, 1, torch_views=kind != "numpy")
    dst = Regions(p.dst.region_sizes, 2, torch_views=kind != "numpy")
    pieces = every_row(p, 3)
    src_pages = np.array([3, 9, 4])
    n = int(piece_bytes(p, pieces).sum())
    staged = np.zeros(n, dtype=np.uint8)
    buf = staged if kind == "numpy" else torch.from_numpy(staged)
    side = source_side(p, src, src_pages, 1)
    sent = gather_digest(p, side, pieces, buf, Digester(algorithm, seed=9), Scratch())
    plain = np.zeros(n, dtype=np.uint8)
    gather(p, side, pieces, plain)
    assert np.array_equal(staged, plain) and sent == digest(plain, algorithm, seed=9)
    dside = destination_side(p, dst, np.array(dst_pages), 2)
    got = scatter_digest(buf, 0, p, dside, pieces, Digester(algorithm, seed=9))
    assert got == sent
    back = np.zeros(n, dtype=np.uint8)
    gather(p, dside, pieces, back)
    assert np.array_equal(back, plain)


def _commit_with_a_writer(
    monkeypatch: pytest.MonkeyPatch, landed: int, before: int, after: int, one_chunk: bool
) -> tuple[str, str, np.ndarray, np.ndarray]:
    """Commit a segment from a window that a writer changes around each chunk's scatter: each
    chunk's first byte is XORed with `landed` from the start, with `before` right before the
    chunk is scattered (after anything read or digested ahead of the scatter) and with `after`
    right after it (before the pages are digested). Returns the digest the sender took, the
    commit's, what the pages hold and the true bytes. `one_chunk`: the segment fits one chunk
    and its size is given (the small-segment path, not cut first)."""
    step = 1 << 20 if one_chunk else 2048
    monkeypatch.setattr(chunked, "CHUNK_BYTES", step)
    p = pairing_of_stage()
    src, dst = Regions(p.src.region_sizes, 1), Regions(p.dst.region_sizes, 2)
    pieces = every_row(p, 2)
    n = int(piece_bytes(p, pieces).sum())
    true = np.zeros(n, dtype=np.uint8)
    gather(p, source_side(p, src, np.array([1, 5]), 0), pieces, true)
    window = np.zeros(n + 64, dtype=np.uint8)
    window[64:] = true
    starts = [64 + at for at, _, _ in chunks(p, pieces, step)]
    assert len(starts) == 1 if one_chunk else len(starts) > 2
    for s in starts:
        window[s] ^= landed
    real_scatter = chunked.scatter_views

    def write_around_scatter(views: list[tuple[Any, Any, Any]]) -> None:
        first = views[0][2]  # the chunk's first piece, as a view of the window
        if np.shares_memory(first, window):
            first[0, 0] ^= before
        real_scatter(views)
        if np.shares_memory(first, window):
            first[0, 0] ^= after

    monkeypatch.setattr(chunked, "scatter_views", write_around_scatter)
    side = destination_side(p, dst, np.array([7, 8]), 3)
    digester = Digester("xxh3_128", seed=1)
    got = scatter_digest(window, 64, p, side, pieces, digester, n if one_chunk else None)
    pages = np.zeros(n, dtype=np.uint8)
    gather(p, side, pieces, pages)
    return digest(true, "xxh3_128", seed=1), got, pages, true


@pytest.mark.parametrize("one_chunk", [False, True])
def test_a_window_changed_after_its_chunk_was_scattered_commits_what_was_scattered(
    monkeypatch: pytest.MonkeyPatch, one_chunk: bool
) -> None:
    """The true bytes were scattered; the window changes right after: the digest (of the
    pages) matches and the pages hold the true bytes. Digesting the window after the scatter
    would see the changed bytes; digesting the pages before it, their old contents."""
    want, got, pages, true = _commit_with_a_writer(
        monkeypatch, landed=0, before=0, after=0x5A, one_chunk=one_chunk
    )
    assert got == want
    assert np.array_equal(pages, true)


@pytest.mark.parametrize("one_chunk", [False, True])
def test_a_window_repaired_after_its_chunk_was_scattered_is_refused(
    monkeypatch: pytest.MonkeyPatch, one_chunk: bool
) -> None:
    """Wrong bytes landed and were scattered; the window is repaired right after, before the
    digest: the digest is of the pages, so it does not match (one of the window would,
    committing the wrong bytes)."""
    want, got, pages, true = _commit_with_a_writer(
        monkeypatch, landed=0x5A, before=0, after=0x5A, one_chunk=one_chunk
    )
    assert got != want
    assert not np.array_equal(pages, true)  # dirty: the caller must not count them committed


@pytest.mark.parametrize("one_chunk", [False, True])
def test_a_window_changed_just_before_its_chunk_is_scattered_is_refused(
    monkeypatch: pytest.MonkeyPatch, one_chunk: bool
) -> None:
    """The true bytes landed; the window changes after anything a commit could read ahead of
    the scatter, and the changed bytes are scattered: refused (a digest taken of the window
    before the scatter would match, and the wrong bytes would be committed)."""
    want, got, pages, true = _commit_with_a_writer(
        monkeypatch, landed=0, before=0x5A, after=0, one_chunk=one_chunk
    )
    assert got != want
    assert not np.array_equal(pages, true)
