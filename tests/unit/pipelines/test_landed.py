"""Landed mode in-process: prefills write only into landing windows; the decode commits.

Real memory (torch:cpu pools, copied through numpy views as host memory is, and once through
torch's kernels as a device pool is), the local transport, both pipelines linked in one loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from kvhandoff.pipelines import packing
from kvhandoff.pipelines.arena import Arena
from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.landing import MAX_WINDOWS_PER_STAGE, Landing
from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.digest import digest, segment_seed
from kvhandoff.pipelines.errors import ConflictError, InvalidInput, KVHandoffError, PlanError
from kvhandoff.pipelines.events import (
    EventBus,
    HandoffFailed,
    SegmentCommitted,
    SegmentRejected,
    StageTransferred,
    event_tag,
)
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.memory import PoolMemory, pool_array
from kvhandoff.pipelines.messages import (
    DestinationMsg,
    Grant,
    HeartbeatAck,
    SegmentMsg,
    layout_json,
)
from kvhandoff.pipelines.models import (
    ModelSpec,
    Partition,
    StateKind,
    decode_layout,
    dense_mha,
    hybrid_npu_mla,
    partition_layers,
    stage_layout,
)
from kvhandoff.pipelines.prefill import HostedStage, PrefillPipeline, Staging
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.pool_base import host_array
from kvhandoff.transport.pools import open_pool
from tests.fakes import eventually

MODEL = hybrid_npu_mla(num_layers=8, scale=64, page_size=4)
PART = partition_layers(8, 2)
NUM_PAGES = 32


@dataclass
class World:
    decode: DecodePipeline
    prefill: PrefillPipeline
    dec: PoolMemory
    stages: dict[int, PoolMemory]
    bus: EventBus
    landing: Landing
    transport: LocalTransport


async def make_world(
    *,
    arena_bytes: int = 1 << 20,
    window_bytes: int = 1 << 20,
    algorithm: str = "xxh3_128",
    landed: bool = True,
    model: ModelSpec = MODEL,
    part: Partition | None = None,
) -> World:
    t = LocalTransport()
    part = PART if part is None else part
    dlay = decode_layout(model, num_pages=NUM_PAGES, num_slots=4)
    dec_pool = open_pool("torch:cpu", dlay.region_sizes)
    dec_pool.register(t)
    dec = PoolMemory(dlay, dec_pool)
    arena_pool = open_pool("torch:cpu", [arena_bytes])
    arena_pool.register(t)
    landing = Landing(
        Arena(arena_pool.bases[0], arena_bytes),
        pool_array(arena_pool, 0),
        dec,
        dec.layout,
        window_bytes=window_bytes,
        algorithm=algorithm,  # type: ignore[arg-type]
    )
    stages = {}
    for r in range(2):
        lay = stage_layout(model, part, r, num_pages=NUM_PAGES, num_slots=4)
        pool = open_pool("torch:cpu", lay.region_sizes)
        pool.register(t)
        stages[r] = PoolMemory(lay, pool)
    for m in stages.values():
        for i in range(len(m.layout.region_sizes)):
            m.region(i)[:] = np.random.default_rng(i).integers(1, 255, m.region(i).shape[0])
    staging_pool = open_pool("torch:cpu", [1 << 20])
    staging_pool.register(t)
    staging = Staging(Arena(staging_pool.bases[0], 1 << 20), pool_array(staging_pool, 0))
    bus = EventBus()
    link = InProcessLink()
    decode = DecodePipeline(
        dec.layout, t.local_target, "d", link, bus, memory=dec, landing=landing if landed else None
    )
    prefill = PrefillPipeline(
        {r: HostedStage(m.layout, m, m) for r, m in stages.items()},
        t,
        link,
        bus,
        # A prefill serves the mode of its configuration: landed with a staging buffer.
        staging=staging if landed else None,
    )
    link.decode = decode
    link.add_prefill("p", prefill, t.local_target)
    w = World(decode, prefill, dec, stages, bus, landing, t)
    w._pools = [dec_pool, arena_pool, staging_pool, *(m.pool for m in stages.values())]  # type: ignore[attr-defined]
    return w


def open_handoff(w: World, hid: str) -> Any:
    """The prefill's open handoff `hid` (one decode here), or None."""
    same = w.prefill._handoffs.with_id(hid)
    return same[0] if same else None


async def close_world(w: World) -> None:
    await w.prefill.close()
    await w.decode.close()
    for pool in w._pools:  # type: ignore[attr-defined]
        pool.close()
    w.transport.close()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = await make_world()
    yield w
    await close_world(w)


async def wait_released(w: World, hid: str, timeout_s: float = 30.0) -> HandoffState:
    view = await w.decode.wait(hid, timeout_s, released=True)
    return view.state


def changed_outside(
    w: World, before: list[np.ndarray], pages: list[int], slot: int | None
) -> list[int]:
    """The decode entries (of those in `before`) whose bytes changed outside KV rows `pages`
    and state slot `slot`: a refused segment's one-pass commit may leave its own handoff's
    leased pages dirty (SAFETY.md S1), and nothing else. Aux rows are all outside."""
    lay = w.dec.layout
    items = [e.item_len for e in lay.kv] + [s.item_len for s in lay.state]
    items += [a.item_len for a in lay.aux]
    own = [pages] * len(lay.kv) + [[] if slot is None else [slot]] * len(lay.state)
    own += [[]] * len(lay.aux)
    out = []
    for i, (then, item, rows) in enumerate(zip(before, items, own)):
        now, usable = w.dec.region(i), then.shape[0] // item * item
        a, b = now[:usable].reshape(-1, item).copy(), then[:usable].reshape(-1, item).copy()
        a[rows], b[rows] = 0, 0
        if not (np.array_equal(a, b) and np.array_equal(now[usable:], then[usable:])):
            out.append(i)
    return out


def assert_landed(w: World, src: list[int], dst: list[int], src_slot: int, dst_slot: int) -> None:
    """Every KV page and the state slot of every stage equal their source bytes."""
    for m in w.stages.values():
        for i, e in enumerate(m.layout.kv):
            j = next(
                k
                for k, d in enumerate(w.dec.layout.kv)
                if (d.layer_id, d.group) == (e.layer_id, e.group)
            )
            s_rows = m.region(i)[: e.nbytes].reshape(-1, e.item_len)
            d_rows = w.dec.region(j)[: e.nbytes].reshape(-1, e.item_len)
            assert np.array_equal(s_rows[src], d_rows[dst]), (e.layer_id, e.group)
        for i, s in enumerate(m.layout.state):
            j = next(
                k
                for k, d in enumerate(w.dec.layout.state)
                if (d.layer_id, d.kind) == (s.layer_id, s.kind)
            )
            a = m.region(len(m.layout.kv) + i)[src_slot * s.item_len : (src_slot + 1) * s.item_len]
            b = w.dec.region(len(w.dec.layout.kv) + j)[
                dst_slot * s.item_len : (dst_slot + 1) * s.item_len
            ]
            assert np.array_equal(a, b), (s.layer_id, s.kind)


