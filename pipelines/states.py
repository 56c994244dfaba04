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

from pipelines.errors import InternalError


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


_TERMINAL = frozenset({HandoffState.COMPLETED, HandoffState.FAILED, HandoffState.ABORTED})
_H, _R, _S = HandoffState, ReleaseState, StageState

#: The one table of legal changes. Terminal handoff states and RELEASED never change.
TRANSITIONS: dict[StrEnum, frozenset[StrEnum]] = {
    _H.PENDING: frozenset({_H.TRANSFERRING, _H.COMPLETED, _H.FAILED, _H.ABORTED}),
    _H.TRANSFERRING: frozenset({_H.COMPLETED, _H.FAILED, _H.ABORTED}),
    _H.COMPLETED: frozenset(),
    _H.FAILED: frozenset(),
    _H.ABORTED: frozenset(),
    _R.HELD: frozenset({_R.RELEASING, _R.RELEASED}),
    _R.RELEASING: frozenset({_R.RELEASED}),
    _R.RELEASED: frozenset(),
    _S.WAITING: frozenset({_S.READY, _S.SENDING, _S.ARRIVED, _S.FAILED, _S.STOPPED}),
    _S.READY: frozenset({_S.SENDING, _S.FAILED, _S.STOPPED}),
    _S.SENDING: frozenset({_S.NOTIFYING, _S.FAILED, _S.STOPPED}),
    _S.NOTIFYING: frozenset({_S.ARRIVED, _S.FAILED, _S.STOPPED}),
    # An arrived stage can still fail its handoff's verification (the bytes that landed differ).
    _S.ARRIVED: frozenset({_S.FAILED}),
    _S.FAILED: frozenset(),
    _S.STOPPED: frozenset(),
}

S = TypeVar("S", HandoffState, ReleaseState, StageState)


class IllegalTransition(InternalError):
    """A state change the table does not allow: a bug, never a client's fault."""

    code = "illegal_transition"


def advance(current: S, new: S, what: str) -> S:
    """`new` if the table allows `current -> new` (or they are equal), else IllegalTransition
    naming `what` (e.g. "handoff 'r1'", "handoff 'r1' stage 2")."""
    if new != current and new not in TRANSITIONS[current]:
        raise IllegalTransition(
            f"{what}: {current.value} -> {new.value} is not a legal transition",
            state=current.value,
            to=new.value,
        )
    return new
