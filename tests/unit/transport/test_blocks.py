"""`Blocks.split` and `Blocks.batches`: the caps in blocks and bytes, and full coverage."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.transport.blocks import Blocks


def spans(blocks: Blocks) -> list[tuple[int, int, int]]:
    """(src, dst, length) per byte-run, merged where consecutive: what lands where."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in zip(blocks.src_addr.tolist(), blocks.dst_addr.tolist(), blocks.length.tolist()):
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def test_split_cuts_only_blocks_above_the_cap_into_consecutive_pieces() -> None:
    b = Blocks.of([0, 1000, 5000], [100_000, 200_000, 300_000], [10, 250, 100])
    cut = b.split(100)
    assert cut.length.tolist() == [10, 100, 100, 50, 100]
    assert cut.src_addr.tolist() == [0, 1000, 1100, 1200, 5000]
    assert cut.dst_addr.tolist() == [100_000, 200_000, 200_100, 200_200, 300_000]
    assert b.split(250) is b


def test_batches_respect_both_caps_and_cover_every_byte_in_order() -> None:
    rng = np.random.default_rng(3)
    n = 500
    lengths = rng.integers(0, 20_000, n).astype(np.uint64)
    src = np.cumsum(lengths) - lengths  # contiguous source, like a pool's pages
    dst = src + np.uint64(1 << 40)
    b = Blocks.of(src, dst, lengths)
    parts = list(b.batches(max_blocks=7, max_bytes=16_384))
    assert all(len(p) <= 7 and p.total_bytes <= 16_384 for p in parts)
    assert sum(p.total_bytes for p in parts) == b.total_bytes
    assert spans(Blocks.concat(parts)) == spans(b)


def test_batches_are_the_longest_runs_of_whole_blocks_under_the_byte_cap() -> None:
    b = Blocks.of([0, 10, 20, 30], [0, 10, 20, 30], [40, 40, 40, 40])
    assert [len(p) for p in b.batches(max_blocks=10, max_bytes=100)] == [2, 2]
    assert [len(p) for p in b.batches(max_blocks=10, max_bytes=80)] == [2, 2]
    assert [len(p) for p in b.batches(max_blocks=1, max_bytes=1000)] == [1, 1, 1, 1]


def test_without_a_byte_cap_batches_are_views_of_at_most_max_blocks() -> None:
    b = Blocks.of(range(10), range(10), [1] * 10)
    assert [len(p) for p in b.batches(4)] == [4, 4, 2]


@pytest.mark.parametrize("bad", [0, -1])
def test_caps_must_be_positive(bad: int) -> None:
    b = Blocks.of([0], [0], [1])
    with pytest.raises(ValueError):
        list(b.batches(bad))
    with pytest.raises(ValueError):
        b.split(bad)


@pytest.mark.parametrize(
    ("max_blocks", "max_bytes", "sizes"),
    [
        (8, 1 << 20, [3]),  # one batch: the blocks as they are
        (3, 400, [3]),
        (3, 399, [2, 1]),  # one byte over: cut like any other list
        (2, 1 << 20, [2, 1]),
        (8, 100, [1, 1, 1, 1]),  # the 200-byte block split
        (2, 150, [1, 1, 2]),
    ],
)
def test_a_few_blocks_are_one_batch_only_under_both_caps(
    max_blocks: int, max_bytes: int, sizes: list[int]
) -> None:
    b = Blocks.of([0, 1000, 5000], [100_000, 200_000, 300_000], [100, 200, 100])
    parts = list(b.batches(max_blocks, max_bytes))
    assert [len(p) for p in parts] == sizes
    assert spans(Blocks.concat(parts)) == spans(b)
    assert all(len(p) <= max_blocks and p.total_bytes <= max_bytes for p in parts)
    assert list(Blocks.empty().batches(4, 100)) == []