#: Two state components with slots of their own (a Mamba pool; a ring pool) and two aux entries.
COMPONENTS = msgspec.structs.replace(
    MODEL,
    state_kinds=(
        StateKind("conv", 48, "mamba"),
        StateKind("temporal", 256, "mamba"),
        StateKind("tail", 40, "ring"),
    ),
    aux_row_bytes=(16, 24),
)


def entry_rows(m: PoolMemory, region: int, item: int) -> Any:
    return m.region(region)[: m.layout.region_sizes[region]].reshape(-1, item)


def assert_slots_landed(w: World, src: dict[int, RequestSlots], dst: RequestSlots) -> None:
    """Each state entry's slot of its own component, and the aux rows of the last stage, equal
    their source rows; every other slot and aux row of the decode is still zero."""
    dec, k = w.dec.layout, len(w.dec.layout.kv)
    written: dict[int, int] = {}
    for rank, m in w.stages.items():
        for i, s in enumerate(m.layout.state):
            j = next(
                x for x, d in enumerate(dec.state) if (d.layer_id, d.kind) == (s.layer_id, s.kind)
            )
            a = entry_rows(m, len(m.layout.kv) + i, s.item_len)[src[rank].of(s.component)]
            b = entry_rows(w.dec, k + j, s.item_len)[dst.of(s.component)]
            assert np.array_equal(a, b), (s.layer_id, s.kind)
            written[k + j] = dst.of(s.component)  # type: ignore[assignment]
        first_aux = len(m.layout.kv) + len(m.layout.state)
        for i, a in enumerate(m.layout.aux):
            sent = entry_rows(m, first_aux + i, a.item_len)[src[rank].aux]
            got = entry_rows(w.dec, k + len(dec.state) + i, a.item_len)[dst.aux]
            assert np.array_equal(sent, got), f"aux entry {i}"
            written[k + len(dec.state) + i] = dst.aux  # type: ignore[assignment]
    for region, row in written.items():
        item = (list(dec.state) + list(dec.aux))[region - k].item_len
        rest = np.delete(entry_rows(w.dec, region, item), [row], axis=0)
        assert not rest.any(), f"region {region} holds bytes beside row {row}"


@pytest.mark.parametrize("signal", ["layers", "ranges"])
async def test_state_per_component_and_aux_rows_land_from_the_last_stage(signal: str) -> None:
    w = await make_world(model=COMPONENTS)
    try:
        src_pages, dst_pages = [3, 4, 9], [10, 11, 2]
        dst = RequestSlots(slot=1, by_component={"ring": 3}, aux=2)
        src = {0: RequestSlots(by_component={"mamba": 0, "ring": 2}), 1: RequestSlots(2, aux=3)}
        await w.decode.create(
            HandoffRequest(
                id="c",
                prefill=["p"],
                dst_pages=dst_pages,
                dst_slot=1,
                dst_slots={"ring": 3},
                dst_aux=2,
                verify=True,
            )
        )
        for rank in (1, 0):
            if signal == "layers":
                w.prefill.ready("c", rank, src_pages, src[rank], layers=[7 if rank else 3])
                w.prefill.ready("c", rank, src_pages, src[rank])
            else:
                w.prefill.ready(
                    "c", rank, src_pages[:2], RequestSlots(), pages_from=0, last_pages=False
                )
                w.prefill.ready("c", rank, src_pages[2:], src[rank], pages_from=2, last_pages=True)
        assert await wait_released(w, "c") == HandoffState.COMPLETED
        view = w.decode.get("c")
        assert view.verification == "passed" and view.dst_aux == 2
        assert view.dst_slots == {"ring": 3}
        assert_slots_landed(w, src, dst)
    finally:
        await close_world(w)


async def test_a_slot_or_aux_row_leased_by_a_live_handoff_is_refused_by_its_field() -> None:
    w = await make_world(model=COMPONENTS)

    def request(hid: str, **slots: Any) -> HandoffRequest:
        return HandoffRequest(id=hid, prefill=["p"], dst_pages=[len(hid)], **slots)

    try:
        await w.decode.create(request("x", dst_slot=0, dst_slots={"ring": 1}, dst_aux=2))
        with pytest.raises(ConflictError) as err:  # its ring slot is 1: x's
            await w.decode.create(request("y1", dst_slot=1, dst_aux=3))
        assert err.value.context == {"field": "dst_slot", "holder": "x"}
        with pytest.raises(ConflictError) as err:
            await w.decode.create(request("y22", dst_slot=3, dst_slots={"ring": 2}, dst_aux=2))
        assert err.value.context == {"field": "dst_aux", "holder": "x"}
        # Slot 1 of the Mamba pool is not slot 1 of the ring pool: free.
        await w.decode.create(request("z333", dst_slot=1, dst_slots={"ring": 0}, dst_aux=0))
        with pytest.raises(PlanError) as err:
            await w.decode.create(request("v4444", dst_slot=3))
        assert err.value.context == {"field": "dst_aux"}
        assert [w.decode.leases.holds(h) for h in ("x", "y1", "y22", "z333", "v4444")] == [
            True,
            False,
            False,
            True,
            False,
        ]
    finally:
        await close_world(w)


async def test_a_landed_pp2_handoff_commits_every_byte_and_digests_it(world: World) -> None:
    w = world
    src, dst = [3, 4, 9, 10, 11], [10, 11, 2, 20, 21]
    await w.decode.create(HandoffRequest(id="a", prefill=["p"], dst_pages=dst, dst_slot=1))
    w.prefill.ready("a", 1, src, 2, layers=[7])  # layer by layer: a segment of layer 7 first
    w.prefill.ready("a", 1, src, 2)
    w.prefill.ready("a", 0, src, 2)
    assert await wait_released(w, "a") == HandoffState.COMPLETED
    assert_landed(w, src, dst, 2, 1)
    view = w.decode.get("a")
    assert view.verification == "passed" and view.released
    tags = [event_tag(e) for e in view.timeline]
    assert "stage.segment_committed" in tags and tags[-2:] == [
        "handoff.completed",
        "handoff.released",
    ]
    # Every window went back to the arena.
    assert w.landing.arena.stats.used_bytes == 0


async def test_an_arena_smaller_than_one_request_streams_it_segment_by_segment() -> None:
    # 64 KiB of windows for a request of several hundred KiB: the stage waits for credits.
    w = await make_world(arena_bytes=64 * 1024, window_bytes=16 * 1024)
    try:
        src = list(range(0, 30))
        dst = list(range(31, 1, -1))
        await w.decode.create(HandoffRequest(id="big", prefill=["p"], dst_pages=dst, dst_slot=0))
        commits = []
        w.bus.add_listener(lambda e: commits.append(e) if isinstance(e, SegmentCommitted) else None)
        w.prefill.ready("big", 0, src, 3)
        w.prefill.ready("big", 1, src, 3)
        assert await wait_released(w, "big") == HandoffState.COMPLETED
        assert_landed(w, src, dst, 3, 0)
        total = sum(e.bytes for e in commits)
        assert total == w.decode.get("big").bytes > 64 * 1024
        assert all(e.bytes <= 16 * 1024 for e in commits)
        assert w.landing.arena.stats.used_bytes == 0
    finally:
        await close_world(w)


