"""Landed mode's safety as a property (SAFETY.md S1), against an engine that keeps no promise.

The engine double moves real bytes between real pools, but each write may land now, land later
(after its call returned, failed or timed out; after the handoff ended and its windows were
granted again), land twice, land corrupted, or never land. And while a commit runs its one
pass (in small chunks, `CHUNK_BYTES`, or as one chunk: both paths of `chunked.scatter_digest`),
a writer acts right before each chunk is scattered from the window and again between that
scatter and the digest of the pages it wrote: late writes land (into that very window, maybe),
the chunk's bytes change, or the next chunk's do.
Under random interleavings of create, ready, abort, peer loss and deadlines, checked at every
step:

- a KV page or state slot of the decode changes only by a commit (`Landing.commit`), only for
  the handoff that leases it at that moment, and only in that handoff's own pages and slot (a
  refused commit's one pass leaves them dirty);
- every handoff that completes has in its pages exactly its source bytes (so what a commit
  holds what its digest matched: a digest of the window, before or after the scatter, instead
  of the pages just written would complete with the writer's bytes);
- every handoff ends with one outcome and one release.

Direct mode cannot pass this (a late write there lands in the pages); the time bound is no part
of the argument here: the engine ignores `start_by` and `max_call_s` on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhandoff.pipelines import chunked
from kvhandoff.pipelines.arena import Arena
from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.landing import Landing
from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import KVHandoffError, TransportError
from kvhandoff.pipelines.events import EventBus, HandoffCompleted, event_tag
from kvhandoff.pipelines.inprocess import InProcessLink
from kvhandoff.pipelines.memory import PoolMemory, pool_array
from kvhandoff.pipelines.messages import layout_json
from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.pipelines.prefill import HostedStage, PrefillPipeline, Staging
from kvhandoff.pipelines.settings import DecodeSettings
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.pool_base import host_array
from kvhandoff.transport.pools import open_pool

MODEL = hybrid_npu_mla(num_layers=4, scale=8, page_size=4)
PART = partition_layers(4, 2)
NUM_PAGES = 6
SRC_PAGES = [1, 2, 3, 4]  # a prefix the decode holds (0 or 1 page), then up to 3 pages
SRC_SLOT = 1
ARENA_BYTES = 3 * 192 * 1024


@dataclass
class Delivery:
    blocks: Blocks
    corrupt: bool


@dataclass
class Engine:
    """Moves bytes like a transfer engine that lies: see the module docstring."""

    rng: random.Random
    check: Any = None  # called after every delivery (the invariant)
    pending: list[Delivery] = field(default_factory=list)
    landed_late: int = 0
    max_call_s: float = 0.01
    in_commit: bool = False  # a commit's pass runs: the pages are its own to change

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None:
        await asyncio.sleep(0)
        fate = self.rng.random()
        if fate < 0.55:
            self._land(Delivery(blocks, corrupt=False))
            if self.rng.random() < 0.2:  # and again, later
                self.pending.append(Delivery(blocks, corrupt=False))
            return
        if fate < 0.7:
            self._land(Delivery(blocks, corrupt=True))
            return
        if fate < 0.85:
            # Fails, but the session keeps sending: the bytes land later anyway.
            self.pending.append(Delivery(blocks, corrupt=self.rng.random() < 0.3))
            raise TransportError("injected: call failed, bytes still in flight", rc=-1)
        if fate < 0.95:
            # Succeeds, but the bytes are delayed past the notice.
            self.pending.append(Delivery(blocks, corrupt=False))
            return
        raise TransportError("injected: nothing landed", rc=-1)

    async def quiesce(self, peer: str | None = None) -> None:
        return None  # it "confirms" at once: the decode must not rely on it

    def deliver_some(self) -> None:
        """Land a random part of what is still in flight (any order)."""
        self.rng.shuffle(self.pending)
        keep = []
        for d in self.pending:
            if self.rng.random() < 0.5:
                self._land(d)
                self.landed_late += 1
            else:
                keep.append(d)
        self.pending = keep

    def _land(self, d: Delivery) -> None:
        for src, dst, n in zip(
            d.blocks.src_addr.tolist(), d.blocks.dst_addr.tolist(), d.blocks.length.tolist()
        ):
            host_array(dst, n)[:] = host_array(src, n)
        if d.corrupt:
            host_array(int(d.blocks.dst_addr[0]), 1)[0] ^= 0x5A
        if self.check is not None and not self.in_commit:
            self.check()


@dataclass
class Rig:
    decode: DecodePipeline
    prefill: PrefillPipeline
    engine: Engine
    bus: EventBus
    dec: PoolMemory
    stages: dict[int, PoolMemory]
    pools: list[Any]
    shadow: list[np.ndarray] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    writer_acts: int = 0  # the mid-commit writer acted around a chunk's scatter
    dirty_refusals: int = 0  # refused commits that left their own pages dirty
    writer_fate: float | None = None  # the mid-commit writer's act, fixed (else drawn per chunk)

    def kv(self) -> list[np.ndarray]:
        return [
            self.dec.region(i) for i in range(len(self.dec.layout.kv) + len(self.dec.layout.state))
        ]

    def check_own(self, before: list[np.ndarray], h: Any) -> None:
        """A commit of `h` changed nothing but `h`'s own pages and slot."""
        lay, slot = self.dec.layout, h.request.dst_slot or 0
        items = [e.item_len for e in lay.kv] + [s.item_len for s in lay.state]
        own = [h.dst_pages] * len(lay.kv) + [[slot]] * len(lay.state)
        for i, (then, now, item, rows) in enumerate(zip(before, self.kv(), items, own)):
            a, b = now.reshape(-1, item).copy(), then.reshape(-1, item).copy()
            a[rows], b[rows] = 0, 0
            if not np.array_equal(a, b):
                self.violations.append(f"{h.id}: a commit changed entry {i} outside its lease")

    def check_unchanged(self) -> None:
        for i, (now, then) in enumerate(zip(self.kv(), self.shadow)):
            if not np.array_equal(now, then):
                self.violations.append(f"decode entry {i} changed outside a commit")
                then[:] = now  # report once


