"""The `Transport` contract, run against both transports (mooncake writes to itself)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvhandoff.transport.base import Transport
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.errors import TransportError, TransportTimeout
from kvhandoff.transport.regions import Region
from tests.unit.transport.conftest import pool_of

SIZE = 1 << 20


def fragmented(src_base: int, dst_base: int, rng: np.random.Generator, n: int) -> Blocks:
    """`n` disjoint 256-byte-multiple blocks at random offsets, written to shuffled places."""
    slots = rng.permutation(SIZE // 1024)[:n].astype(np.uint64) * 1024
    dst_slots = rng.permutation(SIZE // 1024)[:n].astype(np.uint64) * 1024
    lengths = rng.integers(1, 5, n).astype(np.uint64) * 256
    return Blocks.of(slots + src_base, dst_slots + dst_base, lengths)


def expected(
    src: np.ndarray, dst_before: np.ndarray, blocks: Blocks, s0: int, d0: int
) -> np.ndarray:
    out = dst_before.copy()
    for s, d, n in zip(blocks.src_addr.tolist(), blocks.dst_addr.tolist(), blocks.length.tolist()):
        out[d - d0 : d - d0 + n] = src[s - s0 : s - s0 + n]
    return out


async def test_satisfies_protocol(transport: Transport) -> None:
    assert isinstance(transport, Transport)
    assert transport.local_target


async def test_write_copies_exactly_the_blocks_even_above_the_batch_cap(
    transport: Transport, make_buffer
) -> None:
    rng = np.random.default_rng(1)
    src, dst = make_buffer(SIZE), make_buffer(SIZE)
    src[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    dst[:] = 0xA5  # sentinel: bytes outside the destination ranges must keep it
    pools = [pool_of(src), pool_of(dst)]
    for p in pools:
        p.register(transport)
    blocks = fragmented(src.ctypes.data, dst.ctypes.data, rng, 300)  # cap is 64: 5 batches
    want = expected(src, dst, blocks, src.ctypes.data, dst.ctypes.data)
    await transport.write(transport.local_target, blocks)
    np.testing.assert_array_equal(dst, want)
    for p in pools:
        p.close()


async def test_a_write_past_its_start_by_instant_moves_nothing(
    transport: Transport, make_buffer
) -> None:
    src, dst = make_buffer(SIZE), make_buffer(SIZE)
    src[:] = 7
    pools = [pool_of(src), pool_of(dst)]
    for p in pools:
        p.register(transport)
    blocks = fragmented(src.ctypes.data, dst.ctypes.data, np.random.default_rng(2), 100)
    with pytest.raises(TransportTimeout):
        await transport.write(transport.local_target, blocks, start_by=time.monotonic() - 0.1)
    assert not dst.any()
    for p in pools:
        p.close()


async def test_empty_write_is_a_no_op(transport: Transport) -> None:
    await transport.write(transport.local_target, Blocks.empty())


async def test_source_outside_registered_memory_is_rejected(
    transport: Transport, make_buffer
) -> None:
    src, dst = make_buffer(8192), make_buffer(8192)
    pool_of(dst).register(transport)
    with pytest.raises(TransportError):
        await transport.write(
            transport.local_target, Blocks.of([src.ctypes.data], [dst.ctypes.data], [4096])
        )
    assert not dst.any()


async def test_block_straddling_the_end_of_a_region_is_rejected(
    transport: Transport, make_buffer
) -> None:
    src, dst = make_buffer(8192), make_buffer(8192)
    pool_of(src).register(transport)
    pool_of(dst).register(transport)
    with pytest.raises(TransportError):
        await transport.write(
            transport.local_target,
            Blocks.of([src.ctypes.data], [dst.ctypes.data + 8192 - 100], [4096]),
        )


async def test_destination_outside_registered_memory_fails_and_the_transport_recovers(
    transport: Transport, make_buffer
) -> None:
    src, dst, stray = make_buffer(8192), make_buffer(8192), make_buffer(8192)
    src[:] = 7
    pool_of(src).register(transport)
    pool_of(dst).register(transport)
    with pytest.raises(TransportError) as info:
        await transport.write(
            transport.local_target, Blocks.of([src.ctypes.data], [stray.ctypes.data], [4096])
        )
    assert info.value.peer == transport.local_target
    assert not stray.any()
    await transport.write(
        transport.local_target, Blocks.of([src.ctypes.data], [dst.ctypes.data], [4096])
    )
    assert (dst[:4096] == 7).all() and not dst[4096:].any()


async def test_overlapping_registration_is_rejected(transport: Transport, make_buffer) -> None:
    buf = make_buffer(8192)
    transport.register([Region(buf.ctypes.data, 8192)])
    with pytest.raises(TransportError):
        transport.register([Region(buf.ctypes.data + 4096, 8192)])


async def test_unregister_is_idempotent_and_unregistered_memory_is_rejected(
    transport: Transport, make_buffer
) -> None:
    src, dst = make_buffer(4096), make_buffer(4096)
    pool_of(dst).register(transport)
    src_pool = pool_of(src)
    src_pool.register(transport)
    src_pool.close()
    src_pool.close()
    transport.unregister([Region(src.ctypes.data, 4096)])
    with pytest.raises(TransportError):
        await transport.write(
            transport.local_target, Blocks.of([src.ctypes.data], [dst.ctypes.data], [16])
        )


async def test_closed_transport_refuses_writes_and_close_is_idempotent(
    transport: Transport, make_buffer
) -> None:
    buf = make_buffer(4096)
    pool = pool_of(buf)
    pool.register(transport)
    transport.close()
    transport.close()
    pool.close()  # unregistering after the transport closed is harmless
    with pytest.raises(TransportError):
        await transport.write(transport.local_target, Blocks.of([buf.ctypes.data], [0], [1]))


async def test_quiesce_returns_when_idle(transport: Transport) -> None:
    await transport.quiesce()
    await transport.quiesce(transport.local_target)


async def test_declares_a_finite_bound_for_one_call(transport: Transport) -> None:
    assert 0 < transport.max_call_s < 60


async def test_stats_count_what_landed(transport: Transport, make_buffer) -> None:
    src, dst = make_buffer(SIZE), make_buffer(SIZE)
    src[:] = 3
    pools = [pool_of(src), pool_of(dst)]
    for p in pools:
        p.register(transport)
    blocks = fragmented(src.ctypes.data, dst.ctypes.data, np.random.default_rng(4), 100)
    before = transport.stats()
    await transport.write(transport.local_target, blocks)
    after = transport.stats()
    assert after.bytes_written - before.bytes_written == blocks.total_bytes
    assert after.blocks_written - before.blocks_written == len(blocks)
    assert after.batches_succeeded - before.batches_succeeded == 2  # 100 blocks, cap 64
    assert after.batches_failed == before.batches_failed
    for p in pools:
        p.close()
