"""The `local` transport: in-process memmove between registered regions.

For single-process deployments (all stages and decode memory in one process, or a decode and a
prefill service sharing one process) and as the memory bandwidth ceiling in `kvhandoff bench
transport`. Its peers are the local transports of this process that are still open, found by
`local_target`; a destination must lie in memory registered with the peer named.
Copies run on one dedicated worker thread — `ctypes.memmove` releases the GIL, and a 4 GiB
request would otherwise stall the event loop for about a second.

Its write path keeps the rules `kvhandoff.transport.mooncake` states: batches under both caps, one
at a time per write; a batch fails with its own error, carrying the cause if the copy or its
preparation raised (`_copy_unless_late`); the `start_by` check is the last step before the first
byte moves, in the worker thread; only the caller's cancellation cancels (a copy that started
finishes, and `quiesce` waits for it); `max_call_s` bounds one batch's copy generously.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from kvhandoff.transport.base import HOST, TransportStats
from kvhandoff.transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks
from kvhandoff.transport.config import (
    DEFAULT_ALIGN_BYTES,
    DEFAULT_MAX_BYTES_PER_BATCH,
    BlocksPerBatch,
    BytesPerBatch,
)
from kvhandoff.transport.errors import EngineCallError, TransportError, TransportTimeout
from kvhandoff.transport.regions import Region, RegionTable

_ids = itertools.count(1)
#: `max_call_s` of a local copy: a fixed allowance for scheduling (the worker thread may wait for
#: a core) plus the largest batch at a memmove rate far below any host's (DRAM copies run at
#: several GB/s; 100 MB/s leaves room for a loaded, swapping machine).
LOCAL_CALL_BASE_S = 1.0
LOCAL_MIN_BYTES_PER_S = 100e6
#: Open local transports of this process by target name: the peers a write can name.
_open: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()


def local_max_call_s(max_bytes_per_batch: int) -> float:
    """One batch's memmove, bounded generously: `LOCAL_CALL_BASE_S + max_bytes_per_batch /
    LOCAL_MIN_BYTES_PER_S`."""
    return LOCAL_CALL_BASE_S + max_bytes_per_batch / LOCAL_MIN_BYTES_PER_S


class LocalConfig(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="backend", tag="local"
):
    """The `local` transport's settings (`backend = "local"` in the service's transport union):
    the batch caps a write is cut at, as under Mooncake, so a plan made for one runs on both."""

    #: Blocks per copy batch.
    max_blocks_per_batch: BlocksPerBatch = DEFAULT_MAX_BLOCKS_PER_BATCH
    #: Bytes per copy batch; a block larger than this is cut into pieces of at most this size.
    max_bytes_per_batch: BytesPerBatch = DEFAULT_MAX_BYTES_PER_BATCH

    @property
    def align_bytes(self) -> int:
        return DEFAULT_ALIGN_BYTES

    @property
    def max_call_s(self) -> float:
        return local_max_call_s(self.max_bytes_per_batch)


def as_lists(blocks: Blocks) -> tuple[list[int], list[int], list[int]]:
    """(dst, src, lengths) as Python ints, what `move_lists` takes."""
    return blocks.dst_addr.tolist(), blocks.src_addr.tolist(), blocks.length.tolist()


def move_lists(dst: list[int], src: list[int], lengths: list[int]) -> None:
    """memmove every block (the caller has checked the addresses)."""
    move = ctypes.memmove
    for d, s, n in zip(dst, src, lengths, strict=True):
        move(d, s, n)


def _copy_unless_late(blocks: Blocks, start_by: float | None, peer: str) -> None:
    """Worker thread: copy, unless the write's start-by instant has passed — checked in this
    thread after the lists are built, immediately before the first byte moves. Anything the
    preparation or the copy raises fails the batch with that cause."""
    try:
        lists = as_lists(blocks)
    except Exception as exc:  # a failed preparation must never read as success
        raise EngineCallError(
            f"preparing a local copy raised {type(exc).__name__}: {exc}", cause=exc, peer=peer
        ) from exc
    if start_by is not None and time.monotonic() > start_by:
        raise TransportTimeout("the write's deadline passed before this batch started", peer=peer)
    try:
        move_lists(*lists)
    except Exception as exc:  # a failed copy must never read as success
        raise EngineCallError(
            f"local copy raised {type(exc).__name__}: {exc}", cause=exc, peer=peer
        ) from exc


class LocalTransport:
    """Moves blocks inside this process; every block must lie in registered regions."""

    def __init__(
        self,
        *,
        max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH,
        max_bytes_per_batch: int = DEFAULT_MAX_BYTES_PER_BATCH,
    ) -> None:
        self._regions = RegionTable()
        self._target = f"local:{next(_ids)}"
        self._max_blocks = max_blocks_per_batch
        self._max_bytes = max_bytes_per_batch
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvhandoff-local"
        )
        self._running: set[Future[None]] = set()
        self._stats = TransportStats(worker_threads=1)
        _open[self._target] = self

    @classmethod
    def start(cls, config: LocalConfig) -> LocalTransport:
        return cls(
            max_blocks_per_batch=config.max_blocks_per_batch,
            max_bytes_per_batch=config.max_bytes_per_batch,
        )

    @property
    def local_target(self) -> str:
        return self._target

    @property
    def max_call_s(self) -> float:
        return local_max_call_s(self._max_bytes)

    def register(self, regions: Sequence[Region], *, devices: frozenset[str] = HOST) -> None:
        self._check_open()
        if devices - HOST:
            raise TransportError(
                f"the local transport copies host memory only (memmove); these regions are "
                f"{', '.join(sorted(devices - HOST))} memory"
            )
        clash = self._regions.overlapping(regions)
        if clash is not None:
            raise TransportError(f"region {clash!r} overlaps a registered region")
        self._regions.add(regions)

    def unregister(self, regions: Sequence[Region]) -> None:
        self._regions.remove(regions)

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        executor = self._check_open()
        target = _open.get(peer)
        if target is None:
            raise TransportError(f"no open local transport {peer!r} in this process", peer=peer)
        self._regions.check(blocks.src_addr, blocks.length, side="source", peer=peer)
        target._regions.check(blocks.dst_addr, blocks.length, side="destination", peer=peer)
        # Batches keep a cancelled write from copying much more than one batch afterwards.
        for batch in blocks.batches(self._max_blocks, self._max_bytes):
            fut = executor.submit(_copy_unless_late, batch, start_by, peer)
            self._running.add(fut)
            fut.add_done_callback(self._running.discard)
            self._count(batches_submitted=1)
            try:
                await asyncio.wrap_future(fut)
            except TransportError:
                self._count(batches_failed=1)
                raise
            self._count(
                batches_succeeded=1,
                engine_calls=1,
                bytes_written=batch.total_bytes,
                blocks_written=len(batch),
            )

    def stats(self) -> TransportStats:
        return self._stats

    def _count(self, **add: int) -> None:
        """Loop only: replace the snapshot with one where the named counters grew."""
        s = self._stats
        self._stats = msgspec.structs.replace(
            s, **{name: getattr(s, name) + n for name, n in add.items()}
        )

    async def quiesce(self, peer: str | None = None) -> None:
        running = list(self._running)
        if running:
            await asyncio.wait([asyncio.wrap_future(f) for f in running])

    def close(self) -> None:
        _open.pop(self._target, None)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._regions = RegionTable()

    def _check_open(self) -> ThreadPoolExecutor:
        if self._executor is None:
            raise TransportError("transport is closed", peer=self._target)
        return self._executor
