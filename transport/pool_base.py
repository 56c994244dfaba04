"""The pool base class: the memory behind a list of regions, and its registration with a transport.

The caller (a stage or the decode instance in `pipelines`/`service`) passes region sizes in bytes,
usually `StageLayout.region_sizes`; a pool returns one base address per region and knows nothing
of layers. Three kinds, chosen by a spec string (`kvhandoff.transport.pools.open_pool`) or built
directly:

- `torch:<device>` (`kvhandoff.transport.pool_torch.TorchPool`): tensors kvhandoff allocates itself;
- `shm:<name>` (`kvhandoff.transport.pool_shm.ShmPool`): a file under /dev/shm shared with an
engine;
- embedded (`EmbeddedPool`): buffers an engine running kvhandoff in-process hands over.

Placement rule shared by torch and shm pools (`pack_offsets`): regions are laid out in the given
order, each starting at the next multiple of `align_bytes` (4 KiB, or 2 MiB for `ascend`), the
first at offset 0. `offsets` publishes the result so another process can find every region.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvhandoff.transport.base import HOST, Transport
from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.regions import Region

Bytes = npt.NDArray[np.uint8]


def align_up(value: int, align_bytes: int) -> int:
    return -(-value // align_bytes) * align_bytes


def pack_offsets(sizes: Sequence[int], align_bytes: int) -> tuple[list[int], int]:
    """Offsets of `sizes` packed in order, each aligned to `align_bytes`; and the total size
    (rounded up to `align_bytes` so the whole span can be registered as aligned memory)."""
    if align_bytes <= 0 or align_bytes & (align_bytes - 1):
        raise PoolError(f"align_bytes must be a power of two, got {align_bytes}", field="align")
    offsets, end = [], 0
    for i, size in enumerate(sizes):
        if size <= 0:
            raise PoolError(f"region {i} has size {size}; sizes must be positive", field="sizes")
        start = align_up(end, align_bytes)
        offsets.append(start)
        end = start + int(size)
    return offsets, align_up(end, align_bytes)


def host_array(addr: int, length: int) -> Bytes:
    """A numpy uint8 view of host memory at `addr` (no copy; the caller keeps it alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))


class Pool:
    """Regions of memory, optionally registered with one transport. Close is idempotent.

    Subclasses set `regions` (what the caller asked for) and `registrations` (what is handed to
    the engine: one aligned span for torch/shm pools, one entry per buffer for embedded).
    """

    kind: str = "pool"

    def __init__(self, regions: Sequence[Region], registrations: Sequence[Region]) -> None:
        self.regions: tuple[Region, ...] = tuple(regions)
        self.registrations: tuple[Region, ...] = tuple(registrations)
        self._transport: Transport | None = None
        self.closed = False

    @property
    def bases(self) -> list[int]:
        """Base address of every region, in the order of the sizes given."""
        return [r.addr for r in self.regions]

    @property
    def on_host(self) -> bool:
        """Whether `view` works: the regions are host memory this process can read."""
        return True

    @property
    def devices(self) -> frozenset[str]:
        """The torch device types of this pool's memory (what `register` tells the transport)."""
        return HOST

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.registrations)

    def register(self, transport: Transport) -> None:
        """Register this pool's memory with `transport` (one engine call); undone by `close`."""
        if self.closed:
            raise PoolError(f"{self.kind} pool is closed")
        if self._transport is not None:
            raise PoolError(f"{self.kind} pool is already registered with a transport")
        transport.register(self.registrations, devices=self.devices)
        self._transport = transport

    def view(self, index: int) -> Bytes:
        """Writable uint8 view of region `index` (host memory only); for tests and verification."""
        self._check_open()
        region = self.regions[index]
        return host_array(region.addr, region.length)

    def read(self, index: int) -> Bytes:
        """A host copy of region `index` (works for device pools too)."""
        return self.view(index).copy()

    def write(self, index: int, data: Bytes, offset: int = 0) -> None:
        """Copy `data` into region `index` at `offset` (works for device pools too)."""
        self.view(index)[offset : offset + data.shape[0]] = data

    def close(self) -> None:
        """Unregister (if registered) and release what this pool owns. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        transport, self._transport = self._transport, None
        try:
            if transport is not None:
                transport.unregister(self.registrations)
        finally:
            self._release()

    def _release(self) -> None:
        """Free owned memory; called once, after unregistering."""

    def _check_open(self) -> None:
        if self.closed:
            raise PoolError(f"{self.kind} pool is closed")

    def __enter__(self) -> Pool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self.close()


class EmbeddedPool(Pool):
    """Buffers owned by an engine running kvhandoff in-process; each one is registered as is.

    Pass `(addr, length)` pairs for host memory, or torch tensors (kept alive by the pool; their
    device decides whether `view` works). The pool never frees them.
    """

    kind = "embedded"

    def __init__(self, buffers: Sequence[tuple[int, int] | Any]) -> None:
        self._tensors: list[Any] = []
        self._host = True
        regions = []
        for buf in buffers:
            if isinstance(buf, tuple):
                addr, length = buf
            else:  # a torch tensor: contiguous memory, kept alive here
                if not buf.is_contiguous():
                    raise PoolError("embedded tensors must be contiguous", field="buffers")
                addr, length = buf.data_ptr(), buf.numel() * buf.element_size()
                self._tensors.append(buf)
                self._host = self._host and buf.device.type == "cpu"
            regions.append(Region(int(addr), int(length)))
        super().__init__(regions, regions)

    @property
    def on_host(self) -> bool:
        return self._host

    @property
    def devices(self) -> frozenset[str]:
        kinds = {str(t.device.type) for t in self._tensors}
        return frozenset(kinds) | (HOST if len(self._tensors) < len(self.regions) else set())

    def view(self, index: int) -> Bytes:
        if not self._host:
            raise PoolError("view() needs host memory; this embedded pool holds device tensors")
        return super().view(index)

    def tensor(self, index: int) -> Any:
        """Region `index` as the tensor it was handed over as, flat uint8 (no copy); None when
        the buffers were (addr, length) pairs."""
        if not self._tensors or len(self._tensors) != len(self.regions):
            return None
        import torch

        return self._tensors[index].reshape(-1).view(torch.uint8)

    def _release(self) -> None:
        self._tensors.clear()
