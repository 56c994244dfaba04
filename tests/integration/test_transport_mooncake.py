"""Two real processes over Mooncake TCP on 127.0.0.1: this test process sends, a receiver
process (`_transport_receiver.py`) owns shm-backed destination memory. Every destination byte is
checked through the shared /dev/shm file, and every byte outside the destination ranges must
still hold the sentinel the receiver's memory was filled with."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.pairing import pair
from kvhandoff.pipelines.planning import plan
from kvhandoff.transport import mooncake
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.errors import TransportError, TransportTimeout
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.pool_base import Pool, host_array
from kvhandoff.transport.pool_shm import ShmPool
from kvhandoff.transport.pools import open_pool

sys.path.insert(0, os.path.dirname(__file__))
from _transport_receiver import Receiver, spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
pytest.importorskip("mooncake.engine")

SENTINEL = 0x5A
TIMEOUT_S = 3.0
#: Ends only a test that hangs; never what a passing run waits for.
FAILURE_BOUND_S = 30.0


def shm_name() -> str:
    return f"kvhandoff-it-{uuid.uuid4().hex[:12]}"


class Remote:
    """A receiver plus this process's own mapping of its shm file (for checking bytes)."""

    def __init__(self, sizes: list[int], config: dict[str, object] | None = None) -> None:
        self.name = shm_name()
        self.receiver: Receiver = spawn(self.name, sizes, config)
        self.mirror = ShmPool(self.name, sizes, align_bytes=4096, create=False)
        # Receiver address -> file offset: region i sits at offsets[i] in the file.
        self.file_base = self.receiver.bases[0] - self.mirror.offsets[0]
        self.file = np.frombuffer(self.mirror._mmap, dtype=np.uint8)  # type: ignore[arg-type]
        self.file[:] = SENTINEL

    @property
    def target(self) -> str:
        return self.receiver.target

    def close(self) -> None:
        del self.file
        self.mirror.close()
        self.receiver.stop()


@pytest.fixture
async def sender() -> AsyncIterator[MooncakeTransport]:
    t = MooncakeTransport.start(MooncakeConfig(transfer_timeout_s=TIMEOUT_S))
    yield t
    await t.quiesce()
    t.close()


class CountedEngine:
    """The real engine, its batch writes counted: which engine path the transport's calls took.
    A sync write fails the call (and is recorded), so a test of the polled path cannot pass
    through the spin."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.async_writes = 0
        self.sync_writes: list[str] = []

    def batch_transfer_async_write(self, *args: Any) -> int:
        self.async_writes += 1
        return int(self._engine.batch_transfer_async_write(*args))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("batch_transfer_sync_write"):

            def refused(*args: Any) -> int:
                self.sync_writes.append(name)
                raise AssertionError(f"{name} called where the polled path applies")

            return refused
        return getattr(self._engine, name)


@pytest.fixture
async def counted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MooncakeTransport]:
    """A sender whose engine is `CountedEngine` (the real one inside): `counted._engine`."""
    start = mooncake.start_engine
    monkeypatch.setattr(mooncake, "start_engine", lambda config: CountedEngine(start(config)))
    t = MooncakeTransport.start(MooncakeConfig(transfer_timeout_s=TIMEOUT_S))
    yield t
    await t.quiesce()
    t.close()


def engine_of(t: MooncakeTransport) -> CountedEngine:
    engine = t._engine
    assert isinstance(engine, CountedEngine)
    return engine


@pytest.fixture
def remote() -> Iterator[Remote]:
    r = Remote([8 << 20])
    yield r
    r.close()


def expected_image(remote: Remote, blocks: Blocks) -> np.ndarray:
    """The receiver's file as it must look: sentinel everywhere but the copied blocks."""
    image = np.full(remote.file.shape, SENTINEL, dtype=np.uint8)
    for s, d, n in zip(blocks.src_addr.tolist(), blocks.dst_addr.tolist(), blocks.length.tolist()):
        off = d - remote.file_base
        image[off : off + n] = host_array(s, n)
    return image


