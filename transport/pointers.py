"""Tensors over memory an engine owns and names only by address (SGLang's `KVArgs` pointers).

An embedded pool copies into an engine's pages with torch on the pages' own device, so raw
pointers must become tensors first. `tensor_at` wraps without copying: the tensor aliases the
engine's memory, and the engine keeps that memory alive (an `EmbeddedPool` never frees it).

- host memory: `torch.frombuffer` over the address;
- CUDA memory: the `__cuda_array_interface__` protocol. torch reads the pointer's device from
  the driver and would copy to another (default) device, so the import runs with the expected
  device as the default and the result is checked to alias the address there (host memory
  pinned for that device passes too: the device reaches it);
- NPU memory: torch_npu's constructors for memory it did not allocate (`kvhandoff.transport.npu`,
the one
  module that imports torch_npu, and only when an `npu` device is named).
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.npu import npu_tensor_at
from kvhandoff.transport.pool_torch import check_cuda, npu_device


class _CudaMemory:
    """The address and length of CUDA memory in the array interface torch imports (bytes, no
    stream: the engine finished writing what kvhandoff reads before it hands a range over)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


def tensor_at(addr: int, length: int, device: str) -> Any:
    """A flat uint8 tensor over `length` bytes at `addr` on `device` ("cpu", "cuda:N" or
    "npu:N"), no copy. PoolError naming the device when the memory cannot be wrapped there."""
    import torch

    if addr <= 0 or length <= 0:
        raise PoolError(
            f"buffer at {addr:#x} of {length} bytes: address and length must be positive",
            field="buffers",
        )
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=torch.uint8)
    if kind not in ("cuda", "npu"):
        raise PoolError(
            f"buffers on {device} cannot be wrapped as tensors: kvhandoff imports host, CUDA "
            "and NPU memory only",
            field="buffers",
        )
    if kind == "npu":  # before torch.device: torch knows the npu type once torch_npu is loaded
        dev = npu_device(torch, device, what="buffers on", field="buffers")
        return npu_tensor_at(torch, addr, length, dev)
    dev = torch.device(device)
    check_cuda(torch, dev, what="buffers on", field="buffers")
    try:
        with dev:  # a default device set elsewhere would make torch copy to it
            tensor = torch.as_tensor(_CudaMemory(addr, length))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise PoolError(f"buffer at {addr:#x} on {device} cannot be wrapped: {exc}") from exc
    if int(tensor.data_ptr()) != addr or tensor.device != torch.device("cuda", dev.index or 0):
        raise PoolError(
            f"buffer at {addr:#x} is not memory of {device} (torch sees it on {tensor.device})",
            field="buffers",
        )
    return tensor
