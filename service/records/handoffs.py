"""Handoff records: every accepted handoff and its terminal state, kept across restarts.

Called by the bus listener in `kvhandoff.service.runtime.persistence` (`accepted`, `finished`,
`released`, inside the transaction that commits the event), by the decode pipeline as its
`HandoffArchive` (`find`: `GET /v1/handoffs/{id}` of an id this process does not hold), by
`kvhandoff.service.records.listing` (`listed`: `GET /v1/handoffs`, in creation order across lives),
and at start-up (`interrupted`, `fenced`) to end what an earlier process left in flight.

A record is `accepted` until its terminal event, then holds the final `HandoffView`. Its pages
count as released once the handoff completed (every writer reported its bytes landed) or a
`handoff.released` event says so (an abort or a failure is announced before its writers stop);
until then a restarted service keeps them fenced until the deadline plus the engine's timeout,
after which no write of the old prefill stages can land.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvhandoff.pipelines.decode.views import (
    ArchivedHandoff,
    ErrorView,
    FencedPages,
    HandoffRequest,
    HandoffView,
    StageView,
)
from kvhandoff.pipelines.events import Event, HandoffCompleted, HandoffFailed, HandoffReleased
from kvhandoff.pipelines.states import HandoffState, StageState
from kvhandoff.service.storage import LIFE_SHIFT, Database

ACCEPTED = "accepted"
#: The condition of the partial index `handoffs_by_outcome` (`kvhandoff.service.storage`).
_OUTCOME_INDEXED = "state IN ('failed', 'aborted')"
_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(HandoffRequest)
_view_decoder = msgspec.json.Decoder(HandoffView)
_pages_decoder = msgspec.json.Decoder(list[int])


class Progress(msgspec.Struct, frozen=True):
    """How far a handoff in flight got: its stages and the bytes that arrived."""

    stages: list[StageView]
    bytes: int


_progress_decoder = msgspec.json.Decoder(Progress)


def _progress(view: HandoffView) -> bytes:
    return _encoder.encode(Progress(view.stages, view.bytes))


@dataclass(frozen=True)
class Interrupted:
    """A handoff an earlier process accepted and never finished."""

    request: HandoffRequest
    created_at: float
    deadline_at: float


@dataclass
class _Pending:
    """What the bus listener noted of one handoff since the last write (`HandoffRecords.note_*`)."""

    accepted: tuple[HandoffRequest, float, float, int | None] | None = None
    #: Its view now, for its progress (stages, bytes); None once it is no longer held.
    progress: Callable[[], HandoffView | None] | None = None
    final: HandoffView | None = None
    released: HandoffReleased | None = None


class HandoffRecords:
    """A handoff's record is noted as its events come (`note_*`) and written once, with the
    latest of them, when the group commit runs (`apply`, a `Database.before_commit` hook) or
    before any read: a one-page handoff whose arrival, outcome and release come in one request
    is one INSERT and one UPDATE, not four statements that each rewrite its view."""

    def __init__(
        self, db: Database, *, grace_s: float, arena: tuple[int, int] | None = None
    ) -> None:
        self._db = db
        self._grace_s = grace_s
        # This life's landing arena (base, bytes; None in direct mode), kept with each handoff it
        # accepts: a later life frees that handoff's pages at once when no stale write into this
        # arena can reach its own stage memory (`Releases.restore`).
        self._arena = arena or (None, None)
        self._pending: dict[str, _Pending] = {}
        db.before_commit(self.apply)

    # -- noted by the bus listener, written by `apply` -------------------------------------------

    def note_accepted(
        self,
        request: HandoffRequest,
        created_at: float,
        deadline_at: float,
        number: int | None,
        progress: Callable[[], HandoffView | None],
    ) -> None:
        self._pending[request.id] = _Pending(
            accepted=(request, created_at, deadline_at, number), progress=progress
        )

    def note_progress(self, handoff_id: str, progress: Callable[[], HandoffView | None]) -> None:
        self._pending.setdefault(handoff_id, _Pending()).progress = progress

    def note_finished(self, view: HandoffView) -> None:
        self._pending.setdefault(view.id, _Pending()).final = view

    def note_released(self, event: HandoffReleased) -> None:
        self._pending.setdefault(event.handoff_id, _Pending()).released = event

    def apply(self) -> None:
        """Write what was noted, in the order noted, into the open transaction (or each as
        its own, without one): the merged rows of each handoff."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        if self._db.conn.in_transaction:  # the group's commit, or a reader inside one
            for handoff_id, p in pending.items():
                self._write(self._db.conn, handoff_id, p)
            return
        with self._db.transaction() as tx:
            for handoff_id, p in pending.items():
                self._write(tx, handoff_id, p)

    def _write(self, tx: sqlite3.Connection, handoff_id: str, p: _Pending) -> None:
        final = p.final
        if final is not None and p.released is not None:
            final = _with_release(final, p.released)
        if p.accepted is not None:
            request, created_at, deadline_at, number = p.accepted
            progress = None if final is not None or p.progress is None else p.progress()
            self.accepted(tx, request, created_at, deadline_at, number, progress)
        elif final is None and p.progress is not None:
            view = p.progress()
            if view is not None:
                self.progress(tx, view)
        if final is not None:
            self.finished(tx, final)
        elif p.released is not None:
            self.released(tx, p.released)

    # -- written by the bus listener, inside its transaction -----------------------------------

    def accepted(
        self,
        tx: sqlite3.Connection,
        request: HandoffRequest,
        created_at: float,
        deadline_at: float,
        number: int | None = None,
        progress: HandoffView | None = None,
    ) -> None:
        """Record an accepted handoff. `number`: its creation number in this life (the decode
        pipeline's `seq`, so the list orders live handoffs and records alike); None: the next
        after this life's records (a writer without a pipeline). `progress`: its view now (its
        stages), kept in case the process dies before the outcome."""
        seq = (
            self.seq_of(number)
            if number is not None
            else tx.execute(
                "SELECT COALESCE(MAX(seq) + 1, ?) FROM handoffs WHERE seq > ?",
                (self.seq_of(1), self.seq_of(0)),
            ).fetchone()[0]
        )
        tx.execute(
            "INSERT OR REPLACE INTO handoffs (id, request, dst_pages, created_at, deadline_at,"
            " state, seq, progress, arena_base, arena_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                request.id,
                _encoder.encode(request),
                _encoder.encode(request.dst_pages),
                created_at,
                deadline_at,
                ACCEPTED,
                seq,
                None if progress is None else _progress(progress),
                *self._arena,
            ),
        )

    def progress(self, tx: sqlite3.Connection, view: HandoffView) -> None:
        """A stage of the handoff in flight arrived: keep its stages and bytes so far, so that
        if the process dies its record still shows how far it got."""
        tx.execute(
            "UPDATE handoffs SET progress = ? WHERE id = ? AND state = ?",
            (_progress(view), view.id, ACCEPTED),
        )

    def seq_of(self, number: int) -> int:
        """The list position of this life's handoff number `number` (after every earlier life's)."""
        return self._db.life << LIFE_SHIFT | number

    def finished(self, tx: sqlite3.Connection, view: HandoffView) -> None:
        # A completed handoff ended after every writer reported its bytes; a failed or aborted
        # one is announced before its writers stopped, so its pages stay unreleased until a
        # `handoff.released` event.
        released = view.state == HandoffState.COMPLETED or view.released
        tx.execute(
            "UPDATE handoffs SET state = ?, view = ?, finished_at = ?,"
            " released = MAX(released, ?) WHERE id = ?",
            (view.state.value, _encoder.encode(view), view.finished_at, int(released), view.id),
        )

    def released(self, tx: sqlite3.Connection, event: HandoffReleased) -> None:
        """The pages are free: the record says so, and its stored view too, with the event at
        the end of its timeline (what `GET` and `/events` serve after a restart: the stream runs
        to `handoff.released`)."""
        row = tx.execute("SELECT view FROM handoffs WHERE id = ?", (event.handoff_id,)).fetchone()
        if row is None or row[0] is None:
            tx.execute("UPDATE handoffs SET released = 1 WHERE id = ?", (event.handoff_id,))
            return
        view = _with_release(_view_decoder.decode(row[0]), event)
        tx.execute(
            "UPDATE handoffs SET released = 1, view = ? WHERE id = ?",
            (_encoder.encode(view), event.handoff_id),
        )

    def restored_view(self, tx: sqlite3.Connection, event: Event) -> HandoffView | None:
        """The terminal view of a handoff this process does not hold (one an earlier process
        left in flight), built from its record and the terminal `event`."""
        self.apply()
        row = tx.execute(
            "SELECT request, created_at, deadline_at, progress FROM handoffs"
            " WHERE id = ? AND state = ?",
            (event.handoff_id, ACCEPTED),
        ).fetchone()
        if row is None:
            return None
        request = _request_decoder.decode(row[0])
        error = None
        state = HandoffState.ABORTED
        if isinstance(event, HandoffFailed):
            state = HandoffState.FAILED
            error = ErrorView(event.code, event.reason, event.pp_rank, event.context)
        elif isinstance(event, HandoffCompleted):
            state = HandoffState.COMPLETED
        progress = Progress([], 0) if row[3] is None else _progress_decoder.decode(row[3])
        # A stage that had not arrived ended with the handoff: failed with it, or stopped.
        ended = StageState.FAILED if state == HandoffState.FAILED else StageState.STOPPED
        stages = [
            s
            if s.state in (StageState.ARRIVED, StageState.FAILED, StageState.STOPPED)
            else msgspec.structs.replace(s, state=ended)
            for s in progress.stages
        ]
        return HandoffView(
            id=request.id,
            state=state,
            created_at=row[1],
            deadline_at=row[2],
            num_pages=len(request.dst_pages),
            dst_slot=request.dst_slot,
            dst_slots=dict(request.dst_slots),
            dst_aux=request.dst_aux,
            prefix_pages=request.prefix_pages,
            prefill=list(request.prefill),
            verify=bool(request.verify),
            bytes=progress.bytes,
            stages=stages,
            finished_at=event.at,
            released=False,  # its writers may outlive the crash: fenced until the bound passed
            error=error,
            metadata=request.metadata,
            timeline=[event],
        )

    # -- read -----------------------------------------------------------------------------

    def find(self, handoff_id: str) -> ArchivedHandoff | None:
        """`HandoffArchive.find`: a finished handoff's request and final view."""
        self.apply()
        row = self._db.conn.execute(
            "SELECT request, view FROM handoffs WHERE id = ? AND view IS NOT NULL", (handoff_id,)
        ).fetchone()
        if row is None:
            return None
        return ArchivedHandoff(_request_decoder.decode(row[0]), _view_decoder.decode(row[1]))

    def recent(self, limit: int) -> list[HandoffView]:
        """The final views of the `limit` most recently created finished records, oldest
        first (what the dashboard shows after a restart)."""
        self.apply()
        rows = self._db.conn.execute(
            "SELECT view FROM handoffs WHERE view IS NOT NULL ORDER BY seq DESC LIMIT ?", (limit,)
        ).fetchall()
        return [_view_decoder.decode(row[0]) for row in reversed(rows)]

    def listed(
        self, after: int, state: HandoffState | None, limit: int, *, before: int | None = None
    ) -> list[tuple[int, str]]:
        """`(seq, id)` of at most `limit` finished records after `after` (and before `before`),
        in creation order, optionally of one `state`: a range read through an index, whatever
        the table holds (for `completed`, the state of most records, the read walks creation
        order and stops at the `limit`th match)."""
        self.apply()
        where = "seq > ? AND view IS NOT NULL"
        args: list[object] = [after]
        if before is not None:
            where += " AND seq < ?"
            args.append(before)
        if state is not None:
            if not state.terminal:
                return []  # a record holds its outcome, or nothing to list (`find`)
            where += " AND state = ?"
            args.append(state.value)
            if state != HandoffState.COMPLETED:
                where += f" AND {_OUTCOME_INDEXED}"  # the exact term lets SQLite use the index
        rows = self._db.conn.execute(
            f"SELECT seq, id FROM handoffs WHERE {where} ORDER BY seq LIMIT ?", (*args, limit)
        )
        return [(seq, hid) for seq, hid in rows]

    def interrupted(self) -> list[Interrupted]:
        """Handoffs accepted and never finished (the process died while they were in flight)."""
        self.apply()
        rows = self._db.conn.execute(
            "SELECT request, created_at, deadline_at FROM handoffs WHERE state = ?"
            " ORDER BY created_at",
            (ACCEPTED,),
        )
        return [Interrupted(_request_decoder.decode(r), c, d) for r, c, d in rows]

    def fenced(self, now: float) -> list[FencedPages]:
        """Pages not known released whose old writers may still write after `now`."""
        self.apply()
        rows = self._db.conn.execute(
            "SELECT id, dst_pages, request, deadline_at, arena_base, arena_bytes FROM handoffs"
            " WHERE released = 0 AND deadline_at + ? > ?",
            (self._grace_s, now),
        )
        out = []
        for hid, pages, request, deadline_at, arena_base, arena_bytes in rows:
            req = _request_decoder.decode(request)
            out.append(
                FencedPages(
                    hid,
                    _pages_decoder.decode(pages),
                    req.dst_slot,
                    deadline_at + self._grace_s,
                    dict(req.dst_slots),
                    req.dst_aux,
                    arena=None if arena_base is None else (arena_base, arena_bytes),
                )
            )
        return out

    def purge(
        self, tx: sqlite3.Connection, now: float, retention_s: float, max_records: int
    ) -> list[str]:
        """Within `tx`: delete terminal records past retention or beyond the newest
        `max_records`, never one whose pages may still be written. Returns the ids deleted."""
        self.apply()
        safe = "(released = 1 OR deadline_at + ? < ?)"
        ids = [
            r[0]
            for r in tx.execute(
                f"SELECT id FROM handoffs WHERE view IS NOT NULL AND {safe} AND finished_at < ?"
                " UNION SELECT id FROM (SELECT id, released, deadline_at FROM handoffs"
                f" WHERE view IS NOT NULL ORDER BY finished_at DESC LIMIT -1 OFFSET ?)"
                f" WHERE {safe}",
                (self._grace_s, now, now - retention_s, max_records, self._grace_s, now),
            )
        ]
        if ids:
            tx.executemany("DELETE FROM handoffs WHERE id = ?", [(i,) for i in ids])
        return ids


def _with_release(view: HandoffView, event: HandoffReleased) -> HandoffView:
    """`view` with its pages released by `event`, the event at the end of its timeline (what
    `GET` and `/events` serve after a restart: the stream runs to `handoff.released`)."""
    if any(isinstance(e, HandoffReleased) for e in view.timeline):
        return view
    return msgspec.structs.replace(
        view, released=True, released_at=event.at, timeline=[*view.timeline, event]
    )
