"""The landed transfer's memory: the decode's landing arena, a prefill's staging buffer.

Opened with the stages (`kvhandoff.service.runtime.stages`) and closed after the pipeline, before
the transport: each is one `torch:<device>` pool of one region, on the device of the stage memory it
serves (a device pool keeps its copies and digests on the device), registered with the
transport: in landed mode it is the only memory a service registers
(`kvhandoff.service.runtime.stages`). In `direct` mode neither role opens one: the mode is chosen by
configuration on both sides, and a prefill refuses a destination naming another mode than its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.pipelines.arena import Arena
from kvhandoff.pipelines.decode.landing import Landing
from kvhandoff.pipelines.digest import Algorithm
from kvhandoff.pipelines.memory import pool_array
from kvhandoff.pipelines.prefill import Staging
from kvhandoff.service.config import Config, ConfigError
from kvhandoff.service.runtime.stages import HostedMemory
from kvhandoff.transport.base import Transport
from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.pool_base import Pool
from kvhandoff.transport.pools import open_pool


@dataclass
class TransferMemory:
    """The one pool of this service's landed transfers (None in direct mode)."""

    pool: Pool
    device: str

    def landing(self, config: Config, stage: HostedMemory) -> Landing:
        algorithm: Algorithm = "xxh3_128" if self.pool.on_host else "mix64"
        return Landing(
            Arena(self.pool.bases[0], self.pool.regions[0].length),
            pool_array(self.pool, 0),
            stage.memory,
            stage.layout,
            window_bytes=config.transfer.window_bytes,
            algorithm=algorithm,
            peer_share=config.transfer.peer_share,
        )

    def staging(self) -> Staging:
        return Staging(
            Arena(self.pool.bases[0], self.pool.regions[0].length), pool_array(self.pool, 0)
        )

    def close(self) -> None:
        self.pool.close()


def open_transfer_memory(
    config: Config, transport: Transport, hosted: list[HostedMemory]
) -> TransferMemory | None:
    """Allocate and register the arena (decode) or staging buffer (prefill); None in direct
    mode."""
    if config.transfer.mode == "direct":
        return None
    key = "transfer.landing_bytes" if config.role == "decode" else "transfer.staging_bytes"
    size = (
        config.transfer.landing_bytes if config.role == "decode" else config.transfer.staging_bytes
    )
    device = _device_of(hosted[0].pool) if hosted else "cpu"
    try:
        # Not zeroed: every window is written before it is read, and untouched pages of an
        # idle arena stay out of resident memory.
        pool = open_pool(
            f"torch:{device}", [size], align_bytes=config.transport.align_bytes, zeroed=False
        )
    except PoolError as exc:
        raise ConfigError(key, exc.message) from None
    try:
        pool.register(transport)
    except BaseException:
        pool.close()
        raise
    return TransferMemory(pool, device)


def _device_of(pool: Pool) -> str:
    """The device a stage's memory lives on: its copies and digests run there too."""
    device = getattr(pool, "device", None)
    if isinstance(device, str):
        return device
    tensor = getattr(pool, "tensor", None)
    first = tensor(0) if tensor is not None else None
    return str(first.device) if first is not None else "cpu"
