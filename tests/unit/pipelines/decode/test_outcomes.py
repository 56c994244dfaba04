"""What a decode handoff's outcome events report (`pipelines/outcomes.py`): durations measured on
the monotonic clock, like every bound, so a step of the wall clock cannot corrupt them."""

from __future__ import annotations

import time

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.events import Event, EventBus, HandoffCompleted, HandoffReleased
from kvhandoff.pipelines.states import HandoffState
from tests.unit.pipelines.test_handoff_pipelines import World, world  # noqa: F401
from tests.unit.pipelines.test_safety import link_of


async def test_a_wall_clock_step_does_not_corrupt_the_durations_events_report(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """`handoff.completed.seconds` feeds the latency histogram and `seconds_after_outcome` the
    release's: an NTP step back of an hour mid-transfer made the first about -3600 s."""
    w = world
    wall = [time.time()]
    bus = EventBus()
    seen: list[Event] = []
    bus.add_listener(seen.append)
    link = link_of(w)
    decode = DecodePipeline(
        w.dec.layout, w.decode.target, "d", link, bus, memory=None, clock=lambda: wall[0]
    )
    link.decode = decode  # the prefill's notices now reach this pipeline
    started = time.monotonic()
    await decode.create(HandoffRequest(id="m", prefill=["p"], dst_pages=[5], dst_slot=0))
    wall[0] -= 3600.0
    for rank in (0, 1):
        w.prefill.ready("m", rank, [1], 1)
    view = await decode.wait("m", 10.0, released=True)
    took_s = time.monotonic() - started
    link.decode = w.decode
    assert view.state == HandoffState.COMPLETED and view.released, view.error
    (completed,) = [e for e in seen if isinstance(e, HandoffCompleted)]
    (released,) = [e for e in seen if isinstance(e, HandoffReleased)]
    assert 0.0 <= completed.seconds <= took_s
    assert 0.0 <= released.seconds_after_outcome <= took_s
    await decode.close()


async def test_an_ended_handoff_keeps_neither_its_timer_nor_its_delivery_task(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """A held handoff outlives its outcome by `history` handoffs: its cancelled deadline timer
    and its finished delivery task (each with its context) are not kept with it, so the
    collector does not walk them for its whole stay."""
    w = world
    link = link_of(w)
    decode = DecodePipeline(w.dec.layout, w.decode.target, "d", link, EventBus(), memory=None)
    link.decode = decode
    await decode.create(HandoffRequest(id="t", prefill=["p"], dst_pages=[5], dst_slot=0))
    h = decode._handoffs["t"]  # the live record, not its read-only view
    assert h is not None and h.timer is not None and h.delivery is not None
    for rank in (0, 1):
        w.prefill.ready("t", rank, [1], 1)
    view = await decode.wait("t", 10.0, released=True)
    link.decode = w.decode
    assert view.state == HandoffState.COMPLETED and view.released, view.error
    assert h.timer is None and h.delivery is None
    await decode.close()


async def test_the_heartbeats_scan_only_unreleased_handoffs_of_those_held(
    world: World,  # noqa: F811 - the shared fixture
) -> None:
    """Released handoffs stay held (`history`) but leave what the heartbeats scan: the peers
    to ping and a peer's live handoffs list exactly the unreleased ones, in creation order."""
    w = world
    link = link_of(w)
    decode = DecodePipeline(w.dec.layout, w.decode.target, "d", link, EventBus(), memory=None)
    link.decode = decode
    for slot, hid in enumerate("xyz"):
        await decode.create(
            HandoffRequest(id=hid, prefill=["p"], dst_pages=[5 + slot], dst_slot=slot)
        )
    for rank in (0, 1):
        w.prefill.ready("y", rank, [1], 1)
    view = await decode.wait("y", 10.0, released=True)
    assert view.released and decode.query.find("y") is not None  # still held
    assert list(decode._releases.unreleased) == ["x", "z"]
    assert decode.live_with("p") == ["x", "z"] and list(decode.live_by_prefill()) == ["p"]
    await decode.abort("x", "test")
    await decode.abort("z", "test")
    for hid in ("x", "z"):
        await decode.wait(hid, 10.0, released=True)
    link.decode = w.decode
    assert decode.live_with("p") == [] and decode.live_by_prefill() == {}
    assert not decode._releases.unreleased
    await decode.close()
