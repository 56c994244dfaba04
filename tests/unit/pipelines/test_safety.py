"""Each core-safety finding (issue 9) and pipeline-level trust check (issue 10) as a test: decode
and prefill pipelines linked in-process over the local transport, real memory."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import ConflictError, InvalidInput, PeerUnreachable
from kvhandoff.pipelines.events import EventBus, event_tag
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    StageFailedMsg,
    layout_json,
)
from kvhandoff.pipelines.states import HandoffState, StageState
from tests.unit.pipelines.test_handoff_pipelines import World, wait_terminal, world  # noqa: F401


@pytest.fixture
def w(world: World) -> World:  # noqa: F811 - the shared fixture, under a short name
    return world


def link_of(w: World) -> InProcessLink:
    link = w.decode._prefill
    assert isinstance(link, InProcessLink)
    return link


async def arrived_notices(w: World, hid: str) -> list[ArrivalMsg]:
    """Run handoff `hid` (pages 1,2 -> 5,6) to completion, recording the arrival notices."""
    link = link_of(w)
    seen: list[ArrivalMsg] = []
    real = link.arrived

    async def record(url: str, msg: ArrivalMsg) -> None:
        seen.append(msg)
        await real(url, msg)

    link.arrived = record  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id=hid, prefill=["p"], dst_pages=[5, 6], dst_slot=1))
    for rank in (0, 1):
        w.prefill.ready(hid, rank, [1, 2], 0)
    assert await wait_terminal(w, hid) == HandoffState.COMPLETED
    link.arrived = real  # type: ignore[method-assign]
    return seen


async def delivered(w: World, hid: str) -> None:
    """Let the in-process delivery of `hid`'s destination finish."""
    for _ in range(100):
        if all(s.delivered for s in w.decode._handoffs[hid].stages.values()):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{hid} was not delivered")


# ----------------------------------------------------------------------- issue 10: peer trust


async def test_an_arrival_from_anyone_but_the_stage_s_own_peer_life_is_refused(w: World) -> None:
    await w.decode.create(HandoffRequest(id="f", prefill=["p"], dst_pages=[3], dst_slot=0))
    genuine = ArrivalMsg(
        handoff_id="f",
        sender_url="p",
        sender_incarnation=w.prefill.incarnation,
        decode_incarnation=w.decode.incarnation,
        pp_rank=0,
        bytes=0,
        blocks=0,
    )
    forgeries = {
        "sender_url": msgspec.structs.replace(genuine, sender_url="http://attacker"),
        "sender_incarnation": msgspec.structs.replace(genuine, sender_incarnation="old-life"),
        "decode_incarnation": msgspec.structs.replace(genuine, decode_incarnation="old-life"),
    }
    for field, forged in forgeries.items():
        with pytest.raises(ConflictError) as caught:
            w.decode.arrived(forged)
        assert caught.value.context["field"] == field
    # The right sender, but 0 bytes for a stage that has pages: never completes it.
    with pytest.raises(InvalidInput) as caught:
        w.decode.arrived(genuine)
    assert caught.value.context["field"] == "bytes" and caught.value.context["pp_rank"] == 0
    forged_failure = StageFailedMsg(
        handoff_id="f",
        sender_url="http://attacker",
        sender_incarnation=w.prefill.incarnation,
        decode_incarnation=w.decode.incarnation,
        pp_rank=1,
        code="x",
        reason="forged",
    )
    with pytest.raises(ConflictError):
        w.decode.stage_failed(forged_failure)
    view = w.decode.get("f")
    assert view.state == HandoffState.PENDING or view.state == HandoffState.TRANSFERRING
    assert [s.state for s in view.stages] == [StageState.WAITING, StageState.WAITING]
    assert w.decode.leases.holds("f")


async def test_a_replayed_arrival_is_refused_and_never_double_counted(w: World) -> None:
    notices = await arrived_notices(w, "r")
    assert len(notices) == 2
    before = w.decode.get("r")
    for msg in notices:
        with pytest.raises(ConflictError) as caught:
            w.decode.arrived(msg)
        assert "replay" in caught.value.message
    after = w.decode.get("r")
    assert after.bytes == before.bytes and after.timeline == before.timeline


