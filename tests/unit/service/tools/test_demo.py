"""The demo's arguments, and its raw-Mooncake baseline into a landed decode: blocks laid into
the arena's slice."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from kvhandoff.service.tools import demo
from kvhandoff.service.tools.demo import into_span
from kvhandoff.transport.blocks import Blocks


def test_blocks_are_laid_end_to_end_and_start_over_inside_the_span() -> None:
    lengths = np.array([40, 24, 40, 16, 40], dtype=np.uint64)
    blocks = Blocks.of(np.arange(5) * 100, np.zeros(5), lengths)
    out = into_span(blocks, 1000, 100)
    assert out.src_addr.tolist() == blocks.src_addr.tolist()
    assert out.length.tolist() == lengths.tolist()
    # Offsets 0, 40, 64, 104 -> 43 (mod 61), 120 -> 59: never past the span's end.
    assert out.dst_addr.tolist() == [1000, 1040, 1003, 1043, 1059]
    assert all(d + n <= 1100 for d, n in zip(out.dst_addr.tolist(), lengths.tolist()))


def test_a_block_longer_than_the_span_is_refused() -> None:
    blocks = Blocks.of([0], [0], [200])
    with pytest.raises(ValueError, match="200 bytes"):
        into_span(blocks, 0, 100)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_baseline_without_a_data_plane_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.run(_args("--baseline", "--bulk", "0")) == 2
    assert "--baseline compares the data plane's bytes" in capsys.readouterr().err


def test_the_data_plane_runs_at_its_own_scale_and_at_most_four_in_flight() -> None:
    bulk = demo.bulk_args(_args("--bulk", "5", "--bulk-scale", "2", "--concurrency", "16"))
    assert (bulk.requests, bulk.scale, bulk.concurrency) == (5, 2, 4)
    assert demo.bulk_args(_args("--concurrency", "2")).concurrency == 2