def rig(seed: int) -> Rig:
    engine = Engine(random.Random(seed))
    bus = EventBus()
    link = InProcessLink()
    layout = decode_layout(MODEL, num_pages=NUM_PAGES, num_slots=3)
    dec_pool = open_pool("torch:cpu", layout.region_sizes)
    dec = PoolMemory(layout, dec_pool)
    stages = {}
    for r in range(2):
        lay = stage_layout(MODEL, PART, r, num_pages=NUM_PAGES, num_slots=3)
        pool = open_pool("torch:cpu", lay.region_sizes)
        m = PoolMemory(lay, pool)
        for i in range(len(lay.kv) + len(lay.state)):
            m.region(i)[:] = np.random.default_rng(100 * r + i).integers(1, 255, m.region(i).size)
        stages[r] = m
    # A small arena: windows are re-granted while late writes into them are still on their way.
    # (Three windows of the largest segment: one state slot here is 128 KiB.)
    arena_pool = open_pool("torch:cpu", [ARENA_BYTES])
    landing = Landing(
        Arena(arena_pool.bases[0], ARENA_BYTES),
        pool_array(arena_pool, 0),
        dec,
        layout,
        window_bytes=ARENA_BYTES // 3,
    )
    staging_pool = open_pool("torch:cpu", [ARENA_BYTES])
    staging = Staging(Arena(staging_pool.bases[0], ARENA_BYTES), pool_array(staging_pool, 0))
    decode = DecodePipeline(
        dec.layout,
        "dec",
        "d",
        link,
        bus,
        memory=dec,
        landing=landing,
        settings=DecodeSettings(max_grace_s=0.05),
    )
    prefill = PrefillPipeline(
        {r: HostedStage(m.layout, m, m) for r, m in stages.items()},
        engine,
        link,
        bus,
        staging=staging,
    )
    link.decode = decode
    link.add_prefill("p", prefill, "pre")
    r = Rig(decode, prefill, engine, bus, dec, stages, [dec_pool, arena_pool, staging_pool])
    r.pools += [m.pool for m in stages.values()]
    r.shadow = [a.copy() for a in r.kv()]
    engine.check = r.check_unchanged

    # Every commit is checked where it happens: its handoff holds the lease, and afterwards the
    # pages it wrote are the new truth.
    real = landing._scatter_check_commit

    def commit(*args):  # type: ignore[no-untyped-def]
        h = args[2]  # (pairing, pieces, h, ...): the rest passes through as it came
        r.check_unchanged()
        if not decode.leases.holds(h.id) or h.state.terminal:
            r.violations.append(f"{h.id}: a commit without the lease or after the outcome")
        engine.in_commit = True
        try:
            ok = real(*args)
        finally:
            engine.in_commit = False
        r.check_own(r.shadow, h)
        if not ok and any(not np.array_equal(a, b) for a, b in zip(r.kv(), r.shadow)):
            r.dirty_refusals += 1
        r.shadow = [a.copy() for a in r.kv()]
        return ok

    landing._scatter_check_commit = commit  # type: ignore[method-assign]
    window = np.asarray(landing._window)  # the arena's bytes as numpy (host memory)
    real_scatter = chunked.scatter_views

    def scatter_with_writers(views: list[tuple[Any, Any, Any]]) -> None:
        """At most one writer act per chunk of a commit (commits of this size run on the
        loop: this is the loop's thread): late writes land (before the chunk's scatter or
        between it and the digest of the pages it wrote), the chunk's bytes change just before
        its scatter or just after it, or the next chunk's change."""
        views = list(views)
        first, last = views[0][2], views[-1][2]  # the chunk's pieces, packed one after another
        if not (isinstance(first, np.ndarray) and np.shares_memory(first, window)):
            real_scatter(views)  # not a commit's
            return
        start = first.ctypes.data - window.ctypes.data
        end = last.ctypes.data - window.ctypes.data + last.nbytes
        chunk = window[start:end]
        fate = engine.rng.random() if r.writer_fate is None else r.writer_fate
        late = fate < 0.2 and bool(engine.pending)
        if late and fate < 0.1:
            engine.deliver_some()  # maybe into this very chunk, before it is scattered
        elif 0.2 <= fate < 0.25:
            chunk[0] ^= 0x33  # the chunk's bytes change before the scatter reads them
        real_scatter(views)
        if late and fate >= 0.1:
            engine.deliver_some()  # the pages are digested next
        elif 0.2 <= fate < 0.225:
            chunk[0] ^= 0x33  # ... and are repaired before the digest: the pages stay wrong
        elif 0.25 <= fate < 0.45:
            chunk[0] ^= 0x33  # the bytes just scattered change in the window
        elif 0.45 <= fate < 0.5 and end < window.shape[0]:
            window[end] ^= 0x33  # the next chunk's (or a free byte) change
        r.writer_acts += late or 0.2 <= fate < 0.5

    chunked.scatter_views = scatter_with_writers  # type: ignore[assignment]
    bus.add_listener(lambda e: _check_completed(r, e))
    return r


