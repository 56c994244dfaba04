"""The `mooncake` transport: blocks to a peer through the Mooncake Transfer Engine.

Called by the handoff pipeline (`write`, `quiesce`) and by pools (`register`, `unregister`).
Starting the engine, and which memory the installed build moves:
`kvhandoff.transport.mooncake_engine`.

How a write runs. `write` cuts its blocks into batches (at most `max_blocks_per_batch` blocks
and `max_bytes_per_batch` bytes; larger blocks are cut) and queues them on the peer's lane; at most
`max_inflight_batches_per_peer` batches and `max_inflight_bytes_per_peer` bytes per peer are
submitted (a larger batch alone), so the asyncio side gets backpressure
(`kvhandoff.transport.lanes.InflightBound`): the count lets many small writes share one call,
the bytes keep what a small write can queue behind short. Worker threads, shared by all peers
(`kvhandoff.transport.workers`: at most `max_worker_threads`, each exiting after `peer_idle_s`
idle), drain the lanes: one engine call per peer at a time, small batches of several writes
queued behind a running call sharing the next one (if it fails, every write in it fails: they
all go to the same peer, whose failures are rarely per block). One call per peer matters:
Mooncake TCP keeps a per-peer queue of about 2,048 requests; more queued requests fail (`TCP
lane queue-full rejection`, rc -1) — measured with 8 async batches of 2,048 in flight. A lane
idle for `peer_idle_s` is forgotten.

The write path's safety rules, each enforced in one place here:

1. *A batch has one outcome, and success only when the engine said so.* `_call` starts every
   batch of a call as failed and marks success only after the engine's batch write returned
   0; a non-zero rc fails them with that rc, an exception from the call or its preparation
   (`Blocks.concat`, the call's arguments) with `EngineCallError` carrying the cause. The outcome is
   written once by whoever takes the batch off the lane's queue (`_report` in the worker;
   `_expire` and `_enqueue` on the loop, under the lane lock) and read once (`_settle`), each
   with its own exception instance. Tests: `test_an_engine_exception_fails_every_batch_...`,
   `test_an_exception_while_preparing_the_call_fails_its_batches`.
2. *Only the caller cancels.* The futures a write awaits carry errors as values and nothing
   cancels them; a write's `Write.abandoned` (its own failure or cancellation) only skips its
   own batches not started. Tests: `test_a_later_failing_batch_never_turns_a_landed_one_...`,
   `test_a_late_batch_does_not_cancel_the_one_before_it`,
   `test_a_failed_write_skips_only_its_own_batches`.
3. *No batch starts after its `start_by`, nor after its write gave up.* Checked in `_call`, in the
   worker thread, under the lane lock, after the call's arguments are built and immediately
   before the engine call, so neither a stalled loop nor slow preparation can delay it. Test:
   `test_no_batch_starts_after_start_by_even_if_it_passes_while_preparing`.
4. *`quiesce` returns only once no started call is running, and no batch of a polled call
   that gave up still runs.* Calls are counted under the same lock as check 3
   (`calls_started`/`calls_ended`); `quiesce` waits for the calls started before it and for the
   lane's orphans (rule 6); a call starting after it has passed check 3 after the caller
   abandoned its write. Tests: `test_only_the_callers_cancellation_cancels_and_started_calls_
   finish`, `test_a_stopped_receiver_keeps_quiesce_waiting_until_the_last_byte_landed`.
5. *A call returns by `max_call_s` after its check in rule 3 passed*
   (`MooncakeConfig.max_call_s`: an allowance for the thread being preempted between the check
   and the call, the engine's timeout, and 1 ns per byte of the largest batch). What stops
   writing then depends on the call, because the engine cannot cancel a write (on TCP the
   session's body write has no deadline; only the ack has one):
   - the *polled* call (`mooncake_polled`: a few large TCP blocks, landed stages' staged
     blocks) holds its batch ids; those still running when it gives up stay the lane's
     (rule 6) until the engine reports each ended, so `quiesce(peer)` is the point after which
     no byte of that peer's calls lands or is read from the source;
   - the *sync* call (many small blocks: direct mode's per-page runs; every other protocol)
     leaves the engine no handle to ask: its return is the only bound there is, and on TCP a
     receiver stopped (SIGSTOP) past it still gets bytes after it, read from the source after
     the call returned, once it resumes.
   So `start_by + max_call_s` bounds when a write's bytes land only while the receiver keeps
   reading; a receiver stopped past it is outside the bound on either path.
6. *"Stuck" is a fact, not a flag*: a lane is stuck while the call that outlived
   `transfer_timeout_s` is still running, or while any batch id a polled call handed over
   (`PeerLane.orphans`) has not reported an end (`kvhandoff.transport.lanes.PeerLane.stuck`,
   read under the lock): new writes to the peer fail at once and no call to it starts. The loop
   checks orphans every `ORPHAN_POLL_S`; `close` waits for them at most `max_call_s` more, then
   leaves the source memory registered (logged) rather than unregister it under a running
   write. Tests: `test_a_stuck_peer_fails_queued_batches_with_their_own_current_error`,
   `test_a_stopped_receiver_keeps_quiesce_waiting_until_the_last_byte_landed`.

Why sync calls on worker threads, not `batch_transfer_async_write` + one waiter thread: both
engine paths busy-wait a core while a batch runs, and on this 2-core machine (256 MiB to a
receiver process on loopback, best of 2) they tie within noise:

    block     sync 2048/call   async 2048x1   async 1024x2 pipelined   async 512x4
    1 MiB     2.31 GB/s        2.40 GB/s      2.39 GB/s                2.34 GB/s
    256 KiB   2.72 GB/s        2.73 GB/s      2.54 GB/s                2.74 GB/s
    16 KiB    0.60 GB/s        0.59 GB/s      0.61 GB/s                0.59 GB/s
    4 KiB     0.16 GB/s        0.16 GB/s      0.17 GB/s                0.17 GB/s

so the simpler one wins: one call, one return code, no batch id to free (the async path returns
batch id 0, or -1 cast to uint64, on failure, and passing that to `get_batch_transfer_status`
dereferences it), and a peer whose calls hang holds one worker thread, not the other peers'
(up to `max_worker_threads - 1` hung peers leave a thread for the rest). Throughput ties; CPU
does not: the spin costs a core that the engine's sender and the receiver need on a small host.
So a TCP call of a few large blocks (a landed stage's staged 1 MiB blocks) waits by sleeping
instead (`kvhandoff.transport.mooncake_polled`: one-entry async batches, their status checked
every 200 us, the same outcome and time bound as the sync call); per-page batches keep it.

What the engine does when a peer goes away (TCP, measured): a killed receiver fails the running
batch within ~40 ms (rc -1, "Connection reset by peer"); later batches to it fail after ~1 s
each (reconnect cool-down). A receiver that is alive but stopped (SIGSTOP) makes the call spin
until the engine's own timeout: `MC_TRANSFER_TIMEOUT` seconds (read once, when the engine is
constructed; floor 5 s, default 30 s) plus 1 ns per byte of the batch. So `start` sets
`MC_TRANSFER_TIMEOUT` from `transfer_timeout_s`, and the asyncio side enforces
`transfer_timeout_s` per batch itself (timer armed when the worker starts the batch): the write
raises `TransportTimeout` on time, while the worker thread stays inside the engine call until the
engine gives up. Until then the peer is stuck (rule 6): new writes to it fail at once, and
`quiesce(peer)` waits for the call to return, and for a polled call's batches still running
after it (rule 5): on the polled path that is the point after which no byte lands; on the sync
path the engine may keep sending a returned call's bytes to a receiver that is stopped.

Which engine call. Builds with the array API (`batch_transfer_sync_write_arrays`, Mooncake
0.3.14: the same call taking three contiguous 8-byte-integer buffers instead of three
`list[int]`) get the batch's numpy arrays as they are, so no per-block Python int is made on
either side of the binding; older builds (0.3.13, the CPU wheel) get lists. Detected once, at
construction (`uses_array_api`). The same build's `batch_transfer_sync_write_pages` (pages x
`[src_base, src_stride, dst_base, dst_stride, length]` rows, expanded inside the engine, cut
into engine batches of `max_batch_size` inside one call) is deliberately not used: the
planner's blocks are already merged runs and landed mode sends a few staged 1 MiB blocks, so
expanding pages would give the engine more requests, not fewer; and one call running several
engine batches would break rules 3 and 5 (no `start_by` check between them, and a call could
outlast `max_call_s`).

Other facts: writes into unregistered destination memory are rejected by the receiver (rc -1)
and the engine stays usable; unregistered *source* memory is read without complaint over TCP, so
sources are checked here against the regions registered through this transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvhandoff.transport import ascend
from kvhandoff.transport.base import HOST, TransportStats
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.errors import EngineCallError, TransportError, TransportTimeout
from kvhandoff.transport.lanes import Batch, Counters, PeerLane, Write
from kvhandoff.transport.mooncake_engine import (
    WRITE_ARRAYS,
    Engine,
    WriteArrays,
    installed_builds,
    refuse_memory,
    start_engine,
)
from kvhandoff.transport.mooncake_polled import check_ended, polled_call
from kvhandoff.transport.regions import Region, RegionTable
from kvhandoff.transport.workers import Workers

#: Niceness added to the worker threads that wait in engine calls (see `_lower_priority`).
WORKER_NICE = 10
#: Between two checks of a lane's orphaned batch ids (on the loop): orphans exist only after a
#: call gave up on a stalled peer, and a check costs microseconds per id; `quiesce` returns at
#: most this much after the last of them ended.
ORPHAN_POLL_S = 0.01

log = logging.getLogger(__name__)


class MooncakeTransport:
    """`Transport` over one Transfer Engine; build it with `start(config)`. Use from one loop."""

    def __init__(self, engine: Engine, config: MooncakeConfig, target: str) -> None:
        self._engine = engine
        # Looked up once: an engine build either has the array call or it does not.
        self._write_arrays: WriteArrays | None = getattr(engine, WRITE_ARRAYS, None)
        # The polled path's status check (`mooncake_polled`), for the ids it leaves running.
        self._check_status: Callable[[int], int] | None = getattr(
            engine, "transfer_check_status", None
        )
        self._closed = False
        self._config = config
        self._target = target
        self._sources = RegionTable()
        self._lanes: dict[str, PeerLane] = {}
        self._workers = Workers(
            config.max_worker_threads,
            config.peer_idle_s,
            name=f"kvhandoff-mooncake {target}",
            initializer=_lower_priority,
        )
        self._calls = itertools.count(1)
        self._counts = Counters()

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
    def uses_array_api(self) -> bool:
        """Whether writes reach the engine as numpy arrays (`WRITE_ARRAYS`) rather than lists."""
        return self._write_arrays is not None

    @property
    def max_call_s(self) -> float:
        """`MooncakeConfig.max_call_s`: the engine's timeout plus its per-byte allowance for the
        largest batch (`max_bytes_per_batch`)."""
        return self._config.max_call_s

    def stats(self) -> TransportStats:
        c = self._counts
        with c.lock:
            return TransportStats(
                batches_submitted=c.submitted,
                batches_succeeded=c.succeeded,
                batches_failed=c.failed,
                batches_timed_out=c.timed_out,
                bytes_written=c.bytes,
                blocks_written=c.blocks,
                engine_calls=c.calls,
                engine_errors_by_rc=dict(c.by_rc),
                engine_exceptions=c.exceptions,
                live_lanes=len(self._lanes),
                worker_threads=self._workers.threads,
            )

    # -- memory ----------------------------------------------------------------------------

    def register(self, regions: Sequence[Region], *, devices: frozenset[str] = HOST) -> None:
        engine = self._check_open()
        if devices - HOST:  # host memory every build moves: no need to read the metadata
            refuse_memory(devices, installed_builds())
        off = ascend.misaligned(regions) if self._config.protocol == "ascend" else None
        if off is not None:  # kvhandoff's pools are aligned; an engine's buffers (direct mode)
            raise TransportError(
                "protocol ascend registers memory at 2 MiB-aligned addresses only; the region "
                f"at {off.addr:#x} ({off.length} bytes) is not (transfer.mode = landed "
                "registers only kvhandoff's aligned arena and staging buffer)"
            )
        clash = self._sources.overlapping(regions)
        if clash is not None:
            raise TransportError(f"region {clash!r} overlaps a registered region")
        rc = engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            raise TransportError(f"registering {len(regions)} regions failed", rc=rc)
        self._sources.add(regions)

    def unregister(self, regions: Sequence[Region]) -> None:
        if self._closed:
            return
        self._unregister(regions)

    def _unregister(self, regions: Sequence[Region]) -> None:
        known = self._sources.remove(regions)
        if known:
            rc = self._engine.batch_unregister_memory([r.addr for r in known])
            if rc != 0:
                raise TransportError(f"unregistering {len(known)} regions failed", rc=rc)

    # -- transfers: the loop side ----------------------------------------------------------

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        self._check_open()
        if len(blocks) == 0:
            return
        self._sources.check(blocks.src_addr, blocks.length, side="source", peer=peer)
        lane = self._lane(peer)
        lane.users += 1
        loop = asyncio.get_running_loop()
        write = Write()
        submitted: list[Batch] = []
        cfg = self._config
        ok = False
        try:
            for part in blocks.batches(cfg.max_blocks_per_batch, cfg.max_bytes_per_batch):
                await lane.bound.acquire(part.total_bytes)
                if write.abandoned:  # a batch of this write failed: its error is raised below
                    lane.bound.release(part.total_bytes)
                    break
                if lane.stuck():
                    lane.bound.release(part.total_bytes)
                    raise self._stuck_error(lane)
                batch = Batch(part, write, loop.create_future(), start_by)
                submitted.append(batch)
                self._enqueue(lane, batch, loop)
            for batch in submitted:
                error = await batch.verdict
                if error is not None:
                    raise error
            ok = True
        finally:
            if not ok:
                # Cancelled or failed: this write's batches not yet started are dropped.
                write.abandoned = True
            lane.users -= 1
            self._idle_check(lane, loop)

    def _enqueue(self, lane: PeerLane, batch: Batch, loop: asyncio.AbstractEventLoop) -> None:
        lane.inflight += 1
        with self._counts.lock:
            self._counts.submitted += 1
        with lane.lock:
            lane.pending.append(batch)
            start = not lane.scheduled
            lane.scheduled = True
        if not start:
            return  # the lane's drain, queued or running, takes it
        if not self._closed:
            # `Workers.submit` refuses once `close` (perhaps on another thread) has finished.
            with contextlib.suppress(RuntimeError):
                self._workers.submit(functools.partial(self._drain, lane, loop))
                return
        with lane.lock:
            stranded = list(lane.pending)
            lane.pending.clear()
            lane.scheduled = False
        for queued in stranded:
            queued.outcome = TransportError("transport closed before the batch ran", peer=lane.peer)
            self._settle(lane, queued)

    def _settle(self, lane: PeerLane, batch: Batch) -> None:
        """Loop: read the batch's outcome (once), free its slot, hand it to its write."""
        if batch.timer is not None:
            batch.timer.cancel()
        if batch.slot_held:
            batch.slot_held = False
            lane.bound.release(batch.blocks.total_bytes)
        outcome = batch.outcome
        with self._counts.lock:
            if outcome is None:
                self._counts.succeeded += 1
                self._counts.bytes += batch.blocks.total_bytes
                self._counts.blocks += len(batch.blocks)
            else:
                self._counts.failed += 1
        if not batch.verdict.done():
            batch.verdict.set_result(outcome)
        lane.inflight -= 1
        self._idle_check(lane, batch.verdict.get_loop())

    def _idle_check(self, lane: PeerLane, loop: asyncio.AbstractEventLoop) -> None:
        """Loop: once nothing uses the lane, reclaim it after `peer_idle_s` (unless reused)."""
        if lane.inflight == 0 and lane.users == 0 and lane.reaper is None and not self._closed:
            lane.reaper = loop.call_later(self._config.peer_idle_s, self._reap, lane)

    def _arm(self, lane: PeerLane, batches: list[Batch], started: float) -> None:
        """Loop: start the timeout of batches whose engine call started at `started`."""
        delay = max(0.0, self._config.transfer_timeout_s - (time.monotonic() - started))
        for batch in batches:
            if not batch.verdict.done():
                loop = batch.verdict.get_loop()
                batch.timer = loop.call_later(delay, self._expire, lane, batch)

    def _expire(self, lane: PeerLane, batch: Batch) -> None:
        """Loop: the batch's call outlived `transfer_timeout_s`.

        If the call is still inside the engine, the lane is stuck from now until it returns: the
        write gets `TransportTimeout`, the batches queued behind the call fail now (each with its
        own error; the worker can no longer take them), and new writes fail at once. If the call
        has already returned, its outcome is on its way and decides.
        """
        with lane.lock:
            running = lane.in_call == batch.call
            stranded = list(lane.pending) if running else []
            if running:
                lane.stuck_call = batch.call
                lane.pending.clear()
        if not running:
            return
        batch.write.abandoned = True
        # Free the slot now so writes waiting for one wake up and fail fast on `stuck`; the
        # worker still holds the engine call, so nothing new reaches the engine.
        if batch.slot_held:
            batch.slot_held = False
            lane.bound.release(batch.blocks.total_bytes)
        with self._counts.lock:
            self._counts.timed_out += 1
        if not batch.verdict.done():
            batch.verdict.set_result(
                TransportTimeout(
                    f"batch of {len(batch.blocks)} blocks did not finish within "
                    f"{self._config.transfer_timeout_s}s",
                    peer=lane.peer,
                )
            )
        for queued in stranded:
            queued.outcome = self._stuck_error(lane)
            self._settle(lane, queued)

    def _call_ended(self, lane: PeerLane) -> None:
        """Loop: a call of this lane returned, or its last orphan ended; wake the `quiesce`
        calls waiting for no more than that."""
        with lane.lock:
            ended = lane.calls_ended
            orphaned = bool(lane.orphans)
        waiting = []
        for target, fut in lane.quiescers:
            if target > ended or orphaned:
                waiting.append((target, fut))
            elif not fut.done():
                fut.set_result(None)
        lane.quiescers = waiting

    def _orphaned(self, lane: PeerLane, loop: asyncio.AbstractEventLoop, ids: list[int]) -> None:
        """Worker, inside a polled call that gave up (or raised) with batches still running:
        they stay the lane's, which is stuck until each reports an end (rule 6); the loop
        checks them (`_poll_orphans`). Runs before the call counts as ended, so the lane is
        never unstuck between the two."""
        with lane.lock:
            lane.orphans.update(ids)
        _post(loop, self._poll_orphans, lane)

    def _poll_orphans(self, lane: PeerLane) -> None:
        """Loop: check the lane's orphaned ids now and every `ORPHAN_POLL_S` until none runs,
        then wake `quiesce`. On the loop, not a thread: orphans are rare, a check is a few
        microseconds, and the waiters (`quiesce`) are here; `close` checks them itself."""
        if lane.orphan_timer is not None:
            lane.orphan_timer.cancel()  # this check replaces the one it had scheduled
        lane.orphan_timer = None
        loop = asyncio.get_running_loop()
        if self._check_orphans(lane):
            lane.orphan_timer = loop.call_later(ORPHAN_POLL_S, self._poll_orphans, lane)
            return
        self._call_ended(lane)
        self._idle_check(lane, loop)

    def _check_orphans(self, lane: PeerLane) -> int:
        """Any thread: check each orphaned id of the lane once (under its lock, so no id is
        checked twice at once or after it ended); how many still run."""
        with lane.lock:
            if lane.orphans and self._check_status is not None:  # orphans: polled calls only
                check_ended(self._check_status, lane.orphans)
            return len(lane.orphans)

    def _stuck_error(self, lane: PeerLane) -> TransportTimeout:
        return TransportTimeout(
            "a previous batch to this peer timed out and is still inside the engine",
            peer=lane.peer,
        )

    async def quiesce(self, peer: str | None = None) -> None:
        if peer is None:
            lanes = list(self._lanes.values())
        else:
            lanes = [self._lanes[peer]] if peer in self._lanes else []
        loop = asyncio.get_running_loop()
        waits: list[asyncio.Future[None]] = []
        for lane in lanes:
            # A call that starts after this read was checked, under the same lock, against its
            # write's `abandoned` (set before a pipeline calls `quiesce`): not ours to wait for.
            with lane.lock:
                started, ended = lane.calls_started, lane.calls_ended
                orphaned = bool(lane.orphans)
            if ended < started or orphaned:
                fut = loop.create_future()
                lane.quiescers.append((started, fut))
                waits.append(fut)
        if waits:
            await asyncio.wait(waits)

    # -- transfers: the worker side --------------------------------------------------------

    def _drain(self, lane: PeerLane, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: one engine call for this lane, then queue the next one behind the
        other lanes' (fair when more peers are busy than there are threads)."""
        skipped: list[Batch] = []
        with lane.lock:
            taken = self._take(lane, skipped)
        for batch in skipped:
            self._report(loop, lane, batch, self._abandoned_error(lane))
        if taken:
            self._call(lane, loop, taken)
        with lane.lock:
            again = bool(lane.pending)
            lane.scheduled = again
        if again:
            self._workers.submit(functools.partial(self._drain, lane, loop))

    def _take(self, lane: PeerLane, skipped: list[Batch]) -> list[Batch]:
        """Worker, lane lock held: the oldest pending batches that fit in one call together.

        Under load many small writes (other stages, other handoffs) queue for the same peer;
        one call for all of them costs the engine one submission and one wait instead of one
        each. Batches of abandoned writes go to `skipped`.
        """
        taken: list[Batch] = []
        blocks = nbytes = 0
        cap = self._config.max_blocks_per_batch
        cap_bytes = self._config.max_bytes_per_batch
        while lane.pending:
            batch = lane.pending[0]
            if batch.write.abandoned:
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

    def _call(self, lane: PeerLane, loop: asyncio.AbstractEventLoop, taken: list[Batch]) -> None:
        """Worker thread: one engine call for `taken`; every batch gets exactly one outcome.

        The outcome is failure unless the engine call returned 0: an exception from the call or
        from its preparation (`Blocks.concat`, the call's arguments) fails every batch with that
        cause.
        """
        fail: Callable[[], TransportError] = functools.partial(
            TransportError, "the worker stopped before the engine call returned", peer=lane.peer
        )
        succeeded = False
        try:
            if self._closed:
                fail = functools.partial(
                    TransportError, "transport closed before the batch ran", peer=lane.peer
                )
                return
            ready = self._start_call(lane, loop, taken)
            if ready is None:
                return
            blocks, engine_call = ready
            started = time.monotonic()
            rc = self._run_call(lane, loop, taken, engine_call)
            if rc == 0:
                succeeded = True
            else:
                with self._counts.lock:
                    self._counts.by_rc[rc] = self._counts.by_rc.get(rc, 0) + 1
                what = self._describe(blocks, taken, time.monotonic() - started)
                fail = functools.partial(TransportError, f"{what} failed", rc=rc, peer=lane.peer)
        except Exception as exc:  # noqa: BLE001 (see below)
            # The one place the write path catches everything: whatever the binding (pybind11
            # turns C++ exceptions into Python ones) or numpy raises fails these batches with
            # that cause. It must never read as success.
            with self._counts.lock:
                self._counts.exceptions += 1
            fail = functools.partial(
                EngineCallError,
                f"engine call for {len(taken)} batch(es) raised {type(exc).__name__}: {exc}",
                cause=exc,
                peer=lane.peer,
            )
        finally:
            for batch in taken:
                error = None if succeeded else fail()
                if error is not None:
                    batch.write.abandoned = True  # its write skips its batches not started
                self._report(loop, lane, batch, error)

    def _start_call(
        self, lane: PeerLane, loop: asyncio.AbstractEventLoop, taken: list[Batch]
    ) -> tuple[Blocks, Callable[[], int]] | None:
        """Worker: the engine call for `taken`, built and past the last check, or None when
        none of its batches may start. Batches that may not (late, or of an abandoned write)
        get their outcome here and leave `taken` (in place: what is left is the caller's)."""
        while True:
            blocks = (
                taken[0].blocks if len(taken) == 1 else Blocks.concat([b.blocks for b in taken])
            )
            engine_call = self._engine_call(lane, loop, blocks)
            # The last check before the engine call, in this thread, after its arguments
            # are built: no batch starts after its `start_by`, none of an abandoned write
            # starts, and `quiesce` (same lock) sees every call that does start.
            with lane.lock:
                now = time.monotonic()
                late = [b for b in taken if b.start_by is not None and now > b.start_by]
                gone = [b for b in taken if b.write.abandoned and b not in late]
                if lane.orphans:  # rule 6: nothing new starts while an orphan may still write
                    gone = [b for b in taken if b not in late]
                if not late and not gone:
                    call = next(self._calls)
                    lane.calls_started += 1
                    lane.in_call = call
                    for b in taken:
                        b.call = call
                    return blocks, engine_call
            for b in late:
                self._report(loop, lane, b, self._late_error(lane))
            for b in gone:
                why = self._stuck_error(lane) if lane.orphans else self._abandoned_error(lane)
                self._report(loop, lane, b, why)
            taken[:] = [b for b in taken if b not in late and b not in gone]
            if not taken:
                return None

    def _run_call(
        self,
        lane: PeerLane,
        loop: asyncio.AbstractEventLoop,
        taken: list[Batch],
        engine_call: Callable[[], int],
    ) -> int:
        """Worker: run a started call (its timer armed on the loop) and count it ended,
        whatever it returns or raises; its rc."""
        _post(loop, self._arm, lane, taken, time.monotonic())
        try:
            return engine_call()
        finally:
            with lane.lock:
                lane.calls_ended += 1
                lane.in_call = 0
            with self._counts.lock:
                self._counts.calls += 1
            _post(loop, self._call_ended, lane)

    def _engine_call(
        self, lane: PeerLane, loop: asyncio.AbstractEventLoop, blocks: Blocks
    ) -> Callable[[], int]:
        """Worker: the engine call for `blocks`, its arguments built (a few large blocks: the
        sleeping wait of `mooncake_polled`, its batches left running kept by the lane; else
        numpy arrays where the engine takes them, lists otherwise), ready to run after the
        last check."""
        peer = lane.peer
        orphaned = functools.partial(self._orphaned, lane, loop)
        polled = polled_call(self._engine, self._config, peer, blocks, orphaned)
        if polled is not None:
            return polled
        if self._write_arrays is not None:
            # Views of the planner's arrays (contiguous already: `ascontiguousarray` copies
            # only a strided view the binding would refuse); kept alive by this partial.
            return functools.partial(
                self._write_arrays,
                peer,
                np.ascontiguousarray(blocks.src_addr, dtype=np.uint64),
                np.ascontiguousarray(blocks.dst_addr, dtype=np.uint64),
                np.ascontiguousarray(blocks.length, dtype=np.uint64),
            )
        return functools.partial(
            self._engine.batch_transfer_sync_write,
            peer,
            blocks.src_addr.tolist(),
            blocks.dst_addr.tolist(),
            blocks.length.tolist(),
        )

    def _report(
        self,
        loop: asyncio.AbstractEventLoop,
        lane: PeerLane,
        batch: Batch,
        outcome: TransportError | None,
    ) -> None:
        """Worker: write the batch's one outcome and hand it to the loop."""
        batch.outcome = outcome
        _post(loop, self._settle, lane, batch)

    @staticmethod
    def _describe(blocks: Blocks, taken: list[Batch], elapsed_s: float) -> str:
        writes = f", {len(taken)} writes" if len(taken) > 1 else ""
        return (
            f"batch of {len(blocks)} blocks ({blocks.total_bytes} bytes{writes}) "
            f"after {elapsed_s:.2f}s"
        )

    def _late_error(self, lane: PeerLane) -> TransportTimeout:
        return TransportTimeout(
            "the write's deadline passed before this batch started", peer=lane.peer
        )

    def _abandoned_error(self, lane: PeerLane) -> TransportError:
        return TransportError("not started: its write had failed or was cancelled", peer=lane.peer)

    # -- lifecycle -------------------------------------------------------------------------

    def _lane(self, peer: str) -> PeerLane:
        lane = self._lanes.get(peer)
        if lane is None:
            cfg = self._config
            bound = (cfg.max_inflight_batches_per_peer, cfg.max_inflight_bytes_per_peer)
            lane = self._lanes[peer] = PeerLane(peer, *bound)
        if lane.reaper is not None:
            lane.reaper.cancel()
            lane.reaper = None
        return lane

    def _reap(self, lane: PeerLane) -> None:
        """Loop: forget a lane idle for `peer_idle_s` (no batch in flight, no call running)."""
        lane.reaper = None
        with lane.lock:
            busy = lane.scheduled or lane.in_call != 0 or bool(lane.pending or lane.orphans)
        idle = lane.inflight == 0 and lane.users == 0 and not busy and not lane.quiescers
        if idle and self._lanes.get(lane.peer) is lane:
            del self._lanes[lane.peer]

    def _check_open(self) -> Engine:
        if self._closed:
            raise TransportError("transport is closed", peer=self._target)
        return self._engine

    def close(self) -> None:
        """Wait for running engine calls (bounded by `max_call_s`), fail what is queued, stop
        the worker threads, wait for orphaned batches to end (bounded by another `max_call_s`),
        and unregister. Idempotent.

        If orphans still run then (a peer stopped for good), the source memory stays registered
        (logged): the engine may still read it, and unregistering under a running write is
        what the wait exists to prevent. The caller's memory is the caller's to keep."""
        if self._closed:
            return
        self._closed = True  # workers fail the batches they take from now on, without a call
        self._workers.close()  # runs the queued drains (fast now) and joins every thread
        running = self._wait_orphans(time.monotonic() + self._config.max_call_s)
        # Reaper timers left armed find their lane gone: close may run off the loop's thread.
        self._lanes.clear()
        if running:
            log.warning(
                "transport closed with batches still running in the engine (peer: count) %s; "
                "source memory left registered",
                running,
            )
            return
        self._unregister(self._sources.regions)

    def _wait_orphans(self, deadline: float) -> dict[str, int]:
        """Any thread: check every lane's orphans until none runs or `deadline` passed; those
        still running by peer."""
        while True:
            lanes = list(self._lanes.values())  # a snapshot: the loop may add or drop lanes
            running = {lane.peer: n for lane in lanes if (n := self._check_orphans(lane))}
            if not running or time.monotonic() > deadline:
                return running
            time.sleep(ORPHAN_POLL_S)


def _lower_priority() -> None:
    """Worker threads wait inside engine calls: the sync call spins on the batch's status (the
    polled one sleeps between checks); on few cores that spinning competes with the engine's
    own I/O threads and the event loops of every process. A lower priority (Linux: per
    thread) leaves them the CPU they need."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


def _post(loop: asyncio.AbstractEventLoop, fn: object, *args: object) -> None:
    """call_soon_threadsafe that tolerates a loop closed while the engine call ran."""
    # A closed loop raises RuntimeError: nobody is waiting for this batch any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
