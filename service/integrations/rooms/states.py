"""The states of an adapter's rooms, and their one transition table.

Kept apart from `kvhandoff.pipelines.states` on purpose: these are what the *engine adapter* knows
of a request (what it asked of kvhandoff, what it signalled, may its pages still be leased), not the
handoff's own states. The facts an engine acts on are states here: a decode request's pages may
be freed only once every handoff of it is RELEASED, and a prefill room that is STOPPED signals
nothing more (DESIGN.md, "the boundary rule").
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from kvhandoff.pipelines.errors import InternalError


class DecodeState(StrEnum):
    """One decode handoff of one request, as the adapter sees it."""

    OPEN = "open"  # the engine opened the request; nothing asked of kvhandoff, nothing leased
    CREATING = "creating"  # the create is queued or running: it may lease the pages any time
    # The engine gave the request up while its create was queued or running: the handoff is
    # aborted as soon as the create returns (its prefill is told then, not at its deadline).
    CANCELLED = "cancelled"
    HELD = "held"  # created: the pages are leased to it until kvhandoff releases them
    RELEASED = "released"  # no write of it can land any more (or none was ever leased)


class PrefillState(StrEnum):
    """One request on a prefill rank: how far its page ranges were signalled."""

    OPEN = "open"  # the engine opened it; nothing signalled
    SENDING = "sending"  # ranges signalled, not the last
    PAGES_ENDED = "pages_ended"  # every page signalled; a state slot is still to come
    SIGNALLED = "signalled"  # the last range signalled
    EXCUSED = "excused"  # another rank sends it: it moves nothing from here, never fails
    STOPPED = "stopped"  # failing, failed or aborted: nothing more is signalled


_D, _P = DecodeState, PrefillState

#: Every legal change, per kind (two kinds share values: "open"). RELEASED, EXCUSED and
#: STOPPED never change. A decode handoff refused at create, or never created, goes straight
#: to RELEASED; `handoff.released` may come before the create call returned.
TRANSITIONS: dict[type[StrEnum], dict[StrEnum, frozenset[StrEnum]]] = {
    DecodeState: {
        _D.OPEN: frozenset({_D.CREATING, _D.RELEASED}),
        _D.CREATING: frozenset({_D.HELD, _D.CANCELLED, _D.RELEASED}),
        _D.CANCELLED: frozenset({_D.HELD, _D.RELEASED}),
        _D.HELD: frozenset({_D.RELEASED}),
        _D.RELEASED: frozenset(),
    },
    PrefillState: {
        _P.OPEN: frozenset({_P.SENDING, _P.PAGES_ENDED, _P.SIGNALLED, _P.EXCUSED, _P.STOPPED}),
        _P.SENDING: frozenset({_P.PAGES_ENDED, _P.SIGNALLED, _P.EXCUSED, _P.STOPPED}),
        _P.PAGES_ENDED: frozenset({_P.SIGNALLED, _P.EXCUSED, _P.STOPPED}),
        _P.SIGNALLED: frozenset({_P.EXCUSED, _P.STOPPED}),
        _P.EXCUSED: frozenset(),
        _P.STOPPED: frozenset(),
    },
}


class IllegalRoomTransition(InternalError):
    """A room change the table does not allow: a bug in the adapter, never an engine's fault."""

    code = "illegal_room_transition"


S = TypeVar("S", DecodeState, PrefillState)


def advance(current: S, new: S, what: str) -> S:
    """`new` if the table allows `current -> new` (or they are equal), else
    IllegalRoomTransition naming `what`."""
    if type(new) is not type(current) or (
        new != current and new not in TRANSITIONS[type(current)][current]
    ):
        raise IllegalRoomTransition(
            f"{what}: {current.value} -> {new.value} is not a legal transition",
            state=current.value,
            to=new.value,
        )
    return new
