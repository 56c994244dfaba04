"""MooncakeTransport's own rules, against a fake engine: batching, bounds, errors, timeouts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvhandoff.transport.mooncake
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.errors import EngineCallError, TransportError, TransportTimeout
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.mooncake_engine import WRITE_ARRAYS
from tests.fakes import FakeArrayEngineBinding, FakeEngine, threads_named
from tests.unit.transport.conftest import fake_transport, pool_of


async def in_thread(fn, *args) -> None:
    """Block on a FakeEngine wait without blocking the loop (the transport posts to it)."""
    await asyncio.to_thread(fn, *args)


class SteppedClock:
    """`time` as `kvhandoff.transport.mooncake` sees it, with `monotonic()` stepped forward only by
    the test: a `start_by` passes exactly when the test says so, however late the worker thread
    gets to its check on a busy machine."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> SteppedClock:
    stepped = SteppedClock()
    monkeypatch.setattr(kvhandoff.transport.mooncake, "time", stepped)
    return stepped


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
    await in_thread(fake_engine.wait_entered, 1)
    assert len(fake_engine.batch_sizes) == 1  # one worker thread per peer: one call at a time
    assert not task.done()
    fake_engine.hang.set()
    await task
    assert fake_engine.max_active == 1 and len(fake_engine.batch_sizes) == 10
    t.close()


async def test_64_small_writes_behind_a_running_call_share_the_next_one(
    fake_engine, make_buffer
) -> None:
    """The default in-flight bound admits 64 concurrent one-block writes at once: while one call
    runs, the other 63 queue and go in one call, not 8 at a time behind slot cycles."""
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 64)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:1]))
    await in_thread(fake_engine.wait_entered, 1)
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 1])) for i in range(1, 64)]
    await asyncio.sleep(0.05)
    assert all(not task.done() for task in rest)
    fake_engine.hang.set()
    await asyncio.gather(first, *rest)
    assert fake_engine.batch_sizes == [1, 63]
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_inflight_bytes_per_peer_are_bounded(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine, max_inflight_bytes_per_peer=4096)
    src, dst, blocks = setup_blocks(make_buffer, t, 64, block=1024)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:1]))
    await in_thread(fake_engine.wait_entered, 1)
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 1])) for i in range(1, 64)]
    await asyncio.sleep(0.05)
    fake_engine.hang.set()
    await asyncio.gather(first, *rest)
    # At most 4 KiB in flight: a call carries at most 4 of the 1 KiB writes (the first
    # settling may let a 4th in before the worker takes the 3 queued behind it).
    assert fake_engine.batch_sizes[0] == 1 and max(fake_engine.batch_sizes) == 4
    assert sum(fake_engine.batch_sizes) == 64 and len(fake_engine.batch_sizes) >= 16
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_peers_do_not_share_a_worker(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 8)
    fake_engine.hang = threading.Event()
    tasks = [asyncio.create_task(t.write(p, blocks)) for p in ("a:1", "b:1")]
    await in_thread(fake_engine.wait_entered, 2)
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
    await in_thread(fake_engine.wait_entered, 1)
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
    assert MooncakeConfig().engine_env() == {
        "MC_TCP_ADMISSION_TIMEOUT_MS": "10000",  # a request waits for queue room as long as
        "MC_TRANSFER_TIMEOUT": "10",  # its call may take, not the engine's 1 s
    }
    cfg = MooncakeConfig(transfer_timeout_s=2.5, tcp_env={"MC_TCP_SLICE_SIZE": "65536"})
    assert cfg.engine_env() == {
        "MC_TCP_ADMISSION_TIMEOUT_MS": "5000",
        "MC_TCP_SLICE_SIZE": "65536",
        "MC_TRANSFER_TIMEOUT": "5",
    }
    tuned = MooncakeConfig(tcp_env={"MC_TCP_ADMISSION_TIMEOUT_MS": "2000"})
    assert tuned.engine_env()["MC_TCP_ADMISSION_TIMEOUT_MS"] == "2000"  # an operator's wins
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
        "import kvhandoff.transport.mooncake, kvhandoff.transport.local, "
        "kvhandoff.transport.pools\nfrom kvhandoff.transport.config import MooncakeConfig\n"
        "from kvhandoff.transport.errors import TransportError\n"
        "try:\n    kvhandoff.transport.mooncake.MooncakeTransport.start(MooncakeConfig())\n"
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
    await in_thread(fake_engine.wait_entered, 1)  # the worker is inside the engine
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (30, 32, 34, 36)]
    await asyncio.sleep(0)  # all four are queued behind it
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
    await in_thread(fake_engine.wait_entered, 1)
    fake_engine.rc = -1
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (2, 4)]
    await asyncio.sleep(0)
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
    await in_thread(fake_engine.wait_entered, 1)
    late_by = time.monotonic() + 0.05
    late = asyncio.create_task(t.write("peer:1", blocks[5:10], start_by=late_by))
    while time.monotonic() <= late_by:  # its instant passes while the first call still runs
        await asyncio.sleep(0.01)
    fake_engine.hang.set()
    await first
    with pytest.raises(TransportTimeout):
        await late
    assert fake_engine.batch_sizes == [5]
    t.close()


