"""The `mooncake` transport: blocks to a peer through the Mooncake Transfer Engine.

Called by the handoff pipeline (`write`, `quiesce`) and by pools (`register`, `unregister`).

How a write runs. Each peer gets one worker thread that calls the engine's
`batch_transfer_sync_write` for one batch (<= `max_blocks_per_batch` blocks) at a time — small
batches of several writes queued behind a running call share the next one (if that call fails,
every write in it fails: they all go to the same peer, whose failures are rarely per block); at
most `max_inflight_batches_per_peer` batches per peer are submitted (one running, the rest queued
for the worker), so the asyncio side gets backpressure and the engine never runs more than one
call per peer. That bound matters: Mooncake TCP keeps a per-peer queue of about 2,048 requests; more
queued requests fail (`TCP lane queue-full rejection`, rc -1) — measured with 8 async batches of
2,048 in flight.

Why sync calls on a thread per peer, not `batch_transfer_async_write` + one waiter thread: both
engine paths busy-wait a core while a batch runs, and on this 2-core machine (256 MiB to a
receiver process on loopback, best of 2) they tie within noise:

    block     sync 2048/call   async 2048x1   async 1024x2 pipelined   async 512x4
    1 MiB     2.31 GB/s        2.40 GB/s      2.39 GB/s                2.34 GB/s
    256 KiB   2.72 GB/s        2.73 GB/s      2.54 GB/s                2.74 GB/s
    16 KiB    0.60 GB/s        0.59 GB/s      0.61 GB/s                0.59 GB/s
    4 KiB     0.16 GB/s        0.16 GB/s      0.17 GB/s                0.17 GB/s

so the simpler one wins: one call, one return code, no batch id to free (the async path returns
batch id 0, or -1 cast to uint64, on failure, and passing that to `get_batch_transfer_status`
dereferences it), and a peer whose calls hang cannot stall writes to other peers.

What the engine does when a peer goes away (TCP, measured): a killed receiver fails the running
batch within ~40 ms (rc -1, "Connection reset by peer"); later batches to it fail after ~1 s
each (reconnect cool-down). A receiver that is alive but stopped (SIGSTOP) makes the call spin
until the engine's own timeout: `MC_TRANSFER_TIMEOUT` seconds (read once, when the engine is
constructed; floor 5 s, default 30 s) plus 1 ns per byte of the batch. So `start` sets
`MC_TRANSFER_TIMEOUT` from `transfer_timeout_s`, and the asyncio side enforces
`transfer_timeout_s` per batch itself (timer armed when the worker starts the batch): the write
raises `TransportTimeout` on time, while the worker thread stays inside the engine call until the
engine gives up. Until then the peer is marked stuck: new writes to it fail at once, and
`quiesce(peer)` waits for the call to return — the only point after which no byte can still land.

Other facts: writes into unregistered destination memory are rejected by the receiver (rc -1)
and the engine stays usable; unregistered *source* memory is read without complaint over TCP, so
sources are checked here against the regions registered through this transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from transport.blocks import Blocks
from transport.config import MooncakeConfig
from transport.errors import TransportError, TransportTimeout
from transport.regions import Region, RegionTable


class Engine(Protocol):
    """The subset of `mooncake.engine.TransferEngine` this module calls."""

    def get_rpc_port(self) -> int: ...
    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int: ...
    def batch_unregister_memory(self, addrs: list[int]) -> int: ...
    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int: ...


def start_engine(config: MooncakeConfig) -> Engine:
    """Construct and initialise a Transfer Engine as `config` says (imports mooncake lazily)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            "the mooncake transport needs a mooncake-transfer-engine package "
            "(extras: kvhandoff[cpu], [cuda] or [ascend])"
        ) from exc
    # The documented exception to "nothing reads os.environ": the engine takes this tuning only
    # from the environment, at construction, so it is set here, just before.
    os.environ.update(config.engine_env())
    engine = TransferEngine()
    rc = engine.initialize(config.hostname, config.metadata, config.protocol, config.device_name)
    if rc != 0:
        raise TransportError(
            f"Transfer Engine initialisation failed ({config.protocol}, {config.metadata})", rc=rc
        )
    return engine  # type: ignore[no-any-return]


#: Niceness added to the worker threads that wait in engine calls (see `_lower_priority`).
WORKER_NICE = 10


class _Batch:
    """One submitted batch of a write (several may share one engine call): its blocks, the
    asyncio future for its outcome and its timeout timer."""

    __slots__ = ("blocks", "done", "slot_held", "start_by", "stop", "timer")

    def __init__(
        self,
        blocks: Blocks,
        done: asyncio.Future[None],
        stop: threading.Event,
        start_by: float | None,
    ) -> None:
        self.blocks = blocks
        self.done = done
        self.stop = stop
        self.start_by = start_by
        self.timer: asyncio.TimerHandle | None = None
        self.slot_held = True


