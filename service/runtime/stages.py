"""The stages a service hosts: each one's layout, placed in a pool; registered with the transport
only in direct mode.

One `HostedMemory` per `[[stages]]` table. Its layout comes from the model and the partition
(`kvhandoff.pipelines.models`); its memory from the table's `pool` spec:

- `torch:<device>` — tensors allocated here;
- `shm:<name>` — attached: an engine created `/dev/shm/<name>` (the sidecar case: the engine
  writes KV pages there, the service moves them); the byte offset of every entry is published in
  `GET /v1/layout`;
- embedded — buffers an engine running the service in-process handed over
(`kvhandoff.service.embedded`),
  one per entry, KV entries first; with an `EngineStage`, the engine's own layout too (built
  from the flat lists it publishes), so no `[model]` describes it.

Region i of a pool is entry i of the layout (KV entries first, then state entries).

What is registered is reachable: the transfer engine authenticates nobody, and any process that
reaches its port may write any registered byte. So stage pools are registered only where a transport
must move them, in direct mode (a decode's pages are written, a prefill's are read); in landed mode
only the landing arena or staging buffer is (`kvhandoff.service.runtime.transfer_memory`), and the
stages' addresses are not published either (`HostedMemory.info`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import PoolMemory
from kvhandoff.pipelines.messages import ShmPlacement, StageInfo
from kvhandoff.pipelines.models import ModelSpec, decode_layout, stage_layout
from kvhandoff.service.config import Config, ConfigError, StageConfig
from kvhandoff.transport.base import Transport
from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.pool_base import EmbeddedPool, Pool
from kvhandoff.transport.pool_shm import ShmPool, shm_path
from kvhandoff.transport.pools import open_pool


@dataclass(frozen=True)
class EngineStage:
    """An embedding engine's stage as it registers it: its layout (e.g. from
    `kvhandoff.pipelines.layout.layout_from_flat_lists`, addresses included or not) and its buffers,
    one `(addr, length)` pair or contiguous tensor per entry, KV entries first."""

    layout: StageLayout
    buffers: Sequence[Any]


#: Embedded buffers per pp_rank: one (addr, length) pair or contiguous tensor per entry (laid out
#: as the configured model says), or an `EngineStage` that brings its own layout.
Buffers = Mapping[int, Sequence[Any] | EngineStage]


@dataclass(frozen=True)
class HostedMemory:
    """One stage's placed layout over its registered pool."""

    memory: PoolMemory

    @property
    def layout(self) -> StageLayout:
        return self.memory.layout

    @property
    def pool(self) -> Pool:
        return self.memory.pool

    def info(self, *, addresses: bool) -> StageInfo:
        """What `GET /v1/layout` says of this stage; its entries' addresses only with
        `addresses` (a direct-mode decode, whose prefills plan writes into its pages)."""
        pool = self.pool
        shm = None
        if isinstance(pool, ShmPool):
            shm = ShmPlacement(name=pool.name, offsets=list(pool.offsets), size=pool.nbytes)
        layout = self.layout if addresses else self.layout.unplaced()
        return StageInfo(layout=layout, fingerprint=layout.fingerprint, shm=shm)


def unplaced_layout(config: Config, spec: ModelSpec, stage: StageConfig) -> StageLayout:
    if config.role == "decode":
        return decode_layout(spec, num_pages=stage.num_pages, num_slots=stage.num_slots)
    return stage_layout(
        spec,
        config.layer_partition(),
        stage.pp_rank,
        num_pages=stage.num_pages,
        num_slots=stage.num_slots,
    )


def engine_layout(given: EngineStage, stage: StageConfig, key: str) -> StageLayout:
    """An engine's own layout, unplaced (the pool places it), checked against its stage table."""
    layout = given.layout
    if (layout.pp_rank, layout.pp_size) != (stage.pp_rank, stage.pp_size):
        raise ConfigError(
            key,
            f"the engine's layout is stage {layout.pp_rank} of {layout.pp_size}, the stage table "
            f"says {stage.pp_rank} of {stage.pp_size}",
        )
    return layout.place([0] * len(layout.region_sizes))


def open_stages(
    config: Config, transport: Transport, buffers: Buffers | None = None
) -> list[HostedMemory]:
    """Allocate or attach every stage's pool, registered with `transport` in direct mode only
    (module docstring); blocking (engine calls).

    On any failure the pools opened so far are closed (unregistered) before the error leaves.
    """
    register = config.transfer.mode == "direct"
    opened: list[HostedMemory] = []
    try:
        for i, stage in enumerate(config.stages):
            given = buffers.get(stage.pp_rank) if buffers is not None else None
            if isinstance(given, EngineStage):
                layout = engine_layout(given, stage, f"stages[{i}]")
            else:
                layout = unplaced_layout(config, config.model_spec(), stage)
            pool = _open_pool(config, i, stage, layout, buffers)
            try:
                if register:
                    pool.register(transport)
            except BaseException:
                pool.close()
                raise
            opened.append(HostedMemory(PoolMemory(layout, pool)))
    except BaseException:
        for hosted in opened:
            hosted.pool.close()
        raise
    return opened


def _open_pool(
    config: Config, index: int, stage: StageConfig, layout: StageLayout, buffers: Buffers | None
) -> Pool:
    key = f"stages[{index}].pool"
    sizes = layout.region_sizes
    if buffers is not None and stage.pp_rank in buffers:
        entry = buffers[stage.pp_rank]
        given = list(entry.buffers if isinstance(entry, EngineStage) else entry)
        if len(given) != len(sizes):
            raise ConfigError(
                key,
                f"stage {stage.pp_rank} needs {len(sizes)} embedded buffers "
                f"({len(layout.kv)} KV entries, then {len(layout.state)} state), got {len(given)}",
            )
        pool: Pool = EmbeddedPool(given)
        for j, (region, size) in enumerate(zip(pool.regions, sizes)):
            if region.length < size:
                raise ConfigError(
                    key, f"embedded buffer {j} holds {region.length} bytes, entry needs {size}"
                )
        return pool
    align = config.transport.align_bytes
    try:
        if stage.pool.startswith("shm:"):
            name = stage.pool.split(":", 1)[1]
            if not os.path.exists(shm_path(name)):
                # Never created here: a service that made the file would unlink it on exit
                # (or on a restart) under an engine still using it, splitting their memory.
                raise ConfigError(
                    key,
                    f"{shm_path(name)} does not exist; the engine that owns this memory creates "
                    "it (regions packed as GET /v1/layout publishes) and kvhandoff attaches it",
                )
            return ShmPool(name, sizes, align_bytes=align, create=False)
        return open_pool(stage.pool, sizes, align_bytes=align)
    except PoolError as exc:
        raise ConfigError(key, exc.message) from None
