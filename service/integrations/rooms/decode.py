"""A decode rank's handoffs: one record per (request, handoff), changed only through the
transition table (`states.py`), and the one answer an engine's release check reads.

Called by an engine adapter's decode side, from any thread: the engine's scheduler (open,
cancel, close, `release_safe`), the rank's worker thread (the create) and the service's event
thread (`released`, from `handoff.released`). The invariant it keeps, stated once: **a
request's pages are safe to free only when none of its handoffs may still hold a lease**
(`release_safe`), which is true only from `handoff.released` or from a create that provably
leased nothing; never from an outcome. Proven against SGLang's own release path by
`tests/sglang/test_release.py`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvhandoff.service.integrations.rooms.states import DecodeState, advance


@dataclass
class _Record:
    room: int
    state: DecodeState = DecodeState.OPEN
    closed: bool = False  # the engine is done with the request (it may still ask if safe)
    # The request failed because a prefill could not be reached (it may be gone, or started
    # again elsewhere): the engine forgets what it cached of that prefill.
    unreachable: bool = False


class DecodeRooms:
    """The decode handoffs of one rank, by handoff id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._by_room: dict[int, set[str]] = {}

    def open(self, room: int, hid: str) -> None:
        """The engine follows `hid` for `room` (a request's receiver was made or re-keyed)."""
        with self._lock:
            old = self._records.get(hid)
            if old is not None and old.state != DecodeState.RELEASED:
                old.closed = False  # the same handoff, still leased: its record stands
                return
            self._records[hid] = _Record(int(room))
            self._by_room.setdefault(int(room), set()).add(hid)

    def creating(self, hid: str) -> bool:
        """The engine asks for the handoff: OPEN -> CREATING. False when it was given up
        first (nothing is to be created)."""
        with self._lock:
            rec = self._records.get(hid)
            if rec is None or rec.state != DecodeState.OPEN:
                return False
            self._move(hid, rec, DecodeState.CREATING)
            return True

    def created(self, hid: str) -> bool:
        """The create returned: the pages are leased. True when the engine gave the request up
        meanwhile: the caller aborts the handoff now."""
        with self._lock:
            rec = self._records.get(hid)
            if rec is None or rec.state == DecodeState.RELEASED:
                return False  # released already (it failed at once)
            cancelled = rec.state == DecodeState.CANCELLED
            self._move(hid, rec, DecodeState.HELD)
            return cancelled

    def refused(self, hid: str) -> None:
        """The create was refused or cut short before it leased anything."""
        self.released(hid)

    def cancel(self, hid: str) -> bool:
        """The engine gives the request up (its abort, a failure it saw). True when a created
        handoff must be aborted now; one whose create is queued or running is aborted once
        the create returned (`created`: it still runs, so its prefill is told at once rather
        than at its deadline), and an OPEN one is released: nothing was leased."""
        with self._lock:
            rec = self._records.get(hid)
            if rec is None:
                return False
            match rec.state:
                case DecodeState.OPEN:
                    self._move(hid, rec, DecodeState.RELEASED)
                case DecodeState.CREATING:
                    self._move(hid, rec, DecodeState.CANCELLED)
            return rec.state == DecodeState.HELD

    def released(self, hid: str) -> None:
        """No write of `hid` can land any more (`handoff.released`, or nothing was leased)."""
        with self._lock:
            rec = self._records.get(hid)
            if rec is not None:
                self._move(hid, rec, DecodeState.RELEASED)

    def close(self, hid: str) -> None:
        """The engine is done with the request; its record goes once it is released (the
        engine may ask `release_safe` after closing, as SGLang does after `clear()`)."""
        with self._lock:
            rec = self._records.get(hid)
            if rec is None:
                return
            if rec.state == DecodeState.OPEN:
                self._move(hid, rec, DecodeState.RELEASED)  # never asked for: nothing leased
            rec.closed = True
            self._drop_if_done(hid, rec)

    def release_safe(self, room: int) -> bool:
        """True when no handoff of `room` may still write its pages: every one is RELEASED
        (or the rank never asked for one)."""
        with self._lock:
            hids = self._by_room.get(int(room), ())
            return all(self._records[h].state == DecodeState.RELEASED for h in hids)

    def room_of(self, hid: str) -> int | None:
        """The room whose request the engine follows `hid` for (None once it closed it): where
        the handoff's events go."""
        with self._lock:
            rec = self._records.get(hid)
            return None if rec is None or rec.closed else rec.room

    def note_unreachable(self, room: int) -> None:
        """The room fails because a prefill could not be reached (noted before the engine is
        told, so whoever sees the failure sees the note too)."""
        with self._lock:
            for hid in self._by_room.get(int(room), ()):
                self._records[hid].unreachable = True

    def unreachable(self, room: int) -> bool:
        """Whether the room failed because a prefill could not be reached."""
        with self._lock:
            hids = self._by_room.get(int(room), ())
            return any(self._records[h].unreachable for h in hids)

    def state(self, hid: str) -> DecodeState | None:
        with self._lock:
            rec = self._records.get(hid)
            return None if rec is None else rec.state

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def _move(self, hid: str, rec: _Record, new: DecodeState) -> None:
        rec.state = advance(rec.state, new, f"decode handoff {hid!r} of room {rec.room}")
        self._drop_if_done(hid, rec)

    def _drop_if_done(self, hid: str, rec: _Record) -> None:
        if rec.closed and rec.state == DecodeState.RELEASED:
            del self._records[hid]
            room = self._by_room.get(rec.room)
            if room is not None:
                room.discard(hid)
                if not room:
                    del self._by_room[rec.room]