async def test_a_destination_for_another_prefill_life_is_refused(w: World) -> None:
    dest = DestinationMsg(
        handoff_id="x",
        decode_url="d",
        decode_incarnation=w.decode.incarnation,
        prefill_incarnation="an-earlier-life",
        decode_target="t",
        decode_layout=layout_json(w.decode.peer_layout),
        pp_ranks=[0],
        dst_pages=[1],
        deadline_in_s=5.0,
    )
    with pytest.raises(ConflictError) as caught:
        w.prefill.deliver(dest)
    assert caught.value.context["field"] == "prefill_incarnation"
    assert not w.prefill._handoffs.holds("x")


# ----------------------------------------------------------------------- issue 9: findings


async def test_finding_2_failed_is_announced_at_once_and_released_only_when_writers_stopped(
    w: World,
) -> None:
    link = link_of(w)
    gate = asyncio.Event()
    real_abort = link.abort

    async def slow_abort(url: str, msg: AbortMsg) -> AbortAck:
        await gate.wait()  # the prefill is still draining a batch
        return await real_abort(url, msg)

    link.abort = slow_abort  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="a", prefill=["p"], dst_pages=[7], dst_slot=0))
    w.decode.peer_lost("p", "refused")
    view = w.decode.get("a")
    assert view.state == HandoffState.FAILED and not view.released
    assert view.stages[0].state == StageState.FAILED  # a failed stage shows failed
    assert w.decode.leases.holds("a")
    assert "handoff.released" not in [event_tag(e) for e in view.timeline]
    gate.set()
    view = await w.decode.wait("a", 30, released=True)
    tags = [event_tag(e) for e in view.timeline]
    assert tags[-2:] == ["handoff.failed", "handoff.released"] and view.released
    assert view.released_at is not None and not w.decode.leases.holds("a")


async def test_delete_of_a_failed_unreleased_handoff_hurries_its_release(w: World) -> None:
    link = link_of(w)
    real_abort = link.abort
    reachable = False

    async def flaky_abort(url: str, msg: AbortMsg) -> AbortAck:
        if not reachable:
            raise PeerUnreachable("connection refused", peer=url)
        return await real_abort(url, msg)

    link.abort = flaky_abort  # type: ignore[method-assign]
    req = HandoffRequest(id="h", prefill=["p"], dst_pages=[8], dst_slot=0, deadline_s=60)
    await w.decode.create(req)
    await asyncio.sleep(0)
    w.decode._outcomes.fail(w.decode._handoffs["h"], "x", "injected", 0, {})
    for _ in range(5):
        await asyncio.sleep(0.06)  # the quiesce backs off between refused aborts
    assert not w.decode.get("h").released
    reachable = True
    view = await asyncio.wait_for(w.decode.abort("h"), 30)  # not the 60 s bound, and not a 409
    assert view.state == HandoffState.FAILED and view.released


def cut_off(w: World) -> None:
    """The prefill can neither answer an abort nor report its own failure: only the bound can
    free its handoffs' pages."""
    link = link_of(w)

    async def unreachable(url: str, msg: AbortMsg) -> AbortAck:
        raise PeerUnreachable("connection refused", peer=url)

    async def unheard(url: str, msg: StageFailedMsg) -> None:
        raise PeerUnreachable("connection refused", peer=url)

    link.abort = unreachable  # type: ignore[method-assign]
    link.stage_failed = unheard  # type: ignore[method-assign]


async def test_finding_6_close_never_releases_pages_a_writer_may_still_touch(w: World) -> None:
    cut_off(w)
    w.prefill.max_call_s = 0.2
    req = HandoffRequest(id="c", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=0.3)
    await w.decode.create(req)
    await w.decode.close()
    view = w.decode.get("c")
    assert view.state == HandoffState.ABORTED and view.released
    assert not w.decode.leases.holds("c")
    # Released (and only then did close() return) no sooner than the deadline plus the declared
    # engine-call bound, both on the decode's clock.
    assert view.released_at is not None and view.released_at >= view.deadline_at + 0.2
    released = [e for e in view.timeline if event_tag(e) == "handoff.released"]
    assert released[0].confirmed is False  # type: ignore[union-attr]


