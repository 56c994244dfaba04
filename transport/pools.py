"""Open a pool by spec string: `torch:<device>` or `shm:<name>` (kinds in
`kvhandoff.transport.pool_base`).

Kept apart from the base class so the import graph is a tree: `pool_torch` and `pool_shm` build
on `pool_base`, and only this factory knows them all. Importing it does not import torch
(`pool_torch` loads it when a torch pool is opened).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvhandoff.transport.config import DEFAULT_ALIGN_BYTES
from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.pool_base import Pool
from kvhandoff.transport.pool_shm import ShmPool
from kvhandoff.transport.pool_torch import TorchPool


def open_pool(
    spec: str,
    sizes: Sequence[int],
    *,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    create: bool = True,
    pin_memory: bool = False,
    zeroed: bool = True,
) -> Pool:
    """Allocate or attach a pool from a spec string: `torch:<device>` or `shm:<name>`.

    `create` applies to shm (create the file vs. attach an existing one); `pin_memory` to
    `torch:cpu`; `zeroed=False` to torch pools (scratch memory, left as allocated). Embedded
    pools are built directly with `EmbeddedPool`.
    """
    kind, _, arg = spec.partition(":")
    if kind == "torch" and arg:
        return TorchPool(sizes, arg, align_bytes=align_bytes, pin_memory=pin_memory, zeroed=zeroed)
    if kind == "shm" and arg:
        return ShmPool(arg, sizes, align_bytes=align_bytes, create=create)
    raise PoolError(
        f"unknown pool spec {spec!r}; expected torch:<device> or shm:<name>", field="pool"
    )
