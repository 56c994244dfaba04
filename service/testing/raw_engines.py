"""Raw Mooncake in a deployment's topology: the baseline with no kvhandoff code on the path.

The demo and the benchmarks compare handoffs through a `LocalDeployment` with the Transfer
Engine called directly, moving the same blocks into the same decode memory: one engine in this
process (`RawEngine`), one per stage in threads of this process (`StageEngines`), or one per
stage in a process of its own (`StageProcesses`, the services' topology). `raw_write` is the
plain way to call the engine: `batch_transfer_sync_write` in order, from one thread.
`raw_write_sleeping` is the engine's other way, its async calls: each block a batch of its own,
their status checked between short sleeps. The sync call busy-waits a core until its batch
ends; on a host with fewer cores than busy threads that spin slows the engine's own senders and
the receiver, so a landed stage (whose few large blocks take the sleeping wait) is also set
beside a raw baseline that waits the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvhandoff.transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH, Blocks
from kvhandoff.transport.config import DEFAULT_MAX_BYTES_PER_BATCH
from kvhandoff.transport.pool_base import Pool


class RawEngine:
    """The Transfer Engine called directly from this process (no kvhandoff code on the path),
    with `pools` registered as sources: the baseline whole-handoff numbers are compared with."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        from kvhandoff.transport.config import MooncakeConfig
        from kvhandoff.transport.mooncake_engine import start_engine

        self.engine = start_engine(MooncakeConfig())
        self._addrs = [g.addr for pool in pools for g in pool.registrations]
        lengths = [g.length for pool in pools for g in pool.registrations]
        rc = self.engine.batch_register_memory(self._addrs, lengths)
        if rc != 0:
            raise RuntimeError(f"the raw engine could not register the source pools (rc {rc})")

    def close(self) -> None:
        """Unregister the pools (before they are unmapped); the engine goes with the object."""
        if self._addrs:
            self.engine.batch_unregister_memory(self._addrs)
            self._addrs = []

    def seconds(self, target: str, blocks: Blocks) -> float:
        """Wall time of one `raw_write` of `blocks`."""
        t0 = time.perf_counter()
        raw_write(self.engine, target, blocks)
        return time.perf_counter() - t0


def raw_write(engine: Any, target: str, blocks: Blocks) -> None:
    """`batch_transfer_sync_write` over batches of at most 2,048 blocks and 1 GiB (as the
    service's transport cuts them: the engine refuses a call of 2 GiB), in order, from the
    calling thread: the plain way to use the engine."""
    for batch in blocks.batches(DEFAULT_MAX_BLOCKS_PER_BATCH, DEFAULT_MAX_BYTES_PER_BATCH):
        rc = engine.batch_transfer_sync_write(
            target, batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.length.tolist()
        )
        if rc < 0:
            raise RuntimeError(f"raw engine write failed (rc {rc})")