def _check_completed(r: Rig, event: Any) -> None:
    """At the moment a handoff completes, its pages and slot hold exactly its source bytes."""
    if not isinstance(event, HandoffCompleted) or event.role != "decode":
        return
    h = r.decode._handoffs[event.handoff_id]
    dst, n, skip = h.dst_pages, int(h.dst_pages.shape[0]), h.request.prefix_pages
    src = np.asarray(SRC_PAGES[skip : skip + n])
    for m in r.stages.values():
        for i, e in enumerate(m.layout.kv):
            j = next(
                k
                for k, d in enumerate(r.dec.layout.kv)
                if (d.layer_id, d.group) == (e.layer_id, e.group)
            )
            s_rows = m.region(i)[: e.nbytes].reshape(-1, e.item_len)
            d_rows = r.dec.region(j)[: e.nbytes].reshape(-1, e.item_len)
            if not np.array_equal(s_rows[src], d_rows[dst]):
                r.violations.append(f"{h.id}: completed with wrong bytes in layer {e.layer_id}")
        for i, s in enumerate(m.layout.state):
            j = next(
                k
                for k, d in enumerate(r.dec.layout.state)
                if (d.layer_id, d.kind) == (s.layer_id, s.kind)
            )
            slot = h.request.dst_slot or 0
            a = m.region(len(m.layout.kv) + i)[SRC_SLOT * s.item_len : (SRC_SLOT + 1) * s.item_len]
            b = r.dec.region(len(r.dec.layout.kv) + j)[slot * s.item_len : (slot + 1) * s.item_len]
            if not np.array_equal(a, b):
                r.violations.append(f"{h.id}: completed with a wrong slot in layer {s.layer_id}")


handoff_ids = st.sampled_from(["a", "b", "c"])
actions = st.one_of(
    st.tuples(
        st.just("create"),
        handoff_ids,
        st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=3, unique=True),
        st.integers(0, 2),
        st.sampled_from([0.05, 0.2, 2.0]),
        st.integers(0, 1),  # pages of a prefix the decode holds
    ),
    st.tuples(st.just("ready"), handoff_ids, st.sampled_from([0, 1, None])),
    # Chunked prefill: the stage's pages in two ranges (the slot with the second), split here.
    st.tuples(
        st.just("ready_pages"), handoff_ids, st.sampled_from([0, 1, None]), st.integers(0, 3)
    ),
    st.tuples(st.just("abort"), handoff_ids),
    st.tuples(st.just("peer_lost")),
    st.tuples(st.just("deliver")),
    st.tuples(st.just("steps"), st.integers(0, 20)),
    st.tuples(st.just("sleep"), st.sampled_from([0.005, 0.02, 0.06])),
)


