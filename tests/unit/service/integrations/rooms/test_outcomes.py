"""What each handoff event means for its room, per role: the neutral outcome an adapter maps to
its engine's status table."""

from __future__ import annotations

import pytest

from kvhandoff.pipelines.events import (
    DestinationReceived,
    Event,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    HandoffReleased,
    StageReady,
    StageTransferred,
)
from kvhandoff.service.integrations.rooms.outcomes import Outcome, Step, failure_reason, outcome


def transferred(role: str, pp_rank: int, *, final: bool) -> StageTransferred:
    return StageTransferred(
        handoff_id="h",
        role=role,
        pp_rank=pp_rank,
        blocks=1,
        bytes=64,
        batches=1,
        seconds=0.0,
        final=final,
    )


def test_a_decode_room_is_transferring_once_created_and_done_once_completed() -> None:
    created = HandoffCreated(handoff_id="h", role="decode", num_pages=2, pp_size=1)
    completed = HandoffCompleted(handoff_id="h", role="decode", bytes=1, seconds=0.0, verified=True)
    assert outcome(created, prefill=False) == Step(Outcome.TRANSFERRING)
    assert outcome(completed, prefill=False) == Step(Outcome.SUCCESS)
    # A decode's stage events are not its engine's business.
    assert outcome(transferred("decode", 0, final=True), prefill=False) is None


def test_a_prefill_room_transfers_only_its_own_stage_s_bytes() -> None:
    ready = StageReady(handoff_id="h", role="prefill", pp_rank=1, num_pages=2)
    assert outcome(ready, prefill=True, stage_rank=1) == Step(Outcome.TRANSFERRING)
    step = outcome(transferred("prefill", 1, final=True), prefill=True, stage_rank=1)
    assert step == Step(Outcome.TRANSFERRED, nbytes=64, final=True)
    assert outcome(transferred("prefill", 0, final=True), prefill=True, stage_rank=1) is None
    # Completion is the decode's: a prefill room succeeds by its bytes, not by this event.
    done = HandoffCompleted(handoff_id="h", role="prefill", bytes=1, seconds=0.0, verified=True)
    assert outcome(done, prefill=True) is None


def test_a_failure_names_its_stage_and_layer_and_says_when_a_peer_was_unreachable() -> None:
    failed = HandoffFailed(
        handoff_id="h",
        role="decode",
        code="peer_unreachable",
        reason="silent",
        pp_rank=1,
        context={"layer_id": 3, "group": 0},
    )
    step = outcome(failed, prefill=False)
    assert step is not None and step.outcome == Outcome.FAILED and step.unreachable
    assert step.reason == failure_reason(failed)
    assert step.reason == (
        "kvhandoff handoff h failed (peer_unreachable) at stage 1, layer 3, group 0: silent"
    )
    assert step.ended is None  # a failure may still be stopping: the prefill stops it first


def test_an_aborted_prefill_handoff_has_stopped_already() -> None:
    aborted = HandoffAborted(handoff_id="h-r1", role="prefill", reason="gone")
    step = outcome(aborted, prefill=True)
    assert step == Step(Outcome.FAILED, "kvhandoff handoff h-r1 aborted: gone", ended="h-r1")
    decode = outcome(HandoffAborted(handoff_id="h", role="decode", reason="x"), prefill=False)
    assert decode is not None and decode.ended is None and not decode.unreachable


@pytest.mark.parametrize(
    "event",
    [
        HandoffReleased(
            handoff_id="h",
            role="decode",
            outcome="failed",
            confirmed=True,
            seconds_after_outcome=0.0,
        ),
        DestinationReceived(
            handoff_id="h", role="prefill", pp_ranks=[0], decode_url="d", num_pages=1
        ),
        # The other side's events never move this rank's rooms.
        HandoffFailed(handoff_id="h", role="prefill", code="x", reason="y"),
    ],
)
def test_releases_destinations_and_the_other_side_s_events_are_no_outcome(event: Event) -> None:
    assert outcome(event, prefill=False) is None