class _PeerLane:
    """The worker thread, in-flight bound and stuck flag of one peer."""

    def __init__(self, peer: str, max_inflight: int) -> None:
        self.peer = peer
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvhandoff-mooncake", initializer=_lower_priority
        )
        self.slots = asyncio.Semaphore(max_inflight)
        self.running: set[Future[None]] = set()
        #: Batches submitted and not yet taken by the worker, oldest first. The worker merges
        #: those that fit into one engine call (see `_take`).
        self.pending: deque[_Batch] = deque()
        #: Set while a batch has outlived the timeout but is still inside the engine call.
        self.stuck = False


class MooncakeTransport:
    """`Transport` over one Transfer Engine; build it with `start(config)`. Use from one loop."""

    def __init__(self, engine: Engine, config: MooncakeConfig, target: str) -> None:
        self._engine: Engine | None = engine
        self._config = config
        self._target = target
        self._sources = RegionTable()
        self._lanes: dict[str, _PeerLane] = {}

    @classmethod
    def start(cls, config: MooncakeConfig) -> MooncakeTransport:
        engine = start_engine(config)
        host = config.hostname.split(":")[0]
        return cls(engine, config, f"{host}:{engine.get_rpc_port()}")

    @property
    def local_target(self) -> str:
        return self._target

    @property
    def config(self) -> MooncakeConfig:
        return self._config

    @property
    def max_call_s(self) -> float:
        """`MooncakeConfig.max_call_s`: the engine's timeout plus its per-byte allowance for the
        largest batch (`max_bytes_per_batch`)."""
        return self._config.max_call_s

    # -- memory ----------------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> None:
        engine = self._check_open()
        clash = self._sources.overlapping(regions)
        if clash is not None:
            raise TransportError(f"region {clash!r} overlaps a registered region")
        rc = engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            raise TransportError(f"registering {len(regions)} regions failed", rc=rc)
        self._sources.add(regions)

    def unregister(self, regions: Sequence[Region]) -> None:
        if self._engine is None:
            return
        known = self._sources.remove(regions)
        if known:
            rc = self._engine.batch_unregister_memory([r.addr for r in known])
            if rc != 0:
                raise TransportError(f"unregistering {len(known)} regions failed", rc=rc)

    # -- transfers -------------------------------------------------------------------------

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        self._check_open()
        if len(blocks) == 0:
            return
        self._sources.check(blocks.src_addr, blocks.length, side="source", peer=peer)
        lane = self._lane(peer)
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        cap = self._config
        submitted: list[_Batch] = []
        ok = False
        try:
            for part in blocks.batches(cap.max_blocks_per_batch, cap.max_bytes_per_batch):
                await lane.slots.acquire()
                if stop.is_set() or lane.stuck:
                    lane.slots.release()
                    if stop.is_set():
                        break  # a batch of this write has failed: its error is raised below
                    raise self._stuck_error(lane)
                batch = _Batch(part, loop.create_future(), stop, start_by)
                submitted.append(batch)
                lane.pending.append(batch)
                fut = lane.executor.submit(self._run, lane, loop)
                lane.running.add(fut)
                fut.add_done_callback(lane.running.discard)
            for batch in submitted:
                await batch.done
            ok = True
        finally:
            if not ok:
                stop.set()  # batches the worker has not started yet are skipped
                for batch in submitted:
                    if batch.done.done() and not batch.done.cancelled():
                        batch.done.exception()  # retrieved: the first error is what we raise
                    batch.done.cancel()

    def _take(self, lane: _PeerLane, skipped: list[_Batch]) -> list[_Batch]:
        """Worker thread: the oldest pending batches that fit in one engine call together.

        Under load many small writes (other stages, other handoffs) queue for the same peer;
        one call for all of them costs the engine one submission and one wait instead of one
        each. Batches of stopped writes go to `skipped` (the loop cancels them).
        """
        taken: list[_Batch] = []
        blocks = nbytes = 0
        cap = self._config.max_blocks_per_batch
        cap_bytes = self._config.max_bytes_per_batch
        while lane.pending:
            batch = lane.pending[0]
            if batch.stop.is_set():
                skipped.append(lane.pending.popleft())
                continue
            size = batch.blocks.total_bytes
            if taken and (blocks + len(batch.blocks) > cap or nbytes + size > cap_bytes):
                break
            lane.pending.popleft()
            taken.append(batch)
            blocks += len(batch.blocks)
            nbytes += size
        return taken

    def _run(self, lane: _PeerLane, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: one engine call for the pending batches that fit, reporting back."""
        taken: list[_Batch] = []
        skipped: list[_Batch] = []
        error: TransportError | None = None
        try:
            while lane.pending and lane.pending[0].stop.is_set():
                skipped.append(lane.pending.popleft())
            engine = self._engine
            if not lane.pending:
                return  # an earlier call took this task's batch along
            if engine is None:
                taken = [lane.pending.popleft()]
                error = TransportError("transport closed during the write", peer=lane.peer)
                return
            if lane.stuck:
                taken = [lane.pending.popleft()]
                error = self._stuck_error(lane)
                return
            taken = self._take(lane, skipped)
            now = time.monotonic()
            late = [b for b in taken if b.start_by is not None and now > b.start_by]
            if late:
                # Checked here, in the worker: a stalled event loop cannot delay it. The late
                # batches fail now; the others of this call still run.
                for batch in late:
                    batch.stop.set()
                    _post(loop, self._finish, lane, batch, self._late_error(lane))
                taken = [b for b in taken if b not in late]
                if not taken:
                    return
            blocks = (
                taken[0].blocks if len(taken) == 1 else Blocks.concat([b.blocks for b in taken])
            )
            src, dst, lengths = (
                blocks.src_addr.tolist(),
                blocks.dst_addr.tolist(),
                blocks.length.tolist(),
            )
            for batch in taken:
                _post(loop, self._arm, lane, batch)
            started = time.monotonic()
            rc = engine.batch_transfer_sync_write(lane.peer, src, dst, lengths)
            if rc < 0:
                # Set here, in the worker, so the writes' batches queued behind these are
                # skipped before the loop has even heard of the failure.
                for batch in taken:
                    batch.stop.set()
                error = TransportError(
                    f"batch of {len(blocks)} blocks ({blocks.total_bytes} bytes"
                    f"{f', {len(taken)} writes' if len(taken) > 1 else ''}) failed after "
                    f"{time.monotonic() - started:.2f}s",
                    rc=rc,
                    peer=lane.peer,
                )
        finally:
            for batch in skipped:
                _post(loop, self._finish, lane, batch, None)
            for batch in taken:
                _post(loop, self._finish, lane, batch, error)

    def _arm(self, lane: _PeerLane, batch: _Batch) -> None:
        loop = batch.done.get_loop()
        batch.timer = loop.call_later(self._config.transfer_timeout_s, self._expire, lane, batch)

    def _expire(self, lane: _PeerLane, batch: _Batch) -> None:
        lane.stuck = True
        batch.stop.set()
        # Free the slot now so writes waiting for one wake up and fail fast on `stuck`; the
        # worker thread still holds the engine call, so nothing new reaches the engine.
        batch.slot_held = False
        lane.slots.release()
        if not batch.done.done():
            batch.done.set_exception(
                TransportTimeout(
                    f"batch of {len(batch.blocks)} blocks did not finish within "
                    f"{self._config.transfer_timeout_s}s",
                    peer=lane.peer,
                )
            )

    def _finish(self, lane: _PeerLane, batch: _Batch, error: TransportError | None) -> None:
        if batch.timer is not None:
            batch.timer.cancel()
            lane.stuck = False  # the engine call has returned, whatever it said
        if batch.slot_held:
            batch.slot_held = False
            lane.slots.release()
        if batch.done.done():
            return
        if error is not None:
            batch.stop.set()  # the write has failed: skip its batches not yet started
            batch.done.set_exception(error)
        elif batch.stop.is_set():
            batch.done.cancel()
        else:
            batch.done.set_result(None)

    def _late_error(self, lane: _PeerLane) -> TransportTimeout:
        return TransportTimeout(
            "the write's deadline passed before this batch started", peer=lane.peer
        )

    def _stuck_error(self, lane: _PeerLane) -> TransportTimeout:
        return TransportTimeout(
            "a previous batch to this peer timed out and is still inside the engine",
            peer=lane.peer,
        )

    async def quiesce(self, peer: str | None = None) -> None:
        lanes = [self._lanes[peer]] if peer in self._lanes else []
        if peer is None:
            lanes = list(self._lanes.values())
        # list(): worker threads drop finished futures from the set while we look at it.
        running = [asyncio.wrap_future(f) for lane in lanes for f in list(lane.running)]
        if running:
            await asyncio.wait(running)

    # -- lifecycle -------------------------------------------------------------------------

    def _lane(self, peer: str) -> _PeerLane:
        lane = self._lanes.get(peer)
        if lane is None:
            lane = self._lanes[peer] = _PeerLane(peer, self._config.max_inflight_batches_per_peer)
        return lane

    def _check_open(self) -> Engine:
        if self._engine is None:
            raise TransportError("transport is closed", peer=self._target)
        return self._engine

    def close(self) -> None:
        """Wait for running engine calls (bounded by the engine timeout), unregister, drop it."""
        if self._engine is None:
            return
        for lane in self._lanes.values():
            lane.executor.shutdown(wait=True, cancel_futures=True)
            # Batches whose worker task was cancelled above: their writes must not wait forever.
            while lane.pending:
                batch = lane.pending.popleft()
                closed = TransportError("transport closed before the batch ran", peer=lane.peer)
                _post(batch.done.get_loop(), self._finish, lane, batch, closed)
        self._lanes.clear()
        regions = self._sources.regions
        try:
            self.unregister(regions)
        finally:
            self._engine = None


def _lower_priority() -> None:
    """Worker threads mostly spin inside the engine's sync call waiting for the batch; on few
    cores that spinning competes with the engine's own I/O threads and the event loops of every
    process. A lower priority (Linux: per thread) leaves them the CPU they need."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


def _post(loop: asyncio.AbstractEventLoop, fn: object, *args: object) -> None:
    """call_soon_threadsafe that tolerates a loop closed while the engine call ran."""
    # A closed loop raises RuntimeError: nobody is waiting for this batch any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
