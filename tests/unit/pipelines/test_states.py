"""The one transition table: legal changes pass, illegal ones raise naming the object."""

import pytest

from kvhandoff.pipelines.peercache import PeerCache, new_incarnation
from kvhandoff.pipelines.states import (
    TRANSITIONS,
    DeliveryState,
    HandoffState,
    IllegalTransition,
    ReleaseState,
    StageState,
    WriterState,
    advance,
)


def test_outcomes_are_final_and_a_release_is_never_undone() -> None:
    for outcome in (HandoffState.COMPLETED, HandoffState.FAILED, HandoffState.ABORTED):
        assert outcome.terminal
        for other in HandoffState:
            if other != outcome:
                with pytest.raises(IllegalTransition, match="handoff 'x'"):
                    advance(outcome, other, "handoff 'x'")
    with pytest.raises(IllegalTransition):
        advance(ReleaseState.RELEASED, ReleaseState.HELD, "lease")
    assert advance(HandoffState.PENDING, HandoffState.FAILED, "h") == HandoffState.FAILED
    assert advance(ReleaseState.HELD, ReleaseState.RELEASING, "l") == ReleaseState.RELEASING


def test_a_stage_that_ended_stays_ended_except_an_arrival_failing_verification() -> None:
    assert advance(StageState.ARRIVED, StageState.FAILED, "s") == StageState.FAILED
    for final in (StageState.FAILED, StageState.STOPPED):
        for other in StageState:
            if other != final:
                with pytest.raises(IllegalTransition):
                    advance(final, other, "s")
    with pytest.raises(IllegalTransition):
        advance(StageState.ARRIVED, StageState.SENDING, "s")


def test_every_state_has_a_row_of_its_own_kind() -> None:
    for enum in (HandoffState, ReleaseState, StageState, DeliveryState, WriterState):
        rows = TRANSITIONS[enum]
        assert set(rows) == set(enum)
        assert all(type(m) is enum for m in rows) and all(
            type(m) is enum for targets in rows.values() for m in targets
        )
    # Equal strings of two kinds are not one state: a failed handoff is not a failed stage.
    assert HandoffState.FAILED == StageState.FAILED
    with pytest.raises(IllegalTransition):
        advance(DeliveryState.SENDING, StageState.STOPPED, "mixed")  # type: ignore[type-var]


def test_writers_stop_for_good_unless_an_ack_overtook_the_destination() -> None:
    assert advance(WriterState.MAY_WRITE, WriterState.STOPPED_OVERTAKEN, "w").stopped
    assert not advance(WriterState.STOPPED_OVERTAKEN, WriterState.MAY_WRITE, "w").stopped
    with pytest.raises(IllegalTransition):
        advance(WriterState.STOPPED, WriterState.MAY_WRITE, "w")
    with pytest.raises(IllegalTransition):
        advance(DeliveryState.DELIVERED, DeliveryState.SENDING, "d")  # sent once


def test_peer_caches_are_bounded_and_incarnations_random() -> None:
    cache: PeerCache[int] = PeerCache(maxsize=3)
    for i in range(10):
        cache.put(f"p{i}", i)
    assert len(cache) == 3 and "p9" in cache and "p0" not in cache
    assert cache.get("p7") == 7
    cache.put("p10", 10)
    assert "p7" in cache and "p8" not in cache  # least recently used out first
    assert new_incarnation() != new_incarnation()