def test_max_call_s_is_allowance_plus_engine_timeout_plus_largest_batch_at_1_ns_per_byte() -> None:
    cfg = MooncakeConfig(transfer_timeout_s=2.5, max_bytes_per_batch=2 << 30)
    assert cfg.max_call_s == pytest.approx(0.5 + 5 + (2 << 30) / 1e9)
    cfg = MooncakeConfig(transfer_timeout_s=12.2, max_bytes_per_batch=1 << 20)
    assert cfg.max_call_s == pytest.approx(0.5 + 13 + (1 << 20) / 1e9)
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


# -- which engine call: the array API where the binding has it (Mooncake 0.3.14) --------------


async def test_an_engine_with_the_array_call_gets_the_batch_arrays_themselves(make_buffer) -> None:
    engine = FakeArrayEngineBinding(max_blocks=64)
    t = fake_transport(engine)
    assert t.uses_array_api
    src, dst, blocks = setup_blocks(make_buffer, t, 1000)
    await t.write("peer:1", blocks)
    assert engine.api_calls == ["arrays"] * 16  # the ~2,100-per-peer cap still cuts batches
    assert engine.batch_sizes == [64] * 15 + [40]
    for args in engine.array_args:
        assert all(type(a) is np.ndarray and a.dtype == np.uint64 for a in args)
    # One write, no concat: the engine got views of the planner's arrays, not copies.
    first_src, first_dst, first_len = engine.array_args[0]
    assert np.shares_memory(first_src, blocks.src_addr)
    assert np.shares_memory(first_dst, blocks.dst_addr)
    assert np.shares_memory(first_len, blocks.length)
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_an_engine_without_the_array_call_gets_lists() -> None:
    engine = FakeEngine(max_blocks=64)
    t = fake_transport(engine)
    assert not hasattr(engine, WRITE_ARRAYS) and not t.uses_array_api
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros_like(src)
    pool_of(src).register(t)
    await t.write("peer:1", Blocks.of([src.ctypes.data], [dst.ctypes.data], [256]))
    assert engine.api_calls == ["lists"]
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_writes_queued_together_reach_the_array_call_as_one_batch(make_buffer) -> None:
    engine = FakeArrayEngineBinding(max_blocks=64)
    t = fake_transport(engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 10)
    engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await in_thread(engine.wait_entered, 1)
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 4])) for i in (2, 6)]
    await asyncio.sleep(0)
    engine.hang.set()
    await asyncio.gather(first, *rest)
    assert engine.api_calls == ["arrays", "arrays"] and engine.batch_sizes == [2, 8]
    np.testing.assert_array_equal(engine.array_args[1][0], blocks.src_addr[2:10])
    np.testing.assert_array_equal(src, dst)
    t.close()


