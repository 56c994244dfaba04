"""Land, verify, commit: the decode's landing arena and the one code path that writes KV pages.

In landed mode a prefill never writes into KV pages. It writes each packed segment into a window
of this decode's landing arena, granted to one stage of one handoff (`grant`, `first_grants`,
`next_grant`), and says so (`SegmentMsg`). `commit` then, for the handoff that leases the pages:

1. checks the notice names its own grant, pieces of its own destination not committed yet, and
   the bytes those pieces hold (nothing changes on a refusal);
2. reads the window once, chunk by chunk: each chunk scattered into the pages and slot, then
   the pages just written digested (`pipelines/chunked.py`): only this commit writes them, so
   a write landing in the window meanwhile changes what lands and then the digest refuses it;
3. counts the segment's cells committed only if the digest of what the pages hold matches, and
   gives the window back; on a mismatch the cells stay uncommitted (their pages are dirty: the
   stage cannot arrive on them) and the window is kept out of use until the handoff ends.

SAFETY.md S1: KV pages and state slots change only here, for a handoff that is not terminal
and holds their lease; `Releases` releases a lease only once `idle(h)` (no commit of it runs).
S4: a stage arrives only once every cell was committed by a matching digest (`coverage.py`).
A late or stale write can only hit a window: free (harmless), or granted again (its new owner's
digest refuses it).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.arena import Arena, Extent
from kvhandoff.pipelines.awaiting import finish
from kvhandoff.pipelines.chunked import scatter_digest
from kvhandoff.pipelines.decode.coverage import Cells, HandoffLanding, StageLanding
from kvhandoff.pipelines.decode.handoff import DecodeHandoff
from kvhandoff.pipelines.digest import Algorithm, Digester, segment_seed
from kvhandoff.pipelines.errors import ConflictError, InvalidInput
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import Grant, SegmentMsg
from kvhandoff.pipelines.packing import (
    ByteRegions,
    Pieces,
    check_pieces,
    destination_side,
    host_view,
)
from kvhandoff.pipelines.pairing import Pairing

I64 = npt.NDArray[np.int64]
log = logging.getLogger(__name__)

#: Below this many bytes a commit runs on the event loop: a thread hop costs more than the copy.
INLINE_COMMIT_BYTES = 256 * 1024
#: A stop still waiting for a commit's copy after this long says so (and goes on waiting).
DRAIN_WARN_S = 10.0
#: Windows one stage may hold at once: its sender's segments in flight (two) and one to send a
#: refused segment again into. More are not granted, so a sender cannot hoard the arena.
MAX_WINDOWS_PER_STAGE = 3
#: How long one window request waits for room before it answers "none yet, ask again": well
#: inside a peer call's timeout, so a full arena is backpressure, not a failed call.
WINDOW_WAIT_S = 1.0


class Verdict(enum.Enum):
    """What `Landing.commit` made of one segment."""

    COMMITTED = "committed"
    REFUSED = "refused"  # its digest did not match; it may be sent once more
    SPENT = "spent"  # refused again: its resends are spent, the handoff fails


class Landing:
    """The landing arena of one decode pipeline and the commits out of it."""

    def __init__(
        self,
        arena: Arena,
        window: Any,
        memory: ByteRegions,
        layout: StageLayout,
        *,
        window_bytes: int,
        algorithm: Algorithm = "xxh3_128",
        peer_share: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.arena = arena
        # The whole arena as one 1-D uint8 array on its device; numpy for host memory, made
        # once (a CPU tensor's slices and conversions cost more than a small commit's copy).
        self._window = host_view(window)
        self._memory = memory
        self._layout = layout
        self.window_bytes = min(window_bytes, arena.capacity_bytes)
        self.algorithm: Algorithm = algorithm
        # The share of the arena one prefill peer's windows may take, held or quarantined (at
        # least one window): a peer that hangs with windows granted cannot starve the others.
        self.peer_share = peer_share
        self._monotonic = monotonic
        self._handoffs: dict[str, HandoffLanding] = {}
        self._grants: dict[int, tuple[str, int]] = {}  # grant id -> (handoff id, pp_rank)
        # Bytes each prefill peer's requests wait for in `arena.take`: counted in its share
        # when they queue, since the arena serves its queue without asking whose they are.
        self._queued: dict[str, int] = {}
        # (handoff id, rank) -> windows of a stage whose destination was in flight as its
        # handoff ended: `delivery_ended` decides whether they were used.
        self._in_flight: dict[tuple[str, int], list[Extent]] = {}
        self._next_grant_id = 0

    # ----------------------------------------------------------------- handoffs

    def open(
        self,
        handoff_id: str,
        dst_pages: I64,
        pairings: dict[int, Pairing],
        peers: dict[int, str],
    ) -> None:
        """Start landing a new handoff's stages (its slots were validated against the layout:
        every slot row has its index), each sent by its prefill `peers[rank]`; raises
        InvalidInput (changing nothing) when a page, slot or aux row of a stage cannot fit one
        window."""
        n = int(dst_pages.shape[0])
        stages = {}
        for rank, pairing in pairings.items():
            stage = StageLanding.of(pairing, n, peers[rank])
            if stage.largest_item > self.window_bytes:
                raise InvalidInput(
                    f"stage {rank} has a {stage.largest_item}-byte page or slot, larger than "
                    f"the landing window ({self.window_bytes} bytes): raise transfer.window_bytes",
                    field="window_bytes",
                    pp_rank=rank,
                )
            stages[rank] = stage
        self._handoffs[handoff_id] = HandoffLanding(stages)

    def forget(self, handoff_id: str) -> None:
        """A handoff opened here was not created after all (nothing was granted yet)."""
        self._handoffs.pop(handoff_id, None)

    def expected(self, handoff_id: str, rank: int) -> int:
        return self._stage(handoff_id, rank).expected

    def first_grants(self, h: DecodeHandoff, ranks: list[int]) -> list[Grant]:
        """A first window for each of `ranks` if the arena has room now (else they ask)."""
        out = []
        for rank in ranks:
            g = self._try_grant(h.id, rank)
            if g is not None:
                out.append(g)
        return out

    async def grant(self, h: DecodeHandoff, rank: int, nbytes: int) -> Grant | None:
        """A window of up to `nbytes` for stage `rank`, waiting up to `WINDOW_WAIT_S` for room
        (bounded by the handoff's deadline); None when there was none."""
        stage = self._stage(h.id, rank)
        stage.heard = True  # its prefill has the destination
        if len(stage.grants) >= MAX_WINDOWS_PER_STAGE:
            return None  # a sender keeps IN_FLIGHT (2) windows, plus one to resend into
        want = min(nbytes, self.window_bytes, max(stage.expected - stage.committed, 1))
        until = min(h.deadline_mono, self._monotonic() + WINDOW_WAIT_S)
        while not self._within_share(stage.peer, want):
            # Its peer holds its share: wait as for a full arena, then it asks again.
            if not await self.arena.freed(until) or h.state.terminal:
                return None
        # Counted from the share check on, with no await between: a request queued for a full
        # arena is part of what its peer may hold.
        queued = self.arena.rounded(want)
        self._queued[stage.peer] = self._queued.get(stage.peer, 0) + queued
        try:
            extent = await self.arena.take(want, h.id, until_mono=until)
        except TimeoutError:
            return None
        finally:
            left = self._queued[stage.peer] - queued
            if left:
                self._queued[stage.peer] = left
            else:
                del self._queued[stage.peer]
        if (
            h.state.terminal
            or len(stage.grants) >= MAX_WINDOWS_PER_STAGE
            or not self.arena.holds(extent)
        ):
            # It ended, or another request of the stage was granted, while we waited; or its
            # windows were given back (settled, or the quarantine lifted) as this one was served.
            self.arena.give_back(extent)
            return None
        return self._issue(h.id, rank, extent, want)

    async def commit(self, h: DecodeHandoff, rank: int, msg: SegmentMsg) -> Verdict:
        """Commit the segment `msg` names into `h`'s pages (see the module docstring). Returns
        COMMITTED, or, when what the pages hold did not hash to the digest (its cells stay
        uncommitted), REFUSED while the segment may be sent again (`RESENDS_PER_SEGMENT`,
        counted per piece of the stage, so two segments are each allowed theirs) and SPENT
        after. Raises InvalidInput / ConflictError, changing nothing, for a notice this grant
        cannot hold."""
        stage, extent, pieces = self._checked(h, rank, msg)
        # From the claim to the end of the scatter the pages are written: the lease waits for
        # `idle`. Nothing was awaited since `_checked` saw `h` live. The grant is closed before
        # the pass's await: a second notice naming it (other pieces, same window) is refused.
        cells = stage.claim(pieces, rank)
        self._close_grant(msg.grant_id, stage)
        hl = self._handoffs[h.id]
        hl.begin()
        ok = False
        try:
            # What the digest must have been computed under: this life (the pipeline checked
            # the notice names it), this handoff and stage, this grant and these pieces (an
            # earlier owner's bytes do not match).
            seed = segment_seed(
                msg.decode_incarnation,
                h.id,
                rank,
                msg.grant_id,
                pieces.rows,  # the notice's lists as int64 already: no second conversion
                pieces.starts,
                pieces.ends,
            )
            args = (stage.pairing, pieces, h, extent.offset, msg.digest, seed, msg.bytes)
            if msg.bytes <= INLINE_COMMIT_BYTES:
                ok = self._scatter_check_commit(*args)
            else:
                # Even if this caller is cancelled, the lease waits for the pass to end.
                ok = await finish(asyncio.to_thread(self._scatter_check_commit, *args))
        finally:
            hl.end()
            if not ok:
                stage.release(cells)  # dirty pages, not committed: the stage cannot arrive
        return self._verdict(stage, extent, cells, ok, msg.bytes)

    def _checked(
        self, h: DecodeHandoff, rank: int, msg: SegmentMsg
    ) -> tuple[StageLanding, Extent, Pieces]:
        """The stage, the window and the pieces of a notice that names its own open grant,
        pieces of its own destination and their exact bytes, for a live handoff; else raises."""
        stage = self._stage(h.id, rank)
        stage.heard = True
        extent = stage.grants.get(msg.grant_id)
        if extent is None or self._grants.get(msg.grant_id) != (h.id, rank):
            raise ConflictError(
                f"grant {msg.grant_id} is not an open window of handoff {h.id!r} stage {rank}",
                field="grant_id",
                pp_rank=rank,
            )
        pieces = Pieces.of(msg.rows, msg.starts, msg.ends)
        nbytes = check_pieces(stage.pairing, pieces, int(h.dst_pages.shape[0]), True, pp_rank=rank)
        if nbytes != msg.bytes or nbytes > extent.length:
            raise InvalidInput(
                f"the segment's pieces hold {nbytes} bytes; the notice says {msg.bytes} and "
                f"its window holds {extent.length}",
                field="bytes",
                pp_rank=rank,
            )
        if h.state.terminal:
            raise ConflictError(
                f"handoff {h.id!r} is already {h.state.value}: nothing more is committed",
                field="handoff_id",
                pp_rank=rank,
            )
        return stage, extent, pieces

    def _verdict(
        self, stage: StageLanding, extent: Extent, cells: Cells, ok: bool, nbytes: int
    ) -> Verdict:
        if ok:
            stage.committed += nbytes
            self.arena.give_back(extent)
            return Verdict.COMMITTED
        # A writer may still be writing this window: out of use until the handoff ends.
        self.arena.quarantine(extent, float("inf"))
        return Verdict.SPENT if stage.refuse(cells) else Verdict.REFUSED

    def next_grant(self, h: DecodeHandoff, rank: int) -> Grant | None:
        """Another window for the stage now, if it has bytes left without one and there is room."""
        if h.state.terminal:
            return None
        return self._try_grant(h.id, rank)

    def complete(self, h: DecodeHandoff, rank: int) -> bool:
        return self._stage(h.id, rank).complete()

    def committed(self, handoff_id: str, rank: int) -> int:
        hl = self._handoffs.get(handoff_id)
        return hl.stages[rank].committed if hl is not None and rank in hl.stages else 0

    async def idle(self, h: DecodeHandoff) -> None:
        """Returns once no commit of `h` runs. Called once `h` is terminal, so none starts."""
        hl = self._handoffs.get(h.id)
        if hl is not None:
            await hl.idle.wait()

    def settle(
        self,
        h: DecodeHandoff,
        *,
        writers_done: bool,
        until_mono: float,
        undelivered: frozenset[int] = frozenset(),
        in_flight: frozenset[int] = frozenset(),
    ) -> None:
        """`h` ended: its windows go back now when every writer is done (it completed), or are
        quarantined until `until_mono` (its bound) when a writer may still write them. A window
        of a stage in `undelivered` (its destination was never sent, or its delivery ended
        unaccepted) whose prefill never named it goes back at once: unused, and were that
        prefill to write it after all, a later owner's digest (seeded by its own grant) refuses
        the bytes (S3). A stage in `in_flight` (its delivery call has not ended: a hung prefill
        may read it once it runs again) keeps its windows quarantined until `delivery_ended`
        says how that call ended."""
        hl = self._handoffs.pop(h.id, None)
        if hl is None:
            return
        for rank, stage in hl.stages.items():
            unused = rank in undelivered and not stage.heard
            if rank in in_flight and not stage.heard and not writers_done and stage.grants:
                self._in_flight[(h.id, rank)] = list(stage.grants.values())
            for gid, extent in stage.grants.items():
                self._grants.pop(gid, None)
                if unused and not writers_done:
                    self.arena.give_back(extent)
            stage.grants.clear()
        if writers_done:
            # Quarantined windows of rejected segments too: their writer reported again since.
            self.arena.give_back_owner(h.id)
        else:
            self.arena.quarantine_owner(h.id, until_mono)

    def lift(self, handoff_id: str) -> None:
        """Every writer of an ended handoff confirmed it stopped (its prefill life's abort ack,
        or a heartbeat answer without it): its quarantined windows go back now."""
        if handoff_id not in self._handoffs:
            self.arena.give_back_owner(handoff_id)
            for key in [k for k in self._in_flight if k[0] == handoff_id]:
                del self._in_flight[key]

    def delivery_ended(self, handoff_id: str, ranks: list[int], *, accepted: bool) -> None:
        """The delivery of `ranks`' destination, in flight when the handoff ended, ended: not
        accepted, their windows were never used and go back now; accepted, their prefill may
        write them, and they stay quarantined (until their bound, or `lift`)."""
        if not self._in_flight:
            return
        for rank in ranks:
            for extent in self._in_flight.pop((handoff_id, rank), ()):
                if not accepted:
                    self.arena.give_back(extent)  # a no-op when lifted and taken again since

    async def drain(self) -> None:
        """Returns once no commit of any handoff runs. Not bounded by time, and need not be: a
        commit is a local copy of at most one window, which always ends. A service that stops
        waits for this, so no commit of its life writes a page after it stopped (a record of
        it that says unreleased frees its pages at once after a restart: S1)."""
        running = [hl.idle.wait() for hl in self._handoffs.values() if hl.running]
        waiting = asyncio.gather(*running)
        try:
            async with asyncio.timeout(DRAIN_WARN_S):
                await asyncio.shield(waiting)
        except TimeoutError:
            log.error(
                "stopping: %d commit(s) still copying after %g s; waiting for them (a hung "
                "device holds the stop here: no page may change after it)",
                len(running),
                DRAIN_WARN_S,
            )
            await waiting

    def close(self) -> None:
        """The pipeline closed: stop the arena's timers and drop the view of its memory (the
        service unregisters and frees the pool next; no commit runs any more)."""
        self.arena.close()
        self._window = None

    # ----------------------------------------------------------------- internals

    def _scatter_check_commit(
        self,
        pairing: Pairing,
        pieces: Pieces,
        h: DecodeHandoff,
        offset: int,
        expected_digest: str,
        seed: int,
        nbytes: int,
    ) -> bool:
        """One pass over the window at `offset` into `h`'s pages and slots (the `nbytes`
        `check_pieces` counted): True when the pages it wrote hash to `expected_digest`; False
        leaves them dirty (written, uncommitted)."""
        side = destination_side(pairing, self._memory, h.dst_pages, h.request.slots)
        digester = Digester(self.algorithm, seed=seed)
        got = scatter_digest(self._window, offset, pairing, side, pieces, digester, nbytes)
        return got == expected_digest

    def _stage(self, handoff_id: str, rank: int) -> StageLanding:
        hl = self._handoffs.get(handoff_id)
        if hl is None or rank not in hl.stages:
            raise ConflictError(
                f"handoff {handoff_id!r} stage {rank} has no landing (ended, or direct mode)",
                field="handoff_id",
                pp_rank=rank,
            )
        return hl.stages[rank]

    def _remaining(self, handoff_id: str, rank: int) -> int:
        """Bytes of the stage no open window may hold: a lower bound of what is left to send,
        since a sender may leave part of a window empty (its next page did not fit)."""
        stage = self._stage(handoff_id, rank)
        outstanding = sum(e.length for e in stage.grants.values())
        return max(0, stage.expected - stage.committed - outstanding)

    def _try_grant(self, handoff_id: str, rank: int) -> Grant | None:
        if self._remaining(handoff_id, rank) <= 0:
            return None
        stage = self._stage(handoff_id, rank)
        if len(stage.grants) >= MAX_WINDOWS_PER_STAGE:
            return None
        # Sized by the uncommitted bytes, not by `remaining`: an open window's slack would
        # otherwise make this one too small for the sender's next page.
        want = min(stage.expected - stage.committed, self.window_bytes)
        if not self._within_share(stage.peer, want):
            return None
        extent = self.arena.try_take(want, handoff_id)
        return None if extent is None else self._issue(handoff_id, rank, extent, want)

    def _within_share(self, peer: str, want: int) -> bool:
        """Whether `peer` may take `want` more bytes of windows (`peer_share`), counting what
        it holds (quarantine included) and what its requests wait for."""
        share = max(
            self.arena.rounded(self.window_bytes), int(self.arena.capacity_bytes * self.peer_share)
        )
        held = self.arena.tagged_bytes(peer)
        return held + self._queued.get(peer, 0) + self.arena.rounded(want) <= share

    def _issue(self, handoff_id: str, rank: int, extent: Extent, want: int) -> Grant:
        self._next_grant_id += 1
        gid = self._next_grant_id
        stage = self._stage(handoff_id, rank)
        stage.grants[gid] = extent
        self._grants[gid] = (handoff_id, rank)
        # Whose share it counts in while taken, quarantine included.
        self.arena.tag(extent, stage.peer)
        return Grant(grant_id=gid, pp_rank=rank, addr=self.arena.addr(extent), length=want)

    def _close_grant(self, gid: int, stage: StageLanding) -> None:
        stage.grants.pop(gid, None)
        self._grants.pop(gid, None)