async def test_a_wall_clock_step_does_not_shorten_the_fence(w: World) -> None:
    """The bound is measured on the monotonic clock: an NTP step of the decode host's wall
    clock (an hour forward, right after create) frees the pages no sooner than deadline plus
    the declared engine bound. Measured on the wall clock, they were freed 0.2 s after create,
    before the deadline itself."""
    cut_off(w)
    w.prefill.max_call_s = 0.2
    wall = [time.time()]
    decode = DecodePipeline(
        w.dec.layout, "t", "d2", link_of(w), EventBus(), memory=None, clock=lambda: wall[0]
    )
    started = time.monotonic()
    await decode.create(
        HandoffRequest(id="j", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=0.3)
    )
    wall[0] += 3600.0
    view = await decode.abort("j")  # answers once released
    assert view.released and decode.get("j").timeline[-1].confirmed is False  # type: ignore[union-attr]
    assert time.monotonic() - started >= 0.3 + 0.2 - 0.01


async def test_a_bounded_close_leaves_unconfirmed_pages_leased_never_released(w: World) -> None:
    """A stopping service does not wait out the bound when its peers are gone: after
    `timeout_s` it returns with the handoff still leased and unreleased (the service then
    closes the transport that receives writes), and publishes no release it cannot prove."""
    cut_off(w)
    w.prefill.max_call_s = 30.0
    req = HandoffRequest(id="s", prefill=["p"], dst_pages=[9], dst_slot=0, deadline_s=30.0)
    await w.decode.create(req)
    async with asyncio.timeout(30.0):  # not the 60 s of deadline plus bound (nor near it)
        await w.decode.close(timeout_s=0.05)
    view = w.decode.get("s")
    assert view.state == HandoffState.ABORTED and not view.released
    assert w.decode.leases.holds("s")
    assert not [e for e in view.timeline if event_tag(e) == "handoff.released"]


async def test_finding_7_missing_digests_fail_the_handoff_naming_the_stage(w: World) -> None:
    link = link_of(w)
    real = link.arrived

    async def without_digests(url: str, msg: ArrivalMsg) -> None:
        if msg.pp_rank == 1:
            msg = msgspec.structs.replace(msg, digests=None)
        await real(url, msg)

    link.arrived = without_digests  # type: ignore[method-assign]
    req = HandoffRequest(id="v", prefill=["p"], dst_pages=[5], dst_slot=0, verify=True)
    await w.decode.create(req)
    for rank in (0, 1):
        w.prefill.ready("v", rank, [1], 1)
    assert await wait_terminal(w, "v") == HandoffState.FAILED
    view = w.decode.get("v")
    assert view.error is not None and view.error.code == "verification_failed"
    assert view.error.pp_rank == 1 and "stage 1 sent no digests" in view.error.reason


async def test_finding_7_verification_that_cannot_run_says_so_in_the_view(w: World) -> None:
    bus = EventBus()
    blind = DecodePipeline(w.dec.layout, "t", "d2", link_of(w), bus, memory=None)
    view, _ = await blind.create(
        HandoffRequest(id="s", prefill=["p"], dst_pages=[5], dst_slot=0, verify=True)
    )
    assert view.verify and view.verification == "skipped: the decode pool is not host-readable"
    await blind.abort("s")


async def test_finding_9_a_crash_in_one_stage_is_blamed_on_that_stage(w: World) -> None:
    real_get = w.prefill.cache.get

    def crash_on_stage_1(src, dst):  # type: ignore[no-untyped-def]
        if src.pp_rank == 1:
            raise TypeError("a bug in stage 1")
        return real_get(src, dst)

    w.prefill.cache.get = crash_on_stage_1  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[4], dst_slot=0))
    for rank in (0, 1):
        w.prefill.ready("b", rank, [1], 1)
    assert await wait_terminal(w, "b") == HandoffState.FAILED
    error = w.decode.get("b").error
    assert error is not None and error.pp_rank == 1 and "stage 1 crashed" in error.reason
    assert error.code == "internal_error"


async def test_finding_5_an_undeliverable_destination_names_the_stages_of_that_peer(
    w: World,
) -> None:
    link = link_of(w)

    async def refused(url: str, msg: DestinationMsg) -> None:
        raise PeerUnreachable("connection refused", peer=url)

    link.deliver = refused  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="u", prefill=["p"], dst_pages=[4], dst_slot=0))
    assert await wait_terminal(w, "u") == HandoffState.FAILED
    view = w.decode.get("u")
    assert view.error is not None and view.error.pp_rank == 0
    assert "stages 0, 1" in view.error.reason and view.error.context["peer"] == "p"
    assert [s.state for s in view.stages] == [StageState.FAILED, StageState.FAILED]