async def test_strided_blocks_reach_the_array_call_contiguous(make_buffer) -> None:
    """The binding refuses a strided buffer (TypeError); the transport hands it a contiguous
    copy instead of failing the write."""
    engine = FakeArrayEngineBinding(max_blocks=64)
    t = fake_transport(engine)
    src, dst = make_buffer(8 * 16), make_buffer(8 * 16)
    src[:] = np.arange(src.size) % 241
    pool_of(src).register(t)
    offs = np.arange(16, dtype=np.uint64) * np.uint64(8)  # every other one is used
    table = np.stack([offs + np.uint64(src.ctypes.data), offs + np.uint64(dst.ctypes.data)])
    strided = Blocks(table[0, ::2], table[1, ::2], np.full(16, 8, dtype=np.uint64)[::2])
    assert not strided.src_addr.flags.c_contiguous
    await t.write("peer:1", strided)
    assert engine.api_calls == ["arrays"] and engine.batch_sizes == [8]
    assert all(a.flags.c_contiguous for a in engine.array_args[0])  # type: ignore[attr-defined]
    for k in range(0, 16, 2):
        np.testing.assert_array_equal(dst[k * 8 : k * 8 + 8], src[k * 8 : k * 8 + 8])
        assert not dst[k * 8 + 8 : k * 8 + 16].any()
    t.close()


def test_the_installed_engine_is_asked_once_whether_it_has_the_array_call() -> None:
    """The real binding here (0.3.13 CPU wheel: lists only; a 0.3.14 build: arrays)."""
    engine_module = pytest.importorskip("mooncake.engine")
    t = MooncakeTransport.start(MooncakeConfig())
    try:
        assert t.uses_array_api == hasattr(engine_module.TransferEngine, WRITE_ARRAYS)
    finally:
        t.close()


# -- the write path's safety rules, against the fault-injecting engine --------------------------


async def test_an_engine_exception_fails_every_batch_of_the_call_with_its_cause(
    fake_engine, make_buffer
) -> None:
    """Finding 1: an exception from `batch_transfer_sync_write` is a failure, never success."""
    t = fake_transport(fake_engine)
    _, dst, blocks = setup_blocks(make_buffer, t, 10)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await in_thread(fake_engine.wait_entered, 1)
    # Two writes queued behind the running call share the next one, which raises.
    fake_engine.script(0, TypeError("incompatible function arguments"))
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (2, 4)]
    await asyncio.sleep(0)  # both are queued before the running call returns
    fake_engine.hang.set()
    await first
    errors = []
    for task in rest:
        with pytest.raises(EngineCallError) as info:
            await task
        errors.append(info.value)
    assert fake_engine.batch_sizes == [2, 4]
    assert all(isinstance(e.cause, TypeError) and e.__cause__ is e.cause for e in errors)
    assert errors[0] is not errors[1]  # each future its own instance
    assert errors[0].context == {"peer": "peer:1"}
    assert not dst[2 * 16 :].any()
    assert t.stats().engine_exceptions == 1 and t.stats().batches_failed == 2
    t.close()


async def test_an_exception_while_preparing_the_call_fails_its_batches(
    fake_engine, make_buffer, monkeypatch
) -> None:
    """Finding 1: `Blocks.concat` (or `.tolist()`) raising fails the call's batches."""
    t = fake_transport(fake_engine)
    _, dst, blocks = setup_blocks(make_buffer, t, 10)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await in_thread(fake_engine.wait_entered, 1)

    def broken(parts: list[Blocks]) -> Blocks:
        raise MemoryError("concat")

    monkeypatch.setattr(Blocks, "concat", staticmethod(broken))
    rest = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (2, 4)]
    await asyncio.sleep(0)
    fake_engine.hang.set()
    await first
    for task in rest:
        with pytest.raises(EngineCallError, match="MemoryError"):
            await task
    assert fake_engine.batch_sizes == [2] and not dst[2 * 16 :].any()
    t.close()


