"""A prefill rank's rooms: one record per request, its state changed only through the table
(`states.PrefillState`), and the bookkeeping an engine adapter's send path needs around it:
chunk -> page-range signalling, the fan-out replay to a room's copies, and when the room has
all its bytes.

Not thread-safe by itself: the adapter holds its rank's lock (`lock`) around every call, so
what it queues for its worker thread under that lock is in order with the bookkeeping. Engine
neutral: the adapter names the handoffs (its own and its copies') and maps the outcomes to its
engine's status table.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.service.integrations.rooms.states import PrefillState, advance

_P = PrefillState


@dataclass(frozen=True)
class Range:
    """One page range the room's own handoff was given, kept to replay to its copies (a
    fan-out learned later)."""

    pages: Any  # the adapter's own copy of the engine's page indices
    at: int
    last: bool
    slots: dict[str, int] | None
    aux: int | None


@dataclass(frozen=True)
class Chunk:
    """What one engine send becomes: a range at `at` (`last`: the room's last), or a refusal."""

    at: int = 0
    last: bool = False
    refused: str | None = None
    skip: bool = False  # nothing to signal (an empty closing send after the last range)


@dataclass
class PrefillRoom:
    room: int
    own: str  # the id of the handoff this rank sends
    state: PrefillState = _P.OPEN
    sent: int = 0  # pages signalled so far, in the engine's positions
    moved_bytes: int = 0
    transfers: int = 0  # stage-transferred events of its handoffs so far
    last_commit: float | None = None  # when the last segment was committed, once all were
    fan_out: int | None = None  # decode handoffs taking these bytes, once a destination said
    copies: list[str] = field(default_factory=list)
    ranges: list[Range] = field(default_factory=list)  # kept until fan_out is known to be 1
    own_signalled: int = 0  # of `ranges`, how many the own handoff was signalled (replayable)
    replayed: dict[str, int] = field(default_factory=dict)  # per copy, ranges it was given
    finals: set[str] = field(default_factory=set)  # handoffs whose stage has all its bytes
    unreachable: bool = False  # it failed because a peer could not be reached

    def move(self, new: PrefillState) -> None:
        self.state = advance(self.state, new, f"prefill room {self.room}")

    @property
    def ids(self) -> list[str]:
        return [self.own, *self.copies]

    @property
    def excused(self) -> bool:
        return self.state == _P.EXCUSED

    @property
    def stopped(self) -> bool:
        return self.state == _P.STOPPED

    @property
    def moved(self) -> tuple[int, float | None] | None:
        """(bytes moved, when the last segment was committed once all were), or None."""
        return (self.moved_bytes, self.last_commit) if self.transfers else None


class PrefillRooms:
    """The rank's rooms by request, and by the id of each handoff of theirs."""

    def __init__(self, early_kept: int) -> None:
        self.lock = threading.RLock()
        self._rooms: dict[int, PrefillRoom] = {}
        self._by_id: dict[str, int] = {}
        # A fan-out whose destination came before the engine opened the room (bounded).
        self._early: OrderedDict[str, int] = OrderedDict()
        self._early_kept = early_kept

    def open(self, room: int, own: str) -> int | None:
        """The engine opened `room`, this rank sending handoff `own`; returns a fan-out its
        destination said before (`learn_fan_out` it), if any. A room open already (the engine
        opened it twice: a duplicate request id) keeps its record, whatever its state: its
        position, fan-out and copies stand, and a stopped room stays stopped."""
        rec = self._rooms.get(room)
        if rec is None:
            self._rooms[room] = PrefillRoom(room, own)
        if rec is None or rec.state != _P.EXCUSED:  # an excused room routes no event
            self._by_id[own] = room
        return self._early.pop(own, None)

    def close(self, room: int) -> PrefillRoom | None:
        """Forget the room (the engine cleared it): no entry outlives it."""
        rec = self._rooms.pop(room, None)
        if rec is not None:
            for hid in rec.ids:
                self._by_id.pop(hid, None)
        return rec

    def get(self, room: int) -> PrefillRoom | None:
        return self._rooms.get(room)

    def room_of(self, hid: str) -> int | None:
        return self._by_id.get(hid)

    def chunk(self, rec: PrefillRoom, n_pages: int, *, is_last: bool, waiting: list[str]) -> Chunk:
        """One engine send of `n_pages`: where its range goes. The engine counts a chunk last
        once its pages are all sent, but a state slot may come with a later (empty) send: the
        room's last range is the one that brings both (`waiting`: the components whose slot
        has not come yet)."""
        last = is_last and not waiting
        if rec.state == _P.SIGNALLED:
            if n_pages:
                return Chunk(refused=f"{n_pages} pages sent after the last chunk")
            return Chunk(skip=True)  # the engine's empty closing send after the last range
        if not last and rec.state == _P.PAGES_ENDED:
            return Chunk(refused=f"no state slot of {waiting} came")
        at = rec.sent
        rec.sent = at + n_pages
        if last:
            rec.move(_P.SIGNALLED)
        elif is_last:
            rec.move(_P.PAGES_ENDED)  # pages done; the slots come next
        else:
            rec.move(_P.SENDING)
        return Chunk(at=at, last=last)

    def keep(self, rec: PrefillRoom, r: Range) -> bool:
        """Keep a range for the room's copies, until it is known none will come."""
        if rec.fan_out == 1:
            return False
        rec.ranges.append(r)
        return True

    def learn_fan_out(self, rec: PrefillRoom, k: int, copies: list[str]) -> bool | None:
        """The room's bytes go to `k` decode handoffs: its own and `copies`. True when copies
        are to be given what the own one got (`replay`), False when nothing changes, None when
        two decodes disagree (the room is to fail)."""
        if rec.fan_out is not None:
            return False if rec.fan_out == k else None
        rec.fan_out = k
        if k == 1:
            rec.ranges.clear()  # nothing to replay: no copy will come
            return False
        rec.copies = list(copies)
        for hid in copies:
            self._by_id[hid] = rec.room
        rec.replayed = dict.fromkeys(copies, 0)
        return True

    def own_signalled_one(self, rec: PrefillRoom) -> None:
        """The own handoff was signalled its next kept range (its forward had run): one more
        range its copies may be given. Nothing when none is kept (a fan-out of 1 learned since)."""
        if rec.ranges:
            rec.own_signalled += 1

    def learn_early(self, own: str, k: int) -> None:
        """A destination's fan-out for a room the engine has not opened yet."""
        self._early[own] = k
        while len(self._early) > self._early_kept:
            self._early.popitem(last=False)

    def replay(self, rec: PrefillRoom) -> list[tuple[str, list[Range]]]:
        """Per copy, the ranges the own handoff was signalled and it was not yet, in order
        (each copy is then counted as having them)."""
        ranges = rec.ranges[: rec.own_signalled]
        todo = [(copy, ranges[n:]) for copy, n in rec.replayed.items()]
        for copy in rec.replayed:
            rec.replayed[copy] = len(ranges)
        return todo

    def transferred(
        self, rec: PrefillRoom, hid: str, nbytes: int, *, final: bool, now: float
    ) -> bool:
        """A stage's segments of `hid` were committed (at `now`); True once every handoff of
        the room has all its bytes (the engine's Success)."""
        if final:
            rec.finals.add(hid)
        done = final and len(rec.finals) >= (rec.fan_out or 1)
        rec.transfers += 1
        rec.moved_bytes += nbytes
        rec.last_commit = now if done else None
        return done

    def stop(self, rec: PrefillRoom) -> bool:
        """Nothing more of the room is signalled (failing, failed or aborted); False when it
        was stopped already or moves nothing (excused)."""
        if rec.state in (_P.STOPPED, _P.EXCUSED):
            return False
        rec.move(_P.STOPPED)
        return True

    def excuse(self, rec: PrefillRoom) -> tuple[bool, bool]:
        """The room moves nothing from this rank after all: (was anything signalled, was its
        last range). Its handoff ids route no event any more."""
        signalled = rec.state in (_P.SENDING, _P.PAGES_ENDED, _P.SIGNALLED)
        last = rec.state == _P.SIGNALLED
        rec.move(_P.EXCUSED)
        for hid in rec.ids:
            self._by_id.pop(hid, None)
        return signalled, last

    def __len__(self) -> int:
        return len(self._rooms)
