"""LocalTransport's own rules: failures of the copy are failures, counters, its bound."""

from __future__ import annotations

import numpy as np
import pytest

import kvhandoff.transport.local as local_module
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.errors import EngineCallError
from kvhandoff.transport.local import LOCAL_CALL_BASE_S, LOCAL_MIN_BYTES_PER_S, LocalTransport
from tests.unit.transport.conftest import pool_of


async def test_an_exception_from_the_copy_fails_the_write_with_its_cause(
    make_buffer, monkeypatch
) -> None:
    t = LocalTransport()
    src, dst = make_buffer(4096), make_buffer(4096)
    pools = [pool_of(src), pool_of(dst)]
    for p in pools:
        p.register(t)

    def broken(dst: list[int], src: list[int], lengths: list[int]) -> None:
        raise OSError("copy failed")

    monkeypatch.setattr(local_module, "move_lists", broken)
    with pytest.raises(EngineCallError) as info:
        await t.write(t.local_target, Blocks.of([src.ctypes.data], [dst.ctypes.data], [4096]))
    assert isinstance(info.value.cause, OSError)
    assert t.stats().batches_failed == 1 and t.stats().batches_succeeded == 0
    t.close()


async def test_counts_batches_bytes_and_blocks_under_both_caps(make_buffer) -> None:
    t = LocalTransport(max_blocks_per_batch=4, max_bytes_per_batch=8192)
    src, dst = make_buffer(40960), make_buffer(40960)
    src[:] = np.arange(src.size) % 241
    for p in (pool_of(src), pool_of(dst)):
        p.register(t)
    # One 20 KiB block cut into 8 + 8 + 4 KiB, then ten of 2 KiB: batches of 8 KiB each,
    # [8], [8], [4 2 2], [2 2 2 2], [2 2 2 2].
    offs = [0] + [20480 + 2048 * i for i in range(10)]
    blocks = Blocks.of(
        [src.ctypes.data + o for o in offs],
        [dst.ctypes.data + o for o in offs],
        [20480] + [2048] * 10,
    )
    await t.write(t.local_target, blocks)
    np.testing.assert_array_equal(src, dst)
    stats = t.stats()
    assert stats.batches_submitted == stats.batches_succeeded == 5
    assert stats.bytes_written == 40960 and stats.blocks_written == 13
    t.close()


def test_max_call_s_allows_the_largest_batch_at_the_floor_rate() -> None:
    t = LocalTransport(max_bytes_per_batch=1 << 30)
    assert t.max_call_s == pytest.approx(LOCAL_CALL_BASE_S + (1 << 30) / LOCAL_MIN_BYTES_PER_S)
    t.close()