async def test_finding_4_a_handoff_the_prefill_no_longer_has_fails_at_once(w: World) -> None:
    await w.decode.create(HandoffRequest(id="g", prefill=["p"], dst_pages=[4], dst_slot=0))
    await delivered(w, "g")
    live = w.decode.live_by_prefill()
    assert live == {"p": ["g"]}
    ack = HeartbeatAck(role="prefill", url="p", incarnation=w.prefill.incarnation, live=[])
    assert w.decode.reconcile("p", ack, live["p"]) == ["g"]
    view = w.decode.get("g")
    assert view.state == HandoffState.FAILED and view.error is not None
    assert "no longer has" in view.error.reason


async def test_finding_4_a_restarted_prefill_fails_the_handoffs_of_its_earlier_life(
    w: World,
) -> None:
    await w.decode.create(HandoffRequest(id="i", prefill=["p"], dst_pages=[4], dst_slot=0))
    ack = HeartbeatAck(role="prefill", url="p", incarnation="a-new-life", live=[])
    assert w.decode.reconcile("p", ack, []) == ["i"]
    view = w.decode.get("i")
    assert view.state == HandoffState.FAILED and view.error is not None
    assert "restarted" in view.error.reason and view.error.pp_rank == 0


async def test_finding_4_the_prefill_stops_a_handoff_its_decode_no_longer_has(w: World) -> None:
    await w.decode.create(HandoffRequest(id="k", prefill=["p"], dst_pages=[4], dst_slot=0))
    await delivered(w, "k")
    assert w.prefill.live_by_decode() == {"d": ["k"]}
    gone = HeartbeatAck(role="decode", url="d", incarnation=w.decode.incarnation, live=[])
    assert await w.prefill.reconcile("d", gone, ["k"]) == ["k"]
    assert not w.prefill._handoffs.holds("k")
    # A decode that restarted (another incarnation) loses every handoff bound to its old life.
    await w.decode.create(HandoffRequest(id="m", prefill=["p"], dst_pages=[5], dst_slot=1))
    await delivered(w, "m")
    restarted = HeartbeatAck(role="decode", url="d", incarnation="new", live=["m"])
    assert await w.prefill.reconcile("d", restarted, ["m"]) == ["m"]


async def test_finding_3_a_prefill_declaring_longer_engine_calls_than_the_ceiling_is_refused(
    w: World,
) -> None:
    w.prefill.max_call_s = 120.0  # above the decode's max_grace_s (60 s)
    with pytest.raises(InvalidInput) as caught:
        await w.decode.create(HandoffRequest(id="n", prefill=["p"], dst_pages=[4], dst_slot=0))
    assert caught.value.context["field"] == "prefill[0]"
    assert "n" not in w.decode._handoffs and not w.decode.leases.holds("n")


async def test_finding_3_the_deadline_travels_as_a_remaining_duration(w: World) -> None:
    link = link_of(w)
    seen: list[DestinationMsg] = []
    real = link.deliver

    async def record(url: str, msg: DestinationMsg) -> None:
        seen.append(msg)
        await real(url, msg)

    link.deliver = record  # type: ignore[method-assign]
    before = time.monotonic()
    await w.decode.create(
        HandoffRequest(id="t", prefill=["p"], dst_pages=[4], dst_slot=0, deadline_s=7.0)
    )
    await delivered(w, "t")
    after = time.monotonic()
    # Less only by the time between create and sending, however long a loaded machine took.
    assert len(seen) == 1 and 7.0 - (after - before) <= seen[0].deadline_in_s <= 7.0
    assert not hasattr(seen[0], "deadline_at")  # no wall-clock instant crosses hosts
    h = w.prefill._handoffs.with_id("t")[0]
    assert h.deadline_mono is not None
    # Measured on receipt on the prefill's own monotonic clock: never later than the decode's.
    assert before + 6.0 < h.deadline_mono <= time.monotonic() + 7.0


async def test_a_repeated_ready_with_another_src_slot_is_a_conflict(w: World) -> None:
    w.prefill.ready("q", 0, [1, 2], 1, layers=[])
    with pytest.raises(ConflictError) as caught:
        w.prefill.ready("q", 0, [1, 2], 2)
    assert caught.value.context["field"] == "src_slot"
    w.prefill.ready("q", 0, None, None)  # leaving them out is fine
    w.prefill.ready("q", 0, [1, 2], 1)  # and so is repeating them
