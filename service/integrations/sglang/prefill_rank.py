"""A prefill rank's requests as rooms (`kvhandoff.service.integrations.rooms.prefill`), and what
SGLang's prefill calls do with them: each chunk signalled as the stage's next page range, the
fan-out replay to the copies of an MLA decode of larger TP, excusals (SGLang's MLA dummy ranks), and
the boundary rule's prefill half: **every handoff of a room is stopped before SGLang's table
says Failed** (`stop`, `stop_then_fail`), as SGLang frees the source pages then and a segment
still gathering from them would send another request's bytes as this one's.

Called by the manager (`manager.py`): SGLang's sender through it (open, each send, abort,
clear), its excusal listener (`excuse`), the service's event thread (a destination, a stage's
bytes transferred, a failure) and the rank's worker thread (what `stop` and `learn_fan_out`
queue). One lock (the rooms' `lock`, re-entrant: a send refused under it stops its room, which
reads the room under it) orders the bookkeeping with what is queued on the worker thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.pipelines.events import DestinationReceived
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.integrations.rooms.prefill import Chunk, PrefillRoom, PrefillRooms, Range
from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.ids import handoff_id, own_of
from kvhandoff.service.integrations.sglang.layouts import RankLayout, component_slots


class RankHost(Protocol):
    """What a prefill rank reads from its manager (`manager.KVHandoffManager`), when used: its
    ids, SGLang's status table, the service and the rank's worker. A protocol, not an import of
    the manager, which builds the rank: the two modules stay one-way."""

    stage_rank: int
    tp_rank_for_handoffs: int
    state_types: Any
    rank: RankLayout
    _calls: concurrent.futures.ThreadPoolExecutor

    @property
    def service(self) -> EmbeddedService: ...

    def update_status(self, bootstrap_room: int, status: int) -> None: ...

    def fail(self, room: int, reason: str, *, unreachable: bool = False) -> bool: ...

    def submit(
        self, room: int, what: str, call: Callable[[], Any]
    ) -> concurrent.futures.Future[Any]: ...


log = logging.getLogger("kvhandoff.sglang")
#: How many rooms' early facts (an excusal, a fan-out that came before SGLang opened the room)
#: a rank keeps, oldest out first.
EARLY_KEPT = 65536


class PrefillRank:
    """The rooms of one prefill rank, over its manager's service, worker thread and SGLang's
    status table (all read from the manager when used)."""

    def __init__(self, mgr: RankHost, excusal_ttl_s: float) -> None:
        self._mgr = mgr
        self.rooms = PrefillRooms(early_kept=EARLY_KEPT)
        self.lock = self.rooms.lock
        # Excusals that came before SGLang opened their room (`excusal.Excusals`): an open room's
        # excusal is its state (EXCUSED).
        self._excusals = excusal.Excusals(excusal_ttl_s, EARLY_KEPT)

    def own(self, room: int) -> str:
        """The id of the handoff this rank's own TP rank sends for `room`."""
        return handoff_id(room, self._mgr.tp_rank_for_handoffs)

    # ------------------------------------------------------------------ a room's life

    def open(self, room: int) -> str:
        """SGLang opened `room` (its sender): a room record, excused at once when a decode
        excused this rank from it first, given the fan-out a destination said first. A room
        open already keeps its record (`PrefillRooms.open`)."""
        room, hid = int(room), self.own(room)
        with self.lock:
            early = self.rooms.open(room, hid)
            rec = self.rooms.get(room)
            if self._excusals.open(room) and rec is not None and self._excusable(rec):
                self.rooms.excuse(rec)  # nothing was signalled: nothing to withdraw
                return hid
        if early is not None:
            self.learn_fan_out(room, hid, early)
        return hid

    def close(self, room: int) -> None:
        """SGLang cleared the room: no entry outlives it."""
        with self.lock:
            self.rooms.close(int(room))
            self._excusals.close(int(room))

    def room_of(self, hid: str) -> int | None:
        """The open room a handoff of this rank (its own, or a copy) belongs to."""
        with self.lock:
            return self.rooms.room_of(hid)

    def excused(self, room: int) -> bool:
        with self.lock:
            rec = self.rooms.get(int(room))
            return rec is not None and rec.excused

    def unreachable(self, room: int) -> bool:
        with self.lock:
            rec = self.rooms.get(int(room))
            return rec is not None and rec.unreachable

    def moved(self, room: int) -> tuple[int, float | None] | None:
        """(bytes this rank's stage moved, perf_counter of its last commit once every handoff
        has all its bytes, or None), or None when nothing of the room moved from here."""
        with self.lock:
            rec = self.rooms.get(int(room))
            return None if rec is None else rec.moved

    # ------------------------------------------------------------------ excusals

    def excuse(self, room: int) -> None:
        """A decode rank excused this rank from `room` (verified: `excusal.py`): the room moves
        nothing from here and reaches Success at its last send. Ranges already signalled are
        withdrawn first, on the worker thread after them, and the room's events no longer move
        it. Success, should the last send have come already, follows the withdrawal there. A
        room stopped already keeps failing: its handoffs were given up, its reason stands."""
        room, mgr = int(room), self._mgr
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None:
                if not self._excusals.excuse(room, opened=False):
                    return  # a repeat (a replay within the skew window)
            elif not self._excusable(rec):
                return
            else:
                signalled, last = self.rooms.excuse(rec)
                # Queued under the lock: in order with any stage signal `send` queues (which
                # checks the room's state under it).
                if signalled:
                    mgr._calls.submit(self._withdraw, rec.own)
                if last:
                    mgr._calls.submit(mgr.update_status, room, KVPoll.Success)
        log.info("room %d excused: the decode pairs with another prefill TP rank", room)

    @staticmethod
    def _excusable(rec: PrefillRoom) -> bool:
        """Whether an excusal changes the room. Not once it was stopped: its handoffs are being
        given up and its failure stands (STOPPED is final), should the decode's excusal come
        only after this rank failed the room."""
        return not (rec.excused or rec.stopped)

    def _withdraw(self, hid: str) -> None:
        """An excused room's signalled ranges: withdrawn (`aborted`, no failure anywhere); a
        handoff some decode holds after all is given up, which fails it there."""
        reason = "excused: the decode pairs with another prefill TP rank (MLA)"
        try:
            if self._mgr.service.withdraw_prefill(hid, reason):
                return
        except (KVHandoffError, TimeoutError) as exc:
            log.warning("withdrawing %s failed: %s", hid, exc)
        self._give_up(hid, reason)

    # ------------------------------------------------------------------ sends

    def send(
        self,
        room: int,
        kv_indices: Any,
        index_slice: Any,
        is_last_chunk: bool,
        aux_index: int | None,
        state_indices: list[Any] | None,
        wait_event: Any,
        indices_event: Any,
    ) -> None:
        """One SGLang send (`KVHandoffManager.add_transfer_request` says how it is read): the
        room's next page range, queued on the worker thread, or a refusal that stops the room."""
        mgr = self._mgr
        slots, refused = component_slots(mgr.state_types, state_indices)
        if indices_event is not None:
            indices_event.synchronize()
        pages = np.array(kv_indices, dtype=np.int64)  # a copy: SGLang reuses its array
        waiting = sorted(set(mgr.rank.layout.components) - set(slots))
        with self.lock:
            admitted = self._admit(room, len(pages), bool(is_last_chunk), refused, waiting)
        if admitted is None:
            return
        rec, chunk = admitted
        at, last = chunk.at, chunk.last
        start = index_slice.start if isinstance(index_slice, slice) else None
        if start is not None and int(start) != at:
            # SGLang's positions and ours disagree (a sharded or CP-filtered send, which this
            # backend refuses at start-up): never guess where the pages go.
            self.stop(room, f"kvhandoff: chunk at page position {start}, expected {at}")
            return
        aux = int(aux_index) if mgr.rank.has_aux and last and aux_index is not None else None
        self._queue(room, rec, Range(pages, at, last, slots if last else None, aux), wait_event)

    def _admit(
        self, room: int, n_pages: int, is_last: bool, refused: str | None, waiting: list[str]
    ) -> tuple[PrefillRoom, Chunk] | None:
        """Lock held: the room's record and where this send's pages go, or None when the send
        signals nothing (excused, stopped, refused: the room is stopped with the reason).
        Checked with the bookkeeping `excuse` reads, in one critical section: an excusal sees
        either none of this send or all of it."""
        rec = self.rooms.get(room)
        if rec is not None and rec.excused:
            if is_last:  # queued after any withdrawal `excuse` queued
                self._mgr._calls.submit(self._mgr.update_status, room, KVPoll.Success)
            return None
        if rec is None:
            self.stop(room, "kvhandoff: a send for a request this rank has not opened")
            return None
        if rec.stopped:
            return None  # failing or failed: nothing more is signalled, the first reason stands
        if refused:
            self.stop(room, f"kvhandoff: {refused}")
            return None
        chunk = self.rooms.chunk(rec, n_pages, is_last=is_last, waiting=waiting)
        if chunk.refused is not None:
            self.stop(room, f"kvhandoff: {chunk.refused}")
            return None
        if chunk.skip:
            return None  # SGLang's empty closing send after a chunk that already ended the pages
        return rec, chunk

    def _queue(self, room: int, rec: PrefillRoom, r: Range, wait_event: Any) -> None:
        """Signal range `r` on the worker thread once SGLang's forward wrote its pages."""
        with self.lock:  # queued in order with an excusal's withdrawal (see `excuse`)
            if rec.excused:
                # Excused since the bookkeeping above, which `excuse` saw: it queued the
                # withdrawal of what was signalled, and Success if this send was the last.
                return
            # Kept for the room's copies, until it is known none will come (a fan-out of 1).
            kept = self.rooms.keep(rec, r)

            def signal() -> None:
                if wait_event is not None:
                    wait_event.synchronize()  # the forward that writes these pages has run
                self._signal(rec.own, r)
                if kept:  # the room's copies (once known) get what the own handoff got
                    with self.lock:
                        self.rooms.own_signalled_one(rec)
                    self.flush(room)

            self._mgr.submit(room, "stage ready", signal)

    def _signal(self, hid: str, r: Range) -> None:
        self._mgr.service.stage_ready(
            hid,
            self._mgr.stage_rank,
            r.pages,
            pages_from=r.at,
            last_pages=r.last,
            src_slots=r.slots,
            src_aux=r.aux,
        )

    # ------------------------------------------------------------------ fan-out

    def destination(self, event: DestinationReceived) -> None:
        """A decode said where a handoff of this rank's goes, and how many decode handoffs take
        the same bytes: the room's fan-out (its own id's destination, or a copy's)."""
        own = own_of(event.handoff_id)
        with self.lock:
            room = self.rooms.room_of(own)
            if room is None:  # SGLang has not opened the room yet: kept for `open`
                self.rooms.learn_early(own, event.fan_out)
                return
        self.learn_fan_out(room, own, event.fan_out)

    def learn_fan_out(self, room: int, own: str, k: int) -> None:
        """The room's bytes go to `k` decode handoffs: its own and k - 1 copies, each signalled
        every range the own one was (`flush`, on the worker thread after what is queued). Two
        decodes that disagree on k fail the room."""
        copies = [handoff_id(room, self._mgr.tp_rank_for_handoffs, i) for i in range(1, k)]
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None:
                return  # cleared meanwhile
            known = rec.fan_out
            replay = self.rooms.learn_fan_out(rec, k, copies)
        if replay is None:
            why = f"kvhandoff: decode ranks disagree on the fan-out of {own} ({known} and {k})"
            self.stop(room, why)
        elif replay:
            self._mgr.submit(room, "stage ready", lambda: self.flush(room))

    def flush(self, room: int) -> None:
        """On the worker thread: signal each copy the ranges its own handoff was signalled (its
        forward waited for) and it was not yet, in their order; a stopped room's copies are
        given up instead."""
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None or not rec.replayed:
                return
            stopped = rec.stopped
            todo = self.rooms.replay(rec)
        for copy, pending in todo:
            if stopped:
                self._give_up(copy, "the request failed or was aborted on the prefill")
                continue
            for r in pending:
                self._signal(copy, r)

    def transferred(self, room: int, hid: str, nbytes: int, *, final: bool) -> bool:
        """A stage's segments of `hid` were committed; True once every handoff of the room has
        all its bytes (noted before SGLang's Success, which its metric read follows)."""
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None:
                return False
            return self.rooms.transferred(rec, hid, nbytes, final=final, now=time.perf_counter())

    # ------------------------------------------------------------------ stopping

    def stop(
        self, room: int, reason: str, *, unreachable: bool = False, ended: str | None = None
    ) -> None:
        """Stop every handoff of the room, then fail it (`stop_then_fail`, queued on the worker
        thread). Once per room: a room stopped already keeps its first reason; an excused one
        moves nothing and never fails. A send refused so fails its request now (the decode is
        told the stage and the reason, not at its deadline), and a destination that comes later
        is refused."""
        if self.claim_stop(room):
            self._mgr._calls.submit(
                self.stop_then_fail, int(room), reason, unreachable=unreachable, ended=ended
            )

    def claim_stop(self, room: int) -> bool:
        """Mark the room stopped (no copy or range is signalled after this); False when it was
        stopped already or is excused. True for a room SGLang cleared: its handoff is still
        given up."""
        with self.lock:
            rec = self.rooms.get(int(room))
            return True if rec is None else self.rooms.stop(rec)

    def failing(self, room: int, *, unreachable: bool) -> bool:
        """The room is about to fail (`unreachable`: a peer could not be reached): stopped, no
        copy is signalled after this. False for a room this rank is excused from: nothing of it
        can fail."""
        with self.lock:
            rec = self.rooms.get(int(room))
            if rec is None:
                return True
            if rec.excused:
                return False
            rec.unreachable = rec.unreachable or unreachable
            self.rooms.stop(rec)
            return True

    def stop_then_fail(
        self, room: int, reason: str, *, unreachable: bool = False, ended: str | None = None
    ) -> None:
        """On the worker thread, for a room `claim_stop` marked: it fails only once none of its
        handoffs can still read its source pages (each give-up returns then; `ended`: one that
        has stopped already, aborted)."""
        with self.lock:
            rec = self.rooms.get(room)
            ids = rec.ids if rec is not None else [self.own(room)]
        for hid in ids:
            if hid == ended:
                continue
            try:
                self._give_up(hid, reason)
            except Exception:  # a bug: logged; the others are still stopped, the room fails
                log.exception("giving up %s of room %s failed", hid, room)
        self._mgr.fail(room, reason, unreachable=unreachable)

    def abort_room(self, room: int, reason: str) -> None:
        """On the worker thread (SGLang's abort): stop every handoff of the room (its own, and
        its copies when a fan-out is known); each returns once no write of it can land."""
        with self.lock:
            rec = self.rooms.get(room)
            if rec is not None:
                self.rooms.stop(rec)
            ids = rec.ids if rec is not None else [self.own(room)]
        first: Exception | None = None
        for hid in ids:  # each one tried, whatever another one raised
            try:
                self._mgr.service.abort_prefill(hid, reason)
            except Exception as exc:  # noqa: BLE001 - raised once every other one was tried
                first = first or exc
        if first is not None:
            raise first

    def before_release(self, room: int, reason: str) -> None:
        """On the scheduler thread, before SGLang frees the source pages of a room that did not
        succeed (its clear after a Failed of its own: another rank's, a bootstrap timeout, or
        ours): every handoff of it is stopped, waited for, after what is queued on the worker.
        A room stopped or excused already only waits for what it queued there (its give-ups,
        its withdrawal)."""
        room = int(room)
        with self.lock:
            rec = self.rooms.get(room)
            live = rec is not None and not (rec.stopped or rec.excused)

        def stop() -> None:
            if not live:
                return
            try:
                self.abort_room(room, reason)
            except Exception:  # logged: SGLang releases the pages whatever this raised
                log.exception("stopping room %s before SGLang releases it failed", room)

        self._mgr._calls.submit(stop).result()

    def _give_up(self, hid: str, reason: str) -> None:
        try:
            self._mgr.service.abort_prefill(hid, reason)
        except (KVHandoffError, TimeoutError) as exc:  # the failure above stands either way
            log.warning("giving up %s after %s failed: %s", hid, reason, exc)
