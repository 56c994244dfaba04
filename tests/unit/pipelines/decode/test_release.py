"""The release path's bounds under the two clocks it crosses (`pipelines/release.py`): a
destination's transit to its prefill, and a restart's fence against a wall-clock step.

Decode and prefill pipelines linked in-process, as in test_safety; each test asserts an inequality
between instants, never a duration, so it holds however slow the machine is.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import (
    ArchivedHandoff,
    FencedPages,
    FencedUse,
    HandoffRequest,
    HandoffView,
)
from kvhandoff.pipelines.events import Event, EventBus, HandoffReleased
from kvhandoff.pipelines.messages import AbortAck, AbortMsg, DestinationMsg
from kvhandoff.pipelines.prefill.scopes import Finished
from kvhandoff.pipelines.states import HandoffState
from tests.unit.pipelines.test_handoff_pipelines import World, world  # noqa: F401
from tests.unit.pipelines.test_safety import cut_off, link_of


async def test_the_fence_covers_the_time_a_destination_took_to_reach_its_prefill(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """The prefill measures its deadline from the remaining duration on *receipt*, so a
    destination that spent time queued or in transit gives the prefill a later deadline than the
    decode's by that time. A silent prefill may write until its own deadline plus its engine
    bound; the decode must not release before then. It knows when the delivery returned (the
    prefill had received it by then), so it bounds the prefill's deadline by that."""
    w = world
    cut_off(w)  # neither an abort answer nor a failure report: only the bound frees the pages
    w.prefill.max_call_s = 0.2
    link = link_of(w)
    real = link.deliver
    received = asyncio.Event()

    async def queued(url: str, msg: DestinationMsg) -> None:
        await asyncio.sleep(0.3)  # behind other destinations to the same peer
        await real(url, msg)
        received.set()

    link.deliver = queued  # type: ignore[method-assign]
    released_at: list[float] = []

    def on_event(event: Event) -> None:
        if isinstance(event, HandoffReleased) and event.handoff_id == "q":
            released_at.append(time.monotonic())

    w.bus.add_listener(on_event)
    req = HandoffRequest(id="q", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=0.3)
    await w.decode.create(req)
    await received.wait()
    prefill_deadline = w.prefill._handoffs.with_id("q")[0].deadline_mono
    assert prefill_deadline is not None
    view = await w.decode.wait("q", 10.0, released=True)
    assert view.state == HandoffState.FAILED and view.released
    # The prefill could start a batch until its own deadline, landing up to max_call_s later.
    assert released_at and released_at[0] >= prefill_deadline + w.prefill.max_call_s


