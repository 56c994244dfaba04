"""Coalescing of peer notices: idle lanes send at once, busy lanes batch, outcomes per item."""

import asyncio

import msgspec
import pytest

from kvhandoff.pipelines.errors import ConflictError, KVHandoffError, PeerUnreachable
from kvhandoff.pipelines.messages import AbortMsg
from kvhandoff.service.peers.coalesce import Coalescer


class Note(msgspec.Struct, frozen=True):
    n: int


class Peer:
    """Records every batch; each batch waits for `release` so tests control what is in flight."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.fail_with: KVHandoffError | None = None

    async def send(self, peer: str, notices: list[msgspec.Raw]) -> list[KVHandoffError | None]:
        items = [msgspec.json.decode(bytes(raw), type=Note).n for raw in notices]
        self.batches.append(items)
        await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [ConflictError(f"odd {n}") if n % 2 else None for n in items]


async def until(condition) -> None:  # type: ignore[no-untyped-def]
    """Let other tasks run until `condition()` holds (a few loop turns, never wall time)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_idle_lane_sends_at_once_and_busy_lane_batches() -> None:
    peer = Peer()
    co = Coalescer(peer.send)
    first = asyncio.create_task(co.submit("p", Note(0)))
    await until(lambda: peer.batches == [[0]])  # sent without waiting for company
    rest = [asyncio.create_task(co.submit("p", Note(n))) for n in (2, 4, 6)]
    await asyncio.sleep(0)
    peer.release.set()
    await asyncio.gather(first, *rest)
    assert peer.batches == [[0], [2, 4, 6]]


async def test_each_notice_gets_its_own_outcome() -> None:
    peer = Peer()
    peer.release.set()
    co = Coalescer(peer.send)
    results = await asyncio.gather(
        *(co.submit("p", Note(n)) for n in range(4)), return_exceptions=True
    )
    assert [type(r).__name__ for r in results] == [
        "NoneType",
        "ConflictError",
        "NoneType",
        "ConflictError",
    ]


async def test_a_failed_request_fails_every_notice_in_it_and_lanes_are_per_peer() -> None:
    peer = Peer()
    peer.fail_with = PeerUnreachable("down", peer="p")
    co = Coalescer(peer.send)
    other = Peer()
    other.release.set()
    co_other = Coalescer(other.send)
    tasks = [asyncio.create_task(co.submit("p", Note(n))) for n in (0, 2)]
    await co_other.submit("q", Note(8))
    peer.release.set()
    for task in tasks:
        with pytest.raises(PeerUnreachable):
            await task
    assert other.batches == [[8]]


async def test_batches_are_capped_in_bytes() -> None:
    peer = Peer()
    co = Coalescer(peer.send, max_batch_bytes=20)
    first = asyncio.create_task(co.submit("p", Note(0)))
    await until(lambda: peer.batches)
    rest = [asyncio.create_task(co.submit("p", Note(n))) for n in (2, 4, 6, 8)]
    await asyncio.sleep(0)
    peer.release.set()
    await asyncio.gather(first, *rest)
    assert peer.batches == [[0], [2, 4], [6, 8]]  # 7 bytes + a comma each: two fit in 20


async def test_a_cancelled_submitter_is_skipped_and_close_cancels_the_waiting() -> None:
    peer = Peer()
    co = Coalescer(peer.send)
    first = asyncio.create_task(co.submit("p", Note(0)))
    await until(lambda: peer.batches)
    gone = asyncio.create_task(co.submit("p", Note(2)))
    kept = asyncio.create_task(co.submit("p", Note(4)))
    await asyncio.sleep(0)
    gone.cancel()
    peer.release.set()
    await asyncio.gather(first, kept)
    assert peer.batches == [[0], [4]]
    peer.release.clear()
    stuck = asyncio.create_task(co.submit("p", Note(6)))
    await until(lambda: len(peer.batches) == 3)
    await co.close()
    with pytest.raises(asyncio.CancelledError):
        await stuck


async def test_a_lane_is_reclaimed_once_its_peer_is_idle() -> None:
    sent: list[str] = []

    async def send(peer: str, notices: list[msgspec.Raw]) -> list[KVHandoffError | None]:
        sent.append(peer)
        return [None] * len(notices)

    c = Coalescer(send)
    for i in range(50):
        await c.submit(
            f"http://peer-{i}", AbortMsg(handoff_id="h", reason="r", decode_incarnation="d")
        )
    assert len(sent) == 50
    assert c._lanes == {}  # 50 peers served, none kept