async def test_no_batch_starts_after_start_by_even_if_it_passes_while_preparing(
    fake_engine, make_buffer, monkeypatch
) -> None:
    """Deliverable 3: the late-start check is the last step before the engine call, after
    `concat`/`tolist`, in the worker thread."""
    t = fake_transport(fake_engine)
    _, dst, blocks = setup_blocks(make_buffer, t, 10)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await in_thread(fake_engine.wait_entered, 1)
    in_concat, resume = threading.Event(), threading.Event()
    real = Blocks.concat

    def slow(parts: list[Blocks]) -> Blocks:
        in_concat.set()
        resume.wait()
        return real(parts)

    monkeypatch.setattr(Blocks, "concat", staticmethod(slow))
    start_by = time.monotonic() + 0.05
    rest = [
        asyncio.create_task(t.write("peer:1", blocks[i : i + 2], start_by=start_by)) for i in (2, 4)
    ]
    await asyncio.sleep(0)
    fake_engine.hang.set()
    await first
    await in_thread(in_concat.wait)  # both are on time when the worker takes them ...
    while time.monotonic() <= start_by:  # ... and late once the call is prepared
        await asyncio.sleep(0.01)
    resume.set()
    for task in rest:
        with pytest.raises(TransportTimeout, match="deadline passed"):
            await task
    assert fake_engine.batch_sizes == [2] and not dst[2 * 16 :].any()
    t.close()


async def test_a_later_failing_batch_never_turns_a_landed_one_into_a_cancellation(
    fake_engine, make_buffer
) -> None:
    """Finding 5: the write raises the failing batch's error, not `CancelledError`, and the
    batch before it stays a success (its bytes landed and are counted)."""
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 128)
    for rc_second in range(20):
        dst[:] = 0
        fake_engine.script(0, -(rc_second + 1))
        task = asyncio.create_task(t.write("peer:1", blocks))
        await asyncio.sleep(0)  # both batches submitted
        # Hold the loop until the worker has finished both calls: the second batch's failure
        # is known in the worker before the loop has read the first batch's success.
        fake_engine.wait_returned(2 * (rc_second + 1))
        with pytest.raises(TransportError) as info:
            await task
        assert info.value.rc == -(rc_second + 1)
        np.testing.assert_array_equal(dst[: 64 * 16], src[: 64 * 16])
        assert not dst[64 * 16 :].any()
    stats = t.stats()
    assert stats.batches_succeeded == 20 and stats.batches_failed == 20
    assert stats.engine_errors_by_rc == {-(i + 1): 1 for i in range(20)}
    assert stats.bytes_written == 20 * 64 * 16
    t.close()


async def test_a_late_batch_does_not_cancel_the_one_before_it(
    fake_engine, make_buffer, clock: SteppedClock
) -> None:
    """Finding 5: batch 1 starts in time and lands; batch 2 is late; the write raises the
    timeout (never `CancelledError`)."""
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 128)
    fake_engine.hang = threading.Event()
    # Far enough ahead that batch 1 is on time however slowly its worker starts; the instant
    # passes when the test steps the clock, while batch 1 is inside the engine.
    start_by = clock.monotonic() + 60.0
    task = asyncio.create_task(t.write("peer:1", blocks, start_by=start_by))
    await in_thread(fake_engine.wait_entered, 1)
    clock.offset_s = 120.0
    fake_engine.hang.set()
    # Hold the loop while the worker finishes batch 1 and finds batch 2 late (the window in which
    # a shared stop flag used to turn batch 1 into a cancellation; a longer hold only widens it).
    fake_engine.wait_returned(1)
    time.sleep(0.05)
    with pytest.raises(TransportTimeout, match="deadline passed"):
        await task
    np.testing.assert_array_equal(dst[: 64 * 16], src[: 64 * 16])
    assert fake_engine.batch_sizes == [64] and t.stats().batches_succeeded == 1
    t.close()


async def test_a_failed_write_skips_only_its_own_batches(fake_engine, make_buffer) -> None:
    """Finding 5: W1's failure skips W1's queued batches; W2's, queued behind them, run."""
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 64 * 5)
    fake_engine.hang = threading.Event()
    fake_engine.script(-3)
    w1 = asyncio.create_task(t.write("peer:1", blocks[0 : 64 * 3]))
    await in_thread(fake_engine.wait_entered, 1)
    w2 = asyncio.create_task(t.write("peer:1", blocks[64 * 3 :]))
    await asyncio.sleep(0)
    fake_engine.hang.set()
    with pytest.raises(TransportError) as info:
        await w1
    assert info.value.rc == -3
    await w2
    assert fake_engine.batch_sizes == [64, 64, 64]
    assert not dst[: 64 * 3 * 16].any()
    np.testing.assert_array_equal(dst[64 * 3 * 16 :], src[64 * 3 * 16 :])
    t.close()


