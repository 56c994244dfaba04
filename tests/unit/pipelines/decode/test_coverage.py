"""A stage's cells (`pipelines/decode/coverage.py`): listed the same way for a small segment
(a Python loop) as for a large one (numpy), and claimed once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.pipelines.decode import coverage
from kvhandoff.pipelines.decode.coverage import StageLanding, piece_cells
from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.packing import Pieces
from kvhandoff.pipelines.pairing import Pairing, pair

MODEL = hybrid_npu_mla(num_layers=8, scale=64, page_size=4)


def pairing_of_stage() -> Pairing:
    part = partition_layers(8, 2)
    src = stage_layout(MODEL, part, 1, num_pages=16, num_slots=4)
    return pair(src, decode_layout(MODEL, num_pages=16, num_slots=4))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 8), st.integers(1, 12)), max_size=40))
def test_small_and_large_segments_list_the_same_cells(
    triples: list[tuple[int, int, int]],
) -> None:
    p = pairing_of_stage()
    rows, starts, counts = zip(*triples) if triples else ((), (), ())
    pieces = Pieces.of(rows, starts, [s + c for s, c in zip(starts, counts)])
    small = piece_cells(p, pieces)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(coverage, "SMALL_PIECES", -1)
        large = piece_cells(p, pieces)
    for a, b in zip(small, large):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


def test_a_claimed_cell_is_refused_to_a_second_commit_whichever_path_lists_it() -> None:
    p = pairing_of_stage()
    stage = StageLanding.of(p, 4, "http://prefill")
    stage.claim(Pieces.of([0, 1], [0, 2], [2, 3]), 1)
    starts = [i % 4 for i in range(40)] + [2]  # 41 pieces: numpy's path; the last is claimed
    many = Pieces.of([0] * 40 + [1], starts, [s + 1 for s in starts])
    before = stage.covered.copy()
    with pytest.raises(ConflictError):
        stage.claim(Pieces.of([1], [1], [3]), 1)  # page 2 of row 1 is claimed
    with pytest.raises(ConflictError):
        stage.claim(many, 1)
    assert np.array_equal(stage.covered, before)  # a refused claim claims nothing
