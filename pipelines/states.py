"""The states of a handoff and of its stages, shared by both sides, and their one transition table.

Used by the decode pipeline (the handoff's outcome and release, its stages as seen from the
decode side) and the prefill pipeline (its own stages). Every state change goes through `advance`,
which raises `IllegalTransition` for a change the table does not allow, so no code path can, say,
turn a failed handoff into a completed one, or forget that a released lease stays released.

Two facts are kept apart on purpose (see SAFETY.md):

- the **outcome** (`HandoffState`: completed / failed / aborted) is announced as soon as it is
  known, so a router can reschedule at once;
- the **release** (`ReleaseState`) says the destination pages and slot are free: every writer
  confirmed it stopped, or the proven bound (deadline + longest engine call) passed. Only then may
  an engine reuse the pages. A release follows every outcome, and only an outcome.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from kvhandoff.pipelines.errors import InternalError


class HandoffState(StrEnum):
    """A handoff's progress and, once terminal, its outcome."""

    PENDING = "pending"  # created; destinations not yet delivered to every prefill service
    TRANSFERRING = "transferring"  # delivered; waiting for every stage's arrival
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


class ReleaseState(StrEnum):
    """Whether a handoff's destination pages and slot are still leased to it."""

    HELD = "held"  # leased: a writer may land bytes (or the outcome is not known yet)
    RELEASING = "releasing"  # outcome known; stopping the writers / waiting out the bound
    RELEASED = "released"  # no write of this handoff can land any more: pages free


class StageState(StrEnum):
    """One PP stage of one handoff. The decode side sees WAITING, ARRIVED, FAILED and STOPPED;
    the prefill side also READY (source pages known), SENDING and NOTIFYING (all bytes landed,
    the arrival notice is on its way)."""

    WAITING = "waiting"
    READY = "ready"
    SENDING = "sending"
    NOTIFYING = "notifying"
    ARRIVED = "arrived"
    FAILED = "failed"
    STOPPED = "stopped"  # aborted (or its handoff ended otherwise) before it arrived

    @property
    def final(self) -> bool:
        return self in (StageState.ARRIVED, StageState.FAILED, StageState.STOPPED)


class DeliveryState(StrEnum):
    """Whether one stage's destination reached its prefill (decode side)."""

    UNSENT = "unsent"
    SENDING = "sending"  # the call is in flight
    DELIVERED = "delivered"  # its prefill service accepted it
    UNCERTAIN = "uncertain"  # the call failed or was cancelled: it may still have reached it


class WriterState(StrEnum):
    """Whether one stage's writers may still write, as the decode knows it (SAFETY.md I4): the
    facts that decide when a lease may be released. Changed only by `DecodeStage` methods."""

    MAY_WRITE = "may_write"
    # Its prefill acknowledged an abort while the destination was still on its way: the
    # destination may have reached it after the ack (then it is live there again), so the
    # quiesce asks once more after the delivery ended before it trusts this.
    STOPPED_OVERTAKEN = "stopped_overtaken"
    STOPPED = "stopped"  # its own prefill life said no write of it can land any more

    @property
    def stopped(self) -> bool:
        return self != WriterState.MAY_WRITE


_TERMINAL = frozenset({HandoffState.COMPLETED, HandoffState.FAILED, HandoffState.ABORTED})
_H, _R, _S = HandoffState, ReleaseState, StageState
_D, _W = DeliveryState, WriterState

#: The one table of legal changes, one row set per kind of state. Per kind: the enums are
#: StrEnums, so members of two kinds with one value ("failed", "stopped", "sending") are equal
#: and would share a row in one flat mapping. Terminal handoff states and RELEASED never change.
TRANSITIONS: dict[type[StrEnum], dict[StrEnum, frozenset[StrEnum]]] = {
    HandoffState: {
        _H.PENDING: frozenset({_H.TRANSFERRING, _H.COMPLETED, _H.FAILED, _H.ABORTED}),
        _H.TRANSFERRING: frozenset({_H.COMPLETED, _H.FAILED, _H.ABORTED}),
        _H.COMPLETED: frozenset(),
        _H.FAILED: frozenset(),
        _H.ABORTED: frozenset(),
    },
    ReleaseState: {
        _R.HELD: frozenset({_R.RELEASING, _R.RELEASED}),
        _R.RELEASING: frozenset({_R.RELEASED}),
        _R.RELEASED: frozenset(),
    },
    StageState: {
        _S.WAITING: frozenset({_S.READY, _S.SENDING, _S.ARRIVED, _S.FAILED, _S.STOPPED}),
        _S.READY: frozenset({_S.SENDING, _S.FAILED, _S.STOPPED}),
        _S.SENDING: frozenset({_S.NOTIFYING, _S.FAILED, _S.STOPPED}),
        _S.NOTIFYING: frozenset({_S.ARRIVED, _S.FAILED, _S.STOPPED}),
        # An arrived stage can still fail its handoff's verification (the bytes differ).
        _S.ARRIVED: frozenset({_S.FAILED}),
        _S.FAILED: frozenset(),
        _S.STOPPED: frozenset(),
    },
    # One destination per stage: it is sent once, and its fate is known once the call ended.
    DeliveryState: {
        _D.UNSENT: frozenset({_D.SENDING}),
        _D.SENDING: frozenset({_D.DELIVERED, _D.UNCERTAIN}),
        _D.DELIVERED: frozenset(),
        _D.UNCERTAIN: frozenset(),
    },
    # Stopped is for good, except by an ack that overtook the destination: asked again.
    WriterState: {
        _W.MAY_WRITE: frozenset({_W.STOPPED, _W.STOPPED_OVERTAKEN}),
        _W.STOPPED_OVERTAKEN: frozenset({_W.STOPPED, _W.MAY_WRITE}),
        _W.STOPPED: frozenset(),
    },
}


def allowed(current: StrEnum) -> frozenset[StrEnum]:
    """The states `current` may change to."""
    return TRANSITIONS[type(current)][current]


S = TypeVar("S", HandoffState, ReleaseState, StageState, DeliveryState, WriterState)


class IllegalTransition(InternalError):
    """A state change the table does not allow: a bug, never a client's fault."""

    code = "illegal_transition"


def advance(current: S, new: S, what: str) -> S:
    """`new` if the table allows `current -> new` (or they are equal), else IllegalTransition
    naming `what` (e.g. "handoff 'r1'", "handoff 'r1' stage 2")."""
    if new != current and (type(new) is not type(current) or new not in allowed(current)):
        raise IllegalTransition(
            f"{what}: {current.value} -> {new.value} is not a legal transition",
            state=current.value,
            to=new.value,
        )
    return new
