"""The adapter's room tables: every change they allow and refuse, walked."""

from __future__ import annotations

import itertools
from enum import StrEnum

import pytest

from kvhandoff.service.integrations.rooms.states import (
    TRANSITIONS,
    DecodeState,
    IllegalRoomTransition,
    PrefillState,
    advance,
)

FINAL = {DecodeState: {DecodeState.RELEASED}, PrefillState: {PrefillState.STOPPED}}


@pytest.mark.parametrize("kind", [DecodeState, PrefillState])
def test_every_state_has_a_row_and_every_room_can_end(kind: type[StrEnum]) -> None:
    table = TRANSITIONS[kind]
    assert set(table) == set(kind)
    for state in kind:
        seen, todo = {state}, [state]
        while todo:
            for nxt in table[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        # A decode handoff always comes to RELEASED (no record holds pages for ever); a
        # prefill room can always be stopped, unless it moves nothing (excused).
        assert FINAL[kind] & seen or state == PrefillState.EXCUSED, state
    for final in FINAL[kind]:
        assert table[final] == frozenset()


@pytest.mark.parametrize("kind", [DecodeState, PrefillState])
def test_no_room_goes_back_and_a_leased_handoff_leaves_only_by_its_release(
    kind: type[StrEnum],
) -> None:
    # The states are declared in the order a room goes through them: every change is forward
    # (a room never returns to before its create, or to sending after it stopped).
    order = list(kind)
    for state, nexts in TRANSITIONS[kind].items():
        for nxt in nexts:
            assert order.index(nxt) > order.index(state), (state, nxt)
    if kind is DecodeState:
        # Pages leased to a handoff are safe to free by kvhandoff's release only.
        assert TRANSITIONS[kind][DecodeState.HELD] == {DecodeState.RELEASED}


CASES = [
    *itertools.product(DecodeState, DecodeState),
    *itertools.product(PrefillState, PrefillState),
]


@pytest.mark.parametrize(("current", "new"), CASES)
def test_advance_allows_exactly_the_table(current: StrEnum, new: StrEnum) -> None:
    if new == current or new in TRANSITIONS[type(current)][current]:
        assert advance(current, new, "r") is new  # type: ignore[type-var]
    else:
        with pytest.raises(IllegalRoomTransition, match=f"r: {current} -> {new}"):
            advance(current, new, "r")  # type: ignore[type-var]


def test_a_state_of_another_kind_is_refused_even_with_the_same_value() -> None:
    with pytest.raises(IllegalRoomTransition):
        advance(DecodeState.OPEN, PrefillState.OPEN, "r")  # type: ignore[type-var]