async def test_two_segments_of_a_stage_fly_at_once_in_windows_their_pages_do_not_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Windows of 16 KiB + 1000 bytes: every segment leaves slack, so an open window holds fewer
    # bytes than its length, and the next window must still fit the sender's next page.
    w = await make_world(arena_bytes=1 << 20, window_bytes=16 * 1024 + 1000)
    held: list[int] = []
    issue = Landing._issue

    def counting(self: Landing, handoff_id: str, rank: int, extent: object, want: int) -> object:
        grant = issue(self, handoff_id, rank, extent, want)  # type: ignore[arg-type]
        held.append(len(self._stage(handoff_id, rank).grants))
        return grant

    monkeypatch.setattr(Landing, "_issue", counting)
    try:
        src, dst = list(range(0, 30)), list(range(31, 1, -1))
        await w.decode.create(HandoffRequest(id="fly", prefill=["p"], dst_pages=dst, dst_slot=0))
        w.prefill.ready("fly", 0, src, 3)
        w.prefill.ready("fly", 1, src, 3)
        assert await wait_released(w, "fly") == HandoffState.COMPLETED
        assert_landed(w, src, dst, 3, 0)
        # The next segment was in flight while the one before it committed; never more than
        # a stage may hold.
        assert max(held) == 2 and len(held) > 4
        assert w.landing.arena.stats.used_bytes == 0
    finally:
        await close_world(w)


async def test_window_requests_queued_for_a_full_arena_count_against_the_peer_share() -> None:
    """`transfer.peer_share` holds for requests that queued while the arena was full: a peer
    holding one of 4 windows (share 0.5) that queued 3 more requests gets at most 2 windows in
    all once the arena frees (it got all 4: the share was checked before queueing only)."""
    import time
    from types import SimpleNamespace

    window = 64 * 1024
    w = await make_world(arena_bytes=4 * window, window_bytes=window)
    try:
        landing, arena = w.landing, w.landing.arena
        landing.peer_share = 0.5
        await w.decode.create(HandoffRequest(id="src", prefill=["p"], dst_pages=[1], dst_slot=0))
        pairing = landing._stage("src", 0).pairing
        await w.decode.abort("src")
        await eventually(lambda: arena.stats.used_bytes == 0, what="src's windows back")
        until = time.monotonic() + 30
        fillers = [await arena.take(window, "filler", until_mono=until) for _ in range(3)]
        handoffs = []
        for i in range(4):
            hid = f"a{i}"
            landing.open(hid, np.arange(NUM_PAGES, dtype=np.int64), {0: pairing}, {0: "A"})
            handoffs.append(
                SimpleNamespace(
                    id=hid,
                    deadline_mono=until,
                    state=HandoffState.PENDING,  # type: ignore[attr-defined]
                )
            )
        first = await landing.grant(handoffs[0], 0, window)  # type: ignore[arg-type]
        assert first is not None  # the last free window
        queued = [
            asyncio.ensure_future(landing.grant(h, 0, window))  # type: ignore[arg-type]
            for h in handoffs[1:]
        ]
        await asyncio.sleep(0.05)  # all three wait for the full arena
        for extent in fillers:
            arena.give_back(extent)
        grants = [g for g in await asyncio.gather(*queued) if g is not None]
        held = sum(e.length for e in arena.taken())
        assert grants and held <= 2 * window, (len(grants), held)
    finally:
        await close_world(w)


