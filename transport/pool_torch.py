"""`torch:<device>` pools: one backing uint8 tensor kvhandoff allocates, regions packed in it.

Devices: `cpu` (optionally pinned, which needs a CUDA build of torch), `cuda:N`, and `npu:N`.
`npu` needs `torch_npu`, imported (by `kvhandoff.transport.npu`) only when an npu device is
configured: importing it registers the `npu` device type with torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.npu import import_torch_npu
from kvhandoff.transport.pool_base import Bytes, Pool, align_up, pack_offsets
from kvhandoff.transport.regions import Region


def _torch_device(device: str) -> Any:
    import torch

    if device.split(":", 1)[0] == "npu":
        return npu_device(torch, device)
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise PoolError(f"invalid torch device {device!r}: {exc}", field="pool") from exc
    if dev.type == "cuda":
        check_cuda(torch, dev)
    return dev


def check_cuda(torch: Any, dev: Any, *, what: str = "pool device", field: str = "pool") -> None:
    """Name the mistake before torch does: a CPU build raises a bare AssertionError on the
    first allocation, which a start-up would print as a traceback. Also for memory wrapped by
    address (`kvhandoff.transport.pointers`), whose `what` and `field` name it instead."""
    if torch.version.cuda is None:
        raise PoolError(
            f"{what} {str(dev)!r} needs a CUDA build of torch; this is torch "
            f"{torch.__version__}, a CPU build (use a torch:cpu or shm pool, or install a CUDA "
            "build of torch)",
            field=field,
        )
    count = int(torch.cuda.device_count())
    _check_visible(dev, count, "CUDA_VISIBLE_DEVICES", what=what, field=field)


def npu_device(torch: Any, device: str, *, what: str = "pool device", field: str = "pool") -> Any:
    """`device` ("npu" or "npu:N") as a torch device this process can use, torch_npu loaded
    first (it registers the `npu` type). PoolError naming `what`, the device and `field`
    otherwise: before torch_npu fails on it with a bare ACL error code."""
    torch_npu = import_torch_npu(f"{what} {device!r}", field=field)
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise PoolError(f"invalid torch device {device!r}: {exc}", field=field) from exc
    count = int(torch_npu.npu.device_count())
    _check_visible(dev, count, "ASCEND_RT_VISIBLE_DEVICES", what=what, field=field)
    return dev


def _check_visible(dev: Any, count: int, variable: str, *, what: str, field: str) -> None:
    """`dev` must be one of the `count` devices of its type this process sees."""
    if count == 0 or (dev.index or 0) >= count:
        raise PoolError(
            f"{what} {str(dev)!r} is not visible: this process sees {count} {dev.type} "
            f"device(s) (check {variable} and the driver)",
            field=field,
        )


class TorchPool(Pool):
    """Regions packed by `pack_offsets` in one tensor on `device`; registers the aligned span."""

    kind = "torch"

    def __init__(
        self,
        sizes: Sequence[int],
        device: str = "cpu",
        *,
        align_bytes: int,
        pin_memory: bool = False,
        zeroed: bool = True,
    ) -> None:
        import torch

        self.offsets, total = pack_offsets(sizes, align_bytes)
        dev = _torch_device(device)
        self.device = str(dev)
        try:
            # Over-allocate by one alignment unit: torch only guarantees 64-byte alignment.
            # `zeroed=False` (scratch memory such as a landing arena) leaves host pages
            # untouched until used, so an idle arena costs address space, not resident memory.
            alloc = torch.zeros if zeroed else torch.empty
            self._tensor: Any = alloc(
                total + align_bytes, dtype=torch.uint8, device=dev, pin_memory=pin_memory
            )
        except (RuntimeError, ValueError) as exc:
            raise PoolError(f"cannot allocate {total} bytes on {device}: {exc}") from exc
        raw = int(self._tensor.data_ptr())
        base = align_up(raw, align_bytes)
        self._skip = base - raw
        regions = [Region(base + off, int(size)) for off, size in zip(self.offsets, sizes)]
        super().__init__(regions, [Region(base, total)])

    @property
    def on_host(self) -> bool:
        return bool(self._tensor.device.type == "cpu")

    @property
    def devices(self) -> frozenset[str]:
        return frozenset({self.device.split(":", 1)[0]})

    def tensor(self, index: int) -> Any:
        """Region `index` as a uint8 tensor on the pool's device (a view, no copy)."""
        self._check_open()
        start = self._skip + self.offsets[index]
        return self._tensor[start : start + self.regions[index].length]

    def view(self, index: int) -> Bytes:
        self._check_open()
        if not self.on_host:
            raise PoolError(f"view() needs host memory; this pool is on {self.device}")
        return np.asarray(self.tensor(index).numpy())

    def read(self, index: int) -> Bytes:
        return np.asarray(self.tensor(index).cpu().numpy()).copy()

    def write(self, index: int, data: Bytes, offset: int = 0) -> None:
        import torch

        target = self.tensor(index)[offset : offset + data.shape[0]]
        target.copy_(torch.from_numpy(np.ascontiguousarray(data)))

    def _release(self) -> None:
        self._tensor = None