async def test_an_abort_that_overtook_its_destination_is_sent_again_once_it_landed(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """An abort goes out at once, so it can reach the prefill before the destination does; the
    prefill then refuses the late destination because it remembers the aborted id. If it has
    forgotten it meanwhile (it remembers the last 65,536 finished handoffs), the destination
    opens a live handoff there, and the earlier ack says nothing about it. The decode must not
    trust an ack that came while a destination to that peer was still in flight: it asks again
    once the delivery ended, and releases only then."""
    w = world
    link = link_of(w)
    real = link.deliver
    go = asyncio.Event()

    async def overtaken(url: str, msg: DestinationMsg) -> None:
        await go.wait()  # the abort goes past it
        await real(url, msg)

    link.deliver = overtaken  # type: ignore[method-assign]
    req = HandoffRequest(id="o", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=30.0)
    await w.decode.create(req)
    abort = asyncio.ensure_future(w.decode.abort("o"))
    async with asyncio.timeout(30.0):
        while w.prefill._finished.outcome(None, "o") is None:  # the prefill acknowledged it
            await asyncio.sleep(0.01)
    w.prefill._finished = Finished()  # as after 65,536 other handoffs finished there
    go.set()
    view = await asyncio.wait_for(abort, 30.0)
    assert view.state == HandoffState.ABORTED and view.released
    # Nothing of "o" is live on the prefill: no write of it can land in the released pages.
    assert not w.prefill._handoffs.holds("o")
    assert w.prefill._finished.outcome(None, "o") == "aborted"


async def test_an_overtaken_ack_is_doubted_even_when_the_delivery_ended_first(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """As above, but the delivery ends before the first stop round returns, so `h.delivery` is
    already cleared when the quiesce looks at it: the ack must still be doubted and the peer
    asked again. The test above holds the delivery past the first round (it waits for the ack
    before letting the destination go), so it cannot catch a re-ask that runs only while a
    delivery task is still there."""
    w = world
    link = link_of(w)
    real_deliver, real_abort = link.deliver, link.abort
    go = asyncio.Event()
    delivered = asyncio.Event()

    async def overtaken(url: str, msg: DestinationMsg) -> None:
        await go.wait()
        await real_deliver(url, msg)
        delivered.set()

    async def slow_ack(url: str, msg: AbortMsg) -> AbortAck:
        ack = await real_abort(url, msg)  # the prefill acknowledged: nothing live there yet
        if go.is_set():
            return ack  # the second round's answer, after the destination landed
        w.prefill._finished = Finished()  # it forgets the aborted id
        go.set()  # the destination now reaches it and opens a live handoff
        await delivered.wait()
        for _ in range(5):
            await asyncio.sleep(0)  # the delivery task ends (and clears `h.delivery`)
        return ack

    link.deliver = overtaken  # type: ignore[method-assign]
    link.abort = slow_ack  # type: ignore[method-assign]
    req = HandoffRequest(id="o", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=30.0)
    await w.decode.create(req)
    view = await asyncio.wait_for(w.decode.abort("o"), 30.0)
    assert view.state == HandoffState.ABORTED and view.released
    assert not w.prefill._handoffs.holds("o"), "released while the prefill holds a live 'o'"
    assert w.prefill._finished.outcome(None, "o") == "aborted"


class _Archive:
    def __init__(self, *found: ArchivedHandoff) -> None:
        self._found = {a.request.id: a for a in found}

    def find(self, handoff_id: str) -> ArchivedHandoff | None:
        return self._found.get(handoff_id)


def _recorded(handoff_id: str, finished_at: float) -> ArchivedHandoff:
    """A handoff an earlier life recorded as failed, before its pages were released."""
    req = HandoffRequest(id=handoff_id, prefill=["p"], dst_pages=[3], dst_slot=0)
    view = HandoffView(
        id=handoff_id,
        state=HandoffState.FAILED,
        created_at=finished_at - 1.0,
        deadline_at=finished_at + 1.0,
        num_pages=1,
        dst_slot=0,
        prefill=["p"],
        verify=False,
        bytes=0,
        stages=[],
        released=False,
        finished_at=finished_at,
    )
    return ArchivedHandoff(req, view)


async def test_a_wall_clock_step_does_not_show_a_restored_fence_released_early(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """A restart fences an earlier life's pages until a unix instant (only unix time survives a
    restart); from then on the fence is a timer on this life's loop. The view an engine reads
    (`released`) must follow that timer, not the wall clock: stepped forward an hour, the pages
    are still leased, so the view must not call them free."""
    w = world
    wall = [1_000_000.0]
    bus = EventBus()
    decode = DecodePipeline(
        w.dec.layout, "t", "d2", link_of(w), bus, memory=None, clock=lambda: wall[0]
    )
    released = asyncio.Event()
    bus.add_listener(lambda e: released.set() if isinstance(e, HandoffReleased) else None)
    decode.adopt(
        _Archive(_recorded("old", wall[0] - 5.0)),
        [FencedPages("old", [3], 0, release_at=wall[0] + 0.2)],
    )
    wall[0] += 3600.0
    assert decode.leases.holds("old")
    assert decode.query.pages().fenced_handoffs == [FencedUse("old", 1, restored=True)]
    assert not decode.get("old").released and not (await decode.wait("old", 0)).released
    await released.wait()  # the fence's own timer, on the loop's monotonic clock
    assert not decode.leases.holds("old") and decode.get("old").released
    await decode.close()


async def test_a_landed_handoff_of_an_earlier_life_is_released_at_once_confirmed(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """A landed handoff's pages changed only by its own process's commits (S1), and those died
    with the process; its prefills' late writes aim at its life's arena, which shares no byte
    with this life's stage memory: a restart has nothing to fence. Its pages are free for this
    life's first create (an embedded engine's allocator, born with this process, hands them
    out at once), and its `handoff.released` says so, confirmed. A direct one stays fenced, and
    so does a landed one whose old arena overlaps this life's memory (a late write could land
    in an entry)."""
    w = world
    wall = [1_000_000.0]
    bus = EventBus()
    decode = DecodePipeline(
        w.dec.layout, "t", "d2", link_of(w), bus, memory=None, clock=lambda: wall[0]
    )
    released: list[HandoffReleased] = []
    bus.add_listener(lambda e: released.append(e) if isinstance(e, HandoffReleased) else None)
    recorded = {h: _recorded(h, wall[0] - 5.0) for h in ("landed", "direct", "overlaps")}
    for page, hid in ((4, "direct"), (5, "overlaps")):
        req = msgspec.structs.replace(recorded[hid].request, dst_pages=[page])
        recorded[hid] = ArchivedHandoff(req, recorded[hid].view)
    entry = w.dec.layout.kv[1]  # an old arena that ends inside this life's second KV entry
    bound = wall[0] + 60.0
    decode.adopt(
        _Archive(*recorded.values()),
        [
            FencedPages("landed", [3], 0, release_at=bound, arena=(4096, 4096)),
            FencedPages("direct", [4], 1, release_at=bound),
            FencedPages("overlaps", [5], 2, release_at=bound, arena=(entry.base - 64, 128)),
        ],
    )
    assert [(e.handoff_id, e.confirmed) for e in released] == [("landed", True)]
    assert not decode.leases.holds("landed") and decode.get("landed").released
    assert decode.get("landed").released_at == wall[0]
    for hid in ("direct", "overlaps"):
        assert decode.leases.holds(hid) and not decode.get(hid).released
    assert decode.query.pages().fenced_handoffs == [
        FencedUse("direct", 1, restored=True),
        FencedUse("overlaps", 1, restored=True),
    ]
    await decode.close()