async def test_a_stage_holding_its_windows_is_granted_no_more(world: World) -> None:
    w = world
    await w.decode.create(HandoffRequest(id="hog", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    h = w.decode._handoffs["hog"]
    grants = [await w.landing.grant(h, 0, 1024) for _ in range(MAX_WINDOWS_PER_STAGE + 1)]
    # The destination's first window (if it was sent yet) counts too: no more in all.
    assert len(w.landing._stage("hog", 0).grants) == MAX_WINDOWS_PER_STAGE
    assert grants[-1] is None and grants[0] is not None


async def test_the_device_path_commits_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a GPU/NPU pool runs: mix64 and torch's own copy kernels, here on CPU tensors.
    monkeypatch.setattr(packing, "HOST_TENSORS_VIA_NUMPY", False)
    w = await make_world(algorithm="mix64")
    try:
        src, dst = [5, 6, 7], [1, 2, 3]
        await w.decode.create(HandoffRequest(id="g", prefill=["p"], dst_pages=dst, dst_slot=2))
        w.prefill.ready("g", 0, src, 1)
        w.prefill.ready("g", 1, src, 1)
        assert await wait_released(w, "g") == HandoffState.COMPLETED
        assert_landed(w, src, dst, 1, 2)
    finally:
        await close_world(w)


class FlipAfterLanding:
    """A writer that corrupts one byte of its first `flips` writes after they land (as a stale
    write into the window would), before the decode commits them."""

    def __init__(self, inner: LocalTransport, flips: int) -> None:
        self.inner = inner
        self.flips = flips
        self.max_call_s = inner.max_call_s

    async def write(self, peer, blocks, *, start_by=None):  # type: ignore[no-untyped-def]
        await self.inner.write(peer, blocks, start_by=start_by)
        if self.flips > 0:
            self.flips -= 1
            host_array(int(blocks.dst_addr[0]), 1)[0] ^= 0xFF

    async def quiesce(self, peer=None):  # type: ignore[no-untyped-def]
        await self.inner.quiesce(peer)


async def flip_world(flips: int) -> World:
    w = await make_world()
    # The writer the landed sender uses: every landed byte passes through it.
    w.prefill._runner._landed._writer = FlipAfterLanding(w.transport, flips)
    return w


async def test_a_byte_flipped_in_a_window_is_refused_and_the_segment_sent_again() -> None:
    w = await flip_world(1)
    try:
        rejected: list[SegmentRejected] = []
        w.bus.add_listener(lambda e: rejected.append(e) if isinstance(e, SegmentRejected) else None)
        src, dst = [1, 2], [3, 4]
        await w.decode.create(HandoffRequest(id="f", prefill=["p"], dst_pages=dst, dst_slot=0))
        w.prefill.ready("f", 0, src, 0)
        w.prefill.ready("f", 1, src, 0)
        assert await wait_released(w, "f") == HandoffState.COMPLETED
        assert len(rejected) == 1 and rejected[0].resend
        assert_landed(w, src, dst, 0, 0)
    finally:
        await close_world(w)


class FlipWrites(FlipAfterLanding):
    """Corrupts the writes numbered in `which` (1 = the first), after they land."""

    def __init__(self, inner: LocalTransport, which: set[int]) -> None:
        super().__init__(inner, 0)
        self.which = which
        self.count = 0

    async def write(self, peer, blocks, *, start_by=None):  # type: ignore[no-untyped-def]
        await self.inner.write(peer, blocks, start_by=start_by)
        self.count += 1
        if self.count in self.which:
            host_array(int(blocks.dst_addr[0]), 1)[0] ^= 0xFF


async def test_two_segments_of_one_stage_each_refused_once_are_each_sent_again() -> None:
    """The resend budget is per segment on both sides (`RESENDS_PER_SEGMENT`): a stage whose two
    segments are each refused once completes (the decode used to count per stage and failed
    it with digest_mismatch)."""
    w = await make_world()
    w.prefill._runner._landed._writer = FlipWrites(w.transport, {1, 3})
    try:
        rejected: list[SegmentRejected] = []
        committed: list[SegmentCommitted] = []
        w.bus.add_listener(lambda e: rejected.append(e) if isinstance(e, SegmentRejected) else None)
        w.bus.add_listener(
            lambda e: committed.append(e) if isinstance(e, SegmentCommitted) else None
        )
        src, dst = [1, 2], [3, 4]
        layout = w.stages[0].layout
        own = sorted({e.layer_id for e in layout.kv} | {x.layer_id for x in layout.state})
        await w.decode.create(HandoffRequest(id="g", prefill=["p"], dst_pages=dst, dst_slot=0))
        # One segment at a time, so the writes are numbered in order: the first of each is
        # corrupted (writes 1 and 3), its resend is not (2 and 4).
        w.prefill.ready("g", 0, src, 0, layers=own[:2])
        await eventually(lambda: len(committed) == 1, what="the first segment committed")
        w.prefill.ready("g", 0, src, 0, layers=own[2:])
        await eventually(lambda: len(committed) == 2, what="the second segment committed")
        w.prefill.ready("g", 1, src, 0)
        assert await wait_released(w, "g") == HandoffState.COMPLETED
        assert [(e.pp_rank, e.resend) for e in rejected] == [(0, True), (0, True)]
        assert rejected[0].layers != rejected[1].layers  # two segments, not one sent thrice
        assert_landed(w, src, dst, 0, 0)
    finally:
        await close_world(w)


async def test_a_segment_refused_twice_fails_the_handoff_and_dirties_only_its_own_pages() -> None:
    w = await flip_world(100)
    try:
        before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.kv))]
        await w.decode.create(HandoffRequest(id="x", prefill=["p"], dst_pages=[3, 4], dst_slot=0))
        w.prefill.ready("x", 0, [1, 2], 0)
        w.prefill.ready("x", 1, [1, 2], 0)
        assert await wait_released(w, "x") == HandoffState.FAILED
        view = w.decode.get("x")
        assert view.error is not None and view.error.code == "digest_mismatch"
        assert "layer" in view.error.reason
        # A refused segment's one pass wrote this handoff's own leased pages only (dirty: the
        # handoff failed on them, never completed), no other page.
        assert changed_outside(w, before, [3, 4], 0) == []
    finally:
        await close_world(w)


class ScribbleStaging(FlipAfterLanding):
    """A Mooncake client that keeps writing one pattern over the prefill's registered staging
    buffer (the address the handshake hands it): before every transfer out of it, and, through
    `scribbling_update`, before every digest update the sender takes."""

    async def write(self, peer, blocks, *, start_by=None):  # type: ignore[no-untyped-def]
        for src, n in zip(blocks.src_addr, blocks.length):
            host_array(int(src), int(n))[:] = 0xAB
        await self.inner.write(peer, blocks, start_by=start_by)