async def test_only_the_callers_cancellation_cancels_and_started_calls_finish(
    fake_engine, make_buffer
) -> None:
    t = fake_transport(fake_engine)
    src, dst, blocks = setup_blocks(make_buffer, t, 640)
    fake_engine.hang = threading.Event()
    task = asyncio.create_task(t.write("peer:1", blocks))
    await in_thread(fake_engine.wait_entered, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    quiet = asyncio.create_task(t.quiesce("peer:1"))
    await asyncio.sleep(0)
    assert not quiet.done()  # the started call can still write
    fake_engine.hang.set()
    await quiet
    assert fake_engine.batch_sizes == [64]  # the batches not started were skipped
    np.testing.assert_array_equal(dst[: 64 * 16], src[: 64 * 16])  # the started one landed
    assert not dst[64 * 16 :].any()
    t.close()


async def test_a_stuck_peer_fails_queued_batches_with_their_own_current_error(
    fake_engine, make_buffer
) -> None:
    """Finding 10: batches queued behind a call that outlives the timeout fail when it does,
    each with its own instance; once the call returns, no stale flag fails the next write."""
    t = fake_transport(fake_engine, transfer_timeout_s=0.2)
    src, dst, blocks = setup_blocks(make_buffer, t, 10)
    fake_engine.hang = threading.Event()
    first = asyncio.create_task(t.write("peer:1", blocks[0:2]))
    await in_thread(fake_engine.wait_entered, 1)
    queued = [asyncio.create_task(t.write("peer:1", blocks[i : i + 2])) for i in (2, 4)]
    with pytest.raises(TransportTimeout, match="did not finish"):
        await first
    errors = []
    for task in queued:
        with pytest.raises(TransportTimeout, match="still inside the engine") as info:
            await task
        errors.append(info.value)
    assert errors[0] is not errors[1]
    with pytest.raises(TransportTimeout, match="still inside the engine"):
        await t.write("peer:1", blocks[6:8])  # fail fast while the call runs
    fake_engine.hang.set()
    # The call has returned; hold the loop (no callback from the worker runs) and write at once:
    # stuck is read from the lane's state, not from a flag the loop has yet to clear.
    fake_engine.wait_returned(1)
    while t.stats().engine_calls < 1:
        time.sleep(0.001)
    await t.write("peer:1", blocks[8:10])
    np.testing.assert_array_equal(dst[8 * 16 : 10 * 16], src[8 * 16 : 10 * 16])
    assert fake_engine.batch_sizes == [2, 2] and t.stats().batches_timed_out == 1
    t.close()


async def test_worker_threads_are_bounded_and_lanes_and_threads_reclaimed_when_idle(
    fake_engine, make_buffer
) -> None:
    """Finding 8: 200 peers share `max_worker_threads` threads; idle lanes and threads go."""
    t = fake_transport(fake_engine, max_worker_threads=4, peer_idle_s=0.1)
    src, dst, blocks = setup_blocks(make_buffer, t, 200)
    fake_engine.hang = threading.Event()
    tasks = [asyncio.create_task(t.write(f"peer:{i}", blocks[i : i + 1])) for i in range(200)]
    await in_thread(fake_engine.wait_entered, 4)
    assert threads_named(f"kvhandoff-mooncake {t.local_target}") == 4 and fake_engine.active == 4
    assert t.stats().live_lanes == 200 and t.stats().worker_threads == 4
    fake_engine.hang.set()
    await asyncio.gather(*tasks)
    np.testing.assert_array_equal(src, dst)
    assert fake_engine.max_active == 4 and len(set(fake_engine.targets)) == 200
    while t.stats().live_lanes or t.stats().worker_threads:
        await asyncio.sleep(0.02)  # reclaimed after peer_idle_s; the test timeout bounds this
    assert threads_named(f"kvhandoff-mooncake {t.local_target}") == 0
    await t.write("peer:7", blocks[0:1])  # a reclaimed peer's lane comes back on demand
    assert t.stats().live_lanes == 1
    t.close()
    assert threads_named(f"kvhandoff-mooncake {t.local_target}") == 0 and t.stats().live_lanes == 0


async def test_one_call_per_peer_even_with_threads_to_spare(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine, max_worker_threads=8)
    _, _, blocks = setup_blocks(make_buffer, t, 64 * 6)
    fake_engine.hang = threading.Event()
    writes = [
        asyncio.create_task(t.write("peer:1", blocks[i * 64 : (i + 2) * 64])) for i in (0, 2, 4)
    ]
    await in_thread(fake_engine.wait_entered, 1)
    await asyncio.sleep(0.05)
    assert fake_engine.active == 1
    fake_engine.hang.set()
    await asyncio.gather(*writes)
    assert fake_engine.max_active == 1
    t.close()


async def test_close_fails_queued_batches_and_joins_the_threads(fake_engine, make_buffer) -> None:
    t = fake_transport(fake_engine)
    _, _, blocks = setup_blocks(make_buffer, t, 64 * 3)
    fake_engine.hang = threading.Event()
    task = asyncio.create_task(t.write("peer:1", blocks))
    await in_thread(fake_engine.wait_entered, 1)
    closing = asyncio.create_task(asyncio.to_thread(t.close))
    await asyncio.sleep(0.05)
    assert not closing.done()  # waits for the running call
    fake_engine.hang.set()
    await closing
    with pytest.raises(TransportError):
        await task
    assert fake_engine.batch_sizes == [64]
    assert threads_named(f"kvhandoff-mooncake {t.local_target}") == 0
    with pytest.raises(TransportError, match="closed"):
        await t.write("peer:1", blocks)


@pytest.mark.parametrize("seed", range(6))
async def test_random_failures_and_cancellations_keep_the_write_path_rules(
    fake_engine, make_buffer, seed: int
) -> None:
    """Many writes to a few peers over few threads, with random engine rcs and exceptions and
    random cancellations. Whatever the interleaving: a write that returns landed every byte; a
    write raises `CancelledError` only if it was cancelled, otherwise only `TransportError`; and
    once a cancelled write is drained and its peer quiesced, no engine call touches its memory."""
    rng = np.random.default_rng(seed)
    t = fake_transport(fake_engine, max_inflight_batches_per_peer=2, max_worker_threads=2)
    n_writes, per_write = 24, 200
    src, dst, blocks = setup_blocks(make_buffer, t, n_writes * per_write)
    outcomes: list[int | BaseException] = []
    for _ in range(400):
        roll = rng.random()
        outcomes.append(
            0 if roll < 0.85 else int(-rng.integers(1, 6)) if roll < 0.95 else RuntimeError("x")
        )
    fake_engine.script(*outcomes)

    async def one(i: int) -> tuple[str, BaseException | None, int]:
        peer = f"peer:{i % 3}"
        size = int(rng.integers(1, per_write + 1))
        part = blocks[i * per_write : i * per_write + size]
        task = asyncio.create_task(t.write(peer, part))
        cancel_after = int(rng.integers(0, 6)) if rng.random() < 0.3 else -1
        for _ in range(max(cancel_after, 0)):
            await asyncio.sleep(0)
        if cancel_after >= 0:
            task.cancel()
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 — classified below
            if cancel_after >= 0:
                await t.quiesce(peer)
            return ("cancelled" if cancel_after >= 0 else "kept", exc, len(fake_engine.dst_blocks))
        return ("cancelled" if cancel_after >= 0 else "kept", None, size)

    results = await asyncio.gather(*(one(i) for i in range(n_writes)))
    await t.quiesce()
    for i, (kind, exc, info) in enumerate(results):
        lo = dst.ctypes.data + i * per_write * 16
        hi = lo + per_write * 16
        if exc is None:
            size = info
            view = slice(i * per_write * 16, (i * per_write + size) * 16)
            np.testing.assert_array_equal(dst[view], src[view])
        elif isinstance(exc, asyncio.CancelledError):
            assert kind == "cancelled", f"write {i} raised CancelledError uncancelled"
            assert not fake_engine.touched(lo, hi, since_call=info), f"write {i} written late"
        else:
            assert isinstance(exc, TransportError), f"write {i} raised {exc!r}"
    assert fake_engine.active == 0
    while (s := t.stats()).batches_submitted != s.batches_succeeded + s.batches_failed:
        await asyncio.sleep(0.01)  # settlements of abandoned batches still in flight to the loop
    t.close()