# Every segment here is larger than the small chunk and fits the large one: a commit then
# takes each of `scatter_digest`'s two paths (many chunks; one chunk, not cut), and the writer
# acts around every chunk of either.
SMALL_CHUNK, ONE_CHUNK = 4096, ARENA_BYTES
BOTH_PATHS = pytest.mark.parametrize(
    "chunk_bytes", [SMALL_CHUNK, ONE_CHUNK], ids=["chunks", "one-chunk"]
)


async def play(
    script: list[tuple[object, ...]],
    seed: int,
    chunk_bytes: int = SMALL_CHUNK,
    writer_fate: float | None = None,
) -> Rig:
    real_scatter, real_chunk = chunked.scatter_views, chunked.CHUNK_BYTES
    chunked.CHUNK_BYTES = chunk_bytes
    try:
        return await _play(script, seed, writer_fate)
    finally:
        chunked.scatter_views, chunked.CHUNK_BYTES = real_scatter, real_chunk


async def _play(script: list[tuple[object, ...]], seed: int, writer_fate: float | None) -> Rig:
    r = rig(seed)
    r.writer_fate = writer_fate
    tasks: list[asyncio.Future[object]] = []
    for action in script:
        match action:
            case ("create", str(hid), list(pages), int(slot), float(deadline_s), int(prefix)):
                req = HandoffRequest(
                    id=hid,
                    prefill=["p"],
                    dst_pages=pages,
                    prefix_pages=prefix,
                    dst_slot=slot,
                    deadline_s=deadline_s,
                )
                tasks.append(asyncio.ensure_future(r.decode.create(req)))
            case ("ready", str(hid), rank):
                for k in (0, 1) if rank is None else (rank,):
                    tasks.append(asyncio.ensure_future(_ready(r, hid, int(k))))  # type: ignore[call-overload]
            case ("ready_pages", str(hid), rank, int(cut)):
                for k in (0, 1) if rank is None else (rank,):
                    tasks.append(asyncio.ensure_future(_ready_pages(r, hid, int(k), cut)))  # type: ignore[call-overload]
            case ("abort", str(hid)):
                if hid in r.decode._handoffs:
                    tasks.append(asyncio.ensure_future(r.decode.abort(hid)))
            case ("peer_lost",):
                r.decode.peer_lost("p", "was silent")
            case ("deliver",):
                r.engine.deliver_some()
            case ("steps", int(n)):
                for _ in range(n):
                    await asyncio.sleep(0)
            case ("sleep", float(s)):
                await asyncio.sleep(s)
        r.check_unchanged()
    await asyncio.gather(*tasks, return_exceptions=True)
    r.engine.deliver_some()
    async with asyncio.timeout(20):
        await r.decode.close(5.0)
        await r.prefill.close()
    r.engine.pending, late = [], r.engine.pending
    for d in late:  # whatever was still in flight lands after everything ended
        r.engine._land(d)
    r.check_unchanged()
    for pool in r.pools:
        pool.close()
    return r


async def _ready(r: Rig, hid: str, rank: int) -> None:
    await asyncio.sleep(0)
    h = r.decode._handoffs.get(hid)
    n = 1 if h is None else h.request.prefix_pages + int(h.dst_pages.shape[0])
    # A refused signal (the handoff already ended here) is part of the game.
    with contextlib.suppress(KVHandoffError):
        r.prefill.ready(hid, rank, SRC_PAGES[:n], SRC_SLOT)


