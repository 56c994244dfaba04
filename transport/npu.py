"""Ascend NPU memory through `torch_npu`: the one module of kvhandoff that imports it.

Callers: `kvhandoff.transport.pool_torch` (a `torch:npu:N` pool, and the device checks) and
`kvhandoff.transport.pointers` (an engine's NPU buffers known by address). `torch_npu` is imported
only when an `npu` device is named: the import registers the `npu` device type with torch (and
`torch.npu`, whose streams `settle` in `kvhandoff.pipelines.packing` waits on), so every later use
of such a tensor is plain torch.

NPU memory known only by address is wrapped with torch_npu's own constructors for memory it did
not allocate, `torch_npu._C._construct_storage_from_data_pointer` and
`_construct_NPU_Tensor_From_Storage_And_Metadata` (what its NPU graph trees rebuild outputs
with): a storage that never frees the memory, and a flat uint8 tensor in the plain ND format
over it. They are private: a torch_npu without them is refused by name. torch_npu has no call
that asks the driver which device owns an address (CUDA's pointer attributes), so the device is
the engine's word; the wrap is checked to alias the address there.

Written from torch_npu's sources; CPU-tested with a stand-in module, not yet run on an NPU
(`tests/device/test_npu.py` is the check for an Ascend machine).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvhandoff.transport.errors import PoolError

#: What a missing torch_npu is told to install (pyproject's extra).
INSTALL = "install kvhandoff[ascend]: torch_npu, with the CANN toolkit it was built for"
#: `aclFormat` ACL_FORMAT_ND: memory in plain row-major order, no NPU-private tiling.
ACL_FORMAT_ND = 2
#: torch_npu's constructors for memory it did not allocate (see the module docstring).
STORAGE_FROM_POINTER = "_construct_storage_from_data_pointer"
TENSOR_FROM_STORAGE = "_construct_NPU_Tensor_From_Storage_And_Metadata"


def import_torch_npu(what: str, *, field: str) -> ModuleType:
    """torch_npu, imported (once; Python caches it). PoolError naming `what` and `field` when
    it is not installed or fails to load (a CANN toolkit it cannot find raises too)."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise PoolError(
            f"{what} needs torch_npu, which is not installed ({INSTALL})", field=field
        ) from exc
    except (OSError, RuntimeError) as exc:  # installed, but its CANN libraries failed to load
        raise PoolError(
            f"{what} needs torch_npu, which failed to load: {exc}", field=field
        ) from exc


def npu_tensor_at(torch: Any, addr: int, length: int, dev: Any) -> Any:
    """A flat uint8 tensor over `length` bytes of NPU memory at `addr` on NPU `dev` (a torch
    device this process can use: `kvhandoff.transport.pool_torch.npu_device`), no copy, never freed
    by torch. PoolError naming the device when torch_npu cannot wrap it."""
    device = str(dev)
    dev = torch.device("npu", dev.index or 0)  # where the tensor lands, to compare with
    torch_npu = import_torch_npu(f"buffers on {device!r}", field="buffers")
    native = getattr(torch_npu, "_C", None)
    storage_at = getattr(native, STORAGE_FROM_POINTER, None)
    tensor_over = getattr(native, TENSOR_FROM_STORAGE, None)
    if not callable(storage_at) or not callable(tensor_over):
        version = getattr(torch_npu, "__version__", "?")
        raise PoolError(
            f"torch_npu {version} cannot wrap NPU memory it did not allocate: it lacks "
            f"torch_npu._C.{STORAGE_FROM_POINTER} / {TENSOR_FROM_STORAGE} (a torch_npu with "
            "NPU graph trees has them)",
            field="buffers",
        )
    metadata = {
        "dtype": torch.uint8,
        "size": [length],
        "stride": [1],
        "storage_offset": 0,
        "npu_format": ACL_FORMAT_ND,
    }
    try:
        tensor = tensor_over(metadata, storage_at(addr, dev, length))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise PoolError(f"buffer at {addr:#x} on {device} cannot be wrapped: {exc}") from exc
    if int(tensor.data_ptr()) != addr or tensor.device != dev:
        raise PoolError(
            f"buffer at {addr:#x} is not memory of {device} (torch_npu wrapped it on "
            f"{tensor.device} at {int(tensor.data_ptr()):#x})",
            field="buffers",
        )
    return tensor


def use_npu(index: int) -> None:
    """Make NPU `index` current in the calling thread (torch_npu's `set_device`): Mooncake's
    Ascend Direct transport initialises on the current NPU."""
    torch_npu = import_torch_npu(f"transport.npu = {index}", field="transport.npu")
    torch_npu.npu.set_device(index)
