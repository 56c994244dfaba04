"""A staged segment cut into blocks (`kvhandoff.pipelines.prefill.staged.staged_blocks`)."""

from __future__ import annotations

import pytest

from kvhandoff.pipelines.prefill.staged import BLOCK_BYTES, staged_blocks


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4096, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 5]
)
def test_a_segment_is_cut_into_consecutive_blocks_of_at_most_block_bytes(nbytes: int) -> None:
    src, dst = 1 << 30, 1 << 40
    blocks = staged_blocks(src, dst, nbytes)
    lengths = blocks.length.tolist()
    assert sum(lengths) == nbytes and all(0 < n <= BLOCK_BYTES for n in lengths)
    assert len(lengths) == -(-nbytes // BLOCK_BYTES)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    assert blocks.src_addr.tolist() == [src + s for s in starts]
    assert blocks.dst_addr.tolist() == [dst + s for s in starts]
    assert blocks.src_addr.dtype == blocks.length.dtype == "uint64"
