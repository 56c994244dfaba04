"""The `Transport` contract: move `Blocks` from local registered memory to a peer's.

Callers: pools register and unregister their memory; the handoff pipeline (`pipelines`) calls
`write` per stage and `quiesce` before it reports an abort. Implementations:
`kvhandoff.transport.mooncake` (the Transfer Engine) and `kvhandoff.transport.local` (in-process
memmove). Nothing here knows about layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.regions import Region

#: The memory every transport moves: host memory (`register`'s `devices`).
HOST = frozenset({"cpu"})


class TransportStats(msgspec.Struct, frozen=True, kw_only=True):
    """Cumulative counters since the transport started (`Transport.stats()`), for metrics.

    A batch is the unit `write` submits (at most `max_blocks_per_batch` blocks and
    `max_bytes_per_batch` bytes); several small batches to one peer may share one engine call.
    """

    #: Batches handed to the engine's queue by `write`.
    batches_submitted: int = 0
    #: Batches whose engine call returned success: their bytes landed.
    batches_succeeded: int = 0
    #: Batches that failed: engine rc or exception, started too late, skipped because their
    #: write had failed or was cancelled, or the transport closed. Each has its own error.
    batches_failed: int = 0
    #: Batches whose write stopped waiting after `transfer_timeout_s` (the call may still run).
    batches_timed_out: int = 0
    #: Bytes and blocks of succeeded batches.
    bytes_written: int = 0
    blocks_written: int = 0
    #: Engine calls made, calls that returned a non-zero rc (by rc), and calls that raised.
    engine_calls: int = 0
    engine_errors_by_rc: dict[int, int] = msgspec.field(default_factory=dict)
    engine_exceptions: int = 0
    #: Peers with a lane now (queue and in-flight bound), and worker threads alive now.
    live_lanes: int = 0
    worker_threads: int = 0


@runtime_checkable
class Transport(Protocol):
    """What the pipelines need from a transport. Every method may be called from the event loop."""

    @property
    def local_target(self) -> str:
        """The name peers pass to `write` to reach this process's registered memory."""
        ...

    @property
    def max_call_s(self) -> float:
        """The longest one engine call started by this transport can still write after it
        started (given its byte cap per batch). A peer adds it to a write's `start_by` to know
        when that write's bytes can no longer land."""
        ...

    def stats(self) -> TransportStats:
        """Cumulative counters (a snapshot, see `TransportStats`); cheap, any thread."""
        ...

    def register(self, regions: Sequence[Region], *, devices: frozenset[str] = HOST) -> None:
        """Make `regions` readable/writable by transfers, in one engine call. `devices`: the
        torch device types the regions' memory lives on; a transport that cannot move one of
        them raises `TransportError` naming it, before any address reaches the engine (which
        would read a device address as host memory).

        Raises `TransportError` (with the engine's rc) if a region overlaps one already registered.
        """
        ...

    def unregister(self, regions: Sequence[Region]) -> None:
        """Forget `regions`. Unknown regions, repeated calls and calls after `close` are no-ops."""
        ...

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        """Copy every block from local memory to `peer`'s memory; returns when all bytes landed.

        Splits into batches under the configured caps (blocks and bytes). Raises
        `TransportError` (rc, peer) on any failure — `EngineCallError` (with the `cause`) when the
        engine call or its preparation raised — and `TransportTimeout` when a batch exceeds the
        transfer timeout; never returns success for a partial copy, and raises `CancelledError`
        only when its caller was cancelled. Cancelling it stops its batches not yet started;
        see `quiesce`.
        No batch starts after `start_by` (a `time.monotonic()` instant; it then raises
        `TransportTimeout`), checked where the copy starts, not in the event loop, so it holds
        even if the loop stalls: a peer can bound when this write's bytes may still land.
        """
        ...

    async def quiesce(self, peer: str | None = None) -> None:
        """Return once no engine call already started (for `peer`, or any) can still write."""
        ...

    def close(self) -> None:
        """Release the engine. Idempotent; later `write` calls raise `TransportError`."""
        ...