async def test_bytes_written_into_the_staging_buffer_are_never_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill digests what it read from its own pages (a private chunk), not its registered
    staging buffer: a client scribbling that buffer gets every segment refused (the handoff
    fails, no page but its own changes), never its bytes committed as the handoff's (issue 31).
    The buffer is scribbled before every digest update the sender takes, and before every
    transfer out of it."""
    from kvhandoff.pipelines.digest import Digester

    w = await make_world()
    staging = w.prefill._runner._landed._staging
    assert staging is not None
    real_update = Digester.update

    def scribbling_update(self, buf):  # type: ignore[no-untyped-def]
        staging.buffer[:] = 0xAB
        real_update(self, buf)

    monkeypatch.setattr(Digester, "update", scribbling_update)
    w.prefill._runner._landed._writer = ScribbleStaging(w.transport, 0)
    try:
        before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.kv))]
        await w.decode.create(HandoffRequest(id="z", prefill=["p"], dst_pages=[3, 4], dst_slot=0))
        w.prefill.ready("z", 0, [1, 2], 0)
        w.prefill.ready("z", 1, [1, 2], 0)
        assert await wait_released(w, "z") == HandoffState.FAILED
        view = w.decode.get("z")
        assert view.error is not None and view.error.code == "digest_mismatch"
        assert changed_outside(w, before, [3, 4], 0) == []
    finally:
        await close_world(w)


async def test_a_forged_segment_changes_nothing(world: World) -> None:
    w = world
    from kvhandoff.pipelines.messages import SegmentMsg

    await w.decode.create(HandoffRequest(id="s", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    await asyncio.sleep(0.05)  # the destination went out (its first grants with it)
    before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.kv))]
    base = dict(
        handoff_id="s",
        sender_url="p",
        sender_incarnation=w.prefill.incarnation,
        decode_incarnation=w.decode.incarnation,
        pp_rank=0,
        blocks=1,
        digest="",
    )
    cases = [
        (ConflictError, dict(grant_id=999, rows=[0], starts=[0], ends=[1], bytes=1)),
        (InvalidInput, dict(grant_id=1, rows=[0], starts=[0], ends=[9], bytes=1)),
        (InvalidInput, dict(grant_id=1, rows=[10_000], starts=[0], ends=[1], bytes=1)),
    ]
    for exc, fields in cases:
        with pytest.raises(exc):
            await w.decode.segment(SegmentMsg(**base, **fields))  # type: ignore[arg-type]
    after = [w.dec.region(i) for i in range(len(w.dec.layout.kv))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def _forged_destination(w: World, hid: str, **fields: Any) -> DestinationMsg:
    """A destination as a forger (or a holder of the peer secret) could send it: the decode's
    real lives and layout keys, its own choice of mode and windows."""
    layout = w.decode.peer_layout
    base: dict[str, Any] = dict(
        handoff_id=hid,
        decode_url=w.decode.url,
        decode_incarnation=w.decode.incarnation,
        prefill_incarnation=w.prefill.incarnation,
        decode_target=w.decode.target,
        decode_layout=layout_json(layout),
        arena=w.decode.arena_span(),
        pp_ranks=[0],
        dst_pages=[1, 2],
        dst_slot=0,
        deadline_in_s=5.0,
        mode="landed",
        window_bytes=1 << 20,
    )
    return DestinationMsg(**{**base, **fields})


async def test_a_destination_naming_kv_memory_changes_no_byte(world: World) -> None:
    """Deliverable 2 of issue 31: a prefill writes only inside the arena its decode published
    (in its layout of this life), whatever a destination names; direct mode is refused to a
    prefill configured for landed mode. Every decode byte is compared."""
    w = world
    failures: list[HandoffFailed] = []
    w.bus.add_listener(
        lambda e: (
            failures.append(e) if isinstance(e, HandoffFailed) and e.role == "prefill" else None
        )
    )
    before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.region_sizes))]
    kv = w.dec.layout.kv[0]
    arena = w.decode.arena_span()
    assert arena is not None
    page = kv.base + kv.item_len  # a KV page's real address: what the old layout published
    with pytest.raises(ConflictError) as refused:
        w.prefill.deliver(_forged_destination(w, "d", mode="direct"))
    assert refused.value.context["field"] == "mode"
    grants = {
        "kv": Grant(grant_id=1, pp_rank=0, addr=page, length=1 << 16),
        "straddles": Grant(grant_id=2, pp_rank=0, addr=arena.addr + arena.length - 64, length=4096),
        "other stage": Grant(grant_id=3, pp_rank=1, addr=arena.addr, length=4096),
    }
    for hid, grant in grants.items():
        hid = hid.replace(" ", "-")
        w.prefill.deliver(_forged_destination(w, hid, grants=[grant]))
        w.prefill.ready(hid, 0, [3, 4], 0)
        await eventually(lambda hid=hid: open_handoff(w, hid) is None, what=f"{hid} ended")
    assert [f.context.get("field") for f in failures] == ["grants"] * len(grants)
    after = [w.dec.region(i) for i in range(len(w.dec.layout.region_sizes))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


class RecordPeers(FlipAfterLanding):
    """Records the transport target of every write."""

    def __init__(self, inner: LocalTransport) -> None:
        super().__init__(inner, 0)
        self.peers: list[str] = []

    async def write(self, peer, blocks, *, start_by=None):  # type: ignore[no-untyped-def]
        self.peers.append(peer)
        await self.inner.write(peer, blocks, start_by=start_by)


async def test_a_destination_naming_another_transport_target_is_refused(world: World) -> None:
    """The prefill writes to the target its decode life named, never to another one a later
    destination names: another endpoint may hold registered memory at the arena's very
    addresses (device virtual addresses repeat across processes). Here a second transport has
    the arena registered; a destination naming it, with a grant inside the arena, is refused by
    `decode_target` and nothing is written there. (Since v8 the decode's target travels in its
    destinations: a genuine handoff first names it for this decode life.)"""
    w = world
    await w.decode.create(HandoffRequest(id="real", prefill=["p"], dst_pages=[5, 6], dst_slot=1))
    for rank in (0, 1):
        w.prefill.ready("real", rank, [5, 6], 1)
    assert await wait_released(w, "real") == HandoffState.COMPLETED
    other = LocalTransport()
    arena_pool = w._pools[1]  # type: ignore[attr-defined]
    other.register(arena_pool.registrations, devices=arena_pool.devices)  # the same addresses
    recorder = RecordPeers(w.transport)
    w.prefill._runner._landed._writer = recorder
    failures: list[HandoffFailed] = []
    w.bus.add_listener(
        lambda e: (
            failures.append(e) if isinstance(e, HandoffFailed) and e.role == "prefill" else None
        )
    )
    try:
        arena = w.decode.arena_span()
        assert arena is not None
        grant = Grant(grant_id=1, pp_rank=0, addr=arena.addr, length=1 << 16)
        forged = _forged_destination(w, "t", grants=[grant], decode_target=other.local_target)
        w.prefill.deliver(forged)
        w.prefill.ready("t", 0, [3, 4], 0)
        await eventually(lambda: open_handoff(w, "t") is None, what="t ended")
        assert other.local_target not in recorder.peers
        assert [f.context.get("field") for f in failures] == ["decode_target"]
    finally:
        other.close()


async def test_a_notice_sent_again_for_another_grant_is_refused(world: World) -> None:
    """The digest binds the grant, not just the bytes: a notice of handoff `a`, named again for
    handoff `b`'s grant whose window holds `a`'s very bytes (a stale write, or a replay), does
    not commit them into `b`'s pages (it did when the digest was of the bytes alone)."""
    w = world
    data = np.random.default_rng(7).integers(0, 255, 1 << 16, dtype=np.uint8)

    async def first_grant(hid: str) -> tuple[int, int]:
        """The handoff's stage-0 grant (id, window offset), issued with its destination."""
        await eventually(lambda: bool(w.landing._handoffs[hid].stages[0].grants))
        ((gid, extent),) = w.landing._handoffs[hid].stages[0].grants.items()
        return gid, extent.offset

    def notice(hid: str, gid: str | int, digest_hex: str, n: int) -> SegmentMsg:
        return SegmentMsg(
            handoff_id=hid,
            sender_url="p",
            sender_incarnation=w.prefill.incarnation,
            decode_incarnation=w.decode.incarnation,
            pp_rank=0,
            grant_id=int(gid),
            rows=[0],
            starts=[0],
            ends=[1],
            bytes=n,
            blocks=1,
            digest=digest_hex,
        )

    await w.decode.create(HandoffRequest(id="a", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    gid_a, off_a = await first_grant("a")
    n = int(w.decode.cache.get(w.stages[0].layout, w.decode.layout).kv_item_len[0])
    base = w.landing.arena.base_addr
    host_array(base + off_a, n)[:] = data[:n]
    seed = segment_seed(w.decode.incarnation, "a", 0, gid_a, [0], [0], [1])
    sent = notice("a", gid_a, digest(data[:n], "xxh3_128", seed=seed), n)
    assert (await w.decode.segment(sent)).committed  # the notice is well formed

    await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=[5, 6], dst_slot=1))
    gid_b, off_b = await first_grant("b")
    host_array(base + off_b, n)[:] = data[:n]  # `a`'s bytes, in `b`'s window
    before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.region_sizes))]
    again = msgspec.structs.replace(sent, handoff_id="b", grant_id=gid_b)
    ack = await w.decode.segment(again)
    assert not ack.committed and "digest" in ack.reason
    # Its one pass may have written `b`'s own page (dirty), no other; and that cell is not
    # committed: `b`'s stage cannot arrive on it.
    assert changed_outside(w, before, [5, 6], 1) == []
    assert not w.landing._handoffs["b"].stages[0].covered[0, 0]


