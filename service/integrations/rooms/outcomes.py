"""What a handoff's event means for its request, in no engine's vocabulary: a neutral outcome
an adapter maps onto its engine's status table (SGLang's `KVPoll`, a vLLM connector's finished
sets), so every adapter reads the one event union (`kvhandoff.pipelines.events`) the same way.

Called by an engine adapter's event listener (the service's event thread), once it has found
the room an event's handoff belongs to. The mapping is per role, as each side's events mean
different things for its engine: a decode request is done when its handoff completed, a
prefill request when every decode handoff taking its bytes has them all
(`PrefillRooms.transferred`, which the adapter asks on TRANSFERRED).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvhandoff.pipelines.errors import PeerUnreachable
from kvhandoff.pipelines.events import (
    Event,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    StageReady,
    StageTransferred,
)


class Outcome(StrEnum):
    """What a room's engine is to be told. Engines keep their status monotone: a later
    outcome never moves a room back (FAILED is final)."""

    TRANSFERRING = "transferring"  # bytes are moving (decode: created; prefill: a stage signalled)
    # Prefill: a segment of this rank's stage was committed on the decode; SUCCESS once every
    # handoff of the room has all its bytes (`PrefillRooms.transferred`).
    TRANSFERRED = "transferred"
    SUCCESS = "success"  # decode: the handoff completed
    FAILED = "failed"  # the handoff failed or was aborted (a prefill stops the room first)


@dataclass(frozen=True)
class Step:
    """One event's outcome for its room, with what the adapter needs to act on it."""

    outcome: Outcome
    reason: str = ""  # FAILED: what the engine reports (`failure_reason`)
    unreachable: bool = False  # FAILED: a peer could not be reached (it may be gone)
    # FAILED on a prefill: the handoff that stopped already (an aborted one is published once
    # it stopped), so stopping the room need not stop it again.
    ended: str | None = None
    nbytes: int = 0  # TRANSFERRED: the bytes the segments carried
    final: bool = False  # TRANSFERRED: the stage has all its bytes


def failure_reason(event: HandoffFailed | HandoffAborted) -> str:
    """The reason an engine reports for a failed room: the code, the stage and the layer,
    group, kind or field when known."""
    if isinstance(event, HandoffAborted):
        return f"kvhandoff handoff {event.handoff_id} aborted: {event.reason}"
    where = []
    if event.pp_rank is not None:
        where.append(f"stage {event.pp_rank}")
    for key in ("layer_id", "group", "kind", "field"):
        if key in event.context:
            where.append(f"{key.replace('_id', '')} {event.context[key]}")
    at = f" at {', '.join(where)}" if where else ""
    return f"kvhandoff handoff {event.handoff_id} failed ({event.code}){at}: {event.reason}"


def outcome(event: Event, *, prefill: bool, stage_rank: int = 0) -> Step | None:
    """The step `event` of a room's handoff means on this rank (`prefill`: a prefill rank
    sending stage `stage_rank`), or None when it means nothing to the engine. Releases and
    destinations are not outcomes: the adapter's rooms take them (`DecodeRooms.released`,
    `PrefillRooms.learn_fan_out`)."""
    if event.role != ("prefill" if prefill else "decode"):
        return None
    match event:
        case HandoffFailed() | HandoffAborted():
            gone = isinstance(event, HandoffFailed) and event.code == PeerUnreachable.code
            ended = event.handoff_id if prefill and isinstance(event, HandoffAborted) else None
            return Step(Outcome.FAILED, failure_reason(event), unreachable=gone, ended=ended)
        case StageReady() if prefill:
            return Step(Outcome.TRANSFERRING)
        case StageTransferred() if prefill and event.pp_rank == stage_rank:
            return Step(Outcome.TRANSFERRED, nbytes=event.bytes, final=event.final)
        case HandoffCreated() if not prefill:
            return Step(Outcome.TRANSFERRING)
        case HandoffCompleted() if not prefill:
            return Step(Outcome.SUCCESS)
    return None
