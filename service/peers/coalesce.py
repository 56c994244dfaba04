"""Coalescing of peer notices: at most one request in flight per peer, the rest batched.

Destinations (decode → prefill) and arrival/failure notices (prefill → decode) are small and,
under load, many: one HTTP request each would spend most of both services' CPU on HTTP. A
`Coalescer` sends a notice at once when its peer's lane is idle; notices submitted while a
request is in flight wait and leave together in the next one. An idle service therefore adds no
latency, and a busy one sends a few large requests instead of many small ones.

Each notice still gets its own outcome: the receiver answers one result per item, `submit`
returns its own item's answer (None for a bare notice; a segment's `SegmentAck`) or raises its
own item's error only. A failed request (peer unreachable) fails every notice in
it. Batches are capped in bytes so they stay under the receiver's body limit. A lane exists only
while its peer has notices pending or in flight.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvhandoff.pipelines.errors import InternalError, KVHandoffError
from kvhandoff.service.tasks import TaskOwner

#: Sends one batch of pre-encoded notices to a peer; returns, per notice, its answer (None for
#: a bare notice) or the error the peer reported for it.
SendBatch = Callable[[str, list[msgspec.Raw]], Awaitable[list[Any]]]

_encoder = msgspec.json.Encoder()


@dataclass
class _Lane:
    pending: list[tuple[msgspec.Raw, asyncio.Future[Any]]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class Coalescer:
    def __init__(self, send: SendBatch, *, max_batch_bytes: int = 1 << 20) -> None:
        self._send = send
        self._max_bytes = max_batch_bytes
        self._lanes: dict[str, _Lane] = {}
        self._tasks = TaskOwner("coalescer")

    async def submit(self, peer: str, notice: msgspec.Struct) -> Any:
        """Deliver `notice` to `peer`: its answer, or the error the peer reported for it."""
        if self._tasks.closing:
            raise InternalError(f"not sent to {peer}: the service is shutting down", peer=peer)
        loop = asyncio.get_running_loop()
        lane = self._lanes.setdefault(peer, _Lane())
        done: asyncio.Future[Any] = loop.create_future()
        lane.pending.append((msgspec.Raw(_encoder.encode(notice)), done))
        if lane.task is None:
            lane.task = self._tasks.spawn(self._drain(peer, lane), f"coalesce:{peer}")
        return await done

    async def close(self) -> None:
        await self._tasks.close()

    async def _drain(self, peer: str, lane: _Lane) -> None:
        live: list[tuple[msgspec.Raw, asyncio.Future[Any]]] = []
        try:
            while lane.pending:
                live = [(raw, fut) for raw, fut in self._take(lane) if not fut.done()]
                if not live:
                    continue  # every submitter of this batch was cancelled
                try:
                    results = await self._send(peer, [raw for raw, _ in live])
                except KVHandoffError as exc:
                    # One instance per waiter: a raised exception collects each raiser's
                    # traceback, so a shared one would grow and mix unrelated stacks.
                    results = [copy.copy(exc) for _ in live]
                for (_, fut), result in zip(live, results, strict=True):
                    if fut.done():
                        pass
                    elif isinstance(result, KVHandoffError):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
                live = []
        except BaseException as exc:
            # Shutdown or a bug: nobody may be left waiting on a notice that will not be sent.
            for _, fut in live + lane.pending:
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                elif not fut.done():
                    fut.set_exception(InternalError(f"sending to {peer} failed: {exc!r}"))
            lane.pending.clear()
            raise
        finally:
            lane.task = None
            if not lane.pending and self._lanes.get(peer) is lane:
                del self._lanes[peer]  # an idle peer keeps no lane

    def _take(self, lane: _Lane) -> list[tuple[msgspec.Raw, asyncio.Future[Any]]]:
        """The oldest notices that fit in one batch (always at least one)."""
        size, n = 0, 0
        for raw, _ in lane.pending:
            size += len(raw) + 1
            if n and size > self._max_bytes:
                break
            n += 1
        batch, lane.pending = lane.pending[:n], lane.pending[n:]
        return batch
