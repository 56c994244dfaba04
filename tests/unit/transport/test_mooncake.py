"""MooncakeTransport's own rules, against a fake engine: batching, bounds, errors, timeouts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.fakes import FakeEngine
from tests.unit.transport.conftest import fake_transport, pool_of
from transport.blocks import Blocks
from transport.config import MooncakeConfig
from transport.errors import TransportError, TransportTimeout
from transport.mooncake import MooncakeTransport


def setup_blocks(
    make_buffer, transport, n: int, block: int = 16
) -> tuple[np.ndarray, np.ndarray, Blocks]:
    src, dst = make_buffer(n * block), make_buffer(n * block)
    src[:] = np.arange(src.size) % 251
    pool_of(src).register(transport)
    offs = np.arange(n, dtype=np.uint64) * block
    return src, dst, Blocks.of(offs + src.ctypes.data, offs + dst.ctypes.data, [block] * n)


async def test_batches_never_exceed_the_cap_and_cover_every_block(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 1000)
    await t.write("peer:1", blocks)
    assert fake_engine.batch_sizes == [64] * 15 + [40]
    assert set(fake_engine.targets) == {"peer:1"}
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_negative_rc_raises_with_rc_and_peer_and_stops_the_write(
    fake_engine, make_buffer
) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 1000)
    fake_engine.rc = -800
    with pytest.raises(TransportError) as info:
        await t.write("peer:1", blocks)
    assert info.value.rc == -800 and info.value.peer == "peer:1"
    assert info.value.context == {"rc": -800, "peer": "peer:1"}
    await t.quiesce()
    assert len(fake_engine.batch_sizes) == 1  # the batches queued behind it were skipped
    t.close()


async def test_inflight_batches_per_peer_are_bounded(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine, max_inflight_batches_per_peer=3)
    _, _, blocks = setup_blocks(make_buffer, t, 64 * 10)
    fake_engine.hang = threading.Event()
    task = asyncio.create_task(t.write("peer:1", blocks))
    await asyncio.sleep(0.2)
    assert len(fake_engine.batch_sizes) == 1  # one worker thread per peer: one call at a time
    assert not task.done()
    fake_engine.hang.set()
    await task
    assert fake_engine.max_active == 1 and len(fake_engine.batch_sizes) == 10
    t.close()


async def test_peers_do_not_share_a_worker(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 8)
    fake_engine.hang = threading.Event()
    tasks = [asyncio.create_task(t.write(p, blocks)) for p in ("a:1", "b:1")]
    await asyncio.sleep(0.2)
    assert fake_engine.active == 2
    fake_engine.hang.set()
    await asyncio.gather(*tasks)
    t.close()


async def test_hung_peer_times_out_marks_the_peer_stuck_and_quiesce_waits(
    fake_engine, make_buffer
) -> None:
    t = fake_transport(fake_engine, transfer_timeout_s=0.3)
    _, _, blocks = setup_blocks(make_buffer, t, 200)
    fake_engine.hang = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout) as info:
        await t.write("peer:1", blocks)
    assert time.monotonic() - t0 < 2.0
    assert info.value.peer == "peer:1"
    with pytest.raises(TransportTimeout):  # still inside the engine: fail fast, do not queue
        await t.write("peer:1", blocks)
    quiet = asyncio.create_task(t.quiesce("peer:1"))
    await asyncio.sleep(0.1)
    assert not quiet.done()
    fake_engine.hang.set()
    await quiet
    assert fake_engine.batch_sizes == [64]  # the write's later batches never started
    fake_engine.hang = None
    await t.write("peer:1", blocks)  # the engine call returned: the peer is usable again
    t.close()


async def test_cancelled_write_skips_batches_not_started(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 640)
    fake_engine.hang = threading.Event()
    task = asyncio.create_task(t.write("peer:1", blocks))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fake_engine.hang.set()
    await t.quiesce()
    assert len(fake_engine.batch_sizes) == 1
    t.close()


def test_registration_failure_carries_the_rc(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    buf = make_buffer(64)
    fake_engine.registered[buf.ctypes.data] = 64  # the engine already knows it
    with pytest.raises(TransportError) as info:
        pool_of(buf).register(t)
    assert info.value.rc == -7


def test_close_unregisters_everything(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    pool_of(make_buffer(64)).register(t)
    pool_of(make_buffer(64)).register(t)
    t.close()
    assert fake_engine.registered == {}


def test_config_validation_and_engine_env() -> None:
    assert MooncakeConfig().engine_env() == {"MC_TRANSFER_TIMEOUT": "10"}
    cfg = MooncakeConfig(transfer_timeout_s=2.5, tcp_env={"MC_TCP_SLICE_SIZE": "65536"})
    assert cfg.engine_env() == {"MC_TCP_SLICE_SIZE": "65536", "MC_TRANSFER_TIMEOUT": "5"}
    assert MooncakeConfig(protocol="ascend").align_bytes == 2 << 20
    with pytest.raises(ValueError):
        MooncakeConfig(tcp_env={"LD_PRELOAD": "x"})


def test_config_rejects_a_cap_above_the_engine_limit() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_blocks_per_batch": 4096}, MooncakeConfig)


def test_package_imports_without_mooncake() -> None:
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.engine'] = None\n"
        "import transport.mooncake, transport.local, transport.pools\n"
        "from transport.config import MooncakeConfig\n"
        "from transport.errors import TransportError\n"
        "try:\n    transport.mooncake.MooncakeTransport.start(MooncakeConfig())\n"
        "except TransportError as e:\n    print('ok', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ok")


async def test_small_writes_queued_behind_a_running_call_share_the_next_one(
    fake_engine, make_buffer
) -> None:
    t = fake_transport(fake_engine)  # cap 64 blocks per call
    src, dst, blocks = setup_blocks(make_buffer, t, 40)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:30]))
    await asyncio.sleep(0.1)  # the worker is inside the engine with the first write
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (30, 32, 34, 36)]
    await asyncio.sleep(0.1)
    fake_engine.hang.set()
    await asyncio.gather(first, *rest)
    assert fake_engine.batch_sizes == [30, 8]  # four queued writes, one engine call
    np.testing.assert_array_equal(src[: 38 * 16], dst[: 38 * 16])
    t.close()


async def test_a_failed_shared_call_fails_every_write_in_it(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 10)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await asyncio.sleep(0.1)
    fake_engine.rc = -1
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (2, 4)]
    await asyncio.sleep(0.1)
    fake_engine.hang.set()
    for task in [first, *rest]:
        with pytest.raises(TransportError):
            await task
    assert fake_engine.batch_sizes == [2, 4]
    t.close()


async def test_no_batch_starts_after_the_writes_start_by_instant(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, dst, blocks = setup_blocks(make_buffer, t, 10)
    with pytest.raises(TransportTimeout, match="deadline passed"):
        await t.write("peer:1", blocks, start_by=time.monotonic() - 1)
    assert fake_engine.batch_sizes == [] and not dst.any()
    # A batch queued behind a slow call is checked when the worker reaches it, not before.
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:5]))
    await asyncio.sleep(0.1)
    late = asyncio.create_task(t.write("peer:1", blocks[5:10], start_by=time.monotonic() + 0.1))
    await asyncio.sleep(0.3)  # its instant passes while the first call still runs
    fake_engine.hang.set()
    await first
    with pytest.raises(TransportTimeout):
        await late
    assert fake_engine.batch_sizes == [5]
    t.close()


def test_max_call_s_is_the_engine_timeout_plus_the_largest_batch_at_1_ns_per_byte() -> None:
    cfg = MooncakeConfig(transfer_timeout_s=2.5, max_bytes_per_batch=2 << 30)
    assert cfg.max_call_s == pytest.approx(5 + (2 << 30) / 1e9)
    cfg = MooncakeConfig(transfer_timeout_s=12.2, max_bytes_per_batch=1 << 20)
    assert cfg.max_call_s == pytest.approx(13 + (1 << 20) / 1e9)
    assert cfg.engine_timeout_s == cfg.max_call_s
    assert MooncakeTransport(FakeEngine(), cfg, "fake:1").max_call_s == cfg.max_call_s


async def test_batches_are_capped_in_bytes_and_a_larger_block_is_cut(
    fake_engine, make_buffer
) -> None:
    t = fake_transport(fake_engine, max_bytes_per_batch=4096)
    src, dst = make_buffer(3 * 4096), make_buffer(3 * 4096)
    src[:] = np.arange(src.size) % 253
    pool_of(src).register(t)
    # One 10 KiB block, then two of 1 KiB: 4096 + 4096 + 2048 (+ 1024 + 1024 share a call).
    blocks = Blocks.of(
        [src.ctypes.data, src.ctypes.data + 10240, src.ctypes.data + 11264],
        [dst.ctypes.data, dst.ctypes.data + 10240, dst.ctypes.data + 11264],
        [10240, 1024, 1024],
    )
    await t.write("peer:1", blocks)
    assert fake_engine.bytes_per_call == [4096, 4096, 4096]
    np.testing.assert_array_equal(src, dst)
    t.close()