async def _ready_pages(r: Rig, hid: str, rank: int, cut: int) -> None:
    await asyncio.sleep(0)
    h = r.decode._handoffs.get(hid)
    n = 1 if h is None else h.request.prefix_pages + int(h.dst_pages.shape[0])
    cut = min(cut, n)
    with contextlib.suppress(KVHandoffError):
        r.prefill.ready(hid, rank, SRC_PAGES[:cut], None, pages_from=0, last_pages=False)
        await asyncio.sleep(0)  # the first range's segment may be cut and sent meanwhile
        await asyncio.sleep(0)
        r.prefill.ready(hid, rank, SRC_PAGES[cut:n], SRC_SLOT, pages_from=cut, last_pages=True)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # CI runs the same interleavings every time
)
@given(st.lists(actions, min_size=2, max_size=14), st.integers(0, 1000))
@BOTH_PATHS
def test_kv_pages_change_only_by_commits_of_their_leasing_handoff(
    chunk_bytes: int, script: list[tuple[object, ...]], seed: int
) -> None:
    r = asyncio.run(play(script, seed, chunk_bytes))
    assert r.violations == []
    for h in r.decode._handoffs.values():
        view = h.view()
        assert view.state.terminal, (h.id, view.state)
        assert view.released, h.id
        tags = [event_tag(e) for e in view.timeline]
        assert tags.count("handoff.released") == 1
        assert (
            sum(t in ("handoff.completed", "handoff.failed", "handoff.aborted") for t in tags) == 1
        )
        # A lying engine fails handoffs; a crash in kvhandoff (or in this rig) never is the game.
        assert view.error is None or view.error.code != "internal_error", (h.id, view.error)
    assert len(r.decode.leases) == 0


PLAIN: list[tuple[object, ...]] = [
    ("create", "a", [0, 1], 0, 2.0, 0),
    ("ready", "a", None),
    *[("sleep", 0.06)] * 2,
    ("deliver",),
    ("sleep", 0.06),
]


@BOTH_PATHS
def test_the_rig_completes_handoffs_through_the_lying_engine(chunk_bytes: int) -> None:
    """The property above is not vacuous in landed mode: through the same rig and engine, plain
    create-and-ready scripts complete (the engine's fate decides which), each checked at its
    completion by `_check_completed`, on either path of `scatter_digest`."""
    states, acts, dirty = [], 0, 0
    for seed in range(8):
        r = asyncio.run(play(PLAIN, seed, chunk_bytes))
        assert r.violations == []
        view = r.decode._handoffs["a"].view()
        assert view.error is None or view.error.code != "internal_error", view.error
        states.append(view.state.value)
        acts, dirty = acts + r.writer_acts, dirty + r.dirty_refusals
    assert states.count("completed") >= 2, states
    # The mid-commit writer acted, and refused commits left dirty pages the handoff then did
    # not complete on (or rewrote by a matching resend before it did).
    assert acts > 0 and dirty > 0, (acts, dirty)


@BOTH_PATHS
def test_a_chunk_changed_only_while_it_is_scattered_never_completes(chunk_bytes: int) -> None:
    """The writer changes every chunk's bytes in the window just before its scatter and puts
    them back just after it: the pages hold the changed bytes, the window the right ones. A
    commit that digested the window (before or after its scatter) instead of the pages it
    wrote would complete with wrong pages; on either path every commit must be refused. The
    property above draws this act for 1 chunk in 40, and a one-chunk commit has one chunk, so
    its random scripts rarely meet it on that path: here it is every chunk's."""
    refused = 0
    for seed in range(4):
        r = asyncio.run(play(PLAIN, seed, chunk_bytes, writer_fate=0.21))
        assert r.violations == []
        assert r.decode._handoffs["a"].view().state != HandoffState.COMPLETED
        refused += r.dirty_refusals
    assert refused > 0  # commits ran, each scattered the changed bytes and was refused


def test_the_property_can_fail_in_direct_mode() -> None:
    """The same engine against direct mode completes handoffs with wrong bytes in their pages
    (a corrupted or late write lands there): the completion check above is not vacuous."""

    async def run() -> list[str]:
        r = rig(7)
        r.decode._landing = None  # direct mode: destinations name KV pages
        r.decode._releases._landing = None
        r.decode._delivery._landing = None
        r.decode._notices.landed = False
        r.decode._delivery.peer_layout = r.decode.layout  # its pages' addresses are published
        r.decode._delivery._peer_layout_json = layout_json(r.decode.layout)  # as destinations say
        r.prefill.mode = "direct"  # and its prefill is configured for it
        r.engine.check = None  # prefills write the pages themselves here
        for i in range(6):
            hid = f"d{i}"
            await r.decode.create(
                HandoffRequest(
                    id=hid, prefill=["p"], dst_pages=[i % 3, 3 + i % 3], dst_slot=0, deadline_s=0.5
                )
            )
            for k in (0, 1):
                await _ready(r, hid, k)
            # The next handoff leases the same slot: wait for this one's release.
            await r.decode.wait(hid, 10.0, released=True)
            r.engine.deliver_some()
        await r.decode.close(1.0)
        await r.prefill.close()
        for pool in r.pools:
            pool.close()
        return [v for v in r.violations if "completed with" in v]

    assert asyncio.run(run()) != []