class StageEngines:
    """One raw Transfer Engine per prefill stage, each with only its stage's pool registered,
    writing its own blocks at the same time as the others: the same process topology as the
    service (one engine per stage, in parallel), with no kvhandoff code on the path."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.engines: list[RawEngine] = []
        try:
            for pool in pools:
                self.engines.append(RawEngine([pool]))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> dict[str, int]:
        """The process the engines run in (this one), for CPU accounting."""
        return {"raw": os.getpid()}

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def seconds(self, target: str, per_stage: Sequence[Blocks]) -> float:
        """Wall time of every stage's engine writing its `per_stage[r]` at once (threads: the
        engine call releases the GIL), from the first start to the last end."""
        if len(per_stage) != len(self.engines):
            raise ValueError(f"{len(per_stage)} block lists for {len(self.engines)} engines")
        errors: list[BaseException] = []
        start = threading.Barrier(len(self.engines) + 1)

        def one(engine: RawEngine, blocks: Blocks) -> None:
            start.wait()
            try:
                raw_write(engine.engine, target, blocks)
            except Exception as exc:  # noqa: BLE001 - re-raised in the calling thread below
                errors.append(exc)

        threads = [
            threading.Thread(target=one, args=(e, b), daemon=True)
            for e, b in zip(self.engines, per_stage)
        ]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return elapsed


#: Between two rounds of status checks of `raw_write_sleeping` (a 1 MiB block takes ~0.4 ms).
SLEEP_S = 200e-6
#: Blocks of `raw_write_sleeping` in flight at once.
IN_FLIGHT = 64


def raw_write_sleeping(engine: Any, target: str, blocks: Blocks) -> None:
    """Each block as a one-entry `batch_transfer_async_write` (the engine's status check reads a
    batch's first task only), at most `IN_FLIGHT` at once, in order, their status checked
    between sleeps of `SLEEP_S`; raises if a submission or a block failed."""
    rows = np.stack([blocks.src_addr, blocks.dst_addr, blocks.length], axis=1).tolist()
    for first in range(0, len(rows), IN_FLIGHT):
        ids = []
        for src, dst, length in rows[first : first + IN_FLIGHT]:
            batch = engine.batch_transfer_async_write(target, [src], [dst], [length])
            if batch in (0, (1 << 64) - 1):
                raise RuntimeError("raw engine async submission failed")
            ids.append(batch)
        while ids:  # checked until each ends: the engine frees a batch when it reports its end
            statuses = [engine.transfer_check_status(batch) for batch in ids]
            if any(status not in (0, 1) for status in statuses):
                raise RuntimeError(f"raw engine async write failed (status {statuses})")
            ids = [batch for batch, status in zip(ids, statuses) if status == 0]
            if ids:
                time.sleep(SLEEP_S)


class StageProcesses:
    """One raw Transfer Engine per prefill stage, each in a process of its own that maps only
    its stage's shm pool file and registers it — the services' topology with one process per
    stage — all writing their blocks at once on `seconds`. Nothing of kvhandoff is on the path:
    each process calls `batch_transfer_sync_write` in a loop from one thread (`raw_write`), or
    with `sleeping`, the async calls (`raw_write_sleeping`).
    Threads of one process (`StageEngines`) are not the same topology: on a small host the
    engines' busy-waiting calls then share one process's cores and starve each other."""

    def __init__(self, pools: Sequence[Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._bases = [pool.registrations[0].addr for pool in pools]
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        try:
            for pool in pools:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_stage_writer, args=(pool.path, child), daemon=True)
                proc.start()
                self._conns.append(parent)
                self._procs.append(proc)
            for k in range(len(self._conns)):
                ready = self._recv(k)
                if ready != "ready":
                    raise RuntimeError(f"a raw stage process did not start: {ready}")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> dict[str, int]:
        """Each stage's writer process by name (`raw-0`, ...), for CPU accounting."""
        return {f"raw-{k}": proc.pid for k, proc in enumerate(self._procs)}

    def _recv(self, k: int, timeout_s: float = 300.0) -> Any:
        """Stage `k`'s next answer; an error if its process died or said nothing in time
        (never a wait for ever on a process that is gone)."""
        conn, proc = self._conns[k], self._procs[k]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"raw stage process {k} exited with status {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw stage process {k} did not answer in {timeout_s:.0f} s")
        return conn.recv()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []

    def seconds(self, target: str, per_stage: Sequence[Blocks], *, sleeping: bool = False) -> float:
        """From the first stage's start to the last one's end (CLOCK_MONOTONIC is one clock
        for every process of the host) of every stage writing its `per_stage[r]` at once
        (`sleeping`: with the engine's async calls, `raw_write_sleeping`)."""
        if len(per_stage) != len(self._conns):
            raise ValueError(f"{len(per_stage)} block lists for {len(self._conns)} stages")
        for conn, base, blocks in zip(self._conns, self._bases, per_stage):
            # Offsets into the pool: each process maps it at its own address.
            conn.send(
                (
                    target,
                    (blocks.src_addr - np.uint64(base)).tolist(),
                    blocks.dst_addr.tolist(),
                    blocks.length.tolist(),
                    sleeping,
                )
            )
        for k in range(len(self._conns)):
            if (got := self._recv(k)) != "set":
                raise RuntimeError(f"raw stage process: {got}")
        for conn in self._conns:
            conn.send("go")
        spans = [self._recv(k) for k in range(len(self._conns))]
        errors = [s for s in spans if isinstance(s, str)]
        if errors:
            raise RuntimeError(f"raw engine write failed: {errors[0]}")
        return float(max(end for _, end in spans) - min(start for start, _ in spans))


def _stage_writer(path: str, conn: Any) -> None:
    """A raw stage process: map `path`, register it with a fresh engine, then for each block
    list sent, wait for "go", write it and answer (start, end); `None` stops."""
    import mmap

    from kvhandoff.transport.config import MooncakeConfig
    from kvhandoff.transport.mooncake_engine import start_engine

    try:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        base = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
        engine = start_engine(MooncakeConfig())
        if engine.batch_register_memory([base], [size]) != 0:
            raise RuntimeError(f"could not register {path}")
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    try:
        while (job := conn.recv()) is not None:
            target, src_off, dst, lengths, sleeping = job
            blocks = Blocks.of(np.asarray(src_off, dtype=np.uint64) + np.uint64(base), dst, lengths)
            conn.send("set")
            if conn.recv() != "go":
                break
            start = time.monotonic()
            try:
                (raw_write_sleeping if sleeping else raw_write)(engine, target, blocks)
            except RuntimeError as exc:
                conn.send(str(exc))
                continue
            conn.send((start, time.monotonic()))
    except EOFError:
        pass
    finally:
        engine.batch_unregister_memory([base])
