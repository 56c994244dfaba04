"""The one transition table: legal changes pass, illegal ones raise naming the object."""

import pytest

from pipelines.peercache import PeerCache, new_incarnation
from pipelines.states import (
    TRANSITIONS,
    HandoffState,
    IllegalTransition,
    ReleaseState,
    StageState,
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


def test_every_state_has_a_row() -> None:
    for enum in (HandoffState, ReleaseState, StageState):
        assert set(enum) <= set(TRANSITIONS)


def test_peer_caches_are_bounded_and_incarnations_random() -> None:
    cache: PeerCache[int] = PeerCache(maxsize=3)
    for i in range(10):
        cache.put(f"p{i}", i)
    assert len(cache) == 3 and "p9" in cache and "p0" not in cache
    assert cache.get("p7") == 7
    cache.put("p10", 10)
    assert "p7" in cache and "p8" not in cache  # least recently used out first
    assert new_incarnation() != new_incarnation()
