"""Writes that end only once nothing of them can still land, and awaits that survive
cancellation: what every prefill sender (direct and landed) writes through.

A write cancelled or failed is drained and its peer's lane quiesced before the error leaves,
so a caller that reports "stopped" tells the truth about this process's engine calls (the
transport's T3). In landed mode that is liveness only: the decode never trusts it for its pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from kvhandoff.pipelines.awaiting import drain
from kvhandoff.pipelines.prefill.handoff import BlockWriter
from kvhandoff.transport.blocks import Blocks


async def write_all(writer: BlockWriter, target: str, blocks: Blocks, start_by: float) -> None:
    """Write `blocks` to `target` (the transport splits them under its block cap and bounds
    in-flight batches per peer). On cancellation or error, leave only once the engine can no
    longer write anything of it: the write task is drained, then the peer's lane quiesced.

    No batch starts after `start_by` (the handoff's deadline), even if this loop stalls."""
    task = asyncio.get_running_loop().create_task(writer.write(target, blocks, start_by=start_by))
    try:
        await asyncio.shield(task)
    except BaseException:
        # Cancelled (abort, deadline, lost peer) or failed: make sure nothing still lands.
        task.cancel()
        await drain({task})
        await _settle(writer.quiesce(target))
        raise


async def _settle(awaitable: Awaitable[None]) -> None:
    """Await to the end even if cancelled meanwhile; then re-raise the cancellation. A failure
    of the awaited call is raised too: the caller must not report "quiesced" on it."""
    task = asyncio.ensure_future(awaitable)
    try:
        await drain({task})
    finally:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
