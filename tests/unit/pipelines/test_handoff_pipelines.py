"""Decode and prefill pipelines linked in-process over the local transport, real memory."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.leases import Leases
from kvhandoff.pipelines.decode.views import FencedUse, HandoffRequest
from kvhandoff.pipelines.errors import (
    CapacityExceeded,
    ConflictError,
    NotFoundError,
    PairingError,
    PeerUnreachable,
    PlanError,
)
from kvhandoff.pipelines.events import EventBus, StageTransferred, event_tag
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.memory import PoolMemory
from kvhandoff.pipelines.messages import (
    AbortAck,
    AbortMsg,
    DestinationMsg,
    HeartbeatAck,
    StageFailedMsg,
)
from kvhandoff.pipelines.models import (
    ModelSpec,
    StateKind,
    decode_layout,
    hybrid_npu_mla,
    partition_layers,
    stage_layout,
)
from kvhandoff.pipelines.prefill import HostedStage, PrefillPipeline
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.pools import open_pool

MODEL = hybrid_npu_mla(num_layers=8, scale=64, page_size=4)
PART = partition_layers(8, 2)


Mem = PoolMemory


@dataclass
class World:
    decode: DecodePipeline
    prefill: PrefillPipeline
    dec: Mem
    stages: dict[int, Mem]
    bus: EventBus


@contextlib.asynccontextmanager
async def make_world(model: ModelSpec = MODEL) -> AsyncIterator[World]:
    t = LocalTransport()
    dec_pool = open_pool("torch:cpu", decode_layout(model, num_pages=32, num_slots=4).region_sizes)
    dec_pool.register(t)
    dec = Mem(decode_layout(model, num_pages=32, num_slots=4), dec_pool)
    stages = {}
    for r in range(2):
        lay = stage_layout(model, PART, r, num_pages=32, num_slots=4)
        pool = open_pool("torch:cpu", lay.region_sizes)
        pool.register(t)
        stages[r] = Mem(lay, pool)
    for m in stages.values():
        for i in range(len(m.layout.region_sizes)):
            m.region(i)[:] = np.random.default_rng(i).integers(1, 255, m.region(i).shape[0])
    bus = EventBus()
    link = InProcessLink()
    decode = DecodePipeline(dec.layout, t.local_target, "d", link, bus, memory=dec)
    prefill = PrefillPipeline(
        {r: HostedStage(m.layout, m) for r, m in stages.items()}, t, link, bus
    )
    link.decode = decode
    link.add_prefill("p", prefill, t.local_target)
    yield World(decode, prefill, dec, stages, bus)
    await prefill.close()
    await decode.close()
    for m in [dec, *stages.values()]:
        m.pool.close()
    t.close()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with make_world() as w:
        yield w


async def wait_terminal(w: World, hid: str) -> HandoffState:
    sub = w.bus.subscribe()
    try:
        state = w.decode.get(hid).state
        while not state.terminal:
            event = await sub.queue.get()
            if event.handoff_id == hid and event.role == "decode":
                state = w.decode.get(hid).state
        return state
    finally:
        sub.close()


def dec_bytes(w: World) -> bytes:
    return b"".join(
        w.dec.region(i).tobytes() for i in range(len(w.dec.layout.kv) + len(w.dec.layout.state))
    )


async def test_pp2_handoff_lands_every_byte_in_the_right_entry(world: World) -> None:
    w = world
    src, dst = [3, 4, 9], [10, 11, 2]
    await w.decode.create(
        HandoffRequest(id="a", prefill=["p"], dst_pages=dst, dst_slot=1, verify=True)
    )
    w.prefill.ready("a", 1, src, 2, layers=[7])  # layer by layer: KV of layer 7 first
    w.prefill.ready("a", 1, src, 2)
    w.prefill.ready("a", 0, src, 2)
    assert await wait_terminal(w, "a") == HandoffState.COMPLETED
    for m in w.stages.values():
        for i, e in enumerate(m.layout.kv):
            j = next(
                k
                for k, d in enumerate(w.dec.layout.kv)
                if (d.layer_id, d.group) == (e.layer_id, e.group)
            )
            s_rows = m.region(i)[: e.nbytes].reshape(-1, e.item_len)
            d_rows = w.dec.region(j)[: e.nbytes].reshape(-1, e.item_len)
            assert np.array_equal(s_rows[src], d_rows[dst])
        for i, s in enumerate(m.layout.state):
            j = next(
                k
                for k, d in enumerate(w.dec.layout.state)
                if (d.layer_id, d.kind) == (s.layer_id, s.kind)
            )
            a = m.region(len(m.layout.kv) + i)[2 * s.item_len : 3 * s.item_len]
            b = w.dec.region(len(w.dec.layout.kv) + j)[1 * s.item_len : 2 * s.item_len]
            assert np.array_equal(a, b)
    tags = [event_tag(e) for e in w.decode.get("a").timeline]
    assert tags[0] == "handoff.created" and tags[-2:] == ["handoff.completed", "handoff.released"]
    assert not w.decode.leases.holds("a")


async def test_direct_mode_moves_each_component_s_slot_and_the_last_stage_s_aux_rows() -> None:
    # Direct mode plans the stage by layer: the aux rows (no layer) follow its last layers.
    model = msgspec.structs.replace(
        MODEL,
        state_kinds=(StateKind("conv", 48, "mamba"), StateKind("tail", 40, "ring")),
        aux_row_bytes=(16, 24),
    )
    async with make_world(model) as w:
        request = HandoffRequest(
            id="c",
            prefill=["p"],
            dst_pages=[1, 2],
            dst_slot=3,
            dst_slots={"ring": 0},
            dst_aux=1,
            verify=True,
        )
        await w.decode.create(request)
        w.prefill.ready("c", 1, [5, 6], RequestSlots(2, aux=3), layers=[7])
        w.prefill.ready("c", 1, [5, 6], RequestSlots(2, aux=3))
        w.prefill.ready("c", 0, [5, 6], RequestSlots(by_component={"mamba": 1, "ring": 0}))
        assert await wait_terminal(w, "c") == HandoffState.COMPLETED
        assert w.decode.get("c").verification == "passed"  # every state and aux digest matched
        k, dec = len(w.dec.layout.kv), w.dec.layout
        for rank, (mamba, ring) in ((0, (1, 0)), (1, (2, 2))):
            m = w.stages[rank]
            for i, s in enumerate(m.layout.state):
                j = next(
                    x
                    for x, d in enumerate(dec.state)
                    if (d.layer_id, d.kind) == (s.layer_id, s.kind)
                )
                src_row, dst_row = (mamba, 3) if s.component == "mamba" else (ring, 0)
                a = m.region(len(m.layout.kv) + i)[src_row * s.item_len :][: s.item_len]
                b = w.dec.region(k + j)[dst_row * s.item_len :][: s.item_len]
                assert np.array_equal(a, b), (s.layer_id, s.kind)
        last = w.stages[1]
        for i, a in enumerate(last.layout.aux):
            sent = last.region(len(last.layout.kv) + len(last.layout.state) + i)
            got = w.dec.region(k + len(dec.state) + i)
            assert np.array_equal(
                sent[3 * a.item_len :][: a.item_len], got[a.item_len :][: a.item_len]
            )
            assert not got[: a.item_len].any() and not got[2 * a.item_len :].any()


async def test_each_stage_says_final_on_its_last_transfer_only(world: World) -> None:
    w = world
    sent: list[StageTransferred] = []
    w.bus.add_listener(lambda e: sent.append(e) if isinstance(e, StageTransferred) else None)
    await w.decode.create(HandoffRequest(id="f", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    w.prefill.ready("f", 1, [5, 6], 1, layers=[7])  # two chunks at least: layer 7 first
    w.prefill.ready("f", 1, [5, 6], 1)
    w.prefill.ready("f", 0, [5, 6], 1)
    assert await wait_terminal(w, "f") == HandoffState.COMPLETED
    for rank in (0, 1):
        finals = [e.final for e in sent if e.pp_rank == rank]
        assert finals and finals[-1] and not any(finals[:-1]), (rank, finals)
    assert len([e for e in sent if e.pp_rank == 1]) >= 2


async def test_bad_input_is_rejected_and_nothing_is_written(world: World) -> None:
    w = world
    before = dec_bytes(w)
    with pytest.raises(PlanError) as err:
        await w.decode.create(HandoffRequest(id="x", prefill=["p"], dst_pages=[1, 99], dst_slot=0))
    assert err.value.context["field"] == "dst_pages[1]"
    with pytest.raises(PlanError, match="repeats"):
        await w.decode.create(HandoffRequest(id="x", prefill=["p"], dst_pages=[1, 1], dst_slot=0))
    with pytest.raises(NotFoundError):
        w.decode.get("x")
    assert dec_bytes(w) == before


async def test_fencing_and_idempotency(world: World) -> None:
    w = world
    req = HandoffRequest(id="a", prefill=["p"], dst_pages=[1, 2], dst_slot=0)
    _, created = await w.decode.create(req)
    assert created and not (await w.decode.create(req))[1]
    with pytest.raises(ConflictError, match="different request body"):
        await w.decode.create(msgspec.structs.replace(req, dst_slot=1))
    with pytest.raises(ConflictError, match=r"dst_pages\[0\] = 2 is leased"):
        await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[2], dst_slot=1))
    view = await w.decode.abort("a")
    assert view.state == HandoffState.ABORTED and not w.decode.leases.holds("a")
    await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[2], dst_slot=1))


async def test_slot_size_mismatch_fails_before_any_byte(world: World) -> None:
    w = world
    m = w.stages[0]
    bad_state = (msgspec.structs.replace(m.layout.state[0], item_len=8), *m.layout.state[1:])
    w.prefill.stages[0] = HostedStage(msgspec.structs.replace(m.layout, state=bad_state), m)
    before = dec_bytes(w)
    with pytest.raises(PairingError) as err:
        await w.decode.create(HandoffRequest(id="a", prefill=["p"], dst_pages=[1], dst_slot=0))
    assert err.value.context["kind"] == "conv"
    assert dec_bytes(w) == before


async def test_deadline_fails_the_handoff_and_releases_pages(world: World) -> None:
    w = world
    await w.decode.create(
        HandoffRequest(id="a", prefill=["p"], dst_pages=[1], dst_slot=0, deadline_s=0.2)
    )
    w.prefill.ready("a", 0, [5], 0)  # stage 1 never reports
    assert await wait_terminal(w, "a") == HandoffState.FAILED
    assert w.decode.get("a").error.code == "deadline_exceeded"  # type: ignore[union-attr]


async def test_corrupted_byte_is_caught_by_verification(world: World) -> None:
    w = world
    await w.decode.create(
        HandoffRequest(id="a", prefill=["p"], dst_pages=[6], dst_slot=0, verify=True)
    )
    w.prefill.ready("a", 1, [5], 3)
    w.prefill.ready("a", 0, [5], 3, layers=[3])  # layer 3's KV lands first
    e = w.dec.layout.kv[0]  # layer 3 group 0
    src_row = w.stages[0].region(0)[5 * e.item_len : 6 * e.item_len]
    landed = w.dec.region(0)[6 * e.item_len : 7 * e.item_len]
    # Flip only once the row has landed: flipped before, the landing would overwrite the flip
    # and the handoff complete. A busy machine may take seconds; the handoff's 30 s deadline
    # is the only other bound.
    async with asyncio.timeout(20):
        while not np.array_equal(landed, src_row):
            await asyncio.sleep(0.01)
    landed[0] ^= 0xFF  # flip a byte after it landed, before the stage completes
    w.prefill.ready("a", 0, [5], 3)
    assert await wait_terminal(w, "a") == HandoffState.FAILED
    error = w.decode.get("a").error
    assert error is not None and error.code == "verification_failed"
    assert error.context == {"layer_id": 3, "group": 0}


def test_leases_release_is_idempotent() -> None:
    leases = Leases(8, 2)
    leases.acquire("a", np.array([1, 2]), [("state", 0, "dst_slot")])
    leases.release("a")
    leases.release("a")
    leases.acquire("b", np.array([1, 2]), [("state", 0, "dst_slot")])
    assert leases.leased_pages == 2


def test_slots_are_leased_per_component_and_aux_rows_apart() -> None:
    leases = Leases(8, 4)
    leases.acquire("a", np.array([1]), [("mamba", 0, "dst_slots.mamba"), (None, 2, "dst_aux")])
    # The same index of another component, or as an aux row, is another piece of memory.
    leases.acquire("b", np.array([2]), [("swa", 0, "dst_slots.swa"), (None, 0, "dst_aux")])
    with pytest.raises(ConflictError) as err:
        leases.acquire("c", np.array([3]), [("mamba", 0, "dst_slots.mamba")])
    assert err.value.context == {"field": "dst_slots.mamba", "holder": "a"}
    with pytest.raises(ConflictError) as err:
        leases.acquire("c", np.array([3]), [(None, 2, "dst_aux")])
    assert err.value.context["field"] == "dst_aux"
    assert not leases.holds("c") and leases.leased_pages == 2  # refused: nothing changed


async def test_history_keeps_the_newest_finished_and_every_live_handoff(world: World) -> None:
    w = world
    w.decode._history = 3
    live = HandoffRequest(id="live", prefill=["p"], dst_pages=[0], dst_slot=0)
    await w.decode.create(live)
    for i in range(6):
        hid = f"done-{i}"
        await w.decode.create(HandoffRequest(id=hid, prefill=["p"], dst_pages=[1], dst_slot=1))
        await w.decode.abort(hid)
    assert list(w.decode._handoffs) == ["live", "done-4", "done-5"]


async def test_capacity_and_long_poll(world: World) -> None:
    w = world
    w.decode._max_live = 1
    await w.decode.create(HandoffRequest(id="a", prefill=["p"], dst_pages=[0], dst_slot=0))
    with pytest.raises(CapacityExceeded):
        await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[1], dst_slot=1))
    assert not (await w.decode.wait("a", 0.01)).state.terminal
    waiting = asyncio.create_task(w.decode.wait("a", 30))
    w.prefill.ready("a", 0, [5], 1)
    w.prefill.ready("a", 1, [5], 1)
    assert (await waiting).state == HandoffState.COMPLETED
    await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[1], dst_slot=1))


async def test_abort_racing_the_destination_still_ends_aborted(world: World) -> None:
    w = world
    link = w.decode._prefill
    assert isinstance(link, InProcessLink)
    answered = asyncio.Event()
    release = asyncio.Event()
    delivered = asyncio.Event()
    real_abort, real_deliver = link.abort, link.deliver

    async def slow_abort(url: str, msg: AbortMsg) -> AbortAck:
        ack = await real_abort(url, msg)  # the prefill side has recorded the abort...
        answered.set()
        await release.wait()  # ...but its answer is still on the way back
        return ack

    async def late_deliver(url: str, msg: DestinationMsg) -> None:
        await answered.wait()  # the destination arrives after the abort
        try:
            await real_deliver(url, msg)
        finally:
            delivered.set()

    link.abort = slow_abort  # type: ignore[method-assign]
    link.deliver = late_deliver  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="r", prefill=["p"], dst_pages=[2], dst_slot=0))
    aborting = asyncio.create_task(w.decode.abort("r"))
    await delivered.wait()  # refused by the prefill side: it already aborted this handoff
    release.set()
    view = await aborting
    assert view.state == HandoffState.ABORTED and view.error is None


async def test_a_caller_giving_up_on_abort_does_not_cut_the_quiesce_short(world: World) -> None:
    w = world
    link = w.decode._prefill
    assert isinstance(link, InProcessLink)
    release = asyncio.Event()
    real_abort = link.abort

    async def slow_abort(url: str, msg: AbortMsg) -> AbortAck:
        await release.wait()  # the prefill side is still draining its writes
        return await real_abort(url, msg)

    link.abort = slow_abort  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="c", prefill=["p"], dst_pages=[2], dst_slot=0))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(w.decode.abort("c"), 0.05)
    # The outcome is known at once; the pages stay fenced until the prefill side confirms.
    view = w.decode.get("c")
    assert view.state == HandoffState.ABORTED and not view.released
    assert w.decode.leases.holds("c")
    with pytest.raises(ConflictError):
        await w.decode.create(HandoffRequest(id="d", prefill=["p"], dst_pages=[2], dst_slot=1))
    release.set()
    view = await w.decode.wait("c", 30, released=True)
    assert view.state == HandoffState.ABORTED and view.released
    assert not w.decode.leases.holds("c")
    assert w.decode.live_by_prefill() == {}  # nothing left to keep heartbeating for


async def test_pages_of_a_stage_that_never_confirmed_stay_fenced_until_deadline_plus_grace(
    world: World,
) -> None:
    w = world
    link = w.decode._prefill
    assert isinstance(link, InProcessLink)
    w.prefill.max_call_s = 0.2  # what the prefill declares its engine calls can take

    async def unreachable(url: str, msg: AbortMsg) -> AbortAck:
        raise PeerUnreachable("connection refused", peer=url)

    async def unheard(url: str, msg: StageFailedMsg) -> None:
        raise PeerUnreachable("connection refused", peer=url)

    link.abort = unreachable  # type: ignore[method-assign]
    link.stage_failed = unheard  # type: ignore[method-assign]  # its own report is lost too
    req = HandoffRequest(id="l", prefill=["p"], dst_pages=[4], dst_slot=0, deadline_s=0.3)
    await w.decode.create(req)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert w.decode.peer_lost("p", "was silent") == ["l"]
    assert w.decode.get("l").state == HandoffState.FAILED  # reported at once ...
    assert w.decode.leases.holds("l")  # ... but the page stays fenced
    assert not w.decode.get("l").released
    pages = w.decode.query.pages()  # and says so to the dashboard
    assert (pages.leased, pages.live, pages.fenced) == (1, 0, 1)
    assert pages.fenced_handoffs == [FencedUse("l", 1, restored=False)]
    view = await w.decode.wait("l", 30, released=True)
    # Not before the deadline (0.3 s) plus the declared grace (0.2 s): only then can nothing
    # still land.
    assert loop.time() - t0 >= 0.45
    assert view.released and not w.decode.leases.holds("l")
    assert w.decode.query.pages().leased == 0
    released = [e for e in view.timeline if event_tag(e) == "handoff.released"]
    assert len(released) == 1 and released[0].confirmed is False  # type: ignore[union-attr]


async def test_a_prefill_aborted_while_it_waits_for_its_destination_reads_as_having_none(
    world: World,
) -> None:
    """An abort cancels the handoff's task while it awaits the destination, which cancels that
    future too; the heartbeats reading the live handoffs in between must not get the
    CancelledError (it ended their task, issue 18)."""
    w = world
    w.prefill.ready("w", 0, [1, 2], 0)  # opened, waiting for its destination
    h = w.prefill._handoffs.with_id("w")[0]
    assert h.task is not None
    await asyncio.sleep(0)  # the task is now awaiting the destination
    h.task.cancel()
    await asyncio.wait([h.task])
    assert h.destination.cancelled()  # what the abort leaves behind until it closes `h`
    assert h.known_destination is None and h.decode_url is None
    assert w.prefill.live_by_decode() == {}
    ack = HeartbeatAck(role="decode", url="d", incarnation="x", live=[])
    assert await w.prefill.reconcile("d", ack, ["w"]) == []
    await w.prefill.abort("w", "test")
    assert not w.prefill._handoffs.holds("w")


async def test_a_prefill_given_up_before_its_destination_refuses_it_and_the_decode_fails(
    world: World,
) -> None:
    """The engine gives up a request signalled ready without naming its decode, before the
    destination came: that destination is refused (the handoff ended here) and the decode
    fails the handoff at once. The ended handoff had been remembered unscoped only, so the
    destination (scoped by its decode) opened a fresh handoff that waited for a ready signal
    that never came, until the deadline (a race the embedded test lost about 2 runs in 3)."""
    w = world
    w.prefill.ready("g", 0, [1, 2], 0)  # names no decode: unscoped until a destination
    await w.prefill.give_up("g", "client went away")
    assert not w.prefill._handoffs.holds("g")
    await w.decode.create(HandoffRequest(id="g", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    view = await asyncio.wait_for(w.decode.wait("g", 10), 5)
    assert view.state == HandoffState.FAILED, view
    assert view.error is not None and "already failed" in view.error.reason
    assert not w.prefill._handoffs.holds("g")  # nothing was opened for the refused destination


async def test_the_query_surface_answers_with_snapshots_that_do_not_follow_the_handoff(
    world: World,
) -> None:
    """What the service reads (`find`, `held`, `in_flight`, `stage_peer`, `decodes_of`, ...) is
    a copy at the call: it cannot change the handoff, and the handoff's later changes do not
    show through it."""
    w = world
    req = HandoffRequest(id="q", prefill=["p"], dst_pages=[1, 2], dst_slot=0)
    await w.decode.create(req)
    held = w.decode.query.find("q")
    assert held is not None and held.request == req and held.state == HandoffState.PENDING
    with pytest.raises(AttributeError):
        held.state = HandoffState.FAILED  # type: ignore[misc]
    assert [h.request.id for h in w.decode.query.held()] == ["q"]
    assert list(w.decode.query.held(HandoffState.COMPLETED)) == []
    assert (
        w.decode.query.holds("q")
        and not w.decode.query.holds("nope")
        and w.decode.query.find("nope") is None
    )
    assert w.decode.query.in_flight() == 1 and w.decode.query.recent_peers(10) == ["p"]
    assert w.decode.query.stage_peer("q", 0) == "p" and w.decode.query.stage_peer("q", 9) is None
    with pytest.raises(NotFoundError):
        w.decode.query.stage_peer("nope", 0)
    assert w.decode.get("q", timeline=False).timeline == [] and w.decode.get("q").timeline
    async with asyncio.timeout(5):
        while not w.prefill.query.decodes_of("q"):  # until the destination is delivered
            await asyncio.sleep(0.01)
    assert w.prefill.query.decodes_of("q") == ["d"] and w.prefill.query.open_ids() == {"q"}
    assert w.prefill.query.awaiting_destination() == 0 and w.prefill.query.open_count() == 1
    w.prefill.ready("q", 0, [3, 4], 1)
    w.prefill.ready("q", 1, [3, 4], 1)
    assert await wait_terminal(w, "q") == HandoffState.COMPLETED
    assert held.state == HandoffState.PENDING  # the snapshot kept what it saw
    assert w.decode.query.find("q").state == HandoffState.COMPLETED  # type: ignore[union-attr]
    assert (
        w.decode.query.in_flight() == 0
        and w.decode.query.arena() is None
        and w.prefill.query.arena() is None
    )
