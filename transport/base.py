"""The `Transport` contract: move `Blocks` from local registered memory to a peer's.

Callers: pools register and unregister their memory; the handoff pipeline (`pipelines`) calls
`write` per stage and `quiesce` before it reports an abort. Implementations: `transport.mooncake`
(the Transfer Engine) and `transport.local` (in-process memmove). Nothing here knows about layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from transport.blocks import Blocks
from transport.regions import Region


@runtime_checkable
class Transport(Protocol):
    """What the pipelines need from a transport. Every method may be called from the event loop."""

    @property
    def local_target(self) -> str:
        """The name peers pass to `write` to reach this process's registered memory."""
        ...

    def register(self, regions: Sequence[Region]) -> None:
        """Make `regions` readable/writable by transfers, in one engine call.

        Raises `TransportError` (with the engine's rc) if a region overlaps one already registered.
        """
        ...

    def unregister(self, regions: Sequence[Region]) -> None:
        """Forget `regions`. Unknown regions, repeated calls and calls after `close` are no-ops."""
        ...

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        """Copy every block from local memory to `peer`'s memory; returns when all bytes landed.

        Splits into batches under the configured cap. Raises `TransportError` (rc, peer) on any
        failure and `TransportTimeout` when a batch exceeds the transfer timeout; never returns
        success for a partial copy. Cancelling it stops batches not yet started; see `quiesce`.
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
