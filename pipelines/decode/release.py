"""Fencing a handoff's destination pages until no write of it can land, then releasing them.

Called by the decode pipeline (`kvhandoff.pipelines.decode`), which decides outcomes and calls in
here for everything about the lease after that:

- `start(h, reason)` with a handoff's first failure or abort: the one quiesce that stops each
  prefill stage that may still write, then releases;
- `confirm_stopped(h, stage)` when the stage's own prefill life says it stopped (an arrival, its
  failure report, an abort answer, a heartbeat answer without the handoff);
- `release(h, confirmed=True)` at once when every stage arrived;
- `restore(...)` after a restart: the fences of an earlier life, released when their bound passes.

This is the one caller of `Leases.release` and the one publisher of `handoff.released`. SAFETY.md's
invariants enforced here: I2 (`release`), I3 and L2 (`_quiesce`), I4 (`confirm_stopped`), the
decode's half of I5 (`grace_s`, `_quiesce`'s bound) and I8 (a cancelled quiesce releases nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

import msgspec

from kvhandoff.pipelines.decode.handoff import ROLE, DecodeHandoff, DecodeStage, publish
from kvhandoff.pipelines.decode.landing import Landing
from kvhandoff.pipelines.decode.leases import Leases, slot_claims
from kvhandoff.pipelines.decode.views import FencedPages, HandoffArchive, HandoffView
from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError
from kvhandoff.pipelines.events import EventBus, HandoffReleased
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import AbortAck, AbortMsg
from kvhandoff.pipelines.planning import validate_pages_for_layout
from kvhandoff.pipelines.states import (
    DeliveryState,
    HandoffState,
    ReleaseState,
    StageState,
    WriterState,
    advance,
)

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class PrefillAborts(Protocol):
    """The one decode → prefill call a quiesce makes."""

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck: ...


class Releases:
    """The leases of one decode pipeline after their handoffs' outcomes."""

    def __init__(
        self,
        leases: Leases,
        prefill: PrefillAborts,
        bus: EventBus,
        *,
        incarnation: str,
        max_grace_s: float,
        spawn: Spawn,
        lost: Callable[[str], bool],
        landing: Landing | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leases = leases
        # The held handoffs whose lease is not given back yet, in creation order (the pipeline
        # adds each as it holds it; `release` removes it): what the heartbeats scan, instead of
        # every handoff held (`history`, 10,000 by default) per peer and answer.
        self.unreleased: dict[str, DecodeHandoff] = {}
        self._prefill = prefill
        self._bus = bus
        self._incarnation = incarnation
        # The ceiling on any prefill's declared engine-call bound (see `grace_s`).
        self._max_grace_s = max_grace_s
        self._spawn = spawn  # the pipeline's: its close() cancels what is still running
        self._lost = lost  # whether the heartbeats declared a prefill peer lost
        # Landed mode: pages change only by the landing's commits, so a lease is released once
        # none runs; the writers' bound keeps only their windows out of use (`_quiesce_landed`).
        self._landing = landing
        self._clock = clock  # unix time of views, events and records
        self._monotonic = monotonic  # what bounds are measured on
        self._archive: HandoffArchive | None = None
        # Restored handoffs whose pages an earlier life's prefill may still write, until when.
        self._fenced_until: dict[str, float] = {}
        self._fence_timers: list[asyncio.TimerHandle] = []
        # Set when a restored fence lifts: what `wait(..., released=True)` of one waits on.
        self._restored_waiters: dict[str, asyncio.Event] = {}

    # ----------------------------------------------------------------- live handoffs

    def start(self, h: DecodeHandoff, reason: str) -> asyncio.Task[None] | None:
        """The one quiesce of `h` (started with its first failure or abort; none once it is
        released)."""
        if h.quiesce is None and h.release == ReleaseState.HELD:
            h.release = advance(h.release, ReleaseState.RELEASING, f"handoff {h.id!r} lease")
            quiesce = self._quiesce if self._landing is None else self._quiesce_landed
            h.quiesce = self._spawn(quiesce(h, reason))
        return h.quiesce

    def confirm_stopped(
        self, h: DecodeHandoff, stage: DecodeStage, *, overtaking: bool = False
    ) -> None:
        """No write of `stage` can land any more (I4: said by its own prefill life only, which
        says so only once its writes drained). Wakes the quiesce. `overtaking`: said by the ack
        of an abort sent while a destination was on its way, which the quiesce confirms again
        once the delivery ended; any other word of the stage (its arrival, its failure, a later
        ack or heartbeat answer) came after the destination and settles it."""
        if stage.confirm_stopped(overtaking=overtaking, what=f"handoff {h.id!r} stage writers"):
            h.progress.set()
        if self._landing is not None and h.release == ReleaseState.RELEASED and _all_stopped(h):
            # No writer of it can write its windows any more: none stays quarantined.
            self._landing.lift(h.id)

    def release(self, h: DecodeHandoff, *, confirmed: bool) -> None:
        """The one place a lease is given back (I2): after the outcome, once no write can land."""
        assert h.state.terminal, "a lease is released only after the outcome"
        h.release = advance(h.release, ReleaseState.RELEASED, f"handoff {h.id!r} lease")
        self.leases.release(h.id)
        self.unreleased.pop(h.id, None)
        h.released_at = self._clock()
        after_s = self._monotonic() - (h.finished_mono or self._monotonic())
        for st in h.stages.values():
            if not st.state.final:
                st.state = advance(st.state, StageState.STOPPED, f"handoff {h.id!r} stage")
        h.released.set()
        if self._landing is not None:
            # Completed: every writer reported its last segment, its windows go back now.
            # Otherwise a writer may still write its windows: out of use until its bound.
            self._landing.settle(
                h,
                writers_done=h.state == HandoffState.COMPLETED or _all_stopped(h),
                until_mono=self._window_bound(h),
                undelivered=frozenset(
                    r
                    for r, s in h.stages.items()
                    if s.delivery in (DeliveryState.UNSENT, DeliveryState.UNCERTAIN)
                ),
                in_flight=frozenset(
                    r for r, s in h.stages.items() if s.delivery == DeliveryState.SENDING
                ),
            )
        publish(
            self._bus,
            h,
            HandoffReleased(
                handoff_id=h.id,
                role=ROLE,
                outcome=h.state.value,
                confirmed=confirmed,
                seconds_after_outcome=after_s,
                metadata=h.request.metadata,
            ),
        )

    def _window_bound(self, h: DecodeHandoff) -> float:
        """Until when a landed handoff's windows stay quarantined: its writers' bound (I5) when
        known, else the deadline plus the ceiling. Liveness only: a write after it lands in a
        free or re-granted window, whose digest refuses it."""
        bound = self._give_up(h, self._monotonic())
        if bound == math.inf:
            bound = max(h.deadline_mono, self._monotonic()) + self._max_grace_s
        return bound

    def grace_s(self, h: DecodeHandoff) -> float:
        """How long after the deadline an unconfirmed writer may still write (I5): the longest
        engine call its prefill declared (none declared: the ceiling), at most the ceiling."""
        declared = [s.max_call_s for s in h.stages.values() if not s.stopped]
        longest = max(declared, default=0.0)
        return self._max_grace_s if longest <= 0 else min(longest, self._max_grace_s)

    def _give_up(self, h: DecodeHandoff, started: float) -> float:
        """The bound (I5) on the monotonic clock: the latest deadline a prefill of `h` that has
        not confirmed it stopped may hold (no batch starts after it, by T1), plus the longest
        engine call it declared (none writes longer, by T2); from `started` (the quiesce's
        start) if that is past. Not known (infinite) while a delivery call is in flight: its
        prefill's deadline counts from a receipt that may still be to come."""
        if h.delivery is not None and not h.delivery.done():
            return math.inf
        deadlines = [h.deadline_mono, started]
        deadlines += [
            s.writable_until
            for s in h.stages.values()
            if not s.stopped and s.writable_until is not None
        ]
        return max(deadlines) + self.grace_s(h)

    async def _quiesce(self, h: DecodeHandoff, reason: str) -> None:
        """Stop every prefill stage of `h` that may still write, then release its lease (I3).

        A peer that cannot be reached is retried (at once when `abort` hurries it) until it
        answers, is declared lost, or the bound passed. Without its answer the lease is kept
        until the bound (`_give_up`): the prefill's deadline, which it measures as a remaining
        duration from its receipt of the destination, plus the longest engine call it declared.
        A process the heartbeats cannot hear (a stalled loop, a partitioned control network
        beside a working data one) may still write until then. Cancelled (the event loop ends),
        the lease is never released (I8).
        """
        # Aborts go out at once, even before a destination was delivered: the prefill refuses a
        # destination that arrives after the abort of its handoff.
        started = self._monotonic()
        await asyncio.gather(*(self._stop_peer(h, p, reason, started) for p in h.peers))
        if h.delivery is not None:
            await asyncio.wait([h.delivery])  # the peer client's timeout bounds a delivery call
        # An ack that overtook a destination says nothing of it: the prefill refuses a
        # destination of an id it remembers as aborted, but it remembers only so many. Asked
        # whether or not a delivery still ran: one that ended before the first stop round
        # returned clears `h.delivery`, yet its destination may have landed after the ack.
        doubted = [s.peer for s in h.stages.values() if s.doubt_overtaken(f"handoff {h.id!r}")]
        again = sorted(set(doubted))
        await asyncio.gather(*(self._stop_peer(h, p, reason, started) for p in again))
        give_up = self._give_up(h, started)
        while not all(s.stopped for s in h.stages.values()):
            left = give_up - self._monotonic()
            if left <= 0:
                break
            h.progress.clear()  # no await since the check above: no wake-up is lost
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await h.progress.wait()
        self.release(h, confirmed=all(s.stopped for s in h.stages.values()))

    async def _quiesce_landed(self, h: DecodeHandoff, reason: str) -> None:
        """Landed mode: release the lease as soon as no commit of `h` runs (S1: nothing else
        writes its pages, and `h` is terminal, so no commit starts), then stop its prefills as
        in direct mode, so an abort still returns once they stopped. Their windows stay
        quarantined until the bound either way (`release` → `Landing.settle`)."""
        assert self._landing is not None
        await self._landing.idle(h)
        self.release(h, confirmed=True)
        started = self._monotonic()
        await asyncio.gather(*(self._stop_peer(h, p, reason, started) for p in h.peers))

    async def _stop_peer(self, h: DecodeHandoff, peer: str, reason: str, started: float) -> None:
        """Ask prefill `peer` to stop `h` until its stages there are confirmed stopped, it is
        lost, another life of it answers, or the bound passed (then only the bound frees)."""
        delay = 0.05
        msg = AbortMsg(handoff_id=h.id, reason=reason, decode_incarnation=self._incarnation)
        while not all(s.stopped for s in h.stages.values() if s.peer == peer):
            left = self._give_up(h, started) - self._monotonic()
            # Sent while a destination is on its way, the abort may be answered before the
            # destination reaches the prefill (the answers may also come back in either order).
            overtaking = h.delivery is not None and not h.delivery.done()
            try:
                # Past the bound the pages are free whatever the peer says: stop waiting.
                async with asyncio.timeout(max(0.0, left) if left != math.inf else None):
                    ack = await self._prefill.abort(peer, msg)
            except TimeoutError:
                log.warning("handoff %s: %s did not answer the abort by the bound", h.id, peer)
                return
            except KVHandoffError as exc:
                if self._lost(peer) or self._monotonic() >= self._give_up(h, started):
                    log.warning("handoff %s: not waiting for %s any more: %s", h.id, peer, exc)
                    return
                h.progress.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await h.progress.wait()  # set when a caller hurries the release
                delay = min(delay * 2, 1.0)
                continue
            for st in h.stages.values():
                if st.peer == peer and st.incarnation == ack.incarnation:
                    st.max_call_s = max(st.max_call_s, ack.max_call_s)
                    self.confirm_stopped(h, st, overtaking=overtaking)
            if not all(s.stopped for s in h.stages.values() if s.peer == peer):
                return  # another life answered: the old one is not confirmed stopped

    # ----------------------------------------------------------------- an earlier life's fences

    def restore(
        self, layout: StageLayout, archive: HandoffArchive, fenced: Iterable[FencedPages]
    ) -> None:
        """Keep each `fenced` handoff's pages leased until its `release_at` (unix time: the only
        clock that survives a restart), so no new handoff gets pages an earlier process's prefill
        stages may still write; then release them like any handoff.

        A landed one is released now, confirmed, when its earlier life's arena shares no byte
        with this life's stage memory (`layout`): its pages changed only by that process's
        commits (S1), which died with it, and a late write of its prefills, aimed at that
        arena's addresses, finds unregistered memory (refused by the receiving engine) or this
        life's arena (S3). One whose old arena overlaps a stage entry now is fenced as a direct
        one: a late write could land there."""
        self._archive = archive
        loop = asyncio.get_running_loop()
        for f in fenced:
            if f.arena is not None:
                clash = _entry_within(layout, *f.arena)
                if clash is None:
                    self._fenced_until[f.handoff_id] = self._clock()
                    self._release_restored(f.handoff_id, leased=False, confirmed=True)
                    continue
                log.warning(
                    "restored handoff %s: its landing arena [%#x, +%d) overlaps %s of this "
                    "life's memory; its pages stay fenced as a direct handoff's",
                    f.handoff_id,
                    *f.arena,
                    clash,
                )
            self._fenced_until[f.handoff_id] = f.release_at
            delay = f.release_at - self._clock()
            if delay <= 0:
                self._release_restored(f.handoff_id, leased=False)
                continue
            try:
                pages = validate_pages_for_layout(
                    layout, f.dst_pages, f.slots, side="destination", unique=True
                )
                self.leases.acquire(f.handoff_id, pages, slot_claims(layout, f.slots))
            except InvalidInput as exc:  # the pool shrank between runs: nothing there to fence
                log.warning("not fencing pages of restored handoff %s: %s", f.handoff_id, exc)
                self._release_restored(f.handoff_id, leased=False)
                continue
            self._fence_timers.append(
                loop.call_later(delay, self._release_restored, f.handoff_id, True)
            )

    def restored_view(self, view: HandoffView) -> HandoffView:
        """An earlier life's handoff `view` as recorded, released once its restored fence was
        lifted (or at once when it was not fenced: its bound had passed before this life).

        The lease says so, not the wall clock: the fence is a loop timer once restored, so a
        wall-clock step forward must not show as free pages that are still fenced. (No handoff
        of this life holds an archived id: `create` answers those from the archive.)"""
        if view.released or self.leases.holds(view.id):
            return view
        until = self._fenced_until.get(view.id)
        return msgspec.structs.replace(view, released=True, released_at=until)

    async def wait_restored(self, handoff_id: str, timeout_s: float) -> None:
        """Until an earlier life's handoff is released here (its restored fence lifted), or
        `timeout_s` passed: a router's `until=released` or an engine's `released()` after a
        restart waits like one of a handoff of this life."""
        if timeout_s <= 0 or not self.leases.holds(handoff_id):
            return
        lifted = self._restored_waiters.setdefault(handoff_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await lifted.wait()

    def _release_restored(self, handoff_id: str, leased: bool, confirmed: bool = False) -> None:
        """The bound of an earlier life's handoff passed (or, landed, there was none): free its
        pages and say so, like any release (`handoff.released`, confirmed only when no write can
        reach them), so the record, webhooks and SSE readers see it and a later restart does not
        fence these pages again."""
        if leased:
            self.leases.release(handoff_id)
        lifted = self._restored_waiters.pop(handoff_id, None)
        if lifted is not None:
            lifted.set()
        old = self._archive.find(handoff_id) if self._archive is not None else None
        if old is None:
            return
        now = self._clock()
        self._bus.publish(
            HandoffReleased(
                handoff_id=handoff_id,
                role=ROLE,
                outcome=old.view.state.value,
                confirmed=confirmed,
                seconds_after_outcome=max(0.0, now - (old.view.finished_at or now)),
                metadata=old.request.metadata,
            )
        )

    def close(self) -> None:
        """Stop the restored fences' timers (the service is stopping: see I8)."""
        for timer in self._fence_timers:
            timer.cancel()


def _all_stopped(h: DecodeHandoff) -> bool:
    """Every stage's own prefill life confirmed no write of it can land (an ack that overtook
    its destination does not count: that destination may still arrive)."""
    return all(s.writers == WriterState.STOPPED for s in h.stages.values())


def _entry_within(layout: StageLayout, base: int, nbytes: int) -> str | None:
    """The first entry of `layout` sharing a byte with `[base, base + nbytes)`, named; or None."""
    end = base + nbytes
    named: list[tuple[str, int, int]] = [
        (f"KV entry layer {e.layer_id} group {e.group}", e.base, e.nbytes) for e in layout.kv
    ]
    named += [
        (f"state entry layer {s.layer_id} kind {s.kind}", s.base, s.nbytes) for s in layout.state
    ]
    named += [(f"aux entry {i}", a.base, a.nbytes) for i, a in enumerate(layout.aux)]
    for name, start, size in named:
        if start < end and base < start + size:
            return name
    return None