async def test_two_notices_naming_one_grant_commit_at_most_one(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grant is claimed by the first notice naming it, before its commit's copy is awaited: a
    second notice naming the same grant with other pieces (the window's bytes digested under
    their own seed) is refused, not committed into other pages from the same window."""
    from kvhandoff.pipelines.decode import landing as landing_module

    monkeypatch.setattr(landing_module, "INLINE_COMMIT_BYTES", 0)  # every commit awaits a thread
    w = world
    await w.decode.create(HandoffRequest(id="two", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    await eventually(lambda: bool(w.landing._handoffs["two"].stages[0].grants))
    ((gid, extent),) = w.landing._handoffs["two"].stages[0].grants.items()
    n = int(w.decode.cache.get(w.stages[0].layout, w.decode.layout).kv_item_len[0])
    data = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
    host_array(w.landing.arena.base_addr + extent.offset, n)[:] = data

    def notice(start: int) -> SegmentMsg:
        seed = segment_seed(w.decode.incarnation, "two", 0, gid, [0], [start], [start + 1])
        return SegmentMsg(
            handoff_id="two",
            sender_url="p",
            sender_incarnation=w.prefill.incarnation,
            decode_incarnation=w.decode.incarnation,
            pp_rank=0,
            grant_id=gid,
            rows=[0],
            starts=[start],
            ends=[start + 1],
            bytes=n,
            blocks=1,
            digest=digest(data, "xxh3_128", seed=seed),
        )

    answers = await asyncio.gather(
        w.decode.segment(notice(0)), w.decode.segment(notice(1)), return_exceptions=True
    )
    committed = [a for a in answers if not isinstance(a, BaseException) and a.committed]
    assert len(committed) == 1, answers
    refused = [a for a in answers if isinstance(a, ConflictError)]
    assert len(refused) == 1 and refused[0].context["field"] == "grant_id", answers


@pytest.mark.parametrize("accepted", [False, True])
async def test_windows_of_a_destination_in_flight_stay_out_of_use_until_its_delivery_ends(
    world: World, accepted: bool
) -> None:
    """A handoff that ends while its destination is still on its way (a hung prefill: the call
    neither answered nor failed) keeps that destination's windows: the prefill may read it once
    it runs again and write them. They go back once the call ended unaccepted; accepted, they
    stay quarantined (they went back at once, to be granted again while it could write)."""
    w = world
    release = asyncio.Event()
    link = w.decode._prefill
    deliver = link.deliver

    async def hung(url: str, msg: DestinationMsg) -> None:
        await release.wait()
        if not accepted:
            raise ConflictError("the call failed")
        await deliver(url, msg)

    link.deliver = hung  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="h", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
    h = w.decode._handoffs["h"]
    await eventually(lambda: all(s.delivery == "sending" for s in h.stages.values()))
    held = w.landing.arena.stats.used_bytes
    assert held > 0  # its first windows, granted with the destination
    h.state = HandoffState.FAILED  # as its deadline would, with its prefill unreachable
    w.decode._releases.release(h, confirmed=False)
    assert w.landing.arena.stats.used_bytes == held
    release.set()
    await eventually(lambda: all(s.delivery != "sending" for s in h.stages.values()))
    await asyncio.sleep(0.05)
    assert w.landing.arena.stats.used_bytes == (held if accepted else 0)


async def test_a_peer_that_left_a_destination_unanswered_is_granted_no_first_window(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31: once a destination to a prefill has waited longer than a window request may
    (a hung process), that peer's next destinations carry no first window; its stages ask
    once it speaks. (tests/integration/test_hung_prefill.py passes without this rule: the
    windows also come back when the hung deliveries end.)"""
    from kvhandoff.pipelines.decode import delivery

    monkeypatch.setattr(delivery, "WINDOW_WAIT_S", 0.05)
    w = world
    release = asyncio.Event()
    link = w.decode._prefill
    deliver = link.deliver
    sent: list[DestinationMsg] = []

    async def hung(url: str, msg: DestinationMsg) -> None:
        sent.append(msg)
        await release.wait()
        await deliver(url, msg)

    link.deliver = hung  # type: ignore[method-assign]
    try:
        await w.decode.create(HandoffRequest(id="h0", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
        await eventually(lambda: len(sent) == 1, what="the first destination sent")
        assert sent[0].grants  # a peer not known to hang gets its first windows
        held = w.landing.arena.stats.used_bytes
        await asyncio.sleep(0.2)  # unanswered for longer than a window request may wait
        await w.decode.create(HandoffRequest(id="h1", prefill=["p"], dst_pages=[3, 4], dst_slot=1))
        await eventually(lambda: len(sent) == 2, what="the second destination sent")
        assert sent[1].grants == []
        assert w.landing.arena.stats.used_bytes == held
    finally:
        release.set()


async def test_windows_of_a_destination_that_never_reached_its_prefill_go_back_at_once(
    world: World,
) -> None:
    """A destination whose delivery failed, to a prefill that then answers nothing (not even
    the abort), leaves its first windows unused: they go back as its handoff fails, not held
    until deadline + grace (`Landing.settle`, `undelivered`). The abort is held, so no ack can
    lift them instead."""
    w = world
    link = w.decode._prefill
    deliver, abort = link.deliver, link.abort
    sent: list[DestinationMsg] = []
    answer = asyncio.Event()

    async def unreachable(url: str, msg: DestinationMsg) -> None:
        sent.append(msg)
        raise ConflictError("the destination did not reach it", field="handoff_id")

    async def silent(url: str, msg: Any) -> Any:
        await answer.wait()
        return await abort(url, msg)

    link.deliver = unreachable  # type: ignore[method-assign]
    link.abort = silent  # type: ignore[method-assign]
    try:
        await w.decode.create(
            HandoffRequest(id="u", prefill=["p"], dst_pages=[1, 2], dst_slot=0, deadline_s=60.0)
        )
        assert await wait_released(w, "u") == HandoffState.FAILED
        assert sent and sent[0].grants  # it was sent with first windows
        assert w.landing.arena.stats.used_bytes == 0
    finally:
        link.deliver = deliver  # type: ignore[method-assign]
        answer.set()


async def test_an_aborted_handoff_s_windows_go_back_once_its_prefill_confirms(
    world: World,
) -> None:
    """Issue 31: the quarantine of an ended handoff's windows is lifted once every writer's own
    prefill life confirmed it stopped (here its abort ack), not held until deadline + grace;
    and not before: while the ack is held back, the released handoff's windows stay
    quarantined (a writer may still write them)."""
    w = world
    link = w.decode._prefill
    abort = link.abort
    answer = asyncio.Event()

    async def held(url: str, msg: Any) -> Any:
        await answer.wait()
        return await abort(url, msg)

    link.abort = held  # type: ignore[method-assign]
    await w.decode.create(
        HandoffRequest(id="q", prefill=["p"], dst_pages=[1, 2], dst_slot=0, deadline_s=60.0)
    )

    def delivered() -> bool:
        h = open_handoff(w, "q")
        return h is not None and h.known_destination is not None

    await eventually(delivered, what="the destination with its first windows")
    held_bytes = w.landing.arena.stats.used_bytes
    assert held_bytes > 0
    aborting = asyncio.ensure_future(w.decode.abort("q"))  # returns once the prefill acked
    try:
        assert await wait_released(w, "q") == HandoffState.ABORTED  # the lease: at once
        await asyncio.sleep(0.05)
        assert w.landing.arena.stats.quarantined_bytes == held_bytes  # the windows: not yet
    finally:
        answer.set()
    await aborting
    await eventually(lambda: w.landing.arena.stats.used_bytes == 0, what="the windows back")
    assert w.landing.arena.stats.quarantined_bytes == 0


# ------------------------------------------------------------------ page-range readiness


async def test_page_ranges_are_committed_as_each_one_is_signalled(world: World) -> None:
    # Chunked prefill: each range of pages is committed before the next one is signalled, the
    # slot comes with the last; a stage may end with a range of no pages.
    w = world
    src, dst = [3, 4, 9, 10, 11, 20, 21], [10, 11, 2, 20, 21, 5, 6]
    commits: list[SegmentCommitted] = []
    finals: list[StageTransferred] = []
    w.bus.add_listener(lambda e: commits.append(e) if isinstance(e, SegmentCommitted) else None)
    w.bus.add_listener(
        lambda e: finals.append(e) if isinstance(e, StageTransferred) and e.final else None
    )
    await w.decode.create(HandoffRequest(id="c", prefill=["p"], dst_pages=dst, dst_slot=1))
    expected = {r: w.landing.expected("c", r) for r in (0, 1)}
    for rank, cuts in ((0, [0, 3, 5, 7]), (1, [0, 7, 7])):
        for i, (a, b) in enumerate(itertools.pairwise(cuts)):
            last = i == len(cuts) - 2

            def of_stage(rank: int = rank) -> int:
                return len([e for e in commits if e.pp_rank == rank])

            seen = of_stage()
            w.prefill.ready("c", rank, src[a:b], 2 if last else None, pages_from=a, last_pages=last)
            if b > a:  # this range's bytes reach the decode's pages before the next is sent
                await eventually(
                    lambda seen=seen: of_stage() > seen,  # type: ignore[misc]
                    what=f"a commit of stage {rank} pages {a}:{b}",
                )
                assert w.decode.get("c").state != HandoffState.COMPLETED or last
    assert await wait_released(w, "c") == HandoffState.COMPLETED
    assert_landed(w, src, dst, 2, 1)
    for rank in (0, 1):
        mine = [e for e in commits if e.pp_rank == rank]
        assert sum(e.bytes for e in mine) == expected[rank]
    assert len([e for e in commits if e.pp_rank == 0]) >= 3
    # One final transfer per stage, the zero-page end of stage 1 included.
    assert sorted(e.pp_rank for e in finals) == [0, 1]
    assert w.landing.arena.stats.used_bytes == 0


async def test_page_ranges_signalled_before_the_destination_land_once_it_comes(
    world: World,
) -> None:
    w = world
    src, dst = [1, 2, 3, 4], [9, 8, 7, 6]
    for rank in (0, 1):
        w.prefill.ready("early", rank, src[:1], None, pages_from=0, last_pages=False)
        w.prefill.ready("early", rank, src[1:], 0, pages_from=1, last_pages=True)
    await w.decode.create(HandoffRequest(id="early", prefill=["p"], dst_pages=dst, dst_slot=3))
    assert await wait_released(w, "early") == HandoffState.COMPLETED
    assert_landed(w, src, dst, 0, 3)


async def test_ranges_beyond_the_decode_pages_fail_the_stage_naming_the_field(
    world: World,
) -> None:
    # Signalled before the destination said how many pages there are: the stage worker checks
    # when it comes, and the handoff fails naming the field (no page of it is committed).
    w = world
    before = [w.dec.region(i).copy() for i in range(len(w.dec.layout.kv))]
    w.prefill.ready("over", 0, [1, 2, 3], 0, pages_from=0, last_pages=True)
    w.prefill.ready("over", 1, [1, 2, 3], 0, pages_from=0, last_pages=True)
    await w.decode.create(HandoffRequest(id="over", prefill=["p"], dst_pages=[4, 5], dst_slot=0))
    assert await wait_released(w, "over") == HandoffState.FAILED
    error = w.decode.get("over").error
    assert error is not None and error.context.get("field") == "src_pages", error
    after = [w.dec.region(i) for i in range(len(w.dec.layout.kv))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


async def test_bad_page_range_signals_are_refused_naming_the_field_and_change_nothing(
    world: World,
) -> None:
    w = world
    src, dst = [3, 4, 5, 6], [1, 2, 7, 8]
    await w.decode.create(HandoffRequest(id="b", prefill=["p"], dst_pages=dst, dst_slot=0))
    await eventually(lambda: open_handoff(w, "b") is not None, what="the destination")
    await eventually(
        lambda: open_handoff(w, "b").known_destination is not None, what="the destination"
    )
    w.prefill.ready("b", 0, src[:2], None, pages_from=0, last_pages=False)
    inp = open_handoff(w, "b").inputs[0]
    cases: list[tuple[type[KVHandoffError], dict[str, object], str]] = [
        (InvalidInput, dict(src_pages=src[3:], pages_from=3, last_pages=True), "pages_from"),
        (InvalidInput, dict(src_pages=src[1:], pages_from=1, last_pages=True), "pages_from"),
        (InvalidInput, dict(src_pages=src[2:], pages_from=-1, last_pages=True), "pages_from"),
        (InvalidInput, dict(src_pages=src[2:], last_pages=True), "pages_from"),
        (InvalidInput, dict(src_pages=src[2:], pages_from=2), "last_pages"),
        (
            InvalidInput,
            dict(src_pages=src[2:3], slot=0, pages_from=2, last_pages=True),
            "last_pages",
        ),
        (InvalidInput, dict(src_pages=[*src[2:], 9], pages_from=2, last_pages=False), "src_pages"),
        (InvalidInput, dict(src_pages=None, pages_from=2, last_pages=False), "src_pages"),
        (PlanError, dict(src_pages=[7, NUM_PAGES], pages_from=2, last_pages=False), "src_pages[1]"),
        (
            InvalidInput,
            dict(src_pages=src[2:3], slot=0, pages_from=2, last_pages=False),
            "src_slot",
        ),
        (PlanError, dict(src_pages=src[2:], pages_from=2, last_pages=True), "src_slot"),
        (
            InvalidInput,
            dict(src_pages=src[2:], layers=[0], pages_from=2, last_pages=False),
            "layers",
        ),
        (InvalidInput, dict(src_pages=src), "pages_from"),  # by layer after a range
    ]
    for exc, args, field in cases:
        kwargs = dict(args)
        pages, slot = kwargs.pop("src_pages"), kwargs.pop("slot", None)
        with pytest.raises(exc) as err:
            w.prefill.ready("b", 0, pages, slot, **kwargs)  # type: ignore[arg-type]
        assert err.value.context["field"] == field, (args, err.value)
        assert inp.src_pages.tolist() == src[:2] and not inp.ended  # nothing changed
    # A stage signalled by layer takes no range.
    w.prefill.ready("b", 1, src, 0)
    with pytest.raises(InvalidInput) as err:
        w.prefill.ready("b", 1, src[:1], None, pages_from=0, last_pages=False)
    assert err.value.context["field"] == "pages_from"
    # The right ranges still land the handoff.
    w.prefill.ready("b", 0, src[2:], 0, pages_from=2, last_pages=True)
    assert await wait_released(w, "b") == HandoffState.COMPLETED
    assert_landed(w, src, dst, 0, 0)
    # After the end: its last range was signalled, or (once closed) the handoff is finished.
    with pytest.raises((InvalidInput, ConflictError)):
        w.prefill.ready("b", 0, [], 0, pages_from=4, last_pages=True)


async def test_direct_mode_sends_a_ranged_stage_whole_once_its_last_range_is_in() -> None:
    w = await make_world(landed=False)
    try:
        src, dst = [3, 4, 9, 10, 11], [10, 11, 2, 20, 21]
        await w.decode.create(HandoffRequest(id="d", prefill=["p"], dst_pages=dst, dst_slot=1))
        for rank in (0, 1):
            w.prefill.ready("d", rank, src[:2], None, pages_from=0, last_pages=False)
        await asyncio.sleep(0.05)
        assert open_handoff(w, "d").bytes_sent == 0  # nothing moves before the last range
        for rank in (0, 1):
            w.prefill.ready("d", rank, src[2:], 2, pages_from=2, last_pages=True)
        assert await wait_released(w, "d") == HandoffState.COMPLETED
        assert_landed(w, src, dst, 2, 1)
    finally:
        await close_world(w)


async def test_a_stage_without_state_ends_with_a_range_of_no_pages() -> None:
    # Dense layers, no slot: every page is committed before the last range says the stage is
    # over; its arrival is an empty last notice, still reported as the stage's final transfer.
    model = dense_mha(num_layers=4, scale=64, page_size=4)
    w = await make_world(model=model, part=partition_layers(4, 2))
    try:
        finals: list[StageTransferred] = []
        w.bus.add_listener(
            lambda e: finals.append(e) if isinstance(e, StageTransferred) and e.final else None
        )
        src, dst = [5, 6, 7], [1, 2, 3]
        await w.decode.create(HandoffRequest(id="z", prefill=["p"], dst_pages=dst))
        for rank in (0, 1):
            w.prefill.ready("z", rank, src, None, pages_from=0, last_pages=False)
        await eventually(
            lambda: all(w.landing.committed("z", r) == w.landing.expected("z", r) for r in (0, 1)),
            what="every page committed",
        )
        assert w.decode.get("z").state != HandoffState.COMPLETED  # the last range is to come
        for rank in (0, 1):
            w.prefill.ready("z", rank, [], None, pages_from=3, last_pages=True)
        assert await wait_released(w, "z") == HandoffState.COMPLETED
        assert_landed(w, src, dst, 0, 0)
        assert sorted(e.pp_rank for e in finals) == [0, 1]
        assert all(e.bytes == 0 for e in finals)
    finally:
        await close_world(w)


async def test_a_stopping_decode_returns_only_once_no_commit_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A commit's copy runs in a thread and always ends; a stop whose quiesce wait timed out
    # must still wait for it, or the copy would write pages after the service stopped (and a
    # restart frees landed pages at once). The copy is held until a timer lets it go; the stop
    # must return after the copy ended, an order of instants, not a duration.
    import threading
    import time

    from kvhandoff.pipelines.decode import landing as landing_module

    monkeypatch.setattr(landing_module, "INLINE_COMMIT_BYTES", 0)  # every commit in a thread
    w = await make_world()
    started, let_go = threading.Event(), threading.Event()
    copy_ended: list[float] = []
    real = w.landing._scatter_check_commit

    def held(*args: Any) -> bool:
        started.set()
        let_go.wait(30.0)
        try:
            return real(*args)
        finally:
            copy_ended.append(time.monotonic())

    w.landing._scatter_check_commit = held  # type: ignore[method-assign]
    try:
        await w.decode.create(HandoffRequest(id="s", prefill=["p"], dst_pages=[1, 2], dst_slot=0))
        w.prefill.ready("s", 0, [3, 4], 1)
        assert await asyncio.to_thread(started.wait, 30.0)
        threading.Timer(0.5, let_go.set).start()
        await w.decode.close(timeout_s=0.01)  # its quiesce gives up long before the copy ends
        stopped = time.monotonic()
        assert copy_ended and copy_ended[0] <= stopped
    finally:
        let_go.set()
        await close_world(w)


async def test_a_heartbeat_answered_before_the_last_notice_s_ack_stops_nothing(
    world: World,
) -> None:
    """The decode completes a handoff on its stages' last segments and may answer a heartbeat
    without it before those notices' answers are back at the prefill (seen between real SGLang
    servers): the prefill must not stop the stages as a handoff its decode "no longer has"."""
    w = world
    link = w.decode._prefill
    assert isinstance(link, InProcessLink)
    real, release = link.segment, asyncio.Event()
    held: list[int] = []

    async def ack_held(url: str, msg: SegmentMsg) -> Any:
        ack = await real(url, msg)
        if msg.last:
            held.append(msg.pp_rank)
            await release.wait()
        return ack

    link.segment = ack_held  # type: ignore[method-assign]
    await w.decode.create(HandoffRequest(id="t", prefill=["p"], dst_pages=[5, 6], dst_slot=1))
    for rank in (0, 1):
        w.prefill.ready("t", rank, [1, 2], 0)
    await eventually(lambda: len(held) == 2, what="both last notices committed, answers held")
    assert w.decode.get("t").state == HandoffState.COMPLETED
    gone = HeartbeatAck(role="decode", url="d", incarnation=w.decode.incarnation, live=[])
    assert await w.prefill.reconcile("d", gone, ["t"]) == []
    release.set()
    await eventually(lambda: open_handoff(w, "t") is None, what="the prefill's stages ended")
    assert_landed(w, [1, 2], [5, 6], 0, 1)


async def test_a_host_arena_is_committed_from_through_one_numpy_view_of_it() -> None:
    """A `torch:cpu` arena is viewed as numpy once, at the start: each commit slices that view
    (a tensor's slice and conversion per commit cost more than a small segment's copy), and it
    is the arena's own memory, not a copy."""
    w = await make_world()
    try:
        window = w.landing._window
        tensor = pool_array(w._pools[1], 0)  # type: ignore[attr-defined]
        assert isinstance(window, np.ndarray) and window.shape[0] == tensor.shape[0]
        assert window.ctypes.data == tensor.data_ptr()
    finally:
        await close_world(w)
