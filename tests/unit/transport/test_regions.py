from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.regions import Region, RegionTable


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def table() -> RegionTable:
    t = RegionTable()
    t.add([Region(1000, 100), Region(2000, 50)])
    return t


def test_blocks_inside_one_region_pass() -> None:
    assert table().outside(arr(1000, 1090, 2000), arr(100, 10, 50)) is None


@pytest.mark.parametrize(
    ("addr", "length"),
    [(999, 1), (1090, 11), (1100, 1), (1050, 1000), (2049, 2), (0, 1), (3000, 1)],
)
def test_blocks_leaving_every_region_are_found(addr: int, length: int) -> None:
    assert table().outside(arr(1000, addr), arr(1, length)) == 1


@pytest.mark.parametrize("n", [1, 9])
def test_a_length_that_wraps_past_the_address_space_is_refused(n: int) -> None:
    """`addr + length` of a block 8 bytes into a region with length 2**64 - 8 wraps to the
    region's start; the few-block path (1) and the numpy path (9) both refuse it."""
    bad = table().outside(arr(*[1008] * n), arr(*[2**64 - 8] * n))
    assert bad == 0


def test_adjacent_regions_do_not_merge() -> None:
    t = RegionTable()
    t.add([Region(1000, 100), Region(1100, 100)])
    assert t.outside(arr(1050), arr(100)) == 0


def test_empty_table_rejects_everything_and_check_raises() -> None:
    with pytest.raises(TransportError, match="block 0 source"):
        RegionTable().check(arr(1), arr(1), side="source")


def test_overlap_detection_and_removal() -> None:
    t = table()
    assert t.overlapping([Region(1099, 10)]) == Region(1099, 10)
    assert t.overlapping([Region(1100, 10), Region(1105, 10)]) is not None
    assert t.overlapping([Region(1100, 900)]) is None
    assert t.remove([Region(1000, 100), Region(5, 5)]) == [Region(1000, 100)]
    assert len(t) == 1 and t.outside(arr(1000), arr(1)) == 0


def test_few_and_many_blocks_are_checked_alike() -> None:
    # A few blocks are bisected on Python ints, many searched with numpy: the same first
    # offender either way, whatever the blocks (edges, gaps, before, after, across regions).
    t = table()
    rng = np.random.default_rng(7)
    edges = [0, 999, 1000, 1050, 1099, 1100, 1500, 1999, 2000, 2049, 2050, 4000]
    for _ in range(300):
        n = int(rng.integers(1, 5))
        addr = arr(*rng.choice(edges, n).tolist())
        length = arr(*rng.integers(1, 120, n).tolist())
        few = t.outside(addr, length)
        # Many: the same blocks behind enough good ones to take the numpy path.
        pad = 9
        many = t.outside(
            np.concatenate((arr(*[1000] * pad), addr)), np.concatenate((arr(*[1] * pad), length))
        )
        assert many == (None if few is None else few + pad)