def random_source(pool: Pool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(len(pool.regions)):
        view = pool.view(i)
        view[:] = rng.integers(0, 256, view.shape[0], dtype=np.uint8)


async def test_hybrid_npu_mla_request_lands_byte_exact(sender: MooncakeTransport) -> None:
    """A real plan (layer-id pairing, fragmented pages, state slot) from a PP stage to decode."""
    model = hybrid_npu_mla(scale=16, page_size=16)
    partition = partition_layers(model.num_layers, 2)
    src_layout = stage_layout(model, partition, 1, num_pages=256, num_slots=4)
    dst_layout = decode_layout(model, num_pages=512, num_slots=8)
    remote = Remote(dst_layout.region_sizes)
    src_pool = open_pool("torch:cpu", src_layout.region_sizes)
    try:
        src_pool.register(sender)
        random_source(src_pool, 1)
        nkv = len(src_layout.kv)
        src_placed = src_layout.with_bases(src_pool.bases[:nkv], src_pool.bases[nkv:])
        nkv = len(dst_layout.kv)
        dst_bases = remote.receiver.bases
        dst_placed = dst_layout.with_bases(dst_bases[:nkv], dst_bases[nkv:])
        rng = np.random.default_rng(2)
        src_pages = rng.permutation(256)[:200]
        dst_pages = np.concatenate([np.arange(50, 120), rng.permutation(np.arange(200, 512))[:130]])
        blocks = plan(pair(src_placed, dst_placed), src_pages, dst_pages, 3, 6).blocks
        assert len(blocks) > 1000  # fragmented: many short runs
        await sender.write(remote.target, blocks)
        np.testing.assert_array_equal(remote.file, expected_image(remote, blocks))
    finally:
        src_pool.close()
        remote.close()


async def test_ten_thousand_blocks_are_split_under_the_cap(
    sender: MooncakeTransport, remote: Remote
) -> None:
    src_pool = open_pool("torch:cpu", [8 << 20])
    src_pool.register(sender)
    random_source(src_pool, 3)
    rng = np.random.default_rng(4)
    n = 10_000  # 800-byte slots: every block gets its own, shuffled on both sides
    src = rng.permutation(n).astype(np.uint64) * 800 + src_pool.bases[0]
    dst = rng.permutation(n).astype(np.uint64) * 800 + remote.receiver.bases[0]
    blocks = Blocks.of(src, dst, rng.integers(1, 801, n))
    await sender.write(remote.target, blocks)
    np.testing.assert_array_equal(remote.file, expected_image(remote, blocks))
    src_pool.close()


async def test_blocks_above_the_byte_cap_are_cut_and_land_byte_exact(remote: Remote) -> None:
    """The real engine, with batches capped at 64 KiB: 1 MiB blocks travel in 64 KiB pieces."""
    t = MooncakeTransport.start(MooncakeConfig(max_bytes_per_batch=64 << 10))
    src_pool = open_pool("torch:cpu", [4 << 20])
    try:
        src_pool.register(t)
        random_source(src_pool, 6)
        offs = np.array([0, 2 << 20], dtype=np.uint64)
        blocks = Blocks.of(
            offs + src_pool.bases[0], offs + remote.receiver.bases[0] + 4096, [1 << 20] * 2
        )
        await t.write(remote.target, blocks)
        np.testing.assert_array_equal(remote.file, expected_image(remote, blocks))
        stats = t.stats()
        assert stats.engine_calls == stats.batches_succeeded == 32
        assert stats.bytes_written == 2 << 20 and stats.engine_errors_by_rc == {}
    finally:
        src_pool.close()
        t.close()


async def test_unregistered_destination_fails_cleanly_and_the_peer_stays_usable(
    sender: MooncakeTransport, remote: Remote
) -> None:
    src_pool = open_pool("torch:cpu", [1 << 20])
    src_pool.register(sender)
    random_source(src_pool, 5)
    outside = remote.receiver.bases[0] + (8 << 20) + (1 << 20)
    with pytest.raises(TransportError) as info:
        await sender.write(remote.target, Blocks.of([src_pool.bases[0]], [outside], [4096]))
    assert info.value.rc is not None and info.value.rc < 0
    assert info.value.peer == remote.target
    good = Blocks.of([src_pool.bases[0]], [remote.receiver.bases[0] + 4096], [65536])
    await sender.write(remote.target, good)
    np.testing.assert_array_equal(remote.file, expected_image(remote, good))
    src_pool.close()


async def test_few_large_blocks_wait_by_sleeping_land_byte_exact_and_fail_cleanly(
    counted: MooncakeTransport, remote: Remote
) -> None:
    """The real engine's async calls (`mooncake_polled`): 1 MiB blocks go through
    `batch_transfer_async_write` (one submission per block, no sync write) and land byte-exact,
    and a call with one block outside the receiver's registered memory fails with an rc while
    the peer stays usable."""
    engine = engine_of(counted)
    src_pool = open_pool("torch:cpu", [4 << 20])
    try:
        src_pool.register(counted)
        random_source(src_pool, 7)
        offs = np.arange(4, dtype=np.uint64) * np.uint64(1 << 20)
        blocks = Blocks.of(offs + src_pool.bases[0], offs + remote.receiver.bases[0], [1 << 20] * 4)
        await counted.write(remote.target, blocks)
        np.testing.assert_array_equal(remote.file, expected_image(remote, blocks))
        assert engine.async_writes == 4 and engine.sync_writes == []
        outside = remote.receiver.bases[0] + (16 << 20)
        bad = Blocks.of(
            [src_pool.bases[0], src_pool.bases[0] + (1 << 20)],
            [remote.receiver.bases[0] + (4 << 20), outside],
            [1 << 20] * 2,
        )
        with pytest.raises(TransportError) as info:
            await counted.write(remote.target, bad)
        assert info.value.rc is not None and info.value.rc < 0
        assert engine.async_writes == 6
        await counted.write(remote.target, blocks)  # the peer stays usable
        assert engine.async_writes == 10 and engine.sync_writes == []
    finally:
        src_pool.close()


async def test_a_stopped_receiver_keeps_quiesce_waiting_until_the_last_byte_landed(
    counted: MooncakeTransport,
) -> None:
    """Receiver stopped (SIGSTOP) under a call of 32 x 1 MiB: the write raises TransportTimeout,
    and the engine call itself gives up within `max_call_s` (the engine cannot cancel the
    writes: their batch ids stay the lane's). While the receiver stays stopped the peer is stuck
    (a new write fails at once) and `quiesce` does not return; resumed (SIGCONT), every byte of
    the timed-out call lands, then `quiesce` returns, and after that the source is no longer
    read: refilled, none of the new bytes reaches the receiver."""
    size = 32 << 20
    remote = Remote([size])
    src_pool = open_pool("torch:cpu", [size])
    pid = remote.receiver.proc.pid
    try:
        src_pool.register(counted)
        source = src_pool.view(0)
        blocks = _big_blocks(src_pool.bases[0], remote.receiver.bases[0], size, 1 << 20)
        source[:] = 1
        await counted.write(remote.target, blocks)  # connected and working
        calls = counted.stats().engine_calls
        source[:] = 2
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            await asyncio.wait_for(counted.write(remote.target, blocks), FAILURE_BOUND_S)
        while counted.stats().engine_calls == calls:
            assert time.monotonic() - t0 < FAILURE_BOUND_S, "the engine call never returned"
            await asyncio.sleep(0.01)
        assert time.monotonic() - t0 <= counted.max_call_s
        quiet = asyncio.create_task(counted.quiesce(remote.target))
        await asyncio.sleep(1.0)
        assert not quiet.done(), "quiesce returned while the stopped receiver's writes run"
        with pytest.raises(TransportTimeout, match="still"):  # stuck: fails at once
            await asyncio.wait_for(counted.write(remote.target, blocks), 1.0)
        os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(quiet, FAILURE_BOUND_S)
        source[:] = 3  # after quiesce: the engine must no longer read it
        await asyncio.sleep(1.0)
        assert np.all(remote.file == 2), "the timed-out call's bytes, all landed before quiesce"
        await counted.write(remote.target, blocks)  # the peer is usable again
        assert np.all(remote.file == 3)
        assert engine_of(counted).sync_writes == []
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        remote.receiver.proc.wait()
        await counted.quiesce()
        src_pool.close()
        remote.mirror.close()  # the receiver died without unlinking: the attacher cleans up
        os.unlink(remote.mirror.path)


async def _write_until_failure(sender: MooncakeTransport, peer: str, blocks: Blocks) -> None:
    while True:
        await sender.write(peer, blocks)


def _big_blocks(src_base: int, dst_base: int, size: int, block: int) -> Blocks:
    offs = np.arange(size // block, dtype=np.uint64) * block
    return Blocks.of(offs + src_base, offs + dst_base, np.full(offs.shape, block))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
async def test_dead_or_hung_receiver_raises_within_the_timeout(
    sender: MooncakeTransport, sig: signal.Signals
) -> None:
    """Killed: the engine fails fast (connection reset), or at worst the transport's timer ends
    the write. Stopped: the engine would spin until its own timeout (`MC_TRANSFER_TIMEOUT`, floor
    5 s), so the transport's timer raises TransportTimeout after `transfer_timeout_s` (3 s).

    Which bound fired is read from the error, not from a clock: only the transport's timer
    raises TransportTimeout (and counts the batch as timed out); the engine giving up on its own
    returns an rc, a plain TransportError. Measured in seconds, the two are 2 s apart, which a
    loaded machine can blur."""
    size = 64 << 20
    remote = Remote([size])
    src_pool = open_pool("torch:cpu", [size])
    try:
        src_pool.register(sender)
        blocks = _big_blocks(src_pool.bases[0], remote.receiver.bases[0], size, 1 << 20)
        await sender.write(remote.target, blocks)  # connected and working
        timed_out_before = sender.stats().batches_timed_out
        writer = asyncio.create_task(_write_until_failure(sender, remote.target, blocks))
        await asyncio.sleep(0.05)
        os.kill(remote.receiver.proc.pid, sig)
        with pytest.raises(TransportError) as info:
            await asyncio.wait_for(writer, FAILURE_BOUND_S)
        assert info.value.peer == remote.target
        if sig == signal.SIGSTOP:
            assert isinstance(info.value, TransportTimeout), info.value
            assert sender.stats().batches_timed_out > timed_out_before
        with pytest.raises(TransportError):  # and the peer stays failed, without hanging
            await asyncio.wait_for(sender.write(remote.target, blocks), FAILURE_BOUND_S)
    finally:
        if remote.receiver.proc.poll() is None:
            os.kill(remote.receiver.proc.pid, signal.SIGKILL)
        remote.receiver.proc.wait()
        await sender.quiesce()  # the stopped case: the engine call returns at its own timeout
        src_pool.close()
        remote.mirror.close()  # the receiver died without unlinking: the attacher cleans up
        os.unlink(remote.mirror.path)
